"""The single-process server's host cost per streamed token, thread by thread: what bounds a server whose model is
fast (a GPU's, where the served built-in model reached 4.9x two CPU cores, not issue 40's 10x, with its decode all
on CUDA graphs). The server is started per tree (NAME=PATH: that tree's moeserve, e.g. a `git archive` of the
commit before a change), loaded with `moeserve bench serve`'s closed loop (32-token prompts, exactly --tokens
streamed tokens), and its threads' CPU time over the level is read from /proc: the event loop's (the main thread:
HTTP, SSE, the relay's wake-ups), the model thread's (it steps, samples and detokenizes; the server names it for
the OS) and the rest's (torch's intra-op workers).

    PYTHONPATH=. python docs/bench/stream-cost.py [--trees base=/tmp/base new=.] [--clients 32] [--duration 10]
        [--rounds 2] [--tokens 64] [--args "--kv-slots 32"] [--null-model]

Prints one line per tree, round and level: req/s, ITL p50, and CPU microseconds per streamed token of the event
loop, the model thread and the other threads.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
checkpoint = __import__("ep-serve").checkpoint  # ep-serve.py's random `small` checkpoint (fp32), written once


def null_runner(runner, rows: int = 64) -> None:
    """`runner`'s model calls replaced, on this instance, by canned logits (random, one row of them per call in
    turn) and zero expert counts: a model that costs nothing, as a fast GPU's nearly does, so that what is left
    is the server's host work. Greedy tokens then follow the canned rows; the text is noise."""
    import torch

    from moeserve.runtime.model import ModelOutput
    from moeserve.runtime.moe import MoEAux

    cfg = runner.cfg
    logits = torch.randn(rows, 1, cfg.vocab_size, generator=torch.Generator().manual_seed(0))
    counts = [torch.zeros(cfg.n_experts, dtype=torch.long) for _ in cfg.moe_layer_ids]
    turn = [0]

    def out(B: int, graph: bool = False) -> ModelOutput:
        turn[0] = (turn[0] + 1) % rows
        return ModelOutput(logits[turn[0]:turn[0] + 1].expand(B, 1, -1), [MoEAux(c, None) for c in counts], graph)

    runner.prefill = lambda cache, slot, ids_S, start, all_logits=False: out(1)
    runner.step_rows = lambda cache, slots, ids, starts: out(len(slots))
    runner.decode = lambda cache, slots, ids_B, positions: out(len(slots), graph=True)


def serve_null(argv: list[str]) -> int:
    """The server child of --null-model: `moeserve serve ARGV` whose engine's runner is null_runner's."""
    import moeserve.serve.server as server
    from moeserve.cli import main as cli_main

    load = server.load_engine

    def load_null(*args, **kwargs):
        engine = load(*args, **kwargs)
        null_runner(engine.runner)
        return engine

    server.load_engine = load_null
    return cli_main(argv)


def run(tree: str, ckpt: Path, extra: list[str], clients: list[int], duration: float, tokens: int,
        null: bool) -> list[str]:
    import subprocess

    from moeserve.bench.serve import ServeBenchConfig, bench_serve
    from moeserve.bench.server_process import free_port, server_command, stop_server, thread_cpu, wait_ready

    port = free_port()
    command = server_command(ckpt, port, "float32", extra)
    if null:  # the same command line, run by serve_null
        command = [sys.executable, str(Path(__file__).absolute()), "--serve-null", *command[command.index("serve"):]]
    env = {**os.environ, "PYTHONPATH": str(Path(tree).absolute())}  # the server subprocess's moeserve
    # run in the tree: from a checkout, `python -m` would import the checkout's moeserve whatever PYTHONPATH says
    proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, cwd=Path(tree).absolute())
    lines = []
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url)
        for c in clients:
            cfg = ServeBenchConfig(url=url, concurrency=(c,), duration_s=duration, input_len=(32, 32),
                                   output_len=(tokens, tokens), timeout_s=120)
            before = thread_cpu(proc.pid)
            lv = bench_serve(cfg)["levels"][0]
            after = thread_cpu(proc.pid)
            streamed = lv["output_tokens_per_s"] * lv["wall_s"]
            used = {k: after[k] - before.get(k, 0.0) for k in after}
            us = {"loop": used.pop("main", 0.0), "model": used.pop("moeserve-model", 0.0), "rest": sum(used.values())}
            us = {k: 1e6 * v / max(streamed, 1) for k, v in us.items()}
            lines.append(f"C={c:3d} {lv['requests_per_s']:6.2f} req/s  itl p50 {lv['itl_ms']['p50']:5.1f} ms  "
                         f"CPU us a token: loop {us['loop']:6.1f}  model {us['model']:6.1f}  rest {us['rest']:6.1f}")
    finally:
        stop_server(proc)
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", nargs="+", default=["here=."], help="NAME=PATH source trees")
    p.add_argument("--clients", nargs="+", type=int, default=[32])
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--args", default="", help="extra flags for every server, one string")
    p.add_argument("--null-model", action="store_true", help="the runner's model calls cost nothing (null_runner)")
    if sys.argv[1:2] == ["--serve-null"]:
        sys.exit(serve_null(sys.argv[2:]))
    a = p.parse_args()
    ckpt = checkpoint()
    trees = [t.split("=", 1) for t in a.trees]
    for r in range(a.rounds):
        for name, path in trees if r % 2 == 0 else trees[::-1]:
            for line in run(path, ckpt, a.args.split(), a.clients, a.duration, a.tokens, a.null_model):
                print(f"round {r} {name:8s} {line}", flush=True)


if __name__ == "__main__":
    main()
