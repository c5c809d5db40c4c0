"""`moeserve bench layer`: one MoE layer, the same weights, every implementation, one run.

Compares moeserve's dispatch paths with the plain per-expert loop (the reference the tests check
against) and, where transformers is installed, with its MixtralSparseMoeBlock under each experts
backend, at several token counts. The dense GEMM of the same FLOPs is timed in the same run: it is
the ceiling an MoE layer's expert math can reach on this machine, so "% of GEMM" says how much of
the machine the dispatch leaves unused. Each implementation's output is checked against the
reference before it is timed.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from moeserve.bench.train import machine
from moeserve.config import MoEConfig
from moeserve.runtime.engine import DTYPES
from moeserve.runtime.experts import moe_reference
from moeserve.runtime.moe import MoELayer
from moeserve.runtime.packing import onednn_packing_available, pack_weight, packed_linear



@dataclass
class Shape:
    d_model: int = 512
    d_ff: int = 1408
    n_experts: int = 8
    top_k: int = 2

    def flops(self, tokens: int) -> float:
        """Expert FLOPs per forward: 3 matrices of D x F per (token, expert), 2 FLOPs per multiply-add."""
        return 2.0 * 3 * self.d_model * self.d_ff * tokens * self.top_k


def time_ms(fn: Callable[[], object], min_time: float = 0.3, min_runs: int = 5, max_runs: int = 2000) -> list[float]:
    """Wall times (ms) of repeated calls after two warm-up calls, for at least `min_time` seconds."""
    fn(), fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_runs and (len(times) < min_runs or time.perf_counter() - start < min_time):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def moeserve_layer(shape: Shape, seed: int = 0) -> MoELayer:
    """A Mixtral-style layer (softmax, top-k renormalised, SwiGLU) with N(0, 0.02) weights."""
    cfg = MoEConfig(d_model=shape.d_model, d_ff=shape.d_ff, n_experts=shape.n_experts, top_k=shape.top_k,
                    n_heads=8, router="softmax", renormalize=True, expert_act="swiglu")
    torch.manual_seed(seed)
    layer = MoELayer(cfg).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
    return layer


def hf_block(layer: MoELayer, backend: str):
    """transformers' MixtralSparseMoeBlock holding the same weights, or None without transformers."""
    try:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    except ImportError:
        return None
    c = layer.cfg
    cfg = MixtralConfig(hidden_size=c.d_model, intermediate_size=c.d_ff, num_local_experts=c.n_experts,
                        num_experts_per_tok=c.top_k)
    cfg._experts_implementation = backend
    block = MixtralSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        block.gate.weight.copy_(layer.router.gate.weight)
        e = layer.experts
        block.experts.gate_up_proj.copy_(torch.cat([e.w1, e.w3], dim=1))
        block.experts.down_proj.copy_(e.w2)
    return block.to(e.w1.dtype)


def bench_layer(tokens: list[int], dtypes: list[str], shape: Shape = Shape(), min_time: float = 0.3,
                hf_backends: tuple[str, ...] = ("eager", "grouped_mm"), progress: bool = True) -> dict:
    rows = []
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        base = moeserve_layer(shape)
        layer = moeserve_layer(shape).to(dtype)
        layer.prepare_inference()
        gather_max = layer.experts.inference.gather_max
        packed = layer.experts.inference.packed
        for T in tokens:
            torch.manual_seed(1)
            x = torch.randn(1, T, shape.d_model)
            x_d = x.to(dtype)
            x_TD = x_d[0]
            routing = layer.router(x_TD)
            with torch.no_grad():
                ref32 = base(x)  # fp32 reference of the same weights
            w13 = torch.cat([layer.experts.w1, layer.experts.w3], 1)[0].T.contiguous().detach()
            w2 = layer.experts.w2[0].T.contiguous().detach()
            a = torch.randn(T * shape.top_k, shape.d_model, dtype=dtype)
            h = torch.randn(T * shape.top_k, shape.d_ff, dtype=dtype)

            def gemm():
                a @ w13
                h @ w2

            if onednn_packing_available("cpu", dtype):
                p13, p2 = pack_weight(w13.T), pack_weight(w2.T)

                def gemm_packed():
                    packed_linear(a, p13)
                    packed_linear(h, p2)

            impls: dict[str, Callable[[], torch.Tensor | None]] = {
                "dense GEMM (same FLOPs)": gemm,
                "reference loop": lambda: moe_reference(x_TD, routing.expert_ids, routing.gates, layer.experts.w1,
                                                        layer.experts.w2, layer.experts.w3),
                "moeserve (auto)": lambda: layer(x_d),
            }
            if onednn_packing_available("cpu", dtype):
                impls["dense GEMM (same FLOPs), oneDNN packed"] = gemm_packed
            for name, kw in (("gather", dict(gather_max=1 << 30)), ("grouped", dict(gather_max=0)),
                             ("grouped_mm", dict(gather_max=0, grouped_mm=True))):
                variant = moeserve_layer(shape).to(dtype)
                variant.prepare_inference(**kw)
                impls[f"moeserve {name}"] = (lambda v: lambda: v(x_d))(variant)
            for backend in hf_backends:
                block = hf_block(layer, backend)
                if block is not None:
                    impls[f"transformers {backend}"] = (lambda b: lambda: b(x_d))(block)
            for name, fn in impls.items():
                with torch.inference_mode():
                    y = fn()
                    err = None if y is None else (y.float() - ref32).abs().max().item()
                    times = time_ms(fn, min_time)
                p50 = statistics.median(times)
                rows.append({"dtype": dtype_name, "tokens": T, "impl": name, "p50_ms": round(p50, 4),
                             "p90_ms": round(percentile(times, 0.9), 4), "p99_ms": round(percentile(times, 0.99), 4),
                             "gflops": round(shape.flops(T) / p50 / 1e6, 1), "max_abs_err_vs_fp32": err,
                             "runs": len(times)})
                if progress:
                    print(f"  {dtype_name:8s} T={T:<5d} {name:26s} {p50:9.3f} ms", flush=True)
        for r in rows:
            if r["dtype"] == dtype_name:
                r["gather_max"], r["packed"] = gather_max, packed
    return {"shape": shape.__dict__, "machine": machine(), "results": rows}


def speedups(report: dict) -> list[dict]:
    """Per (dtype, tokens): moeserve auto against transformers' best backend and the GEMM ceiling."""
    out = []
    keys = sorted({(r["dtype"], r["tokens"]) for r in report["results"]}, key=lambda k: (k[0], k[1]))
    for dtype, T in keys:
        rs = {r["impl"]: r for r in report["results"] if r["dtype"] == dtype and r["tokens"] == T}
        ours = rs["moeserve (auto)"]["p50_ms"]
        hf = [r for n, r in rs.items() if n.startswith("transformers")]
        best = min(hf, key=lambda r: r["p50_ms"]) if hf else None
        out.append({"dtype": dtype, "tokens": T, "moeserve_ms": ours,
                    "hf_best": best["impl"] if best else None, "hf_best_ms": best["p50_ms"] if best else None,
                    "speedup_vs_hf_best": round(best["p50_ms"] / ours, 2) if best else None,
                    "speedup_vs_reference": round(rs["reference loop"]["p50_ms"] / ours, 2),
                    "fraction_of_gemm": round(rs["dense GEMM (same FLOPs)"]["p50_ms"] / ours, 3),
                    "fraction_of_packed_gemm": round(rs["dense GEMM (same FLOPs), oneDNN packed"]["p50_ms"] / ours, 3)
                    if "dense GEMM (same FLOPs), oneDNN packed" in rs else None})
    return out


def markdown(report: dict) -> str:
    lines = ["| dtype | T | implementation | p50 ms | p90 ms | GFLOP/s | max abs err vs fp32 ref |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in report["results"]:
        err = "-" if r["max_abs_err_vs_fp32"] is None else f"{r['max_abs_err_vs_fp32']:.1e}"
        lines.append(f"| {r['dtype']} | {r['tokens']} | {r['impl']} | {r['p50_ms']:.3f} | {r['p90_ms']:.3f} | "
                     f"{r['gflops']:.0f} | {err} |")
    lines += ["", "| dtype | T | moeserve ms | transformers best | x transformers best | x reference | of GEMM "
              "| of packed GEMM |", "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for s in speedups(report):
        lines.append(f"| {s['dtype']} | {s['tokens']} | {s['moeserve_ms']:.3f} | {s['hf_best']} {s['hf_best_ms']} | "
                     f"{s['speedup_vs_hf_best']} | {s['speedup_vs_reference']} | {s['fraction_of_gemm']:.0%} | "
                     + (f"{s['fraction_of_packed_gemm']:.0%} |" if s["fraction_of_packed_gemm"] else "- |"))
    return "\n".join(lines)


def sweep_gather_threshold(dtype: str = "bfloat16", shape: Shape = Shape(), max_tokens: int = 64,
                           rounds: int = 200) -> dict:
    """p50 of the gather and grouped paths at growing token counts, calls interleaved so that both see
    the same machine state. gather_max (in tokens) is the last count before grouped first wins."""
    x_all = torch.randn(max_tokens, shape.d_model, dtype=DTYPES[dtype])
    paths = {}
    for name, kw in (("gather", dict(gather_max=1 << 30)), ("grouped", dict(gather_max=0))):
        layer = moeserve_layer(shape).to(DTYPES[dtype])
        layer.prepare_inference(**kw)
        paths[name] = layer
    out, T = [], 1
    while T <= max_tokens:
        x = x_all[:T][None]
        times: dict[str, list[float]] = {name: [] for name in paths}
        with torch.inference_mode():
            for layer in paths.values():
                layer(x)
            for _ in range(rounds):
                for name, layer in paths.items():
                    t0 = time.perf_counter()
                    layer(x)
                    times[name].append((time.perf_counter() - t0) * 1e3)
        out.append({"tokens": T, **{f"{n}_ms": round(statistics.median(ts), 4) for n, ts in times.items()}})
        T *= 2
    gather_max = 0
    for r in out:
        if r["gather_ms"] > r["grouped_ms"]:
            break
        gather_max = r["tokens"]
    return {"dtype": dtype, "rows": out, "gather_max": gather_max}


def main(args) -> int:
    if args.sweep:
        res = sweep_gather_threshold(args.dtypes[0])
        for r in res["rows"]:
            print(r)
        print(f"gather path is faster up to {res['gather_max']} tokens ({res['dtype']})")
        return 0
    report = bench_layer(args.tokens, args.dtypes, Shape(args.d_model, args.d_ff, args.experts, args.top_k),
                         args.min_time, progress=not args.quiet)
    print(markdown(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0
