"""Greedy generation through a fused `--kv-cache` export on ONNX Runtime's CPU provider, tree against tree: what
one session call a decode step for every sequence (issue 40) bought over one call per sequence. Each tree
(NAME=PATH: that tree's moeserve, e.g. a `git archive` of the commit before a change) exports the checkpoint
itself, since the graph changed with the runner, and is timed in a process of its own with no torch model
beside it (the two runtimes' thread pools spin after each call and slow each other: bench/onnx.py's BLOCKS).
Trees alternate by round.

    PYTHONPATH=. python docs/bench/onnx-decode.py [--trees base=/tmp/base new=.] [--checkpoint DIR]
        [--batches 1 8 32] [--tokens 64] [--rounds 2] [--repeats 7]

Prints one line per tree and round: tokens/s (median of --repeats generations) at each batch size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

TIMED = r"""
import json, statistics, sys, tempfile, time
from pathlib import Path
import torch
from moeserve.export.onnx_export import export_onnx
from moeserve.runtime.engine import load_engine

checkpoint, batches, tokens, repeats = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
prompts = ["def main(", "import os\n", "class Node:", "x = ", "for i in range(", "return ", "# parse the", "with open("]
with tempfile.TemporaryDirectory() as tmp:
    onnx = export_onnx(checkpoint, Path(tmp) / "kv.onnx", "fused", kv_cache=True).output
    engine = load_engine(onnx, "onnx", device="cpu", threads=torch.get_num_threads())
    rates = {}
    for batch in batches:
        rows = [prompts[i % len(prompts)] for i in range(batch)]
        engine.generate(rows, max_new_tokens=tokens)  # first-call allocations
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            engine.generate(rows, max_new_tokens=tokens)
            seconds.append(time.perf_counter() - start)
        rates[batch] = round(batch * tokens / statistics.median(seconds), 1)
print(json.dumps(rates))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", nargs="+", default=["here=."], help="NAME=PATH source trees")
    p.add_argument("--checkpoint", default=None, help="checkpoint (default: the built-in default model)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--tokens", type=int, default=64, help="new tokens per sequence")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    checkpoint = a.checkpoint
    if checkpoint is None:
        from moeserve.training.default_model import default_model_path

        checkpoint = str(default_model_path(progress=True))
    trees = [t.split("=", 1) for t in a.trees]
    for r in range(a.rounds):
        for name, path in trees if r % 2 == 0 else trees[::-1]:
            # run in the tree: `python -c` puts the working directory first on sys.path, so run from a checkout it
            # would import that checkout's moeserve whatever PYTHONPATH says
            env = {**os.environ, "PYTHONPATH": os.path.abspath(path)}
            out = subprocess.run([sys.executable, "-c", TIMED, checkpoint, json.dumps(a.batches), str(a.tokens),
                                  str(a.repeats)], env=env, capture_output=True, text=True, check=True,
                                 cwd=os.path.abspath(path))
            rates = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{name:>8} round {r}: tokens/s " + ", ".join(f"batch {b}: {v}" for b, v in rates.items()),
                  flush=True)


if __name__ == "__main__":
    main()
