"""What each rank process of tests/runtime/test_expert_parallel.py runs (a module of its own, importable by a
spawned process: the test modules are imported by path). Everything it reports is plain data."""

from __future__ import annotations

import time
import traceback

import torch

from moeserve.bench.ep import spawn_ranks
from moeserve.runtime.engine import SamplingParams
from moeserve.runtime.ep_rank import EPRank, RankOptions
from moeserve.runtime.expert_parallel import ExpertParallelExperts, join_group
from moeserve.runtime.experts import Experts, moe_reference

WAIT_S = 60  # for any one future: a hang fails the run instead of stalling it

# per rank, the requests it serves at once: (prompt, params), different on each rank
REQUESTS = {
    0: [("def f(x):", dict(max_new_tokens=12, logprobs=2)),
        ("import os\n", dict(max_new_tokens=10, temperature=0.8, top_k=20, seed=7)),
        ("import os\n", dict(max_new_tokens=10, temperature=0.8, top_k=20, seed=8))],  # n = 2: one shared prefill
    1: [("class A:\n    def __init__(self):", dict(max_new_tokens=8, prompt_logprobs=1, logprobs=1)),
        ("x = [i * i for i in range(10)]\nprint(x)\n", dict(max_new_tokens=14, temperature=1.0, seed=3))],
}
SCORE_ROWS = {0: [], 1: [[1] + list(range(40, 140))]}  # past the context of 64: rolling windows
PREFILL_CHUNK = 8  # prompts written over several steps, beside the other rows' decodes


def spawn(main, world: int, args: tuple, timeout_s: float) -> dict[int, dict]:
    """Each rank's report from `main(rank, world, port, *args, results)`, one spawned process a rank joining a group
    at a free port of this host; a rank that reports an error fails the caller, one that hangs fails after
    timeout_s."""
    out = spawn_ranks(main, world, args, timeout_s)
    for r, report in out.items():
        assert "error" not in report, f"rank {r}:\n{report['error']}"
    return out


def completion_record(c) -> dict:
    return {"tokens": c.token_ids, "text": c.text, "finish": c.finish_reason,
            "logprobs": None if c.logprobs is None else [lp.logprob for lp in c.logprobs],
            "prompt_logprobs": None if c.prompt_logprobs is None else
            [None if lp is None else lp.logprob for lp in c.prompt_logprobs]}


def stats_record(ep: EPRank) -> dict:
    return {"model_calls": ep.stats.model_calls, "empty_passes": ep.stats.empty_passes,
            "a2a_calls": sum(e.stats.calls for e in ep.experts), "packed": sum(e.stats.packed for e in ep.experts)}


def exchange_cases(group) -> list[float]:
    """The exchange at layer level: max |EP - reference| per case, with each rank's own tokens (zero on some)."""
    torch.manual_seed(0)
    out = []
    for act in ("swiglu", "gelu"):
        ex = Experts(8, 16, 24, act)
        ep = ExpertParallelExperts.of(ex, group)
        ep.prepare_inference()
        g = torch.Generator().manual_seed(10 + group.rank)
        for T, only in ((7, None), (0, None), (5, "own"), (3, "other")):
            x = torch.randn(T, 16, generator=g)
            ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(T)]) if T else torch.zeros(0, 2).long()
            if only is not None:  # every row to one rank's experts: the other receives nothing from here
                base = 4 * (group.rank if only == "own" else 1 - group.rank)
                ids = base + ids % 4
                ids[:, 1] = torch.where(ids[:, 0] == ids[:, 1], base + (ids[:, 1] + 1) % 4, ids[:, 1])
            gates = torch.rand(T, 2, generator=g)
            keep = torch.rand(T, 2, generator=g) < 0.8
            with torch.inference_mode():
                for k, step_tokens in ((None, None), (keep, None), (None, 7), (keep, 7)):  # variable, then packed
                    ep.step_tokens = step_tokens
                    want = moe_reference(x, ids, gates, ex.w1, ex.w2, ex.w3, k)
                    got = ep(x, ids, gates, k)
                    out.append(float((got - want).abs().max()) if T else float(got.shape[0]))
    return out


def serve_requests(ckpt: str, group, packed: bool = True) -> dict:
    ep = EPRank.load(ckpt, group, RankOptions(slots=4, prefill_chunk=PREFILL_CHUNK, packed=packed))
    ep.start()
    futures = [ep.submit(p, SamplingParams(**kw)) for p, kw in REQUESTS[group.rank]]
    scores = ep.submit_scores(SCORE_ROWS[group.rank]) if SCORE_ROWS[group.rank] else None
    done = [completion_record(f.result(WAIT_S)) for f in futures]
    row_scores = [s.logprob for s in scores.result(WAIT_S)] if scores is not None else []
    ep.stop()
    ep.thread.join(WAIT_S)
    model = ep.engine.model
    return {"completions": done, "scores": row_scores, "stopped": not ep.thread.is_alive(),
            "parameters": sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers()),
            "experts": [e.local.expert_ids for e in ep.experts], **stats_record(ep)}


def busy_and_idle(ckpt: str, group, busy_s: float) -> dict:
    """Rank 0 serves one request after another for `busy_s`; rank 1 has none and is asked to stop at once, so it
    can only take the empty passes that keep rank 0 going, until rank 0 stops too."""
    ep = EPRank.load(ckpt, group, RankOptions(slots=2))
    ep.start()
    tokens = []
    if group.rank == 0:
        t0 = time.monotonic()
        while time.monotonic() - t0 < busy_s:
            tokens.append(ep.submit("def f(x):", SamplingParams(max_new_tokens=20)).result(WAIT_S).token_ids)
    ep.stop()
    ep.thread.join(WAIT_S)
    return {"tokens": tokens, "stopped": not ep.thread.is_alive(), **stats_record(ep)}


def main(rank: int, world: int, port: int, checkpoints: dict[str, str], busy_s: float, results) -> None:
    """One rank: join, check the exchange, serve each checkpoint's requests, then the busy/idle lockstep case."""
    torch.set_num_threads(1)  # two ranks on two cores: one thread each
    try:
        group = join_group(f"tcp://127.0.0.1:{port}", rank, world, timeout_s=WAIT_S)
        out: dict = {"exchange": exchange_cases(group)}
        for name, ckpt in checkpoints.items():
            out[name] = serve_requests(ckpt, group)
        out["softmax-variable"] = serve_requests(checkpoints["softmax"], group, packed=False)
        out["busy_and_idle"] = busy_and_idle(checkpoints["softmax"], group, busy_s)
        group.leave()
        results.put((rank, out))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))
