"""`moeserve bench onnx`: forward latency of one checkpoint as the torch Engine in fp32 (the baseline)
and as each ONNX export of it on ONNX Runtime (portable, fused, and vq-table for VQ models), at batch
1 and 8, in one process, the backends taking turns in blocks so that drift hits every one alike.

What is timed is the call a server makes for scoring: ids [B, S] and a mask in, logits out, through
`Engine.forward` / an ONNX-backed `Engine.forward` (expert-load accounting included in both). Each export is
made fresh by `export_onnx`, parity check included, so the numbers are for graphs that passed it.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch

from moeserve.bench.report import check_plot, finish
from moeserve.export import MODES
from moeserve.export.onnx_export import export_onnx
from moeserve.runtime.backends.calibration import interleaved_ms
from moeserve.runtime.device import machine
from moeserve.runtime.engine import Engine, load_engine

# Backends take turns in blocks, not call by call: ONNX Runtime's and torch's thread pools both spin a while
# after each call, and on a small machine a pool still spinning slows the other's next call (measured: torch
# eager 2x slower when interleaved call by call). Three blocks each still spread slow drift over all of them.
BLOCKS = 3


def as_served(engine: Engine, call):
    """call(engine) as `moeserve serve` runs that engine: an ONNX Runtime session's with torch at one thread, since
    there torch only samples and its spinning OpenMP team would slow the session's next call (serve/state.py)."""
    if engine.runner.name != "onnx":
        return call(engine)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return call(engine)
    finally:
        torch.set_num_threads(threads)


def timed(engines: dict[str, Engine], call, repeats: int) -> dict[str, float]:
    """p50 seconds of call(engine) per engine (as_served), the engines taking turns in BLOCKS blocks, each block
    after two untimed calls (first-call allocations, and the other pool's threads going idle)."""
    ms = interleaved_ms({name: (lambda e=engine: as_served(e, call)) for name, engine in engines.items()}, 0.0,
                        min_rounds=BLOCKS, max_rounds=BLOCKS, warmup=0, turn_warmup=2,
                        per_turn=max(1, repeats // BLOCKS))
    return {name: statistics.median(ts) / 1e3 for name, ts in ms.items()}


def rows_of(p50: dict[str, float], tokens: int, **shape) -> list[dict]:
    base = p50["torch eager fp32"]
    return [{"backend": name, **shape, "p50_ms": round(t * 1e3, 3), "tokens_per_s": round(tokens / t, 1),
             "speedup_vs_eager": round(base / t, 2)} for name, t in p50.items()]


def bench_onnx(checkpoint: Path, batches: list[int], seqs: list[int], repeats: int, modes: list[str] | None = None,
               new_tokens: int = 64, log=lambda msg: None) -> dict:
    """Forward latency at every (batch, seq) (seq 1: a single-token call, seq 64: a scoring call), and
    greedy generation of `new_tokens` at every batch size by torch and by a fused KV-cache export (0: none)."""
    torch_engine = Engine.load(checkpoint, dtype="float32", device="cpu")
    cfg = torch_engine.cfg
    if modes is None:
        modes = [m for m in MODES if m != "vq-table" or cfg.router == "vq"]
    threads = torch.get_num_threads()
    engines: dict[str, Engine] = {"torch eager fp32": torch_engine}
    exports = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            log(f"exporting --mode {mode}")
            report = export_onnx(checkpoint, Path(tmp) / f"{mode}.onnx", mode)
            engines[f"onnxruntime {mode}"] = load_engine(report.output, "onnx", device="cpu", threads=threads)
            exports.append({"mode": mode, "file_mib": round(report.file_bytes / 2 ** 20, 2),
                            "max_abs_diff": report.outputs["logits"]["max_abs_diff"],
                            "fallbacks": len(report.fallbacks)})
        rows, gen = [], torch.Generator().manual_seed(0)
        for batch in batches:
            for seq in dict.fromkeys(min(s, cfg.max_seq_len) for s in seqs):
                ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
                mask = torch.ones_like(ids)
                log(f"timing forward, batch {batch} x {seq} tokens, {repeats} calls per backend")
                rows += rows_of(timed(engines, lambda e: e.forward(ids, mask), repeats), batch * seq,
                                batch=batch, seq=seq)
        generation = []
        if new_tokens and cfg.task == "lm":
            log("exporting --mode fused --kv-cache")
            kv = export_onnx(checkpoint, Path(tmp) / "fused-kv.onnx", "fused", kv_cache=True)
            decoders = {"torch eager fp32": torch_engine,
                        "onnxruntime fused, KV cache": load_engine(kv.output, "onnx", device="cpu", threads=threads)}
            for batch in batches:
                prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
                log(f"timing greedy generation, batch {batch}, {new_tokens} new tokens")
                p50 = timed(decoders, lambda e: e.generate(prompts, max_new_tokens=new_tokens),
                            max(BLOCKS, repeats // 5))
                generation += rows_of(p50, batch * new_tokens, batch=batch, new_tokens=new_tokens)
    return {"checkpoint": str(checkpoint), "router": cfg.router, "expert_act": cfg.expert_act,
            "params": sum(p.numel() for p in torch_engine.model.parameters()), "repeats": repeats,
            "machine": machine(), "exports": exports, "results": rows, "generation": generation}


PROMPTS = ["def main(", "import os\n", "class Node:", "x = ", "for i in range(", "return ", "# parse the", "with open("]


def markdown(report: dict) -> str:
    lines = ["| backend | batch x seq | p50 ms | tokens/s | speed-up vs eager |", "| --- | --- | ---: | ---: | ---: |"]
    for r in report["results"]:
        lines.append(f"| {r['backend']} | {r['batch']} x {r['seq']} | {r['p50_ms']} | {r['tokens_per_s']} | "
                     f"{r['speedup_vs_eager']} |")
    if report["generation"]:
        lines += ["", "| greedy generation | batch | new tokens | p50 ms | tokens/s | speed-up vs eager |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in report["generation"]:
            lines.append(f"| {r['backend']} | {r['batch']} | {r['new_tokens']} | {r['p50_ms']} | {r['tokens_per_s']} "
                         f"| {r['speedup_vs_eager']} |")
    lines += ["", "| export | file MiB | max abs diff (logits) | fallback layers |", "| --- | ---: | ---: | ---: |"]
    for e in report["exports"]:
        lines.append(f"| {e['mode']} | {e['file_mib']} | {e['max_abs_diff']:.2e} | {e['fallbacks']} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Tokens per second of each backend: forward calls by batch x sequence, and greedy generation by batch."""
    from moeserve.bench.plots import bars, pyplot, save

    panels = [("forward", report["results"], lambda r: f"{r['batch']}x{r['seq']}")]
    if report["generation"]:
        panels.append(("greedy generation", report["generation"], lambda r: f"batch {r['batch']}"))
    fig, axes = pyplot().subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    for ax, (title, rows, group_of) in zip(axes[0], panels):
        groups = list(dict.fromkeys(group_of(r) for r in rows))
        backends = list(dict.fromkeys(r["backend"] for r in rows))
        tps = {(group_of(r), r["backend"]): r["tokens_per_s"] for r in rows}
        bars(ax, groups, {b: [tps.get((g, b)) for g in groups] for b in backends}, "tokens/s", title, log=True)
    save(fig, path, f"moeserve bench onnx: {Path(report['checkpoint']).name} ({report['router']})")


def main(args) -> int:
    check_plot(args)
    checkpoint = args.checkpoint
    if checkpoint is None:
        from moeserve.training.default_model import default_model_path

        checkpoint = default_model_path(progress=not args.quiet)
    log = (lambda msg: None) if args.quiet else (lambda msg: print(f"moeserve bench onnx: {msg}", flush=True))
    report = bench_onnx(checkpoint, args.batches, args.seqs, args.repeats, args.modes, args.new_tokens, log=log)
    print(markdown(report))
    finish(report, args, "onnx")
    return 0
