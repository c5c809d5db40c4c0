"""The step engine: a prompt's tokens are the same alone, in a static batch, and when it joins running
sequences mid-flight (greedy and seeded sampling, fp32, exactly; on CUDA too where a GPU is present);
chunked prefill, slot reuse without zeroing, cancellation, and expert-load counts exact to the token; the
ONNX runner behind the same steps gives the torch runner's tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moeserve.runtime.backends import cpu_kernel
from moeserve.runtime.engine import Engine, EngineError, SamplingParams
from moeserve.runtime.steps import Sequence

from .test_engine import PROMPTS, make_engine

GREEDY = SamplingParams(max_new_tokens=20, ignore_eos=True)


def sampled(i: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=12 + 3 * i, temperature=0.9, top_k=40, seed=50 + i, ignore_eos=True)


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def engine(request) -> Engine:
    """The same contract on a GPU, in fp32: there a batched GEMM may round a row differently by batch size
    (README), which these short runs of a tiny model have not shown."""
    return make_engine("softmax", device=request.param)


def alone(engine: Engine, prompt: str, params: SamplingParams) -> list[int]:
    return engine.complete([prompt], [params])[0].token_ids


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_joining_mid_flight_equals_alone_and_static_batch(engine, kind):
    params = [GREEDY if kind == "greedy" else sampled(i) for i in range(len(PROMPTS))]
    want = [alone(engine, p, sp) for p, sp in zip(PROMPTS, params)]
    assert [c.token_ids for c in engine.complete(PROMPTS, params)] == want  # static batch
    steps = engine.step_engine(slots=3, prefill_chunk=4)
    seqs = [Sequence(engine.encode(p), sp) for p, sp in zip(PROMPTS, params)]
    steps.add(seqs[0])
    for _ in range(5):
        steps.step()
    steps.add(seqs[1])  # joins a running sequence, its prompt written 4 tokens a step
    steps.step()
    steps.add(seqs[2])
    steps.add(seqs[3])  # 3 slots, 4 sequences: one waits for a slot
    busiest = 0
    while not steps.idle:
        steps.step()
        busiest = max(busiest, 3 - steps.free_slots)
    assert busiest == 3
    assert [s.out for s in seqs] == want
    assert all(s.finish_reason == "length" for s in seqs)
    assert steps.free_slots == 3


def test_a_reused_slot_is_not_zeroed_and_nothing_leaks(engine):
    """A long sequence fills slot 0 far past where the next one goes; the next one in the same slot
    must not see any of it."""
    steps = engine.step_engine(slots=1)
    long = Sequence(engine.encode(PROMPTS[1]), SamplingParams(max_new_tokens=40, ignore_eos=True))
    short = Sequence(engine.encode(PROMPTS[2]), GREEDY)
    steps.run([long])
    assert steps.cache.k[0][0, :, 40:50].abs().sum() > 0  # the old keys are still there
    steps.run([short])
    assert short.out == alone(engine, PROMPTS[2], GREEDY)


def test_text_is_decoded_incrementally_and_stop_strings_cut(engine):
    full = engine.complete([PROMPTS[0]], [SamplingParams(max_new_tokens=30, temperature=1.0, seed=3)])[0]
    assert full.text == engine.tokenizer.decode(full.token_ids)
    k = next(k for k in range(3, len(full.text) - 2) if full.text.index(full.text[k:k + 2]) == k)
    stop = full.text[k:k + 2]
    got = engine.complete([PROMPTS[0]], [SamplingParams(max_new_tokens=30, temperature=1.0, seed=3, stop=[stop])])[0]
    assert (got.text, got.finish_reason) == (full.text[:k], "stop")
    assert len(got.token_ids) < len(full.token_ids)  # it stopped generating, not only cut the text


def test_cancellation_frees_the_slot_at_the_next_step(engine):
    steps = engine.step_engine(slots=1)
    flag = {"cancel": False}
    a = Sequence(engine.encode(PROMPTS[0]), GREEDY, cancelled=lambda: flag["cancel"])
    b = Sequence(engine.encode(PROMPTS[2]), GREEDY)
    steps.add(a)
    steps.add(b)
    steps.step()
    steps.step()
    assert a.slot is not None and b.slot is None and len(a.out) == 3
    flag["cancel"] = True
    ended = steps.step()
    assert a in ended and a.finish_reason == "cancelled" and len(a.out) == 3
    assert b.slot == 0  # admitted in the same step
    while not steps.idle:
        steps.step()
    assert b.out == alone(engine, PROMPTS[2], GREEDY)


def test_expert_load_counts_every_token_once(engine):
    """Per MoE layer, K assignments for each prompt token and each generated token but the last (which is
    never fed back)."""
    engine.expert_load.reset()
    params = [SamplingParams(max_new_tokens=7 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    steps = engine.step_engine(slots=2, prefill_chunk=3)
    seqs = [Sequence(engine.encode(p), sp) for p, sp in zip(PROMPTS, params)]
    steps.run(seqs)
    fed = sum(len(s.prompt) + len(s.out) - 1 for s in seqs)
    counts = engine.expert_load.reset()
    assert counts.sum(dim=1).tolist() == [fed * engine.cfg.top_k] * counts.shape[0]


def test_requests_the_engine_cannot_run_are_refused_before_anything_runs(engine):
    steps = engine.step_engine(slots=1, max_len=16)
    with pytest.raises(EngineError, match="do not fit the cache's 16 positions"):
        steps.add(Sequence(engine.encode("a long enough prompt"), GREEDY))
    with pytest.raises(EngineError, match="outside"):
        steps.add(Sequence([1, 10_000], GREEDY))
    with pytest.raises(EngineError, match="no tokens"):
        steps.add(Sequence([], GREEDY))
    done = Sequence([1, 2], SamplingParams(max_new_tokens=0))
    steps.add(done)
    assert done.finish_reason == "length" and steps.idle


def test_eos_ends_a_sequence_without_its_token(engine):
    first = alone(engine, PROMPTS[3], GREEDY)[0]
    steps = engine.step_engine(slots=1)
    steps.eos_id = first  # the first greedy token is now the end-of-sequence token
    seq = Sequence(engine.encode(PROMPTS[3]), SamplingParams(max_new_tokens=5))
    steps.run([seq])
    assert (seq.out, seq.finish_reason) == ([], "stop")


def test_onnx_runner_gives_the_torch_runners_tokens(tmp_path):
    pytest.importorskip("onnxruntime")
    from moeserve.checkpoint import save_checkpoint
    from moeserve.export.onnx_export import export_onnx
    from moeserve.runtime.engine import load_engine

    engine = make_engine("softmax")
    ckpt = save_checkpoint(tmp_path / "ckpt", engine.cfg, engine.model.state_dict())
    params = [SamplingParams(max_new_tokens=6, ignore_eos=True), sampled(1)]
    want = [c.token_ids for c in engine.complete(PROMPTS[:2], params)]
    for kv in (False, True):
        out = tmp_path / f"m{kv}.onnx"
        export_onnx(ckpt, out, "portable", kv_cache=kv)
        onnx = load_engine(out)
        steps = onnx.step_engine(slots=2, prefill_chunk=5)
        seqs = [Sequence(onnx.encode(p), sp) for p, sp in zip(PROMPTS[:2], params)]
        steps.run(seqs)
        assert [s.out for s in seqs] == want, kv
        # a prompt scored in chunks of 5 through the graph: the torch engine's terms (logits at every position
        # come from both kinds of export)
        scored = Sequence(onnx.encode(PROMPTS[1]), SamplingParams(max_new_tokens=0, prompt_logprobs=2))
        steps.run([scored])
        terms = engine.token_logprobs_ids([engine.encode(PROMPTS[1])])[0]
        assert [lp.logprob for lp in scored.prompt_logprobs[1:]] == pytest.approx(terms, abs=1e-4), kv


class CallLog:
    """The engine's runner, with its model calls written down: ("prefill", tokens), ("step_rows", tokens per row)
    or ("decode", rows)."""

    def __init__(self, runner):
        self.runner, self.calls = runner, []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def prefill(self, cache, slot, ids_S, start, all_logits=False):
        self.calls.append(("prefill", ids_S.shape[0]))
        return self.runner.prefill(cache, slot, ids_S, start, all_logits)

    def step_rows(self, cache, slots, ids, starts):
        self.calls.append(("step_rows", [len(t) for t in ids]))
        return self.runner.step_rows(cache, slots, ids, starts)

    def decode(self, cache, slots, ids_B, positions):
        self.calls.append(("decode", len(slots)))
        return self.runner.decode(cache, slots, ids_B, positions)


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_prompts_and_running_sequences_share_a_call_with_their_own_tokens(engine, kind):
    """Prompts arriving together share one model call (within the step's prompt budget while others run), each
    row as long as its own prompt; a step that prefills carries the running sequences' next tokens in the same
    call. Every sequence gets the tokens it gets alone."""
    prompts = ["def alpha(x):", "class Beta(A)", "import gamma.", "x = 1"]  # bytes: 13, 13, 13 and 5
    ids = [engine.encode(p) for p in prompts]
    params = [GREEDY if kind == "greedy" else sampled(i) for i in range(4)]
    want = [alone(engine, p, sp) for p, sp in zip(prompts, params)]
    L, short = len(ids[0]), len(ids[3])
    assert len(ids[1]) == len(ids[2]) == L != short

    steps = engine.step_engine(slots=4)
    steps.runner = log = CallLog(steps.runner)
    seqs = [Sequence(i, sp) for i, sp in zip(ids, params)]
    steps.run(seqs)
    assert [s.out for s in seqs] == want
    assert log.calls[0] == ("step_rows", [L, L, L, short])  # then one decode call a step
    assert {c[0] for c in log.calls[1:]} == {"decode"}

    # while a sequence runs, a budget of 2L prompt tokens a step: two prompts and the running row's token in
    # one call, then the third prompt's first L - 1 tokens and two running rows, then its last token with three
    steps = engine.step_engine(slots=4, prefill_chunk=2 * L)
    steps.runner = log = CallLog(steps.runner)
    first = Sequence(ids[3], params[3])
    steps.add(first)
    steps.step()
    seqs = [Sequence(i, sp) for i, sp in zip(ids[:3], params)]
    for s in seqs:
        steps.add(s)
    steps.run([])
    assert [s.out for s in [*seqs, first]] == want[:3] + [want[3]]
    assert log.calls[:4] == [("prefill", short), ("decode", 1), ("step_rows", [L, L, 1]),
                             ("step_rows", [L, 1, 1, 1])]
    assert {c[0] for c in log.calls[4:]} == {"decode"}


@pytest.mark.parametrize("dense", ["kernel", "torch"])
def test_rows_of_any_lengths_are_each_their_row_alone(dense):
    """One call of prompt chunks of two lengths and a decode token: each row's logits, and the keys and values it
    writes, are those of its own call alone: exactly where the layers run on the C kernel (whose sums do not depend
    on the other rows), to a rounding on torch's (a GEMM may round a row differently with more rows beside it, and
    one token's experts take another path than several's). No token is padding, so the expert counts are the
    rows' tokens. Calls the cache cannot hold are refused."""
    engine = make_engine()
    if dense == "kernel":
        if not cpu_kernel.available():
            pytest.skip(f"no C kernel here: {cpu_kernel.unavailable_reason()}")
        engine.executor.lay_out(dataclasses.replace(engine.plan, kernel_experts=True, kernel_dense=True,
                                                    kernel_norms=True, pack_dense=False, pack_experts=False))
    model, runner = engine.model, engine.runner
    same = torch.equal if dense == "kernel" else (lambda x, y: torch.allclose(x, y, rtol=0, atol=1e-5))
    a, b, c = engine.encode("import os, sys"), engine.encode("x = 1"), engine.encode("def f(y):")
    cache = runner.new_cache(6, 64)
    with torch.inference_mode():
        runner.prefill(cache, 2, torch.tensor(c), 0)  # slot 2 holds c; its next token is decoded in the mixed call
        runner.prefill(cache, 5, torch.tensor(c), 0)
        out = runner.step_rows(cache, [0, 2, 1], [a, [7], b], [0, len(c), 0])
        alone_a = runner.prefill(cache, 3, torch.tensor(a), 0)
        alone_b = runner.prefill(cache, 4, torch.tensor(b), 0)
        alone_c = runner.decode(cache, [5], torch.tensor([7]), [len(c)])
        for row, want in enumerate([alone_a, alone_c, alone_b]):
            assert same(out.logits[row], want.logits[0, -1:]), row
        for kv in (*cache.k, *cache.v):
            assert same(kv[0, :, :len(a)], kv[3, :, :len(a)])
            assert same(kv[1, :, :len(b)], kv[4, :, :len(b)])
            assert same(kv[2, :, :len(c) + 1], kv[5, :, :len(c) + 1])
        assert [int(x.counts.sum()) for x in out.aux] == [(len(a) + len(b) + 1) * model.cfg.top_k] * len(out.aux)
        with pytest.raises(ValueError, match=r"slots \[0, 0\]: a slot takes one row of a call"):
            runner.step_rows(cache, [0, 0], [a, b], [0, 0])
        with pytest.raises(ValueError, match=r"lengths \[3, 0\]: one each, >= 1"):
            cache.step_rows([0, 1], [0, 0], [3, 0])
        with pytest.raises(ValueError, match="positions up to 64 do not fit a cache of 64"):
            runner.step_rows(cache, [0, 1], [a, b], [0, 64 - len(b) + 1])
        with pytest.raises(ValueError, match=r"take their 5 tokens as one row \[1, 5\]"):
            model(torch.zeros(1, 4, dtype=torch.long), cache=cache.step_rows([0, 1], [0, 0], [3, 2]))
