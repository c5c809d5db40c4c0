"""Expert parallelism (runtime/expert_parallel.py, runtime/ep_rank.py) in real processes: two ranks on gloo over
127.0.0.1, each with its own requests at once, give the single-process engine's answers (fp32: tokens identical,
greedy and seeded; log-probabilities and scores within 1e-5) for the softmax, xmoe and vq (mixed and discrete)
routers, quantized checkpoints, a Hugging Face Mixtral (each rank reads its experts' tensors from the directory),
a Hugging Face Qwen2-MoE (its shared expert on every rank) and a Hugging Face gpt-oss (each rank its experts'
weights and biases, with the clamped SwiGLU); each rank holds only its experts; a busy rank beside an idle one
neither hangs nor desynchronises; the exchange itself equals the reference loop, with zero rows on a rank, in one
process and in two (gpt-oss's BiasedExperts too, in one). Scores, sums of many log-probabilities, are held to 1e-5
of their size (as tests/serve/test_ep_serve.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeserve.bench.server_process import free_port
from moeserve.checkpoint import save_checkpoint
from moeserve.config import preset
from moeserve.runtime.backends.expert_shards import BiasedExpertShard
from moeserve.runtime.engine import Engine, SamplingParams
from moeserve.runtime.ep_rank import EPRank, RankOptions, load_rank_engine
from moeserve.runtime.expert_parallel import (
    EPGroup, ExpertParallelError, ExpertParallelExperts, LockstepError, expert_major, join_group,
)
from moeserve.runtime.expert_replicas import shard_like, shard_tensors
from moeserve.runtime.experts import BiasedExperts, Experts, moe_reference
from moeserve.runtime.model import Transformer
from moeserve.runtime.quant import QuantSpec, quantize_model_

from . import hf_dirs

HERE = Path(__file__).parent
ROUTERS = {"softmax": dict(router="softmax"), "xmoe": dict(router="xmoe"),
           "vq-mixed": dict(router="vq", vq_mode="mixed"), "vq-discrete": dict(router="vq", vq_mode="discrete"),
           # quantized checkpoints: each rank reads its experts' integers and scales (int4 keeping wk, wv at int8, and
           # the head at int8 too: 64 wide, not a multiple of int6's 128)
           "softmax-int4": dict(router="softmax", quantize="int4"), "xmoe-int8": dict(router="xmoe", quantize="int8"),
           # a Hugging Face Mixtral directory, no conversion step: each rank reads its experts' tensors from it
           "mixtral": dict(family="mixtral"),
           # a Hugging Face Qwen2-MoE directory: q/k/v biases, and a gated shared expert that every rank holds whole
           "qwen2-moe": dict(family="qwen2_moe"),
           # a Hugging Face gpt-oss directory: each rank's experts with their biases and the clamped SwiGLU
           # (BiasedExpertShard), beside sinks, a sliding window layer and a router bias on every rank
           "gpt-oss": dict(family="gpt_oss")}
BUSY_S = 2.0
RUN_TIMEOUT_S = 120  # the whole two-rank run; a hang fails the tests after it rather than stalling CI


def checkpoint(root: Path, name: str, quantize: str | None = None, family: str | None = None, **kw) -> Path:
    if family is not None:  # a Hugging Face directory written by transformers
        return getattr(hf_dirs, family)(root / name)
    torch.manual_seed(0)
    model = Transformer(preset("tiny", **kw))  # context 64, byte tokenizer, 2 MoE layers of 4 experts, top-2
    if quantize is not None:
        quantize_model_(model, QuantSpec.parse(quantize))
    if kw["router"] == "vq":  # codes from real activations, so tokens spread over several experts
        with torch.no_grad():
            for layer in model.moe_layers:
                layer.quantizer.codebook.normal_()
                layer.quantizer.initialized.fill_(True)
    return save_checkpoint(root / name, model.cfg, model.state_dict())


# the two ranks' run is one module fixture: on one xdist worker, so that the suite starts it once, not once a worker
pytestmark = pytest.mark.xdist_group("expert-parallel")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ep")
    return {name: str(checkpoint(root, name, **kw)) for name, kw in ROUTERS.items()}


@pytest.fixture(scope="module")
def ranks(checkpoints) -> dict[int, dict]:
    """Both ranks' reports (tests/runtime/ep_worker.py), from one run of two spawned processes."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(HERE))  # the spawned processes import ep_worker by name
        import ep_worker

        return ep_worker.spawn(ep_worker.main, 2, (checkpoints, BUSY_S), RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def reference(checkpoints):
    """The single-process engine of each checkpoint, which the ranks must equal."""
    return {name: Engine.load(path, dtype="float32", device="cpu") for name, path in checkpoints.items()}


# ---- two ranks ------------------------------------------------------------------------------------------------
# the same checkpoint served with other rank options: RankOptions(packed=False), every exchange the variable one
VARIANTS = {"softmax-variable": "softmax"}


@pytest.mark.parametrize("name", [*ROUTERS, *VARIANTS])
def test_two_ranks_answer_as_one_process(ranks, reference, name):
    import ep_worker

    engine = reference[VARIANTS.get(name, name)]
    for rank in (0, 1):
        got = ranks[rank][name]
        for (prompt, kw), c in zip(ep_worker.REQUESTS[rank], got["completions"]):
            want = engine.complete([prompt], SamplingParams(**kw))[0]
            assert c["tokens"] == want.token_ids and c["text"] == want.text, (name, rank, prompt, kw)
            assert c["finish"] == want.finish_reason
            for key in ("logprobs", "prompt_logprobs"):
                w = getattr(want, key)
                if w is None:
                    assert c[key] is None
                    continue
                assert len(c[key]) == len(w)
                for a, b in zip(c[key], w):
                    assert (a is None and b is None) or abs(a - b.logprob) <= 1e-5, (name, key)
        want_scores = [s.logprob for s in engine.score_ids(ep_worker.SCORE_ROWS[rank])]
        assert len(got["scores"]) == len(want_scores)
        for a, b in zip(got["scores"], want_scores):  # a sum over ~100 tokens: 1e-5 of its size, as test_ep_serve
            assert a == pytest.approx(b, abs=1e-5 * max(1.0, abs(b)))
        assert got["stopped"]


@pytest.mark.parametrize("name", list(ROUTERS))
def test_each_rank_holds_only_its_experts(ranks, reference, name):
    model = reference[name].model
    cfg = model.cfg
    whole = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())  # quantized: buffers
    expert_params = sum(t.numel() for k, t in model.state_dict().items() if ".ffn.experts." in k)
    for rank, mine in ((0, [0, 1]), (1, [2, 3])):
        got = ranks[rank][name]
        assert got["experts"] == [mine] * len(cfg.moe_layer_ids)
        assert got["parameters"] == whole - expert_params + expert_params * len(mine) // cfg.n_experts


@pytest.mark.parametrize("name", [*ROUTERS, *VARIANTS])
def test_ranks_made_the_same_passes(ranks, name):
    """The lockstep's invariant: every rank made as many forward passes (its own and empty ones) as the other, and
    as many exchanges, the same of them packed; the discrete VQ layer, a table built at load, makes none while
    serving. Generation steps take the packed exchange; the table's build, outside any step, and the scoring
    slices, whose size the lockstep does not know beforehand, the variable one."""
    a, b = ranks[0][name], ranks[1][name]
    assert a["model_calls"] + a["empty_passes"] == b["model_calls"] + b["empty_passes"]
    assert a["a2a_calls"] == b["a2a_calls"] and a["packed"] == b["packed"]
    assert a["model_calls"] > 0 and b["model_calls"] > 0
    if name == "vq-discrete":
        assert a["a2a_calls"] == 2 and a["packed"] == 0  # the two layers' tables, built through the exchange at load
    elif name in VARIANTS:
        assert a["a2a_calls"] > a["model_calls"] and a["packed"] == 0
    else:
        assert a["a2a_calls"] > a["packed"] > a["model_calls"]


def test_a_busy_rank_beside_an_idle_one(ranks, reference):
    """Rank 0 works for seconds, rank 1 has no request and has been asked to stop from the start: it keeps taking
    empty passes for rank 0 until rank 0 stops too, and both loops end."""
    busy, idle = ranks[0]["busy_and_idle"], ranks[1]["busy_and_idle"]
    want = reference["softmax"].complete(["def f(x):"], SamplingParams(max_new_tokens=20))[0].token_ids
    assert len(busy["tokens"]) >= 2 and all(t == want for t in busy["tokens"])
    assert idle["model_calls"] == 0 and idle["tokens"] == []
    assert idle["empty_passes"] == busy["model_calls"] + busy["empty_passes"] > 0
    assert busy["stopped"] and idle["stopped"]


def test_the_exchange_across_two_ranks_equals_the_reference(ranks):
    for rank in (0, 1):
        assert max(ranks[rank]["exchange"]) <= 1e-5


# ---- one process --------------------------------------------------------------------------------------------
@pytest.fixture
def solo_group():
    group = join_group(f"tcp://127.0.0.1:{free_port()}", 0, 1, timeout_s=30)
    yield group
    group.leave()


def layer_calls(g: torch.Generator):
    """(x, expert ids, gates, capacity mask) of a layer of 6 experts of width 16, top-2: 0, 1 and 9 tokens, each
    without a mask and with one."""
    for T in (0, 1, 9):
        x = torch.randn(T, 16, generator=g)
        ids = torch.randn(T, 6, generator=g).topk(2, dim=-1).indices
        gates = torch.rand(T, 2, generator=g)
        keep = torch.rand(T, 2, generator=g) < 0.7
        for k in (None, keep):
            yield x, ids, gates, k


@pytest.mark.parametrize("exchange", ["variable", "packed", "fixed"])
@pytest.mark.parametrize("act", ["swiglu", "gelu"])
def test_the_exchange_in_one_process_equals_experts(solo_group, act, exchange):
    """The variable all-to-all, the packed one (a step of at most 9 tokens), and the fixed-size one (buffers for 9
    tokens; test_expert_parallel_fixed.py), at 0, 1 and 9 tokens, with and without a capacity mask."""
    torch.manual_seed(0)
    ex = Experts(6, 16, 24, act)
    ep = ExpertParallelExperts.of(ex, solo_group)
    if exchange == "fixed":
        ep.use_fixed(9)
    if exchange == "packed":
        ep.step_tokens = 9
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for x, ids, gates, k in layer_calls(g):
            want = moe_reference(x, ids, gates, ex.w1, ex.w2, ex.w3, k)
            torch.testing.assert_close(ep(x, ids, gates, k), want, atol=1e-6, rtol=0)
            torch.testing.assert_close(ep(x, ids, gates, k), ex(x, ids, gates, k), atol=1e-6, rtol=0)
        ep.prepare_inference()  # the C kernel where it runs, as a rank computes
        x = torch.randn(9, 16, generator=g)
        ids = torch.randn(9, 6, generator=g).topk(2, dim=-1).indices
        gates = torch.rand(9, 2, generator=g)
        torch.testing.assert_close(ep(x, ids, gates), ex(x, ids, gates), atol=1e-5, rtol=1e-5)
        assert ep(x[:0], ids[:0], gates[:0]).shape == (0, 16)
    # one rank: nothing leaves it; the fixed exchange counts nothing itself (a rank counts its calls per pass)
    assert (ep.stats.calls > 0) == (exchange != "fixed") and ep.stats.rows_sent == 0
    assert ep.stats.packed == (ep.stats.calls if exchange == "packed" else 0)


def test_the_packed_exchange_makes_two_collectives_where_the_variable_makes_three(solo_group, monkeypatch):
    """The packed exchange sends the counts in the rows' header (int32, exact past bf16's 256) in one collective and
    gets the rows back in a second; the variable one sends the counts first. A block past PACKED_MAX_BYTES, or a
    step whose size the lockstep does not know, takes the variable one; a call larger than the agreed step is
    refused before any collective, rather than desynchronising the group."""
    torch.manual_seed(0)
    ex = Experts(6, 16, 24, "swiglu").to(torch.bfloat16)
    ep = ExpertParallelExperts.of(ex, solo_group)
    made = []
    real = torch.distributed.all_to_all_single
    monkeypatch.setattr(torch.distributed, "all_to_all_single", lambda *a, **k: made.append(1) or real(*a, **k))
    x = torch.randn(300, 16, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1]] * 300)  # 300 rows for each of experts 0 and 1: past what a bf16 count holds exactly
    gates = torch.rand(300, 2, dtype=torch.bfloat16)

    def collectives(step_tokens: int | None) -> int:
        ep.step_tokens = step_tokens
        made.clear()
        with torch.inference_mode():
            torch.testing.assert_close(ep(x, ids, gates), ex(x, ids, gates), atol=0, rtol=0)
        return len(made)

    assert collectives(None) == 3
    assert collectives(300) == 2 and ep.stats.packed == 1
    assert collectives(400) == 2  # room to spare: the blocks are the step's, whatever this call's tokens
    ep.packed_max_bytes = 400 * 2 * 16 * 2 - 1  # one row short of a block of the step's 800 rows
    assert collectives(400) == 3 and ep.stats.packed == 2
    ep.step_tokens = 299
    with pytest.raises(LockstepError, match="passed 300 tokens to a MoE layer in a step whose ranks agreed on at "
                                            "most 299"):
        ep(x, ids, gates)
    assert ep.stats.calls == 4


def test_biased_experts_in_one_process_equal_biased_experts(solo_group):
    """gpt-oss's experts (biases b1, b3, b2 and the clamped SwiGLU, limit and alpha its own) behind the exchange
    equal BiasedExperts' forward, at 0, 1 and 9 tokens, with and without a capacity mask; the gate multiplies the
    down bias too; a replica's tensors (expert_replicas) carry the biases. The fixed exchange, which has no
    biases, refuses them by name."""
    torch.manual_seed(0)
    ex = BiasedExperts(6, 16, 24, "clamped_swiglu", limit=1.5, alpha=1.3)
    with torch.no_grad():  # biases large enough to matter, pre-activations past the limit
        for p in ex.parameters():
            p.normal_(0.0, 0.5)
    ep = ExpertParallelExperts.of(ex, solo_group)
    assert isinstance(ep.local, BiasedExpertShard) and ep.local.experts.limit == 1.5 and ep.local.experts.alpha == 1.3
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for x, ids, gates, k in layer_calls(g):
            torch.testing.assert_close(ep(x, ids, gates, k), ex(x, ids, gates, k), atol=1e-6, rtol=0)
        assert not ep.prepare_inference()  # no kernel computes biases: torch's loop, BiasedExperts' own math
        x = torch.randn(9, 16, generator=g)
        ids = torch.randn(9, 6, generator=g).topk(2, dim=-1).indices
        unbiased = BiasedExperts(6, 16, 24, "clamped_swiglu", limit=1.5, alpha=1.3)
        unbiased.load_state_dict({**ex.state_dict(), "b2": torch.zeros(6, 16)})
        gates = torch.full((9, 2), 0.5)  # the gated down bias: half of b2 twice, once per expert
        want = unbiased(x, ids, gates) + 0.5 * (ex.b2[ids[:, 0]] + ex.b2[ids[:, 1]])
        torch.testing.assert_close(ep(x, ids, gates), want, atol=1e-5, rtol=0)
        copy = shard_like(ep.local, ep.local.expert_ids, shard_tensors(ep.local))  # what a replica is built from
        assert sorted(shard_tensors(ep.local)) == ["b1", "b2", "b3", "w1", "w2", "w3"]
        counts = [3, 0, 2, 1, 0, 3]
        x = torch.randn(sum(counts), 16, generator=g)
        assert torch.equal(copy(x, counts), ep.local(x, counts))
    with pytest.raises(ExpertParallelError, match="fixed exchange computes plain weights.*BiasedExpertShard"):
        ep.use_fixed(9)


def test_expert_major_order():
    recv = torch.tensor([[2, 1], [0, 3]])  # rank 0 sends 2 rows of expert a and 1 of b; rank 1 three of b
    # received: a0 a0 b0 | b1 b1 b1  ->  expert-major: a0 a0 | b0 b1 b1 b1
    assert expert_major(recv).tolist() == [0, 1, 2, 3, 4, 5]
    recv = torch.tensor([[1, 2], [3, 1]])  # a0 b0 b0 | a1 a1 a1 b1 -> a0 a1 a1 a1 | b0 b0 b1
    assert expert_major(recv).tolist() == [0, 3, 4, 5, 1, 2, 6]
    assert expert_major(torch.tensor([[4, 5]])) is None


@pytest.mark.parametrize("whole", [False, True])
def test_a_rank_in_one_process_serves_as_the_engine(solo_group, checkpoints, whole):
    """World size 1: the whole rank loop (load, lockstep, submit, scores, stop) in this process, every router,
    through the exchange (whole_alone=False), and with the whole model loaded as one process loads it (the
    default for a group of one: the CPU kernel's one-call decode step where it builds, nothing exchanged)."""
    for name, path in checkpoints.items():
        ep = EPRank.load(path, solo_group, RankOptions(slots=2, whole_alone=whole))
        want = Engine.load(path, dtype="float32", device="cpu")
        assert (ep.experts == []) == whole
        assert ep.expert_ids() == [list(range(want.cfg.n_experts))] * len(want.cfg.moe_layer_ids)
        if whole:  # the one-call decode step exactly where one process has it
            assert type(ep.engine.runner) is type(want.runner)
            assert (getattr(ep.engine.runner, "step", None) is None) == (getattr(want.runner, "step", None) is None)
        ep.start()
        params = SamplingParams(max_new_tokens=6, logprobs=1)
        got = ep.submit("def f(x):", params).result(30)
        scores = ep.submit_scores([[1, 5, 6, 7]]).result(30)
        counters = ep.counters()
        ep.stop()
        ep.thread.join(30)
        assert got.token_ids == want.complete(["def f(x):"], params)[0].token_ids, name
        assert ep.stats.model_calls == 1 + 5 + 1, name  # the prompt's chunk, 5 decodes (C step or not), the scores
        assert counters["rows_routed"] == counters["rows_computed"] > 0 and counters["rows_sent"] == 0
        assert scores[0].logprob == pytest.approx(want.score_ids([[1, 5, 6, 7]])[0].logprob, abs=1e-5)
        assert not ep.thread.is_alive()


def test_a_rank_refuses_what_would_pass_the_exchange(solo_group, checkpoints):
    engine = load_rank_engine(checkpoints["softmax"], solo_group)
    ep = EPRank(engine, solo_group)
    with pytest.raises(Exception, match="agreed on 0"):  # a model call outside the loop's steps
        engine.forward(torch.tensor([[1, 2, 3]]))
    from moeserve.runtime.backends.compiled import model_uncompilable

    assert "experts_factory" in model_uncompilable(engine.model)
    with pytest.raises(ExpertParallelError, match="stopping"):
        ep.stop()
        ep.submit("x")
    # a compiled rank's exchange is the fixed one: plain experts, no copies (test_expert_parallel_fixed.py runs it)
    for name, options, why in (("softmax-int4", {}, "int8 / int4 experts"),
                               ("softmax", dict(redundant_experts=1), "redundant experts")):
        with pytest.raises(ExpertParallelError, match=f"compile = 'on' for rank 0 of 1: its {why} have no compiled"):
            EPRank.load(checkpoints[name], solo_group, RankOptions(whole_alone=False, compile="on", **options))
    auto = EPRank.load(checkpoints["softmax-int4"], solo_group, RankOptions(whole_alone=False, compile="auto"))
    assert not auto.graph and auto.engine.runner.name != "compiled"  # auto: eager on a CPU, and where it cannot
    with pytest.raises(ExpertParallelError, match="compile = 'yes'"):
        RankOptions(compile="yes")


def test_bad_groups_are_named_errors(solo_group):
    for kwargs, match in ((dict(init_method="127.0.0.1:80"), "init_method"),
                          (dict(init_method="tcp://h:0"), "init_method"),
                          (dict(rank=2, world_size=2), "rank = 2"),
                          (dict(world_size=0), "world_size = 0"),
                          (dict(backend="mpi"), "backend"),
                          (dict(backend="nccl"), "nccl"),
                          ({}, "already belongs")):
        args = dict(init_method="tcp://127.0.0.1:1", rank=0, world_size=1) | kwargs
        with pytest.raises(ExpertParallelError, match=match):
            join_group(args.pop("init_method"), args.pop("rank"), args.pop("world_size"), **args)
    with pytest.raises(ExpertParallelError, match="5 ranks for 4 experts"):
        EPGroup(0, 5, "gloo", torch.device("cpu")).experts_of(4)
    with pytest.raises(ExpertParallelError, match="slots"):
        RankOptions(slots=0)


# ---- CUDA ------------------------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_nccl_exchange_on_one_gpu():
    """N = 1 on NCCL, so the NCCL path runs where there is one GPU."""
    group = join_group(f"tcp://127.0.0.1:{free_port()}", 0, 1, device="cuda", timeout_s=60)
    try:
        torch.manual_seed(0)
        ex = Experts(4, 32, 48, "swiglu").cuda()
        ep = ExpertParallelExperts.of(ex, group)
        x = torch.randn(5, 32, device="cuda")
        ids = torch.randn(5, 4, device="cuda").topk(2, dim=-1).indices
        gates = torch.rand(5, 2, device="cuda")
        with torch.inference_mode():
            torch.testing.assert_close(ep(x, ids, gates), ex(x, ids, gates), atol=1e-5, rtol=1e-5)
            assert ep(x[:0], ids[:0], gates[:0]).shape == (0, 32)
    finally:
        group.leave()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the failed loop raises, by design
def test_a_rank_says_when_its_loop_stalls_fails_or_ends(solo_group, checkpoints):
    """EPRank.unhealthy (what RankActor.check_health raises): None while the loop advances; named once the loop
    has not finished an iteration for stall_s with work queued (here: its engine's lock held, as a collective
    waiting on a dead peer would hold the step), once a step has failed, and once the loop has ended."""
    import time

    ep = EPRank.load(checkpoints["softmax"], solo_group, RankOptions(slots=2))
    ep.start()
    ep.submit([1, 2, 3], SamplingParams(max_new_tokens=2)).result(30)
    assert ep.unhealthy(0.3) is None and ep.stats.iterations > 0
    with ep.engine.lock:  # the loop cannot finish an iteration
        time.sleep(0.05)
        assert ep.unhealthy(0.3) is None  # no work: an idle rank that waits is not stalled
        future = ep.submit([1, 2, 3], SamplingParams(max_new_tokens=2))
        time.sleep(0.4)
        assert "has not advanced" in ep.unhealthy(0.3)
    future.result(30)
    assert ep.unhealthy(0.3) is None
    ep.lockstep.agree = lambda *a: (_ for _ in ()).throw(RuntimeError("peer gone"))
    failed = ep.submit([1, 2, 3], SamplingParams(max_new_tokens=2))
    with pytest.raises(Exception, match="peer gone"):
        failed.result(30)
    assert "last step failed" in ep.unhealthy(60) and "peer gone" in ep.unhealthy(60)
    ep.thread.join(30)
    ep.failed = None
    assert "not running" in ep.unhealthy(60)
