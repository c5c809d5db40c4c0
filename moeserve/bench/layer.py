"""`moeserve bench layer`: one MoE layer, the same weights, every implementation, one run.

Compares moeserve's dispatch paths with the plain per-expert loop (the reference the tests check
against) and, where transformers is installed, with its MixtralSparseMoeBlock under each experts
backend, at several token counts; the implementations take turns call by call. The dense GEMM of the
same FLOPs is timed in the same run: it is the ceiling an MoE layer's expert math can reach on this
machine, so "% of GEMM" says how much of the machine the dispatch leaves unused. Each
implementation's output is checked against the reference before it is timed.

"moeserve (auto)" is the layer as the engine runs it: laid out by the plan the calibration picked for
this shape on this machine (runtime/calibration.py), printed with the measurements that decided it.
The fixed variants (gather or grouped, plain or packed weights, grouped_mm) show what each choice costs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from moeserve.bench.report import check_plot, finish
from moeserve.bench.stats import percentile
from moeserve.config import MoEConfig
from moeserve.runtime.backends import cpu_kernel
from moeserve.runtime.backends.calibration import ExpertShape, calibrate, interleaved_ms, plan_for
from moeserve.runtime.backends.cpu import lay_out_router
from moeserve.runtime.backends.eager import lay_out_moe
from moeserve.runtime.device import dtype_unsupported, machine
from moeserve.runtime.engine import DTYPES
from moeserve.runtime.experts import moe_reference
from moeserve.runtime.moe import MoELayer
from moeserve.runtime.backends.packing import onednn_packing_available, pack_weight, packed_linear


@dataclass
class Shape:
    d_model: int = 512
    d_ff: int = 1408
    n_experts: int = 8
    top_k: int = 2

    def experts(self) -> ExpertShape:
        """The calibration's key for this layer (Mixtral-style: SwiGLU experts)."""
        return ExpertShape(self.d_model, self.d_ff, self.n_experts, self.top_k, "swiglu")

    def flops(self, tokens: int) -> float:
        """Expert FLOPs per forward: 3 matrices of D x F per (token, expert), 2 FLOPs per multiply-add."""
        return 2.0 * 3 * self.d_model * self.d_ff * tokens * self.top_k


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
                hf_backends: tuple[str, ...] = ("eager", "grouped_mm"), progress: bool = True,
                calibration: str | None = None) -> dict:
    """Every implementation at every token count, per dtype. What this machine cannot run (a dtype torch
    does not run here, packing oneDNN cannot do, a transformers backend that raises) is left out and
    listed under "skipped" with the reason; "moeserve (auto)" runs the plan the calibration picked."""
    rows, plans, skipped = [], {}, []

    def skip(dtype_name: str, what: str, why: str) -> None:
        skipped.append({"dtype": dtype_name, "impl": what, "why": why})
        if progress:
            print(f"  {dtype_name:8s} skipping {what}: {why}", flush=True)

    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        why = dtype_unsupported("cpu", dtype)
        if why is not None:
            skip(dtype_name, "every implementation", f"torch does not run {dtype_name} on this CPU ({why})")
            continue
        plan = plan_for(shape.experts(), "cpu", dtype, calibration)
        plans[dtype_name] = {"plan": plan.describe(), "reason": plan.reason, "source": plan.source,
                             "pack_experts": plan.pack_experts, "kernel_experts": plan.kernel_experts,
                             "grouped_mm": plan.grouped_mm, "gather_max": plan.gather_max}
        if progress:
            print(f"  {dtype_name:8s} calibration: {plan.describe()}\n           why: {plan.reason}", flush=True)
        can_pack = onednn_packing_available("cpu", dtype)
        if not can_pack:
            skip(dtype_name, "oneDNN-packed implementations", f"oneDNN cannot pack {dtype_name} weights on this CPU")
        base = moeserve_layer(shape)
        layer = moeserve_layer(shape).to(dtype)
        layer = lay_out_moe(layer, pack=plan.pack_experts, grouped_mm=plan.grouped_mm, gather_max=plan.gather_max,
                            kernel=plan.kernel_experts)
        lay_out_router(layer)
        variants = {"gather, plain": dict(pack=False, gather_max=1 << 30),
                    "grouped, plain": dict(pack=False, gather_max=0),
                    "grouped_mm, plain": dict(pack=False, gather_max=0, grouped_mm=True)}
        if can_pack:
            variants.update({"gather, packed": dict(pack=True, gather_max=1 << 30),
                             "grouped, packed": dict(pack=True, gather_max=0)})
        why_no_kernel = cpu_kernel.unavailable_for(dtype)
        if why_no_kernel is None:
            variants.update({"gather, C kernel": dict(pack=False, kernel=True, gather_max=1 << 30),
                             "grouped, C kernel": dict(pack=False, kernel=True, gather_max=0)})
        else:
            skip(dtype_name, "C kernel implementations", why_no_kernel)
        for T in tokens:
            torch.manual_seed(1)
            x = torch.randn(1, T, shape.d_model)
            x_d = x.to(dtype)
            x_TD = x_d[0]
            routing = layer.router(x_TD)
            with torch.no_grad():
                ref32 = base(x)[0]  # fp32 reference of the same weights
            # one expert's weights in the [out, in] layout moeserve's own linear maps use (a bf16 `a @ w` on the
            # transposed layout took 60x longer on an AVX2 CPU: a baseline no implementation here runs)
            w13 = torch.cat([layer.experts.w1, layer.experts.w3], 1)[0].contiguous().detach()
            w2 = layer.experts.w2[0].contiguous().detach()
            a = torch.randn(T * shape.top_k, shape.d_model, dtype=dtype)
            h = torch.randn(T * shape.top_k, shape.d_ff, dtype=dtype)

            def gemm():
                F.linear(a, w13)
                F.linear(h, w2)

            impls: dict[str, Callable[[], torch.Tensor | None]] = {
                "dense GEMM (same FLOPs)": gemm,
                "reference loop": lambda: moe_reference(x_TD, routing.expert_ids, routing.gates, layer.experts.w1,
                                                        layer.experts.w2, layer.experts.w3),
                "moeserve (auto)": lambda: layer(x_d)[0],
            }
            if can_pack:
                p13, p2 = pack_weight(w13), pack_weight(w2)

                def gemm_packed():
                    packed_linear(a, p13)
                    packed_linear(h, p2)

                impls["dense GEMM (same FLOPs), oneDNN packed"] = gemm_packed
            for name, kw in variants.items():
                variant = lay_out_moe(moeserve_layer(shape).to(dtype), **kw)
                lay_out_router(variant)
                impls[f"moeserve {name}"] = (lambda v: lambda: v(x_d)[0])(variant)
            for backend in hf_backends:
                block = hf_block(layer, backend)
                if block is not None:
                    impls[f"transformers {backend}"] = (lambda b: lambda: b(x_d))(block)
            errors: dict[str, float | None] = {}
            with torch.inference_mode():
                for name, fn in impls.items():
                    try:
                        y = fn()
                    except (RuntimeError, NotImplementedError) as e:
                        if not any(s["dtype"] == dtype_name and s["impl"] == name for s in skipped):
                            skip(dtype_name, name, str(e).splitlines()[0][:200])
                        continue
                    errors[name] = None if y is None else (y.float() - ref32).abs().max().item()
                times = interleaved_ms({name: impls[name] for name in errors}, min_time * len(errors),
                                       min_rounds=5, max_rounds=2000)
            for name, err in errors.items():
                p50 = statistics.median(times[name])
                rows.append({"dtype": dtype_name, "tokens": T, "impl": name, "p50_ms": round(p50, 4),
                             "p90_ms": round(percentile(times[name], 90), 4),
                             "p99_ms": round(percentile(times[name], 99), 4),
                             "gflops": round(shape.flops(T) / p50 / 1e6, 1), "max_abs_err_vs_fp32": err,
                             "runs": len(times[name])})
                if progress:
                    print(f"  {dtype_name:8s} T={T:<5d} {name:38s} {p50:9.3f} ms", flush=True)
    return {"shape": shape.__dict__, "machine": machine(), "plans": plans, "skipped": skipped, "results": rows}


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
    lines = [f"calibration ({dtype}): {p['plan']}  \nwhy: {p['reason']}" for dtype, p in report["plans"].items()]
    lines += [f"skipped ({s['dtype']}) {s['impl']}: {s['why']}" for s in report["skipped"]]
    lines += [""] if lines else []
    lines += ["| dtype | T | implementation | p50 ms | p90 ms | GFLOP/s | max abs err vs fp32 ref |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in report["results"]:
        err = "-" if r["max_abs_err_vs_fp32"] is None else f"{r['max_abs_err_vs_fp32']:.1e}"
        lines.append(f"| {r['dtype']} | {r['tokens']} | {r['impl']} | {r['p50_ms']:.3f} | {r['p90_ms']:.3f} | "
                     f"{r['gflops']:.0f} | {err} |")
    lines += ["", "| dtype | T | moeserve ms | transformers best | x transformers best | x reference | of GEMM "
              "| of packed GEMM |", "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for s in speedups(report):
        hf = f"{s['hf_best']} {s['hf_best_ms']} | {s['speedup_vs_hf_best']}" if s["hf_best"] else "- | -"
        lines.append(f"| {s['dtype']} | {s['tokens']} | {s['moeserve_ms']:.3f} | {hf} | "
                     f"{s['speedup_vs_reference']} | {s['fraction_of_gemm']:.0%} | "
                     + (f"{s['fraction_of_packed_gemm']:.0%} |" if s["fraction_of_packed_gemm"] else "- |"))
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """p50 latency against token count, per implementation, one panel per dtype."""
    from moeserve.bench.plots import pyplot, save

    dtypes = list(dict.fromkeys(r["dtype"] for r in report["results"]))
    fig, axes = pyplot().subplots(1, max(1, len(dtypes)), figsize=(6 * max(1, len(dtypes)), 4.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        rows = [r for r in report["results"] if r["dtype"] == dtype]
        for impl in dict.fromkeys(r["impl"] for r in rows):
            points = sorted((r["tokens"], r["p50_ms"]) for r in rows if r["impl"] == impl)
            ax.plot(*zip(*points), "o-", markersize=3, label=impl)
        ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="p50 ms", title=dtype)
        ax.legend(fontsize=6)
    s = report["shape"]
    save(fig, path, f"moeserve bench layer: D {s['d_model']}, F {s['d_ff']}, E {s['n_experts']}, k {s['top_k']}")


def sweep(dtype: str, shape: Shape = Shape()) -> str:
    """The calibration measured afresh (nothing read from or written to the cache): every candidate's
    p50 at every token count, and the plan those times give."""
    plan = calibrate(shape.experts(), DTYPES[dtype])
    names = list(plan.timings)
    counts = sorted({T for row in plan.timings.values() for T in row})
    lines = ["| T | " + " | ".join(f"{n} ms" for n in names) + " |", "| ---: |" + " ---: |" * len(names)]
    for T in counts:
        lines.append(f"| {T} | " + " | ".join(f"{plan.timings[n][T]:.3f}" if T in plan.timings[n] else "-"
                                             for n in names) + " |")
    return "\n".join(lines + ["", f"{dtype}: {plan.describe()}", f"why: {plan.reason}"])


def main(args) -> int:
    shape = Shape(args.d_model, args.d_ff, args.experts, args.top_k)
    if args.sweep:
        for dtype in args.dtypes:
            why = dtype_unsupported("cpu", DTYPES[dtype])
            print(f"{dtype}: skipped, torch does not run it on this CPU ({why})" if why else sweep(dtype, shape))
        return 0
    check_plot(args)
    report = bench_layer(args.tokens, args.dtypes, shape, args.min_time, progress=not args.quiet,
                         calibration="redo" if args.calibrate else None)
    print(markdown(report))
    finish(report, args, "layer")
    return 0
