"""A prompt chunk eager against the compiled backend's chunk graph (compiled.py: CompiledPrefill), on this machine:
the torch operators an eager chunk dispatches (counted with a dispatch mode: on a GPU each is a kernel launch the
host pays) and each path's time, alternated in one run. On a CPU the graph is inductor's C++ and the time
is mostly arithmetic; on a GPU (--device cuda) it is one CUDA graph replay against the eager launches.

    PYTHONPATH=. python docs/bench/prefill-graph.py [--device cpu] [--tokens 16 128] [--rounds 5] [--model PATH]

The model is the built-in one (trained once and cached, as `moeserve serve` does) in bf16 on the plan a CUDA bf16
model gets by default (experts as one grouped_mm call, which the graph needs).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moeserve.runtime.backends.plan import default_plan
from moeserve.runtime.engine import Engine
from moeserve.training.default_model import default_model_dir


class Ops(TorchDispatchMode):
    """Counts the torch operators dispatched under it."""

    def __init__(self):
        super().__init__()
        self.n = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n[str(func)] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 128])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=20, help="chunks timed per round and path")
    p.add_argument("--model", default=None, help="checkpoint (default: the built-in model)")
    a = p.parse_args()
    plan = dataclasses.replace(default_plan(a.device, torch.bfloat16), grouped_mm=True, decode_grouped=True,
                               pack_dense=False, pack_experts=False)
    engine = Engine.load(a.model or default_model_dir(), dtype="bfloat16", device=a.device, compile="on", plan=plan)
    runner = engine.runner
    t0 = time.perf_counter()
    runner.warm_up(2)
    print(f"{engine.name}: warm-up (decode buckets and chunk graphs) {time.perf_counter() - t0:.1f} s; "
          f"chunk sizes {runner._prefill.sizes}, spans {runner._prefill.spans}; prompts of one call on a graph "
          f"each: up to {runner.rows_on_graphs}")
    cache = runner.new_cache(2, engine.cfg.max_seq_len)
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)

    def chunk(ids: torch.Tensor, graph: bool) -> float:
        runner.graph_prefill = graph
        sync()
        t = time.perf_counter()
        for _ in range(a.calls):
            out = runner.prefill(cache, 0, ids, 0)
        sync()
        assert out.graph == graph
        return (time.perf_counter() - t) / a.calls * 1e3

    with torch.inference_mode():
        for n in a.tokens:
            ids = torch.randint(3, engine.cfg.vocab_size, (n,), device=a.device)
            for graph in (False, True):
                chunk(ids, graph)  # warm
            with Ops() as m:  # eager only: dynamo does not trace under a dispatch mode
                runner.graph_prefill = False
                runner.prefill(cache, 0, ids, 0)
            times = {False: [], True: []}
            for r in range(a.rounds):
                for graph in ((False, True) if r % 2 == 0 else (True, False)):
                    times[graph].append(chunk(ids, graph))
            e, g = (statistics.median(times[k]) for k in (False, True))
            print(f"{n} tokens: eager {e:.2f} ms ({sum(m.n.values())} operators dispatched), graph {g:.2f} ms "
                  f"(one call): {e / g:.2f}x; rounds eager {[round(x, 2) for x in times[False]]}, "
                  f"graph {[round(x, 2) for x in times[True]]}")


if __name__ == "__main__":
    main()
