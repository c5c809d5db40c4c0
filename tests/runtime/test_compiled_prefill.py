"""A prompt chunk as a compiled graph (compiled.py: CompiledPrefill): padded to a size bucket, its keys written where
eager writes them, its logits within bf16's rounding of eager's and its expert counts those of its real tokens
exactly, one compile for every size and span; prompts arriving while others decode take it in the step engine,
counted in moeserve_prefill_tokens_total; and where it cannot run (a chunk past its sizes, fp32 experts), eager.
On CUDA, a replay waits for nothing on the host."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moeserve.config import preset
from moeserve.runtime.backends import compiled as compiled_mod
from moeserve.runtime.backends.compiled import chunk_sizes, prefill_uncompilable
from moeserve.runtime.backends.plan import default_plan
from moeserve.runtime.engine import Engine
from moeserve.runtime.model import Transformer
from moeserve.runtime.sampling import SamplingParams
from moeserve.runtime.steps import Sequence
from moeserve.tokenizer import ByteTokenizer


def test_chunk_sizes():
    assert chunk_sizes(4096) == [16, 32, 64, 128, 256, 512]
    assert chunk_sizes(256) == [16, 32, 64, 128, 256]
    assert chunk_sizes(300) == [16, 32, 64, 128, 256, 300]
    assert chunk_sizes(10) == [10]


def grouped_plan(device: str):
    """The plan a CUDA bf16 model gets by default: experts as one grouped_mm call, in a compiled step too."""
    return dataclasses.replace(default_plan(device, torch.bfloat16), grouped_mm=True, decode_grouped=True,
                               pack_dense=False, pack_experts=False)


def engines(device: str, **config) -> tuple[Engine, Engine]:
    """The tiny softmax model (or `config`'s) in bf16 with a compiled step on the grouped plan, twice on the same
    weights: the second's prompt chunks eager (graph_prefill off), its decode step compiled like the first's."""
    torch.manual_seed(0)
    model = Transformer(preset("tiny", **({"router": "softmax"} | config)))
    out = []
    for _ in range(2):
        e = Engine.from_model(Transformer(model.cfg), ByteTokenizer(), dtype="bfloat16", device=device,
                              compile="on", plan=grouped_plan(device))
        e.model.load_state_dict(model.state_dict())
        e.executor.lay_out()
        out.append(e)
    out[1].runner.graph_prefill = False
    return out[0], out[1]


def assert_within_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    # 2-core AVX512 EPYC, inductor's graph against eager, both grouped_mm: max 0.17% of the largest logit
    scale = want.abs().max()
    assert (got - want).abs().max() <= 2**-7 * scale
    assert (got - want).abs().mean() <= 2**-10 * scale


def test_which_models_compile_a_prompt_chunk():
    torch.manual_seed(0)
    fp32 = Engine.from_model(Transformer(preset("tiny", router="softmax")), ByteTokenizer(), compile="off",
                             calibration="off")
    assert "grouped_mm" in prefill_uncompilable(fp32.model)  # fp32 experts are indexed per token when traced
    bidirectional = Transformer(preset("tiny", router="softmax", causal=False))
    assert "padding would be attended to" in prefill_uncompilable(bidirectional)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_compiled_prompt_chunk_writes_and_counts_as_eager(device):
    """Chunks of 5, 40 and 20 tokens (sizes 16, 64, 32; the last from position 5 of a slot that holds 5) and one whose
    padding would pass the cache's end (eager): keys and values where eager writes them, the last token's logits and
    the real tokens' expert counts, one compile in all. Several prompts in one call (step_rows) run eager, or a graph
    each where rows_on_graphs allows."""
    why = compiled_mod.compile_unavailable(torch.device(device))
    if why is not None:
        pytest.skip(why)
    from torch._dynamo.utils import counters

    graph, eager = engines(device)
    assert graph.runner.graph_prefill and prefill_uncompilable(graph.model) is None
    # four slots, as test_prompts_arriving_while_others_decode_take_the_graph's step engine has: the same prompt
    # graph (its cache is part of it), which inductor's cache holds for whichever of the two runs second
    caches = [e.runner.new_cache(4, 64) for e in (graph, eager)]
    g = torch.Generator().manual_seed(1)
    chunks = [(0, torch.randint(3, 250, (5,), generator=g), 0), (1, torch.randint(3, 250, (40,), generator=g), 0),
              (0, torch.randint(3, 250, (20,), generator=g), 5), (2, torch.randint(3, 250, (3,), generator=g), 60)]
    compiles = [counters["stats"]["unique_graphs"]]
    with torch.inference_mode():
        for slot, ids, start in chunks:
            got, want = (e.runner.prefill(c, slot, ids.to(device), start) for e, c in zip((graph, eager), caches))
            compiles.append(counters["stats"]["unique_graphs"])
            assert got.graph == (start + 16 <= 64) and not want.graph
            assert_within_bf16(got.logits.float().cpu(), want.logits.float().cpu())
            assert [a.counts.tolist() for a in got.aux] == [a.counts.tolist() for a in want.aux]
            real = slice(start, start + len(ids))
            for layer in range(graph.cfg.n_layers):
                for kv in ("k", "v"):
                    a, b = (getattr(c, kv)[layer][slot, :, real].float().cpu() for c in caches)
                    assert_within_bf16(a, b)
        # one graph for the three sizes: the first chunk compiles it (or finds it built, where
        # test_prompts_arriving_while_others_decode_take_the_graph ran first in this process: the same graph), the
        # others compile nothing
        assert compiles[1] - compiles[0] <= 1 and compiles[-1] == compiles[1]
        assert graph.runner._prefill.steps == {(16, 64): 1, (64, 64): 1, (32, 64): 1}
        # several prompts in one call: one eager call (it reads the experts once), unless as many replays take less
        # time than it (rows_on_graphs, timed at warm-up), then a graph each, in the rows' order
        rows = [[7, 8, 9], list(range(40, 70)), [5] * 17]
        assert graph.runner.rows_on_graphs == 1  # before a warm-up has timed both
        assert not graph.runner.step_rows(caches[0], [0, 1, 2], rows, [0, 0, 0]).graph
        graph.runner.rows_on_graphs = 3
        got, want = (e.runner.step_rows(c, [0, 1, 2], rows, [0, 0, 0]) for e, c in zip((graph, eager), caches))
    assert got.graph and not want.graph and got.logits.shape == want.logits.shape == (3, 1, graph.cfg.vocab_size)
    assert_within_bf16(got.logits.float().cpu(), want.logits.float().cpu())
    assert [a.counts.tolist() for a in got.aux] == [a.counts.tolist() for a in want.aux]
    assert graph.runner._prefill.steps == {(16, 64): 2, (64, 64): 1, (32, 64): 3}  # sizes 16, 32, 32
    with torch.inference_mode():  # the warm-up's timing, both calls on the scratch slot: no sequence's keys touched
        before = [c.k[0][:3].clone() for c in caches]
        assert graph.runner._replays_per_eager_call() >= 1
        assert all(torch.equal(c.k[0][:3], b) for c, b in zip(caches, before))


@pytest.mark.slow
@pytest.mark.parametrize("config", [dict(router="vq", vq_mode="discrete"), dict(sliding_window=8)],
                         ids=["vq-codes", "sliding-window"])
def test_a_compiled_prompt_chunk_of_other_models(config):
    """A VQ router's codes (counted from `codes`, one expert a token) and a sliding window of 8 (the padding's keys
    past every real query's window): a 37-token chunk (size 64) from position 0, and a 9-token one after it (size
    16), logits within bf16's rounding of eager and the same expert counts."""
    if compiled_mod.compile_unavailable(torch.device("cpu")) is not None:
        pytest.skip("no C++ compiler: inductor cannot build a CPU graph here")
    graph, eager = engines("cpu", **config)
    assert graph.runner.graph_prefill
    caches = [e.runner.new_cache(2, 64) for e in (graph, eager)]
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for n, start in ((37, 0), (9, 37)):
            ids = torch.randint(3, 250, (n,), generator=g)
            got, want = (e.runner.prefill(c, 0, ids, start) for e, c in zip((graph, eager), caches))
            assert got.graph and not want.graph
            assert_within_bf16(got.logits.float(), want.logits.float())
            assert [a.counts.tolist() for a in got.aux] == [a.counts.tolist() for a in want.aux]


def test_prompts_share_an_eager_call_unless_their_replays_take_less_time(monkeypatch):
    """rows_on_graphs: how many replays of the smallest chunk's graph fit in one eager call of it, from the two
    timings (3.5 ms against 1 ms: 3 prompts; a replay slower than eager: still 1)."""
    runner = type("Runner", (), {"_decode": type("D", (), {"cache": None, "scratch": 0}), "_prefill": None,
                                 "device": torch.device("cpu")})()
    for graph_ms, eager_ms, rows in ((1.0, 3.5, 3), (2.0, 1.0, 1)):
        timed = {"graph": [graph_ms] * 3, "eager": [eager_ms] * 3}
        monkeypatch.setattr(compiled_mod, "interleaved_ms", lambda fns, *a, timed=timed, **k: timed)
        assert compiled_mod.CompiledBackend._replays_per_eager_call(runner) == rows


def test_a_failing_prompt_graph_runs_prompts_eager_and_says_so(monkeypatch, caplog):
    """--compile on asks for the decode step's graph: a prompt chunk's graph that fails (here before compiling) is
    logged, and that prompt and every later one run eager, with eager's numbers."""
    if compiled_mod.compile_unavailable(torch.device("cpu")) is not None:
        pytest.skip("no C++ compiler: compile='on' is refused here")
    graph, eager = engines("cpu")
    monkeypatch.setattr(compiled_mod.CompiledPrefill, "_run", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    caches = [e.runner.new_cache(2, 64) for e in (graph, eager)]
    ids = torch.arange(3, 12)
    with torch.inference_mode(), caplog.at_level("WARNING", logger="moeserve.runtime"):
        got, want = (e.runner.prefill(c, 0, ids, 0) for e, c in zip((graph, eager), caches))
    assert not got.graph and not graph.runner.graph_prefill and graph.runner.graph_decode
    assert torch.equal(got.logits, want.logits)
    assert "the compiled prompt chunk failed (RuntimeError: boom); running eager" in caplog.text


@pytest.mark.slow
def test_prompts_arriving_while_others_decode_take_the_graph():
    """Prompts join a step engine while a sequence decodes, one at a time and two together: a prompt alone in its call
    is a graph's (moeserve_prefill_tokens_total{path="graph"}), two together one eager call, every decode token a
    replay, and each sequence generates all its tokens. A 60-token prompt arriving beside a decoding sequence is cut
    at 50 tokens (prefill_chunk): its first chunk takes the graph, its second, whose padding would pass the cache's 64
    positions, runs eager."""
    if compiled_mod.compile_unavailable(torch.device("cpu")) is not None:
        pytest.skip("no C++ compiler: inductor cannot build a CPU graph here")
    from moeserve.serve.metrics import Metrics

    graph, _ = engines("cpu")
    tok = ByteTokenizer()
    prompts = [tok.encode(t, bos=True) for t in ("def f(x):", "import os", "class A:", "x = 1")]
    steps = graph.step_engine(slots=4, prefill_chunk=50)
    seqs = [Sequence(p, SamplingParams(max_new_tokens=6, ignore_eos=True)) for p in prompts]
    long = [Sequence(prompts[0], SamplingParams(max_new_tokens=4, ignore_eos=True)),
            Sequence(list(range(1, 61)), SamplingParams(max_new_tokens=1))]
    with torch.inference_mode():
        for joining in ([seqs[0]], [], [seqs[1]], seqs[2:]):
            for seq in joining:
                steps.add(seq)
            steps.step()
        while not steps.idle:
            steps.step()
    assert [len(s.out) for s in seqs] == [6] * 4
    alone, together = sum(map(len, prompts[:2])), sum(map(len, prompts[2:]))
    assert graph.executor.prefill_tokens == {"graph": alone, "eager": together}
    assert graph.executor.decode_tokens == {"graph": 4 * 5}
    with torch.inference_mode():
        for seq in long:  # the second joins while the first decodes
            steps.add(seq)
            steps.step()
        while not steps.idle:
            steps.step()
    assert [len(s.out) for s in long] == [4, 1]
    assert graph.executor.prefill_tokens == {"graph": alone + len(prompts[0]) + 50, "eager": together + 10}
    metrics = Metrics()
    metrics.watch_paths("prefill", lambda: graph.executor.prefill_tokens)
    text = metrics.render().decode()
    assert f'moeserve_prefill_tokens_total{{path="graph"}} {alone + len(prompts[0]) + 50}.0' in text
    assert f'moeserve_prefill_tokens_total{{path="eager"}} {together + 10}.0' in text


@pytest.mark.cuda
def test_a_compiled_prompt_chunk_never_waits_for_the_host():
    """After the warm-up has recorded every graph, prompt chunks of new lengths and decode steps replay in turn under
    sync debug mode 'error' (any synchronizing call raises, recording a graph again included), each call a graph's,
    with its tokens' expert counts."""
    why = compiled_mod.compile_unavailable(torch.device("cuda"))
    if why is not None:
        pytest.skip(why)
    graph, _ = engines("cuda")
    runner = graph.runner
    runner.warm_up(2)
    cache = runner.new_cache(2, 64)
    ids = [torch.arange(3, n, device="cuda") for n in (10, 36)]
    ids += [torch.tensor(t, device="cuda") for t in ([5], [5, 6])]  # before the mode: a copy from the host syncs
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            outs = [runner.prefill(cache, 0, ids[0], 0), runner.decode(cache, [0], ids[2], [7]),
                    runner.prefill(cache, 1, ids[1], 0), runner.decode(cache, [0, 1], ids[3], [8, 33])]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(o.graph for o in outs)
    K, layers = graph.cfg.top_k, len(graph.cfg.moe_layer_ids)
    assert [int(torch.stack([a.counts for a in o.aux]).sum()) for o in outs] == [n * K * layers for n in (7, 1, 33, 2)]
