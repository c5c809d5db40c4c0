"""`moeserve serve --ray --expert-parallel 2` against one process, under `moeserve bench serve` (issue 38's
"numbers to report"; docs/bench/log.md, "Serving with expert parallelism on two cores").

A random `small`-preset checkpoint (seed 0, fp32) is written once; then, per round, each server below is started
on a free port (bench.server_process: the real command line, ready when /readyz says so), loaded with closed-loop
clients at each level (32-token prompts, exactly 32 output tokens, streamed), and stopped. Rounds alternate the
order of the servers, so a drift of the shared machine falls on all of them. Each server can run another source
tree (NAME=PATH: that tree's moeserve on PYTHONPATH, e.g. a `git archive` of the commit before a change).

    PYTHONPATH=. python docs/bench/ep-serve.py [--trees base=/tmp/base new=.] [--clients 8 32] [--duration 15]
        [--rounds 1] [--ep-args ARGS [ARGS ...]] [--args ...] [--one]

Each --ep-args string is an EP server of its own per tree (e.g. --ep-args "" "--compile on": eager and compiled ranks
side by side).

Prints one line per server, round and level: req/s, p50 and p99 end-to-end ms, p50 TTFT and ITL ms, errors.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

CKPT = Path("/tmp/moeserve-ep-serve/small")


def checkpoint() -> Path:
    import torch

    from moeserve.checkpoint import save_checkpoint
    from moeserve.config import preset
    from moeserve.runtime.model import Transformer

    if not (CKPT / "config.json").exists():
        torch.manual_seed(0)
        model = Transformer(preset("small"))
        save_checkpoint(CKPT, model.cfg, model.state_dict())
    return CKPT


def run(tree: str, extra: list[str], clients: list[int], duration: float) -> list[dict]:
    from moeserve.bench.serve import ServeBenchConfig, bench_serve
    from moeserve.bench.server_process import ServerLog, running_server

    env = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(Path(tree).absolute())  # the server subprocess's moeserve
    log = ServerLog()
    try:
        # run in the tree: from a checkout, `python -m` and a local Ray's workers would import the checkout's
        with running_server(CKPT, "float32", extra, log, cwd=Path(tree).absolute()) as url:
            cfg = ServeBenchConfig(url=url, concurrency=tuple(clients), duration_s=duration, input_len=(32, 32),
                                   output_len=(32, 32), timeout_s=120)
            return bench_serve(cfg)["levels"]
    finally:
        if env is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = env
        if log.exit_code not in (0, -15):
            print(log.text[-3000:], file=sys.stderr)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trees", nargs="+", default=["here=."], help="NAME=PATH source trees for the EP server")
    p.add_argument("--clients", nargs="+", type=int, default=[8, 32])
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--ep-args", nargs="+", default=[""], help="extra flags for the EP servers: one string a server")
    p.add_argument("--args", default="", help="extra flags for every server (e.g. --kv-slots 16), one string")
    p.add_argument("--one", action="store_true", help="also one process (the first tree), each round")
    a = p.parse_args()
    checkpoint()
    servers = [(f"one process ({name})", path, a.args.split()) for name, path in [a.trees[0].split("=", 1)] if a.one]
    servers += [(f"EP N=2 ({name}{' ' + ep if ep else ''})", path,
                 ["--ray", "--expert-parallel", "2", *ep.split(), *a.args.split()])
                for name, path in (t.split("=", 1) for t in a.trees) for ep in a.ep_args]
    for r in range(a.rounds):
        order = servers if r % 2 == 0 else servers[::-1]
        for name, path, extra in order:
            for lv in run(path, extra, a.clients, a.duration):
                e2e, ttft, itl = lv["e2e_ms"], lv["ttft_ms"], lv["itl_ms"]
                print(f"round {r} {name:36s} C={int(lv['value']):3d}  {lv['requests_per_s']:6.2f} req/s  "
                      f"p50 {e2e['p50']:7.1f} ms  p99 {e2e['p99']:7.1f} ms  ttft p50 {ttft['p50']:6.1f}  "
                      f"itl p50 {itl['p50']:5.1f}  errors {lv['errors'] or 0}", flush=True)


if __name__ == "__main__":
    main()
