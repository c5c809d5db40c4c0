"""Expert-parallel ranks without Ray or HTTP (issue 38; docs/bench/log.md, "The packed exchange, and where a served
rank's time goes"): what the ranks' step loops cost by themselves, so that a served run's figures can be read
against them.

1. gloo's floor: two processes on 127.0.0.1 make back-to-back collectives (an all_to_all_single of 2 x 16 rows of
   256 floats; an all-reduce and an all-to-all of the lockstep's three numbers), p50 / p90 / p99 / mean in us.
2. the ranks: N processes (runtime/ep_rank.run_rank, one torch thread each) load a random `small` checkpoint (the
   one docs/bench/ep-serve.py writes), and each serves REQUESTS requests of 32 prompt tokens and 32 new tokens
   through 8 cache slots, all submitted at once; per rank: req/s, ms a step, the share of a core its process used,
   and the all-to-all time of a MoE layer call. Each NAME=PATH tree runs with that tree's moeserve (a `git archive`
   of another commit, say), alternating over --rounds.

    PYTHONPATH=. python docs/bench/ep-ranks.py [--trees base=/tmp/base new=.] [--requests 96] [--rounds 2]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent


def gloo_floor(rank: int, world: int, port: int, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = torch.randn(16 * world, 256)
    three = torch.tensor([1, 1, 32] * world)
    out = {}
    for name, call in (("all_to_all_single, 2 x 16 rows", lambda: dist.all_to_all_single(torch.empty_like(rows), rows)),
                       ("all_reduce of 3 numbers", lambda: dist.all_reduce(three[:3].clone())),
                       ("all_to_all of 3 numbers", lambda: dist.all_to_all_single(torch.empty_like(three), three))):
        for _ in range(100):
            call()
        ts = []
        for _ in range(1000):
            t = time.perf_counter()
            call()
            ts.append((time.perf_counter() - t) * 1e6)
        ts.sort()
        out[name] = (ts[500], ts[900], ts[990], statistics.mean(ts))
    dist.destroy_process_group()
    results.put((rank, out))


def serve_rank(rank: int, world: int, port: int, checkpoint: str, requests: int, results) -> None:
    import torch

    from moeserve.runtime.ep_rank import RankOptions, run_rank
    from moeserve.runtime.sampling import SamplingParams

    torch.set_num_threads(1)  # as the served ranks run on 2 cores
    ep = run_rank(checkpoint, f"tcp://127.0.0.1:{port}", rank, world, RankOptions(slots=8))
    params = SamplingParams(max_new_tokens=32)
    prompts = [[(7 * i + j) % 200 + 5 for j in range(32)] for i in range(requests)]
    ep.submit(prompts[0], params).result()  # first-call costs
    steps = ep.stats.steps
    a2a, calls = (sum(getattr(e.stats, k) for e in ep.experts) for k in ("all_to_all_s", "calls"))
    t, cpu = time.perf_counter(), time.process_time()
    for f in [ep.submit(p, params) for p in prompts]:
        f.result()
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    steps = ep.stats.steps - steps
    a2a = sum(e.stats.all_to_all_s for e in ep.experts) - a2a
    calls = sum(e.stats.calls for e in ep.experts) - calls
    ep.stop()
    ep.thread.join()
    results.put((rank, {"req_s": requests / wall, "step_ms": wall / steps * 1e3, "cpu": cpu / wall,
                        "a2a_ms": a2a / calls * 1e3}))


def spawn(target, world: int, *args) -> dict:
    from moeserve.bench.ep import spawn_ranks

    return spawn_ranks(target, world, args, 600)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trees", nargs="+", default=["here=."], help="NAME=PATH source trees")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--requests", type=int, default=96, help="per rank")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--tree", help=argparse.SUPPRESS)  # internal: run the ranks with this tree's moeserve
    a = p.parse_args()
    if a.tree is not None:
        sys.path.insert(0, a.tree)
        sys.path.insert(1, str(HERE))
        from importlib import import_module

        checkpoint = import_module("ep-serve").checkpoint()
        for r, m in sorted(spawn(serve_rank, a.ranks, str(checkpoint), a.requests).items()):
            print(f"rank {r}: {m['req_s']:5.1f} req/s  {m['step_ms']:5.1f} ms a step  {m['cpu'] * 100:3.0f}% of a "
                  f"core  all-to-all {m['a2a_ms']:.2f} ms a layer call", flush=True)
        return
    for name, (p50, p90, p99, mean) in spawn(gloo_floor, 2)[0].items():
        print(f"gloo, 2 ranks, {name:34s} p50 {p50:6.0f} us  p90 {p90:6.0f}  p99 {p99:6.0f}  mean {mean:6.0f}")
    trees = [t.split("=", 1) for t in a.trees]
    for r in range(a.rounds):
        for name, path in (trees if r % 2 == 0 else trees[::-1]):
            out = subprocess.run([sys.executable, __file__, "--tree", str(Path(path).absolute()), "--ranks",
                                  str(a.ranks), "--requests", str(a.requests)], capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": str(Path(path).absolute())})
            if out.returncode:
                sys.exit(f"{name}: {out.stderr[-3000:]}")
            for line in out.stdout.splitlines():
                print(f"round {r} {name:8s} {line}", flush=True)


if __name__ == "__main__":
    multiprocessing.freeze_support()
    main()
