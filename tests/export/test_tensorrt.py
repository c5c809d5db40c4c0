"""TensorRT backend: the parser's operator list as data, the refusal of graphs it cannot parse, the message
when a GPU or TensorRT is missing, and (on a machine with both) fp32/fp16 engines within tolerance of ONNX
Runtime."""

import json

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from moeserve.checkpoint import save_checkpoint
from moeserve.config import ROUTERS, preset
from moeserve.export.onnx_export import ExportError, export_onnx
from moeserve.export.onnx_graph import build_graph
from moeserve.export.tensorrt import (OPS_FILE, TENSORRT_PRECISIONS, build_engine, supported_ops, tensorrt_missing,
                                      unsupported_ops)
from moeserve.runtime.backends.plan import DispatchPlan
from moeserve.runtime.model import Transformer
from moeserve.runtime.backends.eager import EagerBackend

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_graph(router: str, mode: str) -> onnx.ModelProto:
    torch.manual_seed(0)
    model = Transformer(preset("tiny", router=router)).float()
    EagerBackend(model, DispatchPlan())
    with torch.no_grad():
        return build_graph(model, mode)[0]


def hand_graph(*nodes: onnx.NodeProto) -> onnx.ModelProto:
    """A graph of `nodes` over float inputs a, b; only its op types matter here."""
    x = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2]) for n in ("a", "b")]
    y = helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, None)
    return helper.make_model(helper.make_graph(list(nodes), "g", x, [y]))


def test_operator_list_is_the_parsers_support_matrix():
    data = json.loads(OPS_FILE.read_text(encoding="utf-8"))
    assert data["source"].startswith("https://github.com/onnx/onnx-tensorrt/blob/96e78110")  # 10.1 GA
    assert data["tensorrt_version"] == "10.1" and data["max_opset"] == 20 and data["retrieved"]
    assert data["supported"] == sorted(set(data["supported"])) and len(data["supported"]) == 150
    assert list(data["types"]) == data["supported"] and data["types"]["MatMul"] == ["FP32", "FP16", "BF16"]
    ops = supported_ops()
    assert {"MatMul", "Softmax", "TopK", "Gather", "Reshape", "Transpose", "Where", "Erf", "OneHot",
            "ReduceMean", "Range", "Split", "LayerNormalization", "IsInf"} <= ops  # the last two new since 8.5
    assert not ops & {"Unique", "SequenceAt", "MatMulInteger", "DFT"}  # N in 10.1
    assert set(data["restrictions"]) <= ops and "less than 3840" in data["restrictions"]["TopK"]  # K: 1..8 here
    ops.add("Unique")  # a copy: the cached list is untouched
    assert "Unique" not in supported_ops()


def test_unsupported_ops_names_custom_domains_and_unlisted_ops():
    ok = hand_graph(helper.make_node("MatMul", ["a", "b"], ["c"]), helper.make_node("Add", ["c", "a"], ["d"]))
    assert unsupported_ops(ok) == []
    bad = hand_graph(helper.make_node("MatMul", ["a", "b"], ["c"]),
                     helper.make_node("MoE", ["c", "a", "b"], ["d"], domain="com.microsoft"),
                     helper.make_node("Unique", ["d"], ["e"]))
    assert unsupported_ops(bad) == ["Unique", "com.microsoft.MoE"]


@pytest.mark.parametrize("router", ROUTERS)
def test_portable_graph_stays_inside_tensorrts_operators(router):
    graph = tiny_graph(router, "portable")
    assert unsupported_ops(graph) == []
    types = json.loads(OPS_FILE.read_text(encoding="utf-8"))["types"]
    # a bf16 engine: every operator takes BF16, but the logical ones, which take BOOL only
    assert {op for op in {n.op_type for n in graph.graph.node} if "BF16" not in types[op]} <= {"And", "Or", "Not"}


def test_fused_graph_is_refused_before_any_tensorrt_work(tmp_path):
    fused = tiny_graph("xmoe", "fused")
    assert unsupported_ops(fused) == ["com.microsoft.MoE"]
    onnx.save_model(fused, tmp_path / "fused.onnx")
    with pytest.raises(ExportError, match=r"com\.microsoft\.MoE.*--mode portable"):
        build_engine(tmp_path / "fused.onnx", tmp_path / "m.engine", precision="fp32", log=lambda msg: None)
    assert not (tmp_path / "m.engine").exists()


def test_bad_arguments_are_refused(tmp_path):
    onnx.save_model(tiny_graph("softmax", "portable"), tmp_path / "m.onnx")
    with pytest.raises(ExportError, match="unknown precision 'int8'"):
        build_engine(tmp_path / "m.onnx", tmp_path / "m.engine", precision="int8")
    with pytest.raises(ExportError, match="max_seq=65 is past the model's max_seq_len=64"):
        build_engine(tmp_path / "m.onnx", tmp_path / "m.engine", max_seq=65, log=lambda msg: None)
    with pytest.raises(ExportError, match="1 <= opt <= max"):
        build_engine(tmp_path / "m.onnx", tmp_path / "m.engine", opt_batch=9, max_batch=8, log=lambda msg: None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given on a machine without a CUDA GPU")
def test_missing_gpu_is_named(tmp_path):
    missing = tensorrt_missing()
    assert missing is not None and "no CUDA GPU (torch.cuda.is_available() is False)" in missing
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        assert "the 'tensorrt' package is not installed (pip install tensorrt)" in missing
    onnx.save_model(tiny_graph("softmax", "portable"), tmp_path / "m.onnx")
    with pytest.raises(ExportError, match=r"no CUDA GPU \(torch\.cuda\.is_available\(\) is False\)"):
        build_engine(tmp_path / "m.onnx", tmp_path / "m.engine", log=lambda msg: None)
    assert not (tmp_path / "m.engine").exists()


@pytest.mark.cuda
@pytest.mark.skipif(tensorrt_missing() is not None, reason=f"TensorRT engine build: {tensorrt_missing()}")
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_engine_matches_onnxruntime(tmp_path, precision):
    assert precision in TENSORRT_PRECISIONS
    torch.manual_seed(0)
    model = Transformer(preset("tiny", router="xmoe"))
    save_checkpoint(tmp_path / "tiny", model.cfg, model.state_dict())
    export_onnx(tmp_path / "tiny", tmp_path / "m.onnx", mode="portable")
    out = tmp_path / f"m.{precision}.engine"
    report = build_engine(tmp_path / "m.onnx", out, precision=precision, max_batch=4, log=lambda msg: None)
    assert report["passed"] and report["outputs"]["logits"]["max_abs_diff"] <= report["tolerance"]
    assert report["profile"] == {"min": [1, 1], "opt": [1, 64], "max": [4, 64]}
    assert out.stat().st_size == report["file_bytes"] > 0
    assert json.loads((tmp_path / f"{out.name}.report.json").read_text()) == report
