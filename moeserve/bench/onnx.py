"""`moeserve bench onnx`: forward latency of one checkpoint as the torch Engine in fp32 (the baseline)
and as each ONNX export of it on ONNX Runtime (portable, fused, and vq-table for VQ models), at batch
1 and 8, in one process, the backends taking turns in blocks so that drift hits every one alike.

What is timed is the call a server makes for scoring: ids [B, S] and a mask in, logits out, through
`Engine.forward` / `OnnxEngine.forward` (expert-load accounting included in both). Each export is
made fresh by `export_onnx`, parity check included, so the numbers are for graphs that passed it.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moeserve.bench.train import machine
from moeserve.export import MODES
from moeserve.export.onnx_export import export_onnx
from moeserve.runtime.engine import Engine
from moeserve.runtime.onnx_engine import OnnxEngine


# Backends take turns in blocks, not call by call: ONNX Runtime's and torch's thread pools both spin a while
# after each call, and on a small machine a pool still spinning slows the other's next call (measured: torch
# eager 2x slower when interleaved call by call). Three blocks each still spread slow drift over all of them.
BLOCKS = 3


def bench_onnx(checkpoint: Path, batches: list[int], seqs: list[int], repeats: int, modes: list[str] | None = None,
               log=lambda msg: None) -> dict:
    """Forward latency at every (batch, seq): seq 1 is a single-token call, seq 64 a scoring call."""
    torch_engine = Engine.load(checkpoint, dtype="float32", device="cpu")
    cfg = torch_engine.cfg
    if modes is None:
        modes = [m for m in MODES if m != "vq-table" or cfg.router == "vq"]
    shapes = [(b, min(s, cfg.max_seq_len)) for b in batches for s in seqs]
    engines: dict[str, Engine] = {"torch eager fp32": torch_engine}
    exports = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            log(f"exporting --mode {mode}")
            report = export_onnx(checkpoint, Path(tmp) / f"{mode}.onnx", mode)
            engines[f"onnxruntime {mode}"] = OnnxEngine.load(report.output, device="cpu",
                                                             threads=torch.get_num_threads())
            exports.append({"mode": mode, "file_mib": round(report.file_bytes / 2 ** 20, 2),
                            "max_abs_diff": report.outputs["logits"]["max_abs_diff"],
                            "fallbacks": len(report.fallbacks)})
        rows = []
        gen = torch.Generator().manual_seed(0)
        for batch, seq in shapes:
            ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
            mask = torch.ones_like(ids)
            times: dict[str, list[float]] = {name: [] for name in engines}
            log(f"timing batch {batch} x {seq} tokens, {repeats} calls per backend")
            for _ in range(BLOCKS):
                for name, engine in engines.items():
                    for _ in range(2):  # untimed: first-call allocations, and the other pool's threads going idle
                        engine.forward(ids, mask)
                    for _ in range(max(1, repeats // BLOCKS)):
                        t0 = time.perf_counter()
                        engine.forward(ids, mask)
                        times[name].append(time.perf_counter() - t0)
            base = statistics.median(times["torch eager fp32"])
            for name, ts in times.items():
                p50 = statistics.median(ts)
                rows.append({"backend": name, "batch": batch, "seq": seq, "p50_ms": round(p50 * 1e3, 3),
                             "tokens_per_s": round(batch * seq / p50, 1), "speedup_vs_eager": round(base / p50, 2)})
    return {"checkpoint": str(checkpoint), "router": cfg.router, "expert_act": cfg.expert_act,
            "params": sum(p.numel() for p in torch_engine.model.parameters()), "repeats": repeats,
            "machine": machine(), "exports": exports, "results": rows}


def markdown(report: dict) -> str:
    lines = ["| backend | batch x seq | p50 ms | tokens/s | speed-up vs eager |", "| --- | --- | ---: | ---: | ---: |"]
    for r in report["results"]:
        lines.append(f"| {r['backend']} | {r['batch']} x {r['seq']} | {r['p50_ms']} | {r['tokens_per_s']} | "
                     f"{r['speedup_vs_eager']} |")
    lines += ["", "| export | file MiB | max abs diff (logits) | fallback layers |", "| --- | ---: | ---: | ---: |"]
    for e in report["exports"]:
        lines.append(f"| {e['mode']} | {e['file_mib']} | {e['max_abs_diff']:.2e} | {e['fallbacks']} |")
    return "\n".join(lines)


def main(args) -> int:
    checkpoint = args.checkpoint
    if checkpoint is None:
        from moeserve.training.default_model import default_model_path

        checkpoint = default_model_path(progress=not args.quiet)
    log = (lambda msg: None) if args.quiet else (lambda msg: print(f"moeserve bench onnx: {msg}", flush=True))
    report = bench_onnx(checkpoint, args.batches, args.seqs, args.repeats, args.modes, log=log)
    print(markdown(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0
