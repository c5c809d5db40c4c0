"""Redundant experts on a skewed load, measured (runtime/expert_replicas.py; docs/bench/log.md, "Redundant experts").

Two ranks on gloo over 127.0.0.1, one thread each, one MoE layer of the `small` preset's shape (8 SwiGLU experts,
d_model 256, d_ff 512: rank 0 owns experts 0..3, rank 1 owns 4..7) on the C kernel where it runs. Each rank routes
T tokens a call, top-2, 80% of them to experts 0 and 1 (both rank 0's). Per K (replica slots per rank): a window of
W calls under the owners alone, a rebalance, a window under the copies, a rebalance (which reads the second window).
Prints, per K: the imbalance each window measured (the busiest rank's computed rows over the mean), the placement,
the layer's median wall time per call on each rank, and the first rebalance's wall time and the bytes it moved.

    PYTHONPATH=. python docs/bench/expert-replicas.py [T] [W]
"""

from __future__ import annotations

import multiprocessing
import socket
import statistics
import sys
import time

import torch

E, D, F = 8, 256, 512


def rank(r: int, port: int, T: int, W: int, results) -> None:
    from moeserve.runtime.expert_parallel import ExpertParallelExperts, join_group
    from moeserve.runtime.expert_replicas import Replication
    from moeserve.runtime.experts import Experts, moe_reference

    torch.set_num_threads(1)
    group = join_group(f"tcp://127.0.0.1:{port}", r, 2, timeout_s=120)
    out = {}
    for K in (1, 2):
        torch.manual_seed(0)
        ex = Experts(E, D, F, "swiglu")
        ep = ExpertParallelExperts.of(ex, group)
        kernel = ep.prepare_inference()
        g = torch.Generator().manual_seed(100 + r)

        def tokens():
            ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
            ids[torch.rand(T, generator=g) < 0.8] = torch.tensor([0, 1])
            return torch.randn(T, D, generator=g), ids, torch.rand(T, 2, generator=g)

        with torch.inference_mode():
            for _ in range(8):  # warm-up (the kernel's first calls, gloo's first collectives), outside the windows
                ep(*tokens())
        rep = Replication([ep], room=K, every=W)
        times, rebalance_s, worst = [[], []], [], 0.0
        with torch.inference_mode():
            for window in range(2):
                for _ in range(W):
                    x, ids, gates = tokens()
                    t0 = time.perf_counter()
                    y = ep(x, ids, gates)
                    times[window].append(time.perf_counter() - t0)
                    worst = max(worst, float((y - moe_reference(x, ids, gates, ex.w1, ex.w2, ex.w3)).abs().max()))
                    t0 = time.perf_counter()
                    report = rep.after_step()
                    if report is not None:
                        rebalance_s.append(time.perf_counter() - t0)
        first, second = rep.history
        out[K] = {"kernel": kernel, "before": first.before[0], "predicted": first.after[0], "after": second.before[0],
                  "replicas": first.replicas[0], "moved": first.moved, "moved_bytes": first.moved * 3 * F * D * 4,
                  "layer_ms": [1e3 * statistics.median(t) for t in times], "rebalance_ms": 1e3 * rebalance_s[0],
                  "max_abs_diff": worst}
    group.leave()
    results.put((r, out))


def main() -> None:
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    W = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank, args=(r, port, T, W, results)) for r in range(2)]
    for p in procs:
        p.start()
    out = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    print(f"T = {T} tokens a rank a call, W = {W} calls a window, torch {torch.__version__}")
    print("| K | imbalance, owners only | predicted | measured with copies | copies (rank 0, rank 1) | "
          "layer ms/call rank 0 (before -> after) | rank 1 | rebalance ms (copies moved, MB) | max abs diff |")
    print("| ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for K in (1, 2):
        a, b = out[0][K], out[1][K]
        assert a["replicas"] == b["replicas"] and a["before"] == b["before"]
        print(f"| {K} | {a['before']:.3f} | {a['predicted']:.3f} | {a['after']:.3f} | {a['replicas']} | "
              f"{a['layer_ms'][0]:.2f} -> {a['layer_ms'][1]:.2f} | {b['layer_ms'][0]:.2f} -> {b['layer_ms'][1]:.2f} | "
              f"{max(a['rebalance_ms'], b['rebalance_ms']):.1f} ({a['moved']}, {a['moved_bytes'] / 1e6:.1f}) | "
              f"{max(a['max_abs_diff'], b['max_abs_diff']):.1e} |")
    print("C kernel:", out[0][1]["kernel"])


if __name__ == "__main__":
    main()
