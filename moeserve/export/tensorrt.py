"""`moeserve export tensorrt`: portable ONNX graph -> TensorRT engine -> parity with ONNX Runtime -> file and report.

The engine is built from the graph `export_onnx(mode="portable")` wrote, not from the checkpoint: that
graph already passed parity with the torch model, so this step only has to show that TensorRT computes
the same graph, and ONNX Runtime on the same file (CPU provider) is the reference. The graph is
checked first against TensorRT's ONNX parser's operator list (tensorrt_onnx_ops.json), so a fused
graph (com.microsoft.MoE) is refused in a second with the operators named, not after a parser error.

TensorRT is optional and needs a CUDA GPU: every `import tensorrt` is inside a function, and
`tensorrt_missing()` says what is missing before any work starts. Engines are specific to the GPU
and the TensorRT version that built them, hence `tensorrt_version` in the report.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from functools import cache
from pathlib import Path
from typing import Callable

from moeserve.export.onnx_export import ExportError, check_destination, export_onnx, report_path, require_onnx
from moeserve.files import atomic_write

TENSORRT_PRECISIONS = ("fp32", "fp16", "bf16")
PARITY_DTYPE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # keys of parity.TOLERANCE
INPUTS = ("input_ids", "attention_mask")
OPS_FILE = Path(__file__).with_name("tensorrt_onnx_ops.json")


@cache
def _supported() -> frozenset[str]:
    return frozenset(json.loads(OPS_FILE.read_text(encoding="utf-8"))["supported"])


def supported_ops() -> set[str]:
    """Operators (default ONNX domain) that TensorRT's ONNX parser supports, from the json beside this file
    (read once; each caller gets its own copy)."""
    return set(_supported())


def _op_types(graph) -> set[str]:
    """Op types of `graph` and of any subgraphs (If/Loop bodies), a custom domain written as a prefix."""
    ops = set()
    for node in graph.node:
        ops.add(node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}")
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                ops |= _op_types(sub)
    return ops


def unsupported_ops(model) -> list[str]:
    """Sorted op types of `model` (an onnx.ModelProto) that TensorRT's parser would refuse; any node of
    another domain counts, named with its domain (com.microsoft.MoE)."""
    return sorted(_op_types(model.graph) - _supported())


def tensorrt_missing() -> str | None:
    """None when a CUDA GPU and the tensorrt package are both here; otherwise what is missing, in words."""
    import torch

    missing = []
    if not torch.cuda.is_available():
        missing.append("no CUDA GPU (torch.cuda.is_available() is False)")
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        missing.append("the 'tensorrt' package is not installed (pip install tensorrt)")
    except OSError as e:  # installed, but its shared libraries (libnvinfer) do not load
        missing.append(f"the 'tensorrt' package does not load: {e}")
    return "; ".join(missing) or None


def _torch_dtype(trt_dtype):
    """The torch dtype of a TensorRT I/O tensor (by name: trt.nptype has no bfloat16)."""
    import torch

    names = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT64": torch.int64,
             "INT32": torch.int32, "INT8": torch.int8, "UINT8": torch.uint8, "BOOL": torch.bool}
    if trt_dtype.name not in names:
        raise ExportError(f"engine I/O tensor of type {trt_dtype.name} has no torch dtype here")
    return names[trt_dtype.name]


def _run_engine(engine, context, feeds: dict) -> dict:
    """One call of `engine` on numpy `feeds`, torch CUDA tensors as the I/O buffers; numpy outputs back."""
    import tensorrt as trt
    import torch

    buffers = {}
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    for name in names:  # every input shape first: output shapes are only known once all are set
        if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
            dtype = _torch_dtype(engine.get_tensor_dtype(name))
            buffers[name] = torch.from_numpy(feeds[name]).to("cuda", dtype).contiguous()
            if not context.set_input_shape(name, tuple(buffers[name].shape)):
                raise ExportError(f"TensorRT refused input {name} of shape {tuple(buffers[name].shape)}")
    for name in names:
        if name not in buffers:
            shape = tuple(context.get_tensor_shape(name))
            buffers[name] = torch.empty(shape, dtype=_torch_dtype(engine.get_tensor_dtype(name)), device="cuda")
        context.set_tensor_address(name, buffers[name].data_ptr())
    stream = torch.cuda.current_stream()
    if not context.execute_async_v3(stream.cuda_stream):
        raise ExportError("TensorRT execute_async_v3 failed; see its log above")
    stream.synchronize()
    return {name: t.float().cpu().numpy() for name, t in buffers.items() if name not in feeds}


def build_engine(onnx_path: str | os.PathLike, out: str | os.PathLike, precision: str = "fp16", max_batch: int = 8,
                 max_seq: int | None = None, opt_batch: int = 1, opt_seq: int | None = None,
                 log: Callable[[str], None] = print) -> dict:
    """Build a TensorRT engine of the portable graph at `onnx_path` into `out`, check it against ONNX
    Runtime on held-out inputs, and return the report (also written to `<out>.report.json`).

    One optimization profile covers both inputs: min (1, 1), opt (opt_batch, opt_seq), max (max_batch,
    max_seq). max_seq defaults to the model's max_seq_len (the RoPE table has no rows past it) and
    opt_seq to max_seq: the graph has no KV cache, so every call runs whole sequences. Raises
    ExportError when TensorRT or a GPU is missing, the graph has operators TensorRT cannot parse, the
    build fails, or parity is past `parity.TOLERANCE` for `precision` (the engine is then not written)."""
    if precision not in TENSORRT_PRECISIONS:
        raise ExportError(f"unknown precision {precision!r}; expected one of: {', '.join(TENSORRT_PRECISIONS)}")
    onnx, ort = require_onnx()
    from moeserve.export.parity import TOLERANCE, Diff, held_out_inputs, held_out_shapes

    start = time.perf_counter()
    onnx_path, out = Path(onnx_path), check_destination(out)
    if not onnx_path.is_file():
        raise ExportError(f"ONNX graph {onnx_path} does not exist; write one with `moeserve export onnx`")
    model = onnx.load(str(onnx_path), load_external_data=False)  # ops and metadata only
    if bad := unsupported_ops(model):
        raise ExportError(f"{onnx_path} holds operators TensorRT's ONNX parser does not support: {', '.join(bad)} "
                          f"(export with --mode portable for TensorRT)")
    meta = {p.key: p.value for p in model.metadata_props}
    del model
    if meta.get("moeserve.kv_cache") == "true":
        raise ExportError(f"{onnx_path} is a KV-cache graph; TensorRT engines are built from the forward graph "
                          f"(export without --kv-cache)")
    cfg = json.loads(meta["moeserve.config"]) if "moeserve.config" in meta else None
    if max_seq is None:
        if cfg is None:
            raise ExportError(f"{onnx_path} has no moeserve.config metadata to read max_seq_len from; give max_seq")
        max_seq = cfg["max_seq_len"]
    if cfg is not None and max_seq > cfg["max_seq_len"]:
        raise ExportError(f"max_seq={max_seq} is past the model's max_seq_len={cfg['max_seq_len']}")
    opt_seq = max_seq if opt_seq is None else opt_seq
    if not (1 <= opt_batch <= max_batch and 1 <= opt_seq <= max_seq):
        raise ExportError(f"the profile needs 1 <= opt <= max: opt ({opt_batch}, {opt_seq}), max ({max_batch}, "
                          f"{max_seq})")
    profile_shapes = {"min": [1, 1], "opt": [opt_batch, opt_seq], "max": [max_batch, max_seq]}
    # the graph and the arguments are checked first, so those mistakes show on a machine without a GPU too
    if (missing := tensorrt_missing()) is not None:
        raise ExportError(f"TensorRT export needs a CUDA GPU and the tensorrt package: {missing}")
    import tensorrt as trt

    log(f"building a TensorRT {trt.__version__} {precision} engine of {onnx_path}, profile {profile_shapes}")
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # a path, so external weights (<name>.data) are found
        errors = "\n  ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ExportError(f"TensorRT's ONNX parser refused {onnx_path}:\n  {errors}")
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for name in INPUTS:
        profile.set_shape(name, *(tuple(s) for s in profile_shapes.values()))
    config.add_optimization_profile(profile)
    if precision != "fp32":  # weak typing: TensorRT picks fp16/bf16 kernels where it may (gone in TensorRT 11)
        flag = getattr(trt.BuilderFlag, precision.upper(), None)
        if flag is None:
            raise ExportError(f"TensorRT {trt.__version__} has no BuilderFlag.{precision.upper()} (removed in "
                              f"TensorRT 11 with weakly typed builds); build {precision} with tensorrt 10.x")
        config.set_flag(flag)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ExportError(f"TensorRT could not build a {precision} engine of {onnx_path}; see its log above")
    blob = bytes(memoryview(serialized))

    log("checking parity with ONNX Runtime (CPU) on held-out inputs")
    engine = trt.Runtime(logger).deserialize_cuda_engine(blob)
    context = engine.create_execution_context()
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    vocab = cfg["vocab_size"] if cfg is not None else 2  # token ids past a real vocabulary would fail the Gather
    classify = cfg is not None and cfg.get("task") == "classify"
    shapes = list(dict.fromkeys((min(b, max_batch), s) for b, s in held_out_shapes(max_seq)))
    diffs: dict[str, Diff] = {}
    for i, (batch, seq) in enumerate(shapes):
        ids, mask = held_out_inputs(batch, seq, vocab, seed=i)
        feeds = {"input_ids": ids, "attention_mask": mask}
        ref = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        got = _run_engine(engine, context, feeds)
        real = mask.astype(bool)
        for name in ("logits", "probs"):
            if name in ref:  # LM logits at real positions only; a classifier's, every row
                a, b = (got[name], ref[name]) if classify else (got[name][real], ref[name][real])
                diffs.setdefault(name, Diff()).add(a, b)
    del context, engine, session

    tol = TOLERANCE[PARITY_DTYPE[precision]]
    passed = all(d.max_abs <= tol for d in diffs.values())
    report = {"engine": str(out), "onnx": str(onnx_path), "precision": precision, "profile": profile_shapes,
              "tensorrt_version": trt.__version__, "outputs": {k: d.as_dict() for k, d in diffs.items()},
              "tolerance": tol, "passed": passed, "shapes": [list(s) for s in shapes], "file_bytes": len(blob),
              "seconds": time.perf_counter() - start}
    if passed:  # a temporary file renamed over `out`: never a half-written engine where one was asked for
        atomic_write(out, blob)
    atomic_write(report_path(out), json.dumps(report, indent=2) + "\n")
    if not passed:
        name, worst = max(report["outputs"].items(), key=lambda kv: kv[1]["max_abs_diff"])
        raise ExportError(f"TensorRT {precision} parity past tolerance: {name} differs from ONNX Runtime by up to "
                          f"{worst['max_abs_diff']:.3g} (> {tol:g}); {out} not written, see {report_path(out)}")
    log(f"wrote {out} ({len(blob) / 2 ** 20:.1f} MiB); {precision} parity within {tol:g}: "
        + ", ".join(f"{k} max |diff| {d['max_abs_diff']:.2e}" for k, d in report["outputs"].items()))
    return report


def export_tensorrt(model: str | os.PathLike, out: str | os.PathLike, precision: str = "fp16", *, max_batch: int = 8,
                    max_seq: int | None = None, log: Callable[[str], None] = print) -> dict:
    """`moeserve export tensorrt`: a portable .onnx export is built as it is; a checkpoint directory is
    first exported to a portable graph (parity-checked against torch) in a temporary directory."""
    if (missing := tensorrt_missing()) is not None:  # before a checkpoint's export, not after it
        raise ExportError(f"TensorRT export needs a CUDA GPU and the tensorrt package: {missing}")
    model = Path(model)
    if model.suffix == ".onnx":
        return build_engine(model, out, precision, max_batch, max_seq, log=log)
    check_destination(out)
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = Path(tmp) / "portable.onnx"
        export_onnx(model, onnx_path, "portable", log=log)
        report = build_engine(onnx_path, out, precision, max_batch, max_seq, log=log)
    report["onnx"] = f"portable export of {model}"
    atomic_write(report_path(Path(out)), json.dumps(report, indent=2) + "\n")
    return report

