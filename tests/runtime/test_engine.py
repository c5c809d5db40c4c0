"""Engine: batched generation equals per-prompt generation, scoring and classification equal a direct
computation, expert-load accounting counts exactly the routed tokens, bad requests get EngineError."""

import math

import pytest
import torch

from moeserve.config import preset
from moeserve.runtime import device
from moeserve.runtime.engine import Engine, EngineError, SamplingParams, resolve_dtype
from moeserve.runtime.kv_cache import KVCache
from moeserve.runtime.model import Transformer
from moeserve.runtime.backends.packing import PackedLinear, onednn_packing_available
from moeserve.tokenizer import ByteTokenizer

PROMPTS = ["def f(x):", "import os\nimport sys\nclass A:\n", "a", "x = [1, 2,"]


def make_engine(router: str = "softmax", device: str = "cpu", dtype: str = "float32", **overrides) -> Engine:
    torch.manual_seed(0)  # the same weights on every device
    cfg = preset("tiny", router=router, max_seq_len=96, **overrides)
    model = Transformer(cfg)
    if router == "vq":  # codes from real activations, so tokens spread over several experts
        with torch.no_grad():
            for layer in model.moe_layers:
                layer.quantizer.codebook.normal_()
    return Engine.from_model(model, ByteTokenizer(), dtype=dtype, device=device)


@pytest.fixture(scope="module", params=["softmax", "sigmoid", "xmoe", "vq"])
def engine(request) -> Engine:
    return make_engine(request.param)


def test_batch_greedy_equals_alone(engine):
    alone = [engine.generate(p, max_new_tokens=24)[0] for p in PROMPTS]
    assert engine.generate(PROMPTS, max_new_tokens=24) == alone
    assert all(len(a.encode()) > 0 for a in alone)


def test_batch_sampled_equals_alone_per_seed(engine):
    params = [SamplingParams(max_new_tokens=16 + 4 * i, temperature=0.9, top_k=50, top_p=0.95, seed=10 + i,
                             ignore_eos=True)
              for i in range(len(PROMPTS))]
    alone = [engine.complete([p], [sp])[0] for p, sp in zip(PROMPTS, params)]
    batch = engine.complete(PROMPTS, params)
    assert [c.token_ids for c in batch] == [c.token_ids for c in alone]
    assert [c.completion_tokens for c in batch] == [16 + 4 * i for i in range(len(PROMPTS))]
    # The seed matters: another seed gives another continuation.
    other = engine.complete([PROMPTS[0]], [SamplingParams(16, 0.9, 50, 0.95, seed=999)])[0]
    assert other.token_ids != alone[0].token_ids


def test_batch_prefill_logits_match_alone():
    """Prompts of different lengths, each prefilled into its own slot of one KVCache and then decoded
    together in one call, give the logits each prompt gives alone (prompt plus next token, uncached)."""
    eng = make_engine()
    rows = [eng.encode(p) for p in PROMPTS]
    slots = [2, 0, 3, 1]  # not the rows' order: the decode step gathers its slots
    cache = KVCache.for_model(eng.model, len(rows), max(len(r) for r in rows) + 1)
    with torch.no_grad():
        prefill = [eng.model(torch.tensor([r]), cache=cache.rows([slot], [0], len(r))).logits[0, -1].float()
                   for r, slot in zip(rows, slots)]
        next_ids = torch.stack([p.argmax() for p in prefill])  # each prompt's greedy next token
        step = eng.model(next_ids[:, None], cache=cache.rows(slots, [len(r) for r in rows], 1)).logits[:, -1].float()
    for i, r in enumerate(rows):
        alone = eng.forward(torch.tensor([r + [int(next_ids[i])]]))[0]
        torch.testing.assert_close(prefill[i], alone[-2], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(step[i], alone[-1], atol=1e-5, rtol=1e-5)


def test_logits_with_cache_match_full_forward():
    eng = make_engine()
    ids = eng.encode("while True:\n    pass")
    full = eng.forward(torch.tensor([ids]))[0]
    params = SamplingParams(max_new_tokens=1)
    eng.complete([ids[:5]], params)  # warm the code path; the check below is on the raw model
    m = eng.model
    cache = KVCache.for_model(m, 1, len(ids))
    with torch.no_grad():
        m(torch.tensor([ids[:5]]), cache=cache.rows([0], [0], 5))
        for i in range(5, len(ids)):
            step = m(torch.tensor([[ids[i]]]), cache=cache.rows([0], [i], 1)).logits[0, -1]
            torch.testing.assert_close(step, full[i], atol=1e-5, rtol=1e-5)


def test_top_k_one_is_greedy_and_stop_strings():
    eng = make_engine()
    greedy = eng.generate(PROMPTS[0], max_new_tokens=20)[0]
    assert eng.generate(PROMPTS[0], max_new_tokens=20, temperature=1.5, top_k=1, seed=3)[0] == greedy
    stop = greedy[5:7]
    c = eng.complete([PROMPTS[0]], [SamplingParams(max_new_tokens=20, stop=[stop])])[0]
    assert c.text == greedy[: greedy.index(stop)] and c.finish_reason == "stop"
    c = eng.complete([PROMPTS[0]], [SamplingParams(max_new_tokens=7)])[0]
    assert c.finish_reason == "length" and c.completion_tokens == 7 and c.prompt_tokens == len(PROMPTS[0]) + 1


def test_eos_ends_a_row():
    eng = make_engine()
    with torch.no_grad():  # make <eos> the certain next token
        eng.model.tok_embeddings.weight[ByteTokenizer.eos_id] *= 0
        eng.model.tok_embeddings.weight[ByteTokenizer.eos_id] += 50 * eng.model.norm.weight.sign()
    eng.executor.lay_out()  # packed copies follow weight edits only when laid out again
    c = eng.complete(["abc"], [SamplingParams(max_new_tokens=10)])[0]
    assert c.token_ids == [] and c.finish_reason == "stop"
    c = eng.complete(["abc"], [SamplingParams(max_new_tokens=3, ignore_eos=True)])[0]
    assert c.token_ids == [ByteTokenizer.eos_id] * 3


def test_score_equals_direct_log_softmax(engine):
    texts = ["hello world", "x", "def g():\n    return 1\n"]
    scores = engine.score(texts)
    for t, s in zip(texts, scores):
        ids = engine.encode(t)
        logits = engine.forward(torch.tensor([ids]))[0]
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None]).sum().item()
        assert s.n_tokens == len(t.encode())
        assert s.logprob == pytest.approx(lp, abs=1e-4)
        assert s.bits_per_byte == pytest.approx(-lp / math.log(2) / len(t.encode()), abs=1e-5)


def test_expert_load_counts_exactly_the_routed_tokens():
    eng = make_engine()
    eng.expert_load.reset()
    rows = [eng.encode(p) for p in PROMPTS]
    eng.score_ids(rows)  # right-padded batch: padding must not be counted
    counts = eng.expert_load.reset()
    n_real = sum(len(r) for r in rows)
    assert counts.shape == (eng.cfg.n_layers, eng.cfg.n_experts)
    assert counts.sum(dim=1).tolist() == [n_real * eng.cfg.top_k] * eng.cfg.n_layers
    # Generation: prompt tokens once, then one routed token per generated token fed back.
    out = [c.token_ids for c in eng.complete(rows, SamplingParams(max_new_tokens=6, ignore_eos=True))]
    counts = eng.expert_load.reset()
    fed = n_real + sum(len(o) - 1 for o in out)
    assert counts.sum(dim=1).tolist() == [fed * eng.cfg.top_k] * eng.cfg.n_layers
    # The per-expert split equals the routes of a direct forward.
    ids = torch.tensor([rows[1]])
    direct = eng.model(ids).aux
    eng.forward(ids)
    want = torch.stack([torch.bincount(a.routing.expert_ids.reshape(-1), minlength=eng.cfg.n_experts) for a in direct])
    assert torch.equal(eng.expert_load.snapshot(), want)


def test_route_lists_experts_per_token():
    eng = make_engine()
    routes = eng.route("abc")
    assert len(routes) == len(eng.model.moe_layers)
    assert [len(r) for r in routes] == [4] * len(routes)  # <bos> a b c
    assert all(len(set(t)) == eng.cfg.top_k and all(0 <= e < eng.cfg.n_experts for e in t) for r in routes for t in r)


def test_classify_probabilities():
    torch.manual_seed(0)
    cfg = preset("tiny", task="classify", n_classes=3, causal=False, max_seq_len=64)
    eng = Engine.from_model(Transformer(cfg), ByteTokenizer())
    texts = ["good", "bad movie", "a much longer review of the film"]
    probs = eng.classify(texts)
    for t, p in zip(texts, probs):
        alone = eng.forward(torch.tensor([eng.encode(t)]))[0].softmax(-1)
        assert sum(p) == pytest.approx(1.0, abs=1e-6)
        torch.testing.assert_close(torch.tensor(p), alone, atol=1e-5, rtol=1e-5)
    with pytest.raises(EngineError, match="classify model; scoring needs a language model"):
        eng.score(["x"])
    with pytest.raises(EngineError, match="language model; classify needs"):
        make_engine().classify(["x"])


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=-1), "max_new_tokens = -1"),
    (dict(temperature=-0.5), "temperature = -0.5"),
    (dict(temperature=float("nan")), "temperature = nan"),
    (dict(top_k=0), "top_k = 0"),
    (dict(top_p=0.0), "top_p = 0.0"),
    (dict(top_p=1.5), "top_p = 1.5"),
    (dict(stop=[""]), "stop"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(EngineError, match=message):
        make_engine().generate("abc", **kwargs)


def test_bad_prompts():
    eng = make_engine()
    with pytest.raises(EngineError, match="prompt 0 is empty"):
        eng.generate("")
    with pytest.raises(EngineError, match="tokens; the model's context is 96"):
        eng.generate("x" * 200)
    with pytest.raises(EngineError, match="must be a string"):
        eng.score([3])
    with pytest.raises(EngineError, match="outside"):
        eng.complete([[1, 9999]], SamplingParams())
    # Long prompts get what fits: the budget shrinks to the context.
    out = eng.complete(["y" * 90], [SamplingParams(max_new_tokens=50, ignore_eos=True)])[0]
    assert out.completion_tokens == 96 - 91 and out.finish_reason == "length"


def test_dtype_resolution():
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) is torch.float32
    assert resolve_dtype("bf16", cpu) is torch.bfloat16
    assert resolve_dtype("auto", cpu) in (torch.float32, torch.bfloat16)
    with pytest.raises(EngineError, match="dtype 'int8'"):
        resolve_dtype("int8", cpu)


@pytest.mark.parametrize("onednn_bf16", ["this cpu", "forced off"])
def test_bf16_engine_generates_like_fp32_at_first_tokens(monkeypatch, onednn_bf16):
    """bf16 on the machine's own path, and on the unpacked fallback forced on every machine (AVX2-only CPUs
    take it for real). The fp32 engine's model is packed in place where fp32 packing is the default; its
    bf16 copy must come out laid out for bf16, never holding the fp32 packed weights."""
    if onednn_bf16 == "forced off":
        monkeypatch.setattr(device, "onednn_bf16_available", lambda: False)
    fp32 = make_engine()
    bf16 = Engine.from_model(make_engine().model, ByteTokenizer(), dtype="bfloat16")
    packed = onednn_packing_available("cpu", torch.bfloat16)
    assert bf16.plan.pack_dense == bf16.plan.pack_experts == packed
    assert any(isinstance(m, PackedLinear) for m in bf16.model.modules()) == packed
    assert all(layer.experts.w.packed == packed for layer in bf16.model.moe_layers)
    a = fp32.forward(torch.tensor([fp32.encode("def f(x): return x")]))
    b = bf16.forward(torch.tensor([bf16.encode("def f(x): return x")]))
    assert b.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    assert (a - b).abs().max().item() < 0.1 * a.abs().max().item()
    assert len(bf16.generate("def ", max_new_tokens=8)[0].encode()) > 0


def test_tiny_temperature_and_top_p_are_greedy_not_nan():
    """1e-300 overflows logits / temperature to inf, and float32 rounds top_p=5e-324 to 0 (dropping every
    token): both must give the argmax, not NaN probabilities (found by fuzzing the server)."""
    eng = make_engine()
    greedy = eng.complete(["ab"], [SamplingParams(6, 0.0)])[0].token_ids
    assert eng.complete(["ab"], [SamplingParams(6, 1e-300)])[0].token_ids == greedy
    assert eng.complete(["ab"], [SamplingParams(6, 1.0, top_p=5e-324, seed=3)])[0].token_ids == greedy


def test_run_never_records_a_graph():
    """Engine.run called as it is (no inference_mode around it) takes the inference path: with autograd on,
    every layer took the training path (torch's loop over experts, no packed weights or C kernel) and recorded
    a graph, 2-4x slower at a short prompt."""
    engine = make_engine()
    assert torch.is_grad_enabled()
    out = engine.executor.run(torch.tensor([engine.encode("def f(x):")]))
    assert out.logits.is_inference() and not out.logits.requires_grad
    torch.testing.assert_close(out.logits.float(), engine.forward(torch.tensor([engine.encode("def f(x):")])),
                               atol=0, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_scoring_runs_the_head_a_few_rows_at_a_time(dtype, monkeypatch):
    """Scores come from the head and log-softmax over HEAD_ROWS rows at a time, never the batch's [B, S, V] logits,
    with each token's log-probability exactly that of the whole logits' log-softmax (the chunks split rows only)."""
    from moeserve.runtime import model as model_mod

    monkeypatch.setattr(model_mod, "HEAD_ROWS", 7)
    engine = make_engine(dtype=dtype)
    rows = [engine.encode(p) for p in PROMPTS]
    seen = []
    head = engine.model.output
    monkeypatch.setattr(head, "forward", lambda x, forward=head.forward: seen.append(x.shape[0]) or forward(x))
    got = engine.token_logprobs_ids(rows)
    assert seen and max(seen) == 7 and sum(seen) == len(rows) * (max(map(len, rows)) - 1)
    ids, mask = engine._right_pad(rows)
    with torch.inference_mode():
        logits = engine.model(ids, attention_mask=mask).logits  # the whole batch's, as scoring computed them before
    want = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    assert got == [lp[:len(r) - 1] for lp, r in zip(want.tolist(), rows)]
