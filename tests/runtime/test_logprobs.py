"""Log-probabilities from the step engine, and a prompt's choices sharing one prefill.

References are direct: a full forward pass of the prompt and the tokens so far, log-softmax in float32,
top-k. The step engine computes the same numbers through a KV cache (chunked prefill, batched decode),
so they agree to float32 rounding, not bit for bit."""

from __future__ import annotations

import pytest
import torch

from moeserve.runtime.engine import Engine, EngineError, SamplingParams
from moeserve.runtime.sampling import token_logprobs
from moeserve.runtime.steps import Sequence

from .test_engine import PROMPTS, make_engine

TOL = 2e-5


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine("softmax")


def reference(engine: Engine, ids: list[int]) -> torch.Tensor:
    """log p(. | ids[:i+1]) for every i: [len(ids), V], from one forward pass without a cache."""
    return engine.forward(torch.tensor([ids]))[0].float().log_softmax(-1)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_generated_tokens_logprobs_and_top_alternatives_match_a_direct_forward(engine, temperature):
    prompt = engine.encode(PROMPTS[1])
    params = SamplingParams(max_new_tokens=10, temperature=temperature, top_k=5, seed=3, ignore_eos=True, logprobs=5)
    c = engine.complete([prompt], [params])[0]
    assert len(c.logprobs) == len(c.token_ids) == 10 and c.prompt_logprobs is None
    ref = reference(engine, prompt + c.token_ids)
    for i, (t, lp) in enumerate(zip(c.token_ids, c.logprobs)):
        row = ref[len(prompt) - 1 + i]  # the distribution the token was drawn from, before temperature and top-k
        assert lp.token == t
        assert lp.logprob == pytest.approx(float(row[t]), abs=TOL)
        top = row.topk(5)
        assert [tid for tid, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=TOL)
        if temperature == 0:
            assert lp.top[0][0] == t  # greedy: the chosen token is the likeliest


@pytest.mark.parametrize("chunk", [4, 512])
def test_prompt_logprobs_equal_the_scored_terms_chunked_or_not(engine, chunk):
    """While another sequence runs, a scored prompt is written `chunk` tokens a step; every chunk's rows
    predict the next chunk's first token across the boundary."""
    prompt = engine.encode(PROMPTS[1])
    assert len(prompt) > 3 * 4
    steps = engine.step_engine(slots=2, prefill_chunk=chunk)
    other = Sequence(engine.encode(PROMPTS[0]), SamplingParams(max_new_tokens=30, ignore_eos=True))
    steps.add(other)
    steps.step()
    seq = Sequence(prompt, SamplingParams(max_new_tokens=0, prompt_logprobs=2))
    steps.add(seq)
    while not seq.done:
        steps.step()
    c = seq.completion()
    assert c.token_ids == [] and c.finish_reason == "length"
    assert c.prompt_logprobs[0] is None and len(c.prompt_logprobs) == len(prompt)
    want = engine.token_logprobs_ids([prompt])[0]
    assert [lp.token for lp in c.prompt_logprobs[1:]] == prompt[1:]
    assert [lp.logprob for lp in c.prompt_logprobs[1:]] == pytest.approx(want, abs=TOL)
    assert sum(want) == pytest.approx(engine.score_ids([prompt])[0][0], abs=1e-4)
    ref = reference(engine, prompt)
    for i, lp in enumerate(c.prompt_logprobs[1:]):
        assert [tid for tid, _ in lp.top] == ref[i].topk(2).indices.tolist()


def test_a_whole_context_prompt_is_scored_without_generating(engine):
    prompt = (engine.encode(PROMPTS[1]) * 20)[:engine.cfg.max_seq_len]
    with pytest.raises(EngineError, match="context"):  # nothing fits after it
        engine.complete([prompt], [SamplingParams(max_new_tokens=1)])
    c = engine.complete([prompt], [SamplingParams(max_new_tokens=0, prompt_logprobs=0)])[0]
    assert [lp.logprob for lp in c.prompt_logprobs[1:]] == pytest.approx(engine.token_logprobs_ids([prompt])[0],
                                                                        abs=TOL)
    assert all(lp.top == [] for lp in c.prompt_logprobs[1:])


def test_logprobs_out_of_range_are_refused(engine):
    for bad in (21, -1, True, 2.0):
        with pytest.raises(EngineError, match="logprobs"):
            engine.complete([[1, 2]], [SamplingParams(logprobs=bad)])
    with pytest.raises(EngineError, match="prompt_logprobs"):
        engine.complete([[1, 2]], [SamplingParams(prompt_logprobs=21)])


def test_token_logprobs_helper_takes_each_rows_own_top_n():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 2.0, 1.0]])
    got = token_logprobs(logits, [0, 2], [1, 0])
    lp = logits.log_softmax(-1)
    assert got[0].token == 0 and got[0].logprob == pytest.approx(float(lp[0, 0]))
    assert got[0].top == [(2, pytest.approx(float(lp[0, 2])))]
    assert got[1].top == [] and got[1].logprob == pytest.approx(float(lp[1, 2]))


# ---- n choices of one prompt ----------------------------------------------------------------------
def choices(seeds: list[int], logprobs: int | None = None) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=12, temperature=0.9, seed=s, ignore_eos=True, logprobs=logprobs,
                           prompt_logprobs=logprobs) for s in seeds]


def counting_prefills(engine: Engine) -> list[int]:
    """Record the start position of every prefill call of the engine's runner (an instance attribute
    shadows the method for this engine only)."""
    calls: list[int] = []
    run = type(engine.runner).prefill

    def prefill(cache, slot, ids, start, all_logits=False):
        calls.append(start)
        return run(engine.runner, cache, slot, ids, start, all_logits)

    engine.runner.prefill = prefill
    return calls


@pytest.mark.parametrize("share", [True, False])
def test_choices_of_one_prompt_share_its_prefill_and_equal_single_requests(share):
    engine = make_engine("softmax")
    prompt = engine.encode(PROMPTS[1])
    seeds = [7, 8, 9]
    alone = [engine.complete([prompt], choices([s], 2))[0] for s in seeds]
    calls = counting_prefills(engine)
    seqs = [Sequence(prompt, p) for p in choices(seeds, 2)]
    engine.step_engine(4, share_prefill=share).run(seqs)
    assert len(calls) == (1 if share else 3)
    got = [s.completion() for s in seqs]
    assert [c.token_ids for c in got] == [c.token_ids for c in alone]
    assert len({tuple(c.token_ids) for c in got}) > 1  # the seeds differ, so do the choices
    for g, a in zip(got, alone):
        assert [lp.logprob for lp in g.logprobs] == pytest.approx([lp.logprob for lp in a.logprobs], abs=TOL)
        assert g.prompt_logprobs == a.prompt_logprobs  # the same prefill, copied or computed again: exact


def test_choices_beyond_the_free_slots_prefill_on_their_own():
    """Two slots for three choices: the third waits for a slot and writes the prompt itself, and its
    tokens are still those of a single request."""
    engine = make_engine("softmax")
    prompt = engine.encode(PROMPTS[0])
    seeds = [1, 2, 3]
    alone = [engine.complete([prompt], choices([s]))[0].token_ids for s in seeds]
    calls = counting_prefills(engine)
    seqs = engine.step_engine(2).run([Sequence(prompt, p) for p in choices(seeds)])
    assert [s.out for s in seqs] == alone
    assert calls == [0, 0]  # the first choice's prefill (shared with the second), then the third's own
