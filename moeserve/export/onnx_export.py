"""`moeserve export onnx`: checkpoint -> ONNX graph -> parity check -> file and report.

The graph is written to a temporary file beside the destination and renamed over it only once its
parity with the torch model is inside tolerance, so a failed or interrupted export never leaves a
half-written or wrong model where the user asked for one. The report (`<out>.report.json`, and a
one-screen summary) is written either way: a failed parity check is exactly when one wants it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from moeserve.errors import UserError
from moeserve.export import MODES
from moeserve.files import atomic_write, publish, temporary_beside

# ONNX's protobuf cannot hold 2 GiB; past this the weights go to `<out>.data` beside the graph.
EXTERNAL_DATA_BYTES = 1 << 30


class ExportError(UserError):
    """An export that cannot be done as asked: mode, model, output path or missing package."""


class ParityError(ExportError):
    """The exported model differs from the torch model past tolerance; the CLI exits 1."""


def require_onnx():
    try:
        import onnx
        import onnxruntime
    except ImportError as e:
        raise ExportError(f"ONNX export needs the '{e.name}' package: pip install 'moeserve[export]'") from e
    return onnx, onnxruntime


def check_destination(out: str | os.PathLike) -> Path:
    """The output path, refused early (before minutes of work) when nothing can be written there."""
    out = Path(out)
    if out.is_dir():
        raise ExportError(f"--out {out} is a directory; give a file name such as {out / 'model.onnx'}")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise ExportError(f"--out {out}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ExportError(f"--out {out}: directory {parent} is not writable")
    return out


# The MoEConfig.extensions the graph does not write, each with why. The others (d_head, qkv_bias, o_bias, qk_norm,
# layer_windows, dense_d_ff, shared_d_ff, shared_gate) are standard operators in every mode (onnx_graph.py, moe_graph.py).
NOT_WRITTEN = {
    "attention_sinks": "a learned logit per head joining each softmax's denominator, which the graph's Softmax does "
                       "not take (a key of zeros whose mask entry is the sink would: not written yet)",
    "router_bias": "a bias on the router's logits, which the graph's routers (export/moe_graph.py router_graph) lack",
    "expert_bias": "biases in the experts' maps, which the MoE and QMoE operators as written here and the portable "
                   "experts lack",
    "clamped_swiglu": "the clamped SwiGLU of gpt-oss's experts, which the graph's SwiGLU (and the MoE operator's) "
                      "does not clamp",
}


def check_combination(cfg, mode: str) -> None:
    if mode not in MODES:
        raise ExportError(f"unknown export mode {mode!r}; expected one of: {', '.join(MODES)}")
    if mode == "vq-table" and cfg.router != "vq":
        raise ExportError(f"--mode vq-table folds VQ layers into tables; this model's router is {cfg.router!r} "
                          f"(use portable or fused)")
    if lacking := [n for n in cfg.extensions if n in NOT_WRITTEN]:
        raise ExportError(f"this model turns on {', '.join(lacking)} (a Hugging Face family's "
                          f"{cfg.extra.get('hf_model_type', 'architecture')}), which the ONNX graph "
                          f"(export/onnx_graph.py) does not write yet: "
                          f"{'; '.join(f'{n}: {NOT_WRITTEN[n]}' for n in lacking)}; serve it with moeserve's own "
                          f"backends")
    if cfg.capacity_factor is not None and not (cfg.router == "vq" and cfg.vq_mode == "discrete"):
        raise ExportError(f"capacity_factor={cfg.capacity_factor} (tokens dropped past each expert's capacity) has "
                          f"no ONNX form; export a dropless model (capacity_factor null), as serving runs anyway")


@dataclass
class ExportReport:
    checkpoint: str
    output: str
    mode: str
    kv_cache: bool
    passed: bool
    tolerance: float
    outputs: dict[str, dict]  # output name -> max_abs_diff, mean_abs_diff
    layers: list[dict]  # per MoE layer: block index, form, fallback reason, top-1 agreement
    shapes: list[list[int]]  # held-out (batch, seq) shapes compared
    tokens: int
    file_bytes: int
    opset: int
    onnx_version: str
    onnxruntime_version: str
    provider: str
    seconds: float
    extra: dict = field(default_factory=dict)

    @property
    def fallbacks(self) -> list[dict]:
        return [layer for layer in self.layers if layer["fallback"]]

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "fallbacks": self.fallbacks}, indent=2) + "\n"

    def summary(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        cache = " --kv-cache" if self.kv_cache else ""
        lines = [f"moeserve export onnx --mode {self.mode}{cache}: parity {verdict} (tolerance {self.tolerance:g} "
                 f"max abs)",
                 f"  {self.checkpoint} -> {self.output} ({self.file_bytes / 2 ** 20:.1f} MiB, opset {self.opset}, "
                 f"onnx {self.onnx_version}, onnxruntime {self.onnxruntime_version}, {self.provider}, "
                 f"{self.seconds:.1f} s)",
                 f"  held-out shapes (batch x seq): {', '.join(f'{b}x{s}' for b, s in self.shapes)}; "
                 f"{self.tokens} real tokens"]
        for name, d in self.outputs.items():
            lines.append(f"  {name:<19} max |diff| {d['max_abs_diff']:.2e}   mean |diff| {d['mean_abs_diff']:.2e}")
        lines.append("  layer  form               top-1 agreement")
        for layer in self.layers:
            lines.append(f"  {layer['layer']:>5}  {layer['form']:<18} {layer['top1_agreement']:.4f}")
        for layer in self.fallbacks:
            lines.append(f"  fallback, layer {layer['layer']}: {layer['fallback']}")
        if self.extra.get("qmoe"):
            lines.append("  quantized experts run by ONNX Runtime's QMoE on their own bytes: "
                         + ", ".join(self.extra["qmoe"]))
        for name, why in self.extra.get("widened", {}).items():
            lines.append(f"  {name}: {why}")
        by_reason: dict[str, list[str]] = {}
        for name, why in self.extra.get("dequantized", {}).items():
            by_reason.setdefault(why, []).append(name)
        for why, names in by_reason.items():
            lines.append(f"  quantized weights written as float32 ({why}): {', '.join(names)}")
        return "\n".join(lines)


def report_path(out: Path) -> Path:
    return out.with_name(out.name + ".report.json")


def export_onnx(checkpoint: str | os.PathLike, out: str | os.PathLike, mode: str = "portable", *,
                kv_cache: bool = False, log: Callable[[str], None] = lambda msg: None) -> ExportReport:
    """Export `checkpoint` to `out` in `mode` (with KV-cache inputs and outputs if `kv_cache`); returns the
    report. Raises ExportError when the export cannot be made, or when its parity is past tolerance (the
    model file is then not written)."""
    onnx, ort = require_onnx()
    import torch

    from moeserve.export.graph import OPSET
    from moeserve.export.moe_graph import dequantized, qmoe_experts, widened
    from moeserve.export.onnx_graph import build_graph
    from moeserve.export.parity import TOLERANCE, check
    from moeserve.runtime.backends.plan import DispatchPlan
    from moeserve.runtime.backends.eager import EagerBackend
    from moeserve.runtime.engine import Engine
    from moeserve.runtime.loading import load_model

    if mode not in MODES:
        raise ExportError(f"unknown export mode {mode!r}; expected one of: {', '.join(MODES)}")
    out = check_destination(out)
    start = time.perf_counter()
    model, ckpt = load_model(checkpoint)
    cfg = model.cfg
    check_combination(cfg, mode)
    if kv_cache and cfg.task != "lm":
        raise ExportError(f"--kv-cache is for language models; this model's task is {cfg.task!r}")
    model = model.float()
    plain = DispatchPlan()  # plain weights: the graph reads them, and the parity reference runs them
    EagerBackend(model, plain)  # builds VQ tables
    metadata = {"moeserve.checkpoint": str(ckpt.path)}
    if (ckpt.path / "tokenizer.json").is_file() and cfg.tokenizer == "hf":
        metadata["moeserve.tokenizer_json"] = (ckpt.path / "tokenizer.json").read_text(encoding="utf-8")
    log(f"building the {mode} graph of {ckpt.path}")
    with torch.no_grad():
        proto, forms = build_graph(model, mode, metadata, kv_cache=kv_cache)

    tmp = temporary_beside(out)
    data = out.with_name(out.name + ".data")
    external = proto.ByteSize() > EXTERNAL_DATA_BYTES
    try:
        onnx.save_model(proto, tmp, save_as_external_data=external, location=data.name if external else None)
        log("checking parity with the torch model on held-out inputs")
        session = ort.InferenceSession(str(tmp), providers=["CPUExecutionProvider"])
        parity = check(session, Engine(model, name=ckpt.path.name, plan=plain))
        del session
        tol = TOLERANCE["float32"]
        passed = all(d.max_abs <= tol for d in parity.outputs.values())
        layers = [{**f.__dict__, "top1_agreement": a} for f, a in zip(forms, parity.top1_agreement())]
        report = ExportReport(
            checkpoint=str(ckpt.path), output=str(out), mode=mode, kv_cache=kv_cache, passed=passed, tolerance=tol,
            outputs={k: d.as_dict() for k, d in parity.outputs.items()}, layers=layers,
            shapes=[list(s) for s in parity.shapes], tokens=parity.tokens,
            file_bytes=tmp.stat().st_size + (data.stat().st_size if external else 0), opset=OPSET,
            onnx_version=onnx.__version__, onnxruntime_version=ort.__version__, provider="CPUExecutionProvider",
            seconds=time.perf_counter() - start)
        if cfg.quantization is not None:
            report.extra["qmoe"] = qmoe_experts(model, forms)
            report.extra["dequantized"] = dequantized(model, forms, mode != "portable")
            report.extra["widened"] = widened(model, mode != "portable")
        if passed:
            publish(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
            if external and data.exists():
                data.unlink()
    atomic_write(report_path(out), report.to_json())
    if not passed:
        worst = max(report.outputs.items(), key=lambda kv: kv[1]["max_abs_diff"])
        raise ParityError(f"parity past tolerance: {worst[0]} differs from the torch model by up to "
                          f"{worst[1]['max_abs_diff']:.3g} (> {report.tolerance:g}); {out} not written, see "
                          f"{report_path(out)}\n{report.summary()}")
    return report
