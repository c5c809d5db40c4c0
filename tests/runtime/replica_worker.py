"""What each rank process of tests/runtime/test_expert_replicas.py runs (a module of its own, importable by a spawned
process). Everything it reports is plain data."""

from __future__ import annotations

import traceback

import torch

from moeserve.runtime.engine import SamplingParams
from moeserve.runtime.ep_rank import EPRank, RankOptions
from moeserve.runtime.expert_parallel import ExpertParallelExperts, join_group
from moeserve.runtime.expert_replicas import Replication
from moeserve.runtime.experts import Experts, moe_reference

WAIT_S = 60
E, D, F = 8, 16, 24  # rank 0 owns experts 0..3, rank 1 owns 4..7
PLACEMENTS = ([[], [0]], [[4, 5], [0, 1]], [[6], [2]], [[5, 6, 7], [0, 1, 2]])  # per rank, its copies
# per rank, the requests it serves at once (as tests/runtime/ep_worker.py: greedy, seeded, logprobs)
REQUESTS = {
    0: [("def f(x):", dict(max_new_tokens=16, logprobs=2)),
        ("import os\n", dict(max_new_tokens=12, temperature=0.8, top_k=20, seed=7))],
    1: [("class A:\n    def __init__(self):", dict(max_new_tokens=12, prompt_logprobs=1)),
        ("x = [i * i for i in range(10)]\nprint(x)\n", dict(max_new_tokens=14, temperature=1.0, seed=3))],
}


def routed(T: int, pattern: str, g: torch.Generator) -> torch.Tensor:
    """[T, 2] distinct expert ids: 'random', 'skewed' (most rows to experts 0 and 1, both rank 0's), 'hot' (every
    row to expert 0 and one other)."""
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)]) if T else torch.zeros(0, 2).long()
    if pattern == "skewed":
        hot = torch.rand(T, generator=g) < 0.8
        ids[hot] = torch.tensor([0, 1])
    elif pattern == "hot":
        ids[:, 0] = 0
        ids[:, 1] = 1 + ids[:, 1] % (E - 1)
    return ids


def exchange_cases(group) -> dict:
    """The exchange with copies placed: max |EP - reference| per case, and whether the outputs equal the exchange
    without copies bit for bit (the same layer before set_replicas), with torch's experts and the C kernel's."""
    torch.manual_seed(0)
    diffs, identical, kernel = [], [], []
    for act in ("swiglu", "gelu"):
        ex = Experts(E, D, F, act)
        for prepare in (False, True):
            plain, ep = ExpertParallelExperts.of(ex, group), ExpertParallelExperts.of(ex, group)
            if prepare:
                kernel.append(plain.prepare_inference() and ep.prepare_inference())
            for placement in PLACEMENTS:
                moved = ep.set_replicas(placement)
                assert moved > 0 and ep.placement == placement, (placement, moved)
                g = torch.Generator().manual_seed(10 + group.rank)
                for T, pattern in ((7, "random"), (0, "random"), (1, "hot"), (5, "hot"), (33, "skewed")):
                    x = torch.randn(T, D, generator=g)
                    ids = routed(T, pattern, g)
                    gates = torch.rand(T, 2, generator=g)
                    keep = torch.rand(T, 2, generator=g) < 0.8
                    with torch.inference_mode():
                        for k in (None, keep):
                            want = moe_reference(x, ids, gates, ex.w1, ex.w2, ex.w3, k)
                            # the remainder rows go to another copy on the next call; variable, then packed
                            for step_tokens in (None, None, 33, 33):
                                ep.step_tokens = step_tokens
                                got = ep(x, ids, gates, k)
                                diffs.append(float((got - want).abs().max()) if T else float(got.shape[0]))
                                identical.append(bool(torch.equal(got, plain(x, ids, gates, k))))
            assert ep.set_replicas([[], []]) == 0 and ep.replicas is None  # dropping copies moves nothing
    return {"diffs": diffs, "identical": identical, "kernel": kernel,
            "replica_params": sum(p.numel() for p in ep.replicas.parameters()) if ep.replicas is not None else 0}


def measured_imbalance(group, room: int) -> dict:
    """A load skewed to experts 0 and 1 (rank 0's) through the exchange: a window under the owners alone, a
    rebalance, a window under the copies, a rebalance: the second one's `before` is the imbalance measured with
    the copies in place."""
    torch.manual_seed(0)
    ex = Experts(E, D, F, "swiglu")
    ep = ExpertParallelExperts.of(ex, group)
    ep.prepare_inference()
    rep = Replication([ep], room=room, every=4)
    g = torch.Generator().manual_seed(20 + group.rank)
    reports = []
    with torch.inference_mode():
        for _ in range(2):
            for _ in range(4):
                x = torch.randn(64, D, generator=g)
                ids = routed(64, "skewed", g)
                ep(x, ids, torch.rand(64, 2, generator=g))
                report = rep.after_step()
            reports.append(report)
    return {"reports": [vars(r) for r in reports], "replicas": ep.placement}


def serve(ckpt: str, group, redundant: int) -> dict:
    """The rank loop with copies placed every 2 steps with work, from the live load: replication kicks in after
    the first prompts' chunks, while they decode."""
    ep = EPRank.load(ckpt, group, RankOptions(slots=4, prefill_chunk=8, redundant_experts=redundant,
                                              rebalance_every=2))
    ep.start()
    futures = [ep.submit(p, SamplingParams(**kw)) for p, kw in REQUESTS[group.rank]]
    done = [f.result(WAIT_S) for f in futures]
    ep.stop()
    ep.thread.join(WAIT_S)
    model = ep.engine.model
    history = ep.replication.history if ep.replication is not None else []
    return {"tokens": [c.token_ids for c in done], "stopped": not ep.thread.is_alive(),
            "logprobs": [None if c.logprobs is None else [lp.logprob for lp in c.logprobs] for c in done],
            "parameters": sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers()),
            "held": [[*e.local.expert_ids, *e.placement[group.rank]] for e in ep.experts],
            "rebalances": [{"step": r.step, "before": r.before, "after": r.after, "owners_only": r.owners_only,
                            "replicas": r.replicas, "moved": r.moved} for r in history],
            "a2a_calls": sum(e.stats.calls for e in ep.experts)}


def main(rank: int, world: int, port: int, checkpoints: dict[str, str], results) -> None:
    torch.set_num_threads(1)  # two ranks on two cores: one thread each
    try:
        group = join_group(f"tcp://127.0.0.1:{port}", rank, world, timeout_s=WAIT_S)
        out: dict = {"exchange": exchange_cases(group),
                     "imbalance": {room: measured_imbalance(group, room) for room in (1, 2)}}
        for name, ckpt in checkpoints.items():
            out[name] = serve(ckpt, group, 1)
        group.leave()
        results.put((rank, out))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))
