"""The single-process server's host cost per streamed token, thread by thread: what bounds a server whose model is
fast (a GPU's, where the served built-in model reached 4.9x two CPU cores, not issue 40's 10x, with its decode all
on CUDA graphs). The server is started per tree (NAME=PATH: that tree's moeserve, e.g. a `git archive` of the
commit before a change), loaded with `moeserve bench serve`'s closed loop (32-token prompts, exactly --tokens
streamed tokens), and its threads' CPU time over the level is read from /proc: the event loop's (the main thread:
HTTP, SSE, the relay's wake-ups) and the rest's (the model thread, which steps, samples and detokenizes, and
torch's intra-op workers; Python does not name its threads for the OS, so /proc cannot tell these apart).

    PYTHONPATH=. python docs/bench/stream-cost.py [--trees base=/tmp/base new=.] [--clients 32] [--duration 10]
        [--rounds 2] [--tokens 64] [--args "--kv-slots 32"]

Prints one line per tree, round and level: req/s, ITL p50, and CPU microseconds per streamed token of the event
loop and of the other threads.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
checkpoint = __import__("ep-serve").checkpoint  # the random `small` checkpoint, fp32


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of `pid`'s threads: loop (the main thread's) and rest (every other's)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {"loop": 0.0, "rest": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out["loop" if int(tid) == pid else "rest"] += (int(fields[11]) + int(fields[12])) / tick
    return out


def server_pid(port: int) -> int:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if b"serve" in args and str(port).encode() in args:
            return int(pid)
    raise SystemExit(f"no server process on port {port}")


def run(tree: str, extra: list[str], clients: list[int], duration: float, tokens: int) -> list[str]:
    from moeserve.bench.serve import ServeBenchConfig, bench_serve
    from moeserve.bench.server_process import ServerLog, running_server

    env = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(Path(tree).absolute())  # the server subprocess's moeserve
    lines = []
    try:
        with running_server(checkpoint(), "float32", extra, ServerLog()) as url:
            pid = server_pid(int(url.rsplit(":", 1)[1]))
            for c in clients:
                cfg = ServeBenchConfig(url=url, concurrency=(c,), duration_s=duration, input_len=(32, 32),
                                       output_len=(tokens, tokens), timeout_s=120)
                before = thread_cpu(pid)
                lv = bench_serve(cfg)["levels"][0]
                after = thread_cpu(pid)
                streamed = lv["output_tokens_per_s"] * lv["wall_s"]
                us = {k: 1e6 * (after[k] - before[k]) / max(streamed, 1) for k in after}
                lines.append(f"C={c:3d} {lv['requests_per_s']:6.2f} req/s  itl p50 {lv['itl_ms']['p50']:5.1f} ms  "
                             f"CPU us a token: loop {us['loop']:6.1f}  rest {us['rest']:7.1f}")
    finally:
        if env is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = env
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", nargs="+", default=["here=."], help="NAME=PATH source trees")
    p.add_argument("--clients", nargs="+", type=int, default=[32])
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--args", default="", help="extra flags for every server, one string")
    a = p.parse_args()
    trees = [t.split("=", 1) for t in a.trees]
    for r in range(a.rounds):
        for name, path in trees if r % 2 == 0 else trees[::-1]:
            for line in run(path, a.args.split(), a.clients, a.duration, a.tokens):
                print(f"round {r} {name:8s} {line}", flush=True)


if __name__ == "__main__":
    main()
