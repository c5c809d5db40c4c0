"""The fixed-size all-to-all of expert parallelism (expert_parallel.py: use_fixed, exchange_fixed), the exchange a
compiled step or a CUDA graph can hold: two ranks on gloo compile the MoE layer (softmax and xmoe routers), the
experts alone under skewed loads (a rank receiving zero rows, a rank sending no tokens, a buffer filled exactly),
and the whole decode step (compiled.CompiledDecode), each with torch.compile(fullgraph=True), where any host sync
would be a graph break and fail the compile; their outputs equal the variable exchange's and the single-process
layer's within fp32 rounding. In one process: the eager fixed exchange against the reference loop, the padding
rows' zeros, and the refusals. On a GPU (`pytest -m cuda`): the exchange on NCCL captured in a CUDA graph under
torch.cuda.set_sync_debug_mode("error"), and the compiled decode step's CUDA graphs over an expert-parallel model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moeserve.bench.server_process import free_port
from moeserve.config import preset
from moeserve.runtime.backends import compiled as compiled_mod
from moeserve.runtime.backends.compiled import CompileError, CompiledDecode, model_uncompilable
from moeserve.runtime.backends.expert_shards import QuantExpertShard
from moeserve.runtime.engine import Engine, SamplingParams
from moeserve.runtime.ep_rank import EPRank, RankOptions
from moeserve.runtime.expert_parallel import (
    ExpertParallelError, ExpertParallelExperts, join_group, use_fixed_exchange,
)
from moeserve.runtime.experts import Experts, expert_rows, moe_reference
from moeserve.runtime.kv_cache import KVCache
from moeserve.runtime.model import Transformer
from moeserve.runtime.quant import QuantExperts, QuantSpec

from .test_expert_parallel import checkpoint, solo_group  # noqa: F401  (the fixture: a group of one rank on gloo)

HERE = Path(__file__).parent
RUN_TIMEOUT_S = 600  # both ranks compile ~5 graphs each (70 s alone on 2 cores); a hang fails after it
HAS_CXX = compiled_mod.compile_unavailable(torch.device("cpu")) is None

pytestmark = pytest.mark.xdist_group("expert-parallel")


# ---- two ranks, compiled --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def softmax_ckpt(tmp_path_factory) -> str:
    return str(checkpoint(tmp_path_factory.mktemp("ep-fixed"), "softmax", router="softmax"))


@pytest.fixture(scope="module")
def ranks(softmax_ckpt) -> dict[int, dict]:
    """Both ranks' reports (tests/runtime/ep_fixed_worker.py), from one run of two spawned processes."""
    if not HAS_CXX:
        pytest.skip("no C++ compiler: inductor cannot build a CPU graph here")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(HERE))  # the spawned processes import the workers by name
        import ep_fixed_worker
        import ep_worker

        return ep_worker.spawn(ep_fixed_worker.main, 2, (softmax_ckpt,), RUN_TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("router", ["softmax", "xmoe"])
def test_the_compiled_fixed_exchange_equals_the_variable_one_and_one_process(ranks, router):
    for rank in (0, 1):
        got = ranks[rank]["layers"][router]
        assert got["compiled_vs_layer"] <= 1e-5 and got["compiled_vs_variable"] <= 1e-5, (rank, got)
        assert got["eager_vs_layer"] <= 1e-5, (rank, got)
        assert got["counts_equal"]  # the layer's expert-load counts, traced in the same graph
        assert got["fixed_calls"] == 0  # the fixed exchange counts nothing itself: a rank counts per pass (ep_rank.py)


@pytest.mark.slow
def test_the_compiled_fixed_exchange_under_skewed_loads(ranks):
    r0, r1 = ({c["case"]: c for c in ranks[r]["skewed"]} for r in (0, 1))
    for case in (*r0.values(), *r1.values()):
        assert case["compiled_vs_reference"] <= 1e-5 and case["compiled_vs_variable"] <= 1e-5, case
        assert case["shape"] == [case["tokens"], 16]
    # every row to rank 0's experts: rank 1 received nothing; then rank 0's 8 tokens * top-2 all to rank 1
    assert r1["all_to_rank_0"]["received_rows"] == 0 and r0["all_to_rank_0"]["received_rows"] > 0
    assert r0["full_beside_empty"]["tokens"] == 8 and r1["full_beside_empty"]["tokens"] == 0
    assert r1["full_beside_empty"]["received_rows"] == 16  # the buffer's C = max_tokens * K rows, exactly full
    assert r0["full_beside_empty"]["received_rows"] == r0["all_to_rank_0"]["received_rows"]  # none from rank 1


@pytest.mark.slow
def test_the_compiled_decode_step_runs_expert_parallel(ranks):
    """Each rank's decode step, one graph for its own bucket (2 rows on rank 0, 1 on rank 1), gives the logits of
    the single-process model within fp32 rounding (fused reductions, as compiled.py says: ~1e-6 of the logits)."""
    for rank, bucket in ((0, 2), (1, 1)):
        got = ranks[rank]["decode"]
        assert got["graphs"] == [bucket] and got["steps"] == 5
        assert got["max_diff"] <= 1e-5 * max(1.0, got["scale"]), got


@pytest.mark.slow
def test_ranks_with_a_compiled_decode_step_answer_as_one_process(ranks, softmax_ckpt):
    """EPRank with compile 'on': prompts in chunks on one rank while the other decodes, n = 2, logprobs and a
    scoring job. The steps where every rank only decoded ran the compiled step (its fixed exchange), the others eager
    on every rank; the tokens are the single-process engine's, the log-probabilities within 1e-5, and the ranks made
    the same passes and exchanges."""
    import ep_worker

    engine = Engine.load(softmax_ckpt, dtype="float32", device="cpu")
    for rank in (0, 1):
        got = ranks[rank]["ranks"]
        assert got["graph"] and got["stopped"]
        assert got["decode_tokens"]["graph"] > 0 and got["decode_tokens"]["eager"] > 0, got["decode_tokens"]
        for (prompt, kw), c in zip(ep_worker.REQUESTS[rank], got["completions"]):
            want = engine.complete([prompt], SamplingParams(**kw))[0]
            assert c["tokens"] == want.token_ids and c["text"] == want.text, (rank, prompt, kw)
            for key in ("logprobs", "prompt_logprobs"):
                w = getattr(want, key)
                assert (c[key] is None) == (w is None)
                for a, b in zip(c[key] or [], w or []):
                    assert (a is None and b is None) or abs(a - b.logprob) <= 1e-5, (rank, key)
        want_scores = [s.logprob for s in engine.score_ids(ep_worker.SCORE_ROWS[rank])]
        assert got["scores"] == pytest.approx(want_scores, abs=1e-5 * max([1.0, *map(abs, want_scores)]))
    a, b = ranks[0]["ranks"], ranks[1]["ranks"]
    assert a["model_calls"] + a["empty_passes"] == b["model_calls"] + b["empty_passes"]
    assert a["a2a_calls"] == b["a2a_calls"] > 0


# ---- one process ----------------------------------------------------------------------------------------------
def test_the_fixed_exchange_refuses_a_call_past_its_size(solo_group):
    """Its results against the reference are test_expert_parallel.py's (parametrized over both exchanges)."""
    torch.manual_seed(0)
    ex = Experts(6, 16, 24, "swiglu")
    ep = ExpertParallelExperts.of(ex, solo_group).use_fixed(9)
    with torch.inference_mode():
        for T in (0, 1, 9):
            ep(torch.randn(T, 16), torch.zeros(T, 2, dtype=torch.long), torch.ones(T, 2))
        with pytest.raises(ExpertParallelError, match="10 tokens in one call to a fixed exchange sized for 9"):
            ep(torch.randn(10, 16), torch.zeros(10, 2, dtype=torch.long), torch.ones(10, 2))
    assert ep.stats.calls == 0  # nothing counted inside: a count in a compiled step is a guard (ep_rank.py counts)


class HostReads(TorchDispatchMode):
    """Records the ops whose result the host must read from the device: a scalar (.item(), .tolist(), int(t)) or
    a size that depends on the values (nonzero, masked_select, unique, repeat_interleave by counts). On CUDA each
    is a sync; none can be held by a CUDA graph."""

    READS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "repeat_interleave", "bincount")

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if any(r in name for r in self.READS):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_the_fixed_exchange_reads_nothing_back_to_the_host(solo_group):
    """The eager fixed exchange (as a CUDA graph would capture it) makes no op that reads the device from the host,
    where the variable one does (the detector's other side)."""
    torch.manual_seed(0)
    ex = Experts(6, 16, 24, "swiglu")
    fixed = ExpertParallelExperts.of(ex, solo_group).use_fixed(9)
    variable = ExpertParallelExperts.of(ex, solo_group)
    x, ids, gates = torch.randn(7, 16), torch.randn(7, 6).topk(2, dim=-1).indices, torch.rand(7, 2)
    keep = torch.rand(7, 2) < 0.7
    with torch.inference_mode():
        with HostReads() as reads:
            fixed(x, ids, gates, keep)
        assert reads.seen == []
        with HostReads() as reads:
            variable(x, ids, gates, keep)
        assert "_local_scalar_dense" in reads.seen or "bincount" in reads.seen


def test_expert_rows_puts_each_row_through_its_expert_and_zeroes_padding():
    torch.manual_seed(0)
    ex = Experts(3, 8, 12, "swiglu")
    x = torch.randn(5, 8)
    ids = torch.tensor([2, 0, 3, 1, 7])  # 3 and 7: no expert (padding rows)
    with torch.no_grad():
        got = expert_rows(x, ids, ex.w1, ex.w2, ex.w3)
        for n, e in enumerate(ids.tolist()):
            want = moe_reference(x[n:n + 1], torch.tensor([[e]]), torch.ones(1, 1), ex.w1, ex.w2, ex.w3) if e < 3 \
                else torch.zeros(1, 8)
            torch.testing.assert_close(got[n:n + 1], want, atol=1e-6, rtol=0)
    assert got[2].abs().max() == 0 and got[4].abs().max() == 0 and got[0].abs().max() > 0


def test_the_fixed_exchange_refuses_what_it_cannot_size(solo_group):
    torch.manual_seed(0)
    ex = Experts(4, 16, 24, "swiglu")
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ExpertParallelError, match="max_tokens"):
            ExpertParallelExperts.of(ex, solo_group).use_fixed(bad)
    quant = ExpertParallelExperts(solo_group, 4, QuantExpertShard(range(4), QuantExperts(
        4, 32, 32, "swiglu", QuantSpec.parse("int8"))))
    with pytest.raises(ExpertParallelError, match="QuantExpertShard"):
        quant.use_fixed(4)


def test_a_model_compiles_expert_parallel_only_on_the_fixed_exchange(solo_group):
    torch.manual_seed(0)
    model = Transformer(preset("tiny"))
    for layer in model.moe_layers:
        layer.experts = ExpertParallelExperts.of(layer.experts, solo_group)
    assert "use_fixed" in model_uncompilable(model)
    with pytest.raises(CompileError, match="use_fixed"):
        CompiledDecode(model, KVCache.for_model(model, 3, spare=1))
    assert use_fixed_exchange(model, 1) == len(model.moe_layers)
    assert model_uncompilable(model) is None
    with pytest.raises(CompileError, match="largest batch bucket is 2 rows; the fixed all-to-all is sized for 1"):
        CompiledDecode(model, KVCache.for_model(model, 3, spare=1))  # 2 slots and the scratch: buckets 1, 2
    CompiledDecode(model, KVCache.for_model(model, 2, spare=1))  # 1 slot: bucket 1 fits (compiles lazily)


# ---- CUDA ------------------------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_the_fixed_exchange_replays_in_a_cuda_graph_on_nccl():
    """N = 1 on NCCL: the fixed exchange captured in a CUDA graph over static input buffers, the capture and every
    replay under set_sync_debug_mode("error") (any host sync raises), replayed on new routings (spread, all on one
    expert, a capacity mask, a short batch padded by gate 0) and compared each time with the variable exchange and
    the reference loop, run eagerly outside the error mode."""
    group = join_group(f"tcp://127.0.0.1:{free_port()}", 0, 1, device="cuda", timeout_s=60)
    try:
        torch.manual_seed(0)
        T, E, D = 8, 8, 64
        ex = Experts(E, D, 96, "swiglu").cuda()
        fixed = ExpertParallelExperts.of(ex, group).use_fixed(T)
        variable = ExpertParallelExperts.of(ex, group)
        g = torch.Generator(device="cuda").manual_seed(1)

        def routing(kind: str):
            x = torch.randn(T, D, device="cuda", generator=g)
            ids = torch.randn(T, E, device="cuda", generator=g).topk(2, dim=-1).indices
            gates = torch.rand(T, 2, device="cuda", generator=g)
            keep = torch.ones(T, 2, dtype=torch.bool, device="cuda")
            if kind == "one_expert":
                ids = torch.stack([torch.zeros(T, dtype=torch.long, device="cuda"), ids[:, 1] % (E - 1) + 1], 1)
            if kind == "masked":
                keep = torch.rand(T, 2, device="cuda", generator=g) < 0.6
            if kind == "short":  # 3 real tokens; the rest padding whose gates are 0
                gates[3:] = 0
            return x, ids, gates, keep

        static = routing("spread")
        with torch.inference_mode():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture: NCCL's communicator, the allocator's pools
                for _ in range(3):
                    fixed(*static)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            torch.cuda.set_sync_debug_mode("error")
            try:
                with torch.cuda.graph(graph):
                    y_static = fixed(*static)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            for kind in ("spread", "one_expert", "masked", "short"):
                new = routing(kind)
                torch.cuda.set_sync_debug_mode("error")
                try:
                    for buf, value in zip(static, new):
                        buf.copy_(value)  # device to device: queued, no sync
                    graph.replay()
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                torch.cuda.synchronize()
                x, ids, gates, keep = new
                want = moe_reference(x, ids, gates, ex.w1, ex.w2, ex.w3, keep)
                torch.testing.assert_close(y_static, want, atol=1e-4, rtol=1e-4, msg=kind)  # TF32-free fp32 GEMMs
                torch.testing.assert_close(y_static, variable(x, ids, gates, keep), atol=1e-4, rtol=1e-4, msg=kind)
        del graph, y_static  # before the group goes: a live graph holding NCCL work can hang its destruction
        torch.cuda.synchronize()  # (pytorch/pytorch#115388)
    finally:
        group.leave()


@pytest.mark.cuda
@pytest.mark.slow
def test_the_compiled_decode_step_on_cuda_over_expert_parallel_experts():
    """The whole decode step on one GPU (N = 1 on NCCL), compiled with mode "reduce-overhead" (CUDA graphs, one per
    bucket and span, where inductor records them around the collectives): every MoE layer's fixed exchange inside
    the step gives the single-process model's logits, fed one token a step at buckets 2 and 1."""
    why = compiled_mod.compile_unavailable(torch.device("cuda"))
    if why is not None:
        pytest.skip(why)
    group = join_group(f"tcp://127.0.0.1:{free_port()}", 0, 1, device="cuda", timeout_s=120)
    try:
        torch.manual_seed(0)
        model = Transformer(preset("tiny")).cuda().eval()
        ep = Transformer(preset("tiny")).cuda().eval()
        ep.load_state_dict(model.state_dict())
        for layer in ep.moe_layers:
            layer.experts = ExpertParallelExperts.of(layer.experts, group)
        use_fixed_exchange(ep, 2)
        step = CompiledDecode(ep, KVCache.for_model(ep, 3, spare=1))
        rows = [[1, 5, 9, 14, 3, 7], [1, 7, 7, 2, 8, 9]]
        with torch.inference_mode():
            want = model(torch.tensor(rows, device="cuda")).logits
            for n in (2, 1):
                got = torch.stack([step(list(range(n)), torch.tensor([r[p] for r in rows[:n]], device="cuda"),
                                        [p] * n)[0][:, 0] for p in range(len(rows[0]))], dim=1)
                torch.testing.assert_close(got, want[:n], atol=1e-4, rtol=1e-4)
        assert {b for b, _ in step.steps} == {1, 2}
        del step  # its graphs, before the group goes (pytorch/pytorch#115388)
        torch.compiler.reset()
        torch.cuda.synchronize()
    finally:
        group.leave()


@pytest.mark.cuda
@pytest.mark.slow
def test_a_compiled_rank_on_nccl_answers_as_one_process(softmax_ckpt, monkeypatch):
    """EPRank with compile 'on' on one GPU (N = 1 on NCCL, through the exchange: whole_alone False): its decodes
    replay the step's CUDA graphs with the fixed exchange inside, its prompts' chunks and scoring run eager, and the
    tokens are the single-process engine's on the same GPU, the log-probabilities within 1e-4."""
    monkeypatch.syspath_prepend(str(HERE))
    import ep_worker

    why = compiled_mod.compile_unavailable(torch.device("cuda"))
    if why is not None:
        pytest.skip(why)
    group = join_group(f"tcp://127.0.0.1:{free_port()}", 0, 1, device="cuda", timeout_s=120)
    try:
        ep = EPRank.load(softmax_ckpt, group, RankOptions(slots=2, prefill_chunk=ep_worker.PREFILL_CHUNK,
                                                          compile="on", whole_alone=False))
        assert ep.graph and ep.experts  # the rank's experts exchange, and its step is the compiled one
        ep.start()
        futures = [ep.submit(p, SamplingParams(**kw)) for p, kw in ep_worker.REQUESTS[1]]
        scores = ep.submit_scores(ep_worker.SCORE_ROWS[1])
        done = [f.result(120) for f in futures]
        got_scores = [s.logprob for s in scores.result(120)]
        ep.stop()
        ep.thread.join(120)
        assert not ep.thread.is_alive() and ep.failed is None
        decode = dict(ep.engine.executor.decode_tokens)
        assert decode.get("graph", 0) > 0, decode
        del ep
        torch.compiler.reset()
        torch.cuda.synchronize()
    finally:
        group.leave()
    engine = Engine.load(softmax_ckpt, dtype="float32", device="cuda", compile="off")
    for (prompt, kw), c in zip(ep_worker.REQUESTS[1], done):
        want = engine.complete([prompt], SamplingParams(**kw))[0]
        assert c.token_ids == want.token_ids, (prompt, kw)
        for a, b in zip(c.logprobs or [], want.logprobs or []):
            assert abs(a.logprob - b.logprob) <= 1e-4
    want_scores = [s.logprob for s in engine.score_ids(ep_worker.SCORE_ROWS[1])]
    assert got_scores == pytest.approx(want_scores, abs=1e-4 * max([1.0, *map(abs, want_scores)]))
