"""The compiled decode step (compiled.py): the same tokens and the same expert-load counts as eager (fp32),
with padded buckets and a scratch slot; the mode and capability checks, both sides of each probe."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from moeserve.config import preset
from moeserve.runtime.backends import compiled as compiled_mod
from moeserve.runtime.backends import experts as experts_mod
from moeserve.runtime.backends.plan import default_plan
from moeserve.runtime.backends.experts import lay_out_experts
from moeserve.runtime.backends.compiled import CompileError, buckets, resolve_compile, spans
from moeserve.runtime.engine import Engine, EngineError
from moeserve.runtime.model import Transformer
from moeserve.runtime.sampling import SamplingParams
from moeserve.tokenizer import ByteTokenizer

CPU = torch.device("cpu")
HAS_CXX = compiled_mod.compile_unavailable(CPU) is None


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(3) == [1, 2, 3]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(12) == [1, 2, 4, 8, 12]


def test_spans():
    assert spans(64, 16) == [16, 32, 64]
    assert spans(100, 16) == [16, 32, 64, 100]
    assert spans(32768) == [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
    assert spans(128) == [128]  # a context shorter than the least span: one span, the whole of it


def test_a_warm_up_for_a_static_batch_builds_its_bucket_alone(monkeypatch):
    """A server warms every bucket up to its slots; a static batch of `rows` (the benches) needs one graph, at every
    span. The compiled step is a stand-in that records each call's rows and span (the selection, not inductor, is
    under test), and the rows pass through the executor's seam."""
    from moeserve.runtime.kv_cache import KVCache

    model = Transformer(preset("tiny", router="softmax", max_seq_len=64))
    decode = compiled_mod.CompiledDecode(model, KVCache.for_model(model, 6 + 1), least_span=16)  # 6 slots, a scratch
    calls = []
    decode._step = lambda ids, slots, positions, span: calls.append((ids.shape[0], span.shape[0]))
    decode.warm_up(rows=3)
    assert decode.buckets == [1, 2, 4, 6] and calls == [(4, 16), (4, 32), (4, 64)]
    calls.clear()
    decode.warm_up()
    assert sorted({b for b, _ in calls}) == [1, 2, 4, 6] and len(calls) == 4 * 3
    with pytest.raises(ValueError, match="7 rows in a decode step; the cache has 6 slots"):
        decode.warm_up(rows=7)
    if compiled_mod.compile_unavailable(torch.device("cpu")) is None:  # the seam: Executor -> CompiledBackend
        engine = Engine.from_model(model, ByteTokenizer(), calibration="off", compile="on")
        seen = []
        monkeypatch.setattr(compiled_mod.CompiledDecode, "warm_up", lambda self, rows=None: seen.append(rows))
        monkeypatch.setattr(compiled_mod.CompiledPrefill, "warm_up", lambda self: None)
        monkeypatch.setattr(compiled_mod.CompiledBackend, "_replays_per_eager_call", lambda self: 1)
        engine.executor.warm_up(6, rows=5)
        engine.executor.warm_up(6)
        assert seen == [5, None]


def test_modes():
    assert resolve_compile("off", CPU) is False
    assert resolve_compile("auto", CPU) is False  # eager on a CPU unless asked
    with pytest.raises(CompileError, match="compile mode 'fast'"):
        resolve_compile("fast", CPU)


def test_on_without_a_compiler_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(CompileError, match="needs a C\\+\\+ compiler"):
        resolve_compile("on", CPU)
    assert resolve_compile("auto", torch.device("cuda")) is False  # auto never fails: it stays eager


@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler: inductor cannot build a CPU graph here")
def test_on_with_a_compiler():
    assert resolve_compile("on", CPU) is True


def test_engine_refusals():
    torch.manual_seed(0)
    with pytest.raises(EngineError, match="capacity_factor"):
        Engine.from_model(Transformer(preset("tiny", capacity_factor=1.25)), ByteTokenizer(), compile="on")
    with pytest.raises(EngineError, match="compile mode 'yes'"):
        Engine.from_model(Transformer(preset("tiny")), ByteTokenizer(), compile="yes")


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("router", ["softmax", "vq"])
def test_compiled_decode_gives_eager_tokens_and_counts(router, device):
    """Two prompts of different lengths finish at different steps: buckets 2 and 1 are both used (each bucket is
    a graph inductor compiles, ~10 s of C++ on a slow CPU: a third prompt would add one and prove nothing more);
    greedy and seeded sampling; the expert load is the real rows' only. On CUDA the graphs are CUDA graphs (mode
    "reduce-overhead"), replayed over the cache they were captured on."""
    why = compiled_mod.compile_unavailable(torch.device(device))
    if why is not None:
        pytest.skip(why)
    torch.manual_seed(0)
    cfg = preset("tiny", router=router, vq_mode="discrete") if router == "vq" else preset("tiny", router=router)
    model = Transformer(cfg)
    tok = ByteTokenizer()
    eager = Engine.from_model(model, tok, device=device, calibration="off")
    fast = Engine.from_model(Transformer(cfg), tok, device=device, calibration="off", compile="on")
    fast.model.load_state_dict(model.state_dict())
    fast.executor.lay_out()
    rows = [tok.encode("def f(x):", bos=True), tok.encode("import", bos=True)]
    params = [SamplingParams(max_new_tokens=n, temperature=t, seed=3) for n, t in ((12, 0.0), (5, 0.8))]
    want = eager.complete(rows, params)
    got = fast.complete(rows, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert torch.equal(fast.expert_load.snapshot(), eager.expert_load.snapshot())
    assert fast.runner._decode is not None and fast.runner.graph_decode  # it ran compiled, not a silent fallback


def bucket_logits(device: str, plan, seen: list, sizes: tuple[int, ...] = (2, 1),
                  graph_prefill: bool = True) -> tuple[torch.Tensor, Engine]:
    """The tiny softmax model (the same weights each call) in bf16 with a compiled step on `plan`: two prompts
    prefilled (on the prompt graph unless `graph_prefill` is off), then one token decoded at each batch bucket of
    `sizes` in turn; their logits, [sum(sizes), V]. `seen` (a list that a patched path appends to) is emptied after
    the prefill, so what it holds after came from the step's graphs."""
    torch.manual_seed(0)
    tok = ByteTokenizer()
    rows = [tok.encode(t, bos=True) for t in ("def f(x):", "import")]
    engine = Engine.from_model(Transformer(preset("tiny", router="softmax")), tok, dtype="bfloat16", device=device,
                               compile="on", plan=plan)
    runner, cache, steps = engine.runner, engine.runner.new_cache(2, 32), []
    runner.graph_prefill = graph_prefill and runner.graph_prefill
    with torch.inference_mode():
        for slot, r in enumerate(rows):
            runner.prefill(cache, slot, torch.tensor(r, device=device), 0)
        seen.clear()
        for n in sizes:
            ids = torch.tensor([7, 11][:n], device=device)
            out = runner.decode(cache, list(range(n)), ids, [len(r) + 2 - n for r in rows[:n]])
            steps.append(out.logits.float().cpu())
    assert runner.graph_decode
    return torch.cat([x.reshape(-1, x.shape[-1]) for x in steps]), engine


def assert_within_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    # 2-core AVX512 EPYC, grouped_mm against indexing: max 0.15% of the largest logit, mean 0.03%; the groups'
    # offsets shifted by one expert: max 1.9%, mean 0.3%
    scale = want.abs().max()
    assert (got - want).abs().max() <= 2**-7 * scale
    assert (got - want).abs().mean() <= 2**-10 * scale


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_compiled_decode_with_grouped_experts(device, monkeypatch):
    """decode_grouped: the compiled step runs each layer's experts as one grouped_mm call over the routed rows
    (bf16, the dtype torch compiles grouped_mm for), with its counts on the device: the logits of the step that
    indexes each token's experts out of the stack, within bf16's rounding, at batch bucket 2 (each bucket is a graph
    of ~15 kernels, ~10 s of C++ cold; bucket 1 would prove nothing more, and the prompts are prefilled eagerly)."""
    why = compiled_mod.compile_unavailable(torch.device(device))
    if why is not None:
        pytest.skip(why)
    grouped_mm, seen = experts_mod.F.grouped_mm, []
    monkeypatch.setattr(experts_mod.F, "grouped_mm", lambda *a, **k: seen.append(1) or grouped_mm(*a, **k))
    plan = dataclasses.replace(default_plan(device, torch.bfloat16), grouped_mm=True)
    logits = {}
    for grouped in (False, True):  # eager prefills run grouped_mm either way
        logits[grouped], engine = bucket_logits(device, dataclasses.replace(plan, decode_grouped=grouped), seen,
                                                sizes=(2,), graph_prefill=False)
        assert engine.model.moe_layers[0].experts.w.decode_grouped == grouped
        assert (len(seen) > 0) == grouped  # grouped_mm only in the grouped step
    assert_within_bf16(logits[True], logits[False])


@pytest.mark.cuda
def test_compiled_decode_with_gemv_experts_on_cuda(monkeypatch):
    """decode_reduce_max: a CUDA-graph step of up to 2 rows runs each layer's experts as moe_reduced's GEMVs (traced:
    seen while the graphs are built), with the logits of the step that indexes them, within bf16's rounding, at
    batch buckets 2 and 1 (on a CPU: tests/runtime/test_experts.py, eager and one fullgraph compile)."""
    why = compiled_mod.compile_unavailable(torch.device("cuda"))
    if why is not None:
        pytest.skip(why)
    reduced, seen = experts_mod.moe_reduced, []
    monkeypatch.setattr(experts_mod, "moe_reduced", lambda *a: seen.append(1) or reduced(*a))
    plan = dataclasses.replace(default_plan("cuda", torch.bfloat16), decode_grouped=False)
    logits = {}
    for gemv in (0, 2):
        logits[gemv], _ = bucket_logits("cuda", dataclasses.replace(plan, decode_reduce_max=gemv), seen)
        assert (len(seen) > 0) == bool(gemv)
    assert_within_bf16(logits[2], logits[0])


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_compiled_decode_step_never_waits_for_the_host(device, monkeypatch):
    """The step's expert counts are counted on the device (experts.expert_counts), not by torch.bincount, which
    reads the largest id back to size its output: a host sync after every replay on CUDA. On a CPU, bincount must
    not be called; on CUDA, replays under sync debug mode 'error' (any synchronizing call raises), with the counts
    of the rows that ran."""
    why = compiled_mod.compile_unavailable(torch.device(device))
    if why is not None:
        pytest.skip(why)
    torch.manual_seed(0)
    dtype = "bfloat16" if device == "cuda" else "float32"
    engine = Engine.from_model(Transformer(preset("tiny", router="softmax")), ByteTokenizer(), dtype=dtype,
                               device=device, calibration="off", compile="on")
    runner, tok = engine.runner, ByteTokenizer()
    cache = runner.new_cache(2, 32)
    rows = [tok.encode(t, bos=True) for t in ("def f(x):", "import")]
    with torch.inference_mode():
        for slot, r in enumerate(rows):
            runner.prefill(cache, slot, torch.tensor(r, device=device), 0)
        ids = torch.tensor([7, 11], device=device)
        runner.decode(cache, [0, 1], ids, [len(r) for r in rows])  # builds and captures the graph
        monkeypatch.setattr(torch, "bincount", lambda *a, **k: pytest.fail("bincount in a compiled decode step"))
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            outs = [runner.decode(cache, [0, 1], ids, [len(r) + 1 + i for r in rows]) for i in range(3)]
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode(0)
    assert runner.graph_decode and runner._decode is not None
    for out in outs:
        counts = torch.stack([a.counts for a in out.aux]).cpu()
        assert counts.sum(-1).tolist() == [2 * 2] * len(out.aux)  # 2 rows x top-2, every MoE layer


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_compiled_decode_attends_over_the_live_span(device, monkeypatch):
    """A row at position p reads the first span > p of its slot, not the whole cache: a sequence from position 9 to
    48 steps through spans 16, 32 and 64 of a 64-position cache, with one compile for all three (the span is a
    dynamic dimension), and the same tokens as eager (fp32), which reads exactly the live length."""
    why = compiled_mod.compile_unavailable(torch.device(device))
    if why is not None:
        pytest.skip(why)
    from torch._dynamo.utils import counters

    monkeypatch.setattr(compiled_mod, "LEAST_SPAN", 16)
    torch.manual_seed(0)
    model = Transformer(preset("tiny", router="softmax"))
    tok = ByteTokenizer()
    eager = Engine.from_model(model, tok, device=device, calibration="off")
    fast = Engine.from_model(Transformer(model.cfg), tok, device=device, calibration="off", compile="on")
    fast.model.load_state_dict(model.state_dict())
    fast.executor.lay_out()
    prompt = [tok.encode("def f(x):", bos=True)]
    assert len(prompt[0]) == 10
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    want = [c.token_ids for c in eager.complete(prompt, params)]
    graphs = counters["stats"]["unique_graphs"]
    got = [c.token_ids for c in fast.complete(prompt, params)]
    assert got == want
    decode = fast.runner._decode
    assert decode.spans == [16, 32, 64]
    # positions 10..48 (the last token is chosen, not decoded): 6 steps below 16, 16 below 32, 17 below 64
    assert decode.steps == {(1, 16): 6, (1, 32): 16, (1, 64): 17}
    assert counters["stats"]["unique_graphs"] - graphs == 1


def test_grouped_decode_is_refused_where_it_cannot_compile():
    ex = Transformer(preset("tiny")).moe_layers[0].experts
    with pytest.raises(ValueError, match=r"decode_grouped runs torch's grouped_mm on plain bfloat16 weights: not "
                                         r"with grouped_mm=True, kernel=False and float32"):
        lay_out_experts(ex, grouped_mm=True, decode_grouped=True)
    with pytest.raises(ValueError, match="not with grouped_mm=False"):
        lay_out_experts(ex.to(torch.bfloat16), grouped_mm=False, decode_grouped=True)
    assert lay_out_experts(ex, grouped_mm=True, decode_grouped=True, graph=True).w.decode_grouped


@pytest.mark.slow
def test_decode_stays_on_the_graph_while_prompts_arrive():
    """A prompt arriving while a sequence decodes is prefilled eagerly, and the decoding row takes the compiled step
    in the same step rather than riding in the prompt's call: every decode token is a replay, counted as such in
    moeserve_decode_tokens_total, with the tokens of the eager engine, whose rows ride in the prompt's call. Two
    slots, as test_compiled_decode_gives_eager_tokens_and_counts has: the same graphs, which inductor's cache holds
    for whichever of the two runs second."""
    if not HAS_CXX:
        pytest.skip("no C++ compiler: inductor cannot build a CPU graph here")
    from moeserve.runtime.steps import Sequence
    from moeserve.serve.metrics import Metrics

    torch.manual_seed(0)
    model = Transformer(preset("tiny", router="softmax"))
    tok = ByteTokenizer()
    eager = Engine.from_model(model, tok, calibration="off")
    fast = Engine.from_model(Transformer(model.cfg), tok, calibration="off", compile="on")
    fast.model.load_state_dict(model.state_dict())
    fast.executor.lay_out()
    prompts = [tok.encode(t, bos=True) for t in ("def f(x):", "import os")]
    tokens = {}
    for name, engine in (("eager", eager), ("compiled", fast)):
        steps = engine.step_engine(slots=2)
        seqs = [Sequence(p, SamplingParams(max_new_tokens=12, ignore_eos=True)) for p in prompts]
        with torch.inference_mode():
            steps.add(seqs[0])
            for i in range(6):  # the second prompt joins at step 3, while the first decodes
                if i == 3:
                    steps.add(seqs[1])
                steps.step()
            while not steps.idle:
                steps.step()
        tokens[name] = [s.out for s in seqs]
    assert tokens["compiled"] == tokens["eager"]
    # each sequence's first token comes from its prefill, the other 11 from decode steps
    assert eager.executor.decode_tokens == {"eager": 22}
    assert fast.executor.decode_tokens == {"graph": 22}
    metrics = Metrics()
    metrics.watch_paths("decode", lambda: fast.executor.decode_tokens)
    text = metrics.render().decode()
    assert 'moeserve_decode_tokens_total{path="graph"} 22.0' in text
    assert 'moeserve_decode_tokens_total{path="eager"} 0.0' in text
