"""ONNX export of quantized checkpoints (export/moe_graph.py's QMoE, MatMulNBits) run through real onnxruntime on
CPU: parity with the weight-only torch reference for every router and the families' additions, the QMoE node against
QuantExperts, the expert bytes read as stored, an int6 head as 8-bit MatMulNBits, and each fallback with its reason.
The models, cases and sessions are test_onnx_export.py's."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from moeserve.config import preset  # noqa: E402
from moeserve.export.moe_graph import PORTABLE_WHY  # noqa: E402
from moeserve.export.onnx_export import export_onnx  # noqa: E402
from moeserve.export.onnx_graph import build_graph  # noqa: E402
from moeserve.runtime.backends.plan import DispatchPlan  # noqa: E402
from moeserve.runtime.backends.eager import EagerBackend  # noqa: E402
from moeserve.runtime.engine import Engine  # noqa: E402
from moeserve.runtime.model import Transformer  # noqa: E402

from .test_onnx_export import (  # noqa: E402
    TOL, make_model, make_weights_matter, max_diff, n_moe, session_of, torch_cases, write_checkpoint,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def quantized(name: str, fmt: str, group: int | None = None) -> Transformer:
    from moeserve.runtime.quant import QuantSpec, quantize_model_

    model = make_model(name)
    quantize_model_(model, QuantSpec.parse(fmt, group))
    EagerBackend(model, DispatchPlan())  # VQ tables
    return model


def plain_engine(model: Transformer) -> Engine:
    """The weight-only reference export_onnx checks against: QuantExperts' and QuantLinear's own forwards (weights
    dequantized, activations not), on a copy."""
    return Engine(copy.deepcopy(model), plan=DispatchPlan())


def op_count(path_or_proto, op: str) -> int:
    proto = onnx.load(str(path_or_proto)) if isinstance(path_or_proto, Path) else path_or_proto
    return sum(n.op_type == op for n in proto.graph.node)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("name", ["softmax", "xmoe", "sigmoid-k2", "vq-mixed", "gqa-window-dense"])
def test_quantized_checkpoints_export_with_parity(tmp_path, name, fmt):
    """ONNX Runtime's graphs run the quantized linear maps as MatMulNBits and the experts as QMoE, both on their own
    bytes (no float copy of an expert anywhere in the graph); what has no such form (a dense FFN; everything in
    portable mode, which stays inside TensorRT's set) is written dequantized, and the report names it with why.
    Parity, checked by export_onnx running the graph in ONNX Runtime, is against the quantized torch model's
    weight-only forward: the same fp32 weights (QMoE dequantizes (u - zero) * scale as torch does, exactly), sums
    in another order, so the float tolerance (1e-4; measured <= 1.1e-5, most ~3e-6) holds as for float models.
    A sigmoid router with top_k 2 is fused here (QMoE takes the gates as an input), where float experts fall back."""
    model = quantized(name, fmt)
    cfg, L = model.cfg, model.cfg.n_layers
    ckpt = write_checkpoint(tmp_path / "ckpt", model)
    fused = export_onnx(ckpt, tmp_path / "fused.onnx", "fused")
    assert fused.passed and fused.outputs["logits"]["max_abs_diff"] <= TOL
    proto = onnx.load(str(tmp_path / "fused.onnx"))
    assert op_count(proto, "MatMulNBits") == 4 * L + 1  # q, k, v, o of every layer and the head
    per_layer = 2 if model.moe_layers[0].mix is not None else 1  # VQ's mixed layer: continuous and discrete paths
    assert (op_count(proto, "QMoE"), op_count(proto, "MoE")) == (per_layer * n_moe(cfg), 0)
    assert all(f["fallback"] is None and f["dequantized"] is None for f in fused.layers)
    for node in (n for n in proto.graph.node if n.op_type == "QMoE"):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["expert_weight_bits"] == int(fmt[3:]) and attrs["swiglu_fusion"] == 1
        assert attrs.get("block_size") == (None if fmt == "int8" else 32)  # int8 per row: block-wise would quantize x
    expert_size = cfg.n_experts * cfg.d_ff * cfg.d_model
    floats = [t.name for t in proto.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and
              int(np.prod(t.dims)) >= expert_size]
    assert floats == []
    dense = [f"layers.{b}.ffn.w{i}" for b in range(L) if b not in cfg.moe_layer_ids for i in (1, 2, 3)]
    moe = [f"layers.{b}.ffn.experts" for b in cfg.moe_layer_ids]
    assert fused.extra["qmoe"] == moe
    assert fused.extra["dequantized"] == {n: "the dense FFN is written as float MatMuls" for n in dense}
    assert "QMoE on their own bytes: " + ", ".join(moe) in fused.summary()
    if dense:
        assert "quantized weights written as float32 (the dense FFN" in fused.summary()
    portable = export_onnx(ckpt, tmp_path / "portable.onnx", "portable")
    assert portable.passed
    assert sum(op_count(tmp_path / "portable.onnx", op) for op in ("MatMulNBits", "QMoE", "MoE")) == 0
    assert portable.extra["qmoe"] == [] and len(portable.extra["dequantized"]) == 4 * L + len(dense) + len(moe) + 1
    assert set(portable.extra["dequantized"].values()) == {PORTABLE_WHY}


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("name", ["qwen3-like", "qwen2-like"])
def test_quantized_family_checkpoints_export_with_parity(tmp_path, name, fmt):
    """The family additions beside quantized weights, in ONNX Runtime's graph: a map with a bias stays float
    (Transformer.quantizable), so Qwen2-like q, k, v are float MatMuls + Add and only o and the head run as
    MatMulNBits; Qwen3-like's q, k, v, o (d_head 24: q 96 wide, whole blocks of 32) all do. The shared expert is
    written dequantized, as a dense FFN, and the report says so; the experts go to QMoE."""
    model = quantized(name, fmt)
    cfg, L = model.cfg, model.cfg.n_layers
    report = export_onnx(write_checkpoint(tmp_path / "ckpt", model), tmp_path / "fused.onnx", "fused")
    assert report.passed and report.outputs["logits"]["max_abs_diff"] <= TOL
    proto = onnx.load(str(tmp_path / "fused.onnx"))
    assert op_count(proto, "MatMulNBits") == (L + 1 if cfg.qkv_bias else 4 * L + 1)
    assert (op_count(proto, "QMoE"), op_count(proto, "MoE")) == (n_moe(cfg), 0)
    shared = [f"layers.{b}.ffn.shared.w{i}" for b in cfg.moe_layer_ids for i in (1, 2, 3)] if cfg.shared_d_ff else []
    assert set(shared) <= set(report.extra["dequantized"])
    assert all(report.extra["dequantized"][n] == "the dense FFN is written as float MatMuls" for n in shared)


@pytest.mark.parametrize(("fmt", "group"), [("int8", None), ("int4", 32), ("int4", 64)])
@pytest.mark.parametrize(("gate", "k", "renormalize"), [("softmax", 2, False), ("softmax", 2, True),
                                                         ("sigmoid", 2, False), ("softmax", 1, True)])
def test_qmoe_node_matches_quant_experts(fmt, group, gate, k, renormalize):
    """One QMoE node alone against QuantExperts' forward (the weight-only reference), its routing stubbed by the
    gates computed here from fixed logits: the byte layout, the interleaved SwiGLU rows, the scales' shape (per row
    for int8, per group for int4) and the router_weights gates. fp32 sums of 64 or 128 products in ONNX Runtime's
    order, outputs of magnitude ~1: measured <= 1e-6; 1e-5 leaves room and is far below a wrong nibble (~1e-2)."""
    from moeserve.export.graph import Graph
    from moeserve.export.moe_graph import qmoe_op
    from moeserve.runtime.experts import Experts
    from moeserve.runtime.quant import QuantExperts, QuantSpec

    E, D, F, T = 4, 64, 128, 23
    gen = torch.Generator().manual_seed(0)
    experts = Experts(E, D, F, "swiglu")
    with torch.no_grad():
        for w in (experts.w1, experts.w2, experts.w3):
            w.copy_(torch.randn(w.shape, generator=gen) * 0.1)
    q = QuantExperts.of(experts, QuantSpec.parse(fmt, group))
    x_TD, logits_TE = torch.randn(T, D, generator=gen), torch.randn(T, E, generator=gen)

    g = Graph("qmoe")
    x, logits = g.input("x", onnx.TensorProto.FLOAT, ["T", D]), g.input("logits", onnx.TensorProto.FLOAT, ["T", E])
    weights = g.op("Softmax", logits, axis=-1) if gate == "softmax" else g.op("Sigmoid", logits)
    g.output(qmoe_op(g, x, logits, weights, q, k, renormalize, "experts"), "y", onnx.TensorProto.FLOAT, ["T", D])
    got = session_of(g.model({})).run(None, {"x": x_TD.numpy(), "logits": logits_TE.numpy()})[0]

    ids_TK = logits_TE.topk(k, -1).indices
    gates_TK = (logits_TE.softmax(-1) if gate == "softmax" else logits_TE.sigmoid()).gather(-1, ids_TK)
    if renormalize:
        gates_TK = gates_TK / gates_TK.sum(-1, keepdim=True)
    with torch.no_grad():
        want = q(x_TD, ids_TK, gates_TK).numpy()
    assert np.abs(want).max() > 0.3
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_qmoe_graph_reads_the_expert_bytes():
    """The QMoE node is what the logits come from: one nibble of the most used expert's fc2 changed in the graph (not
    the torch model) puts it past tolerance."""
    model = quantized("softmax", "int4")
    engine = plain_engine(model)
    proto, _ = build_graph(model, "fused")
    cases = torch_cases(engine)[-2:]
    assert max_diff(session_of(proto), engine, cases) <= TOL
    top1 = np.bincount(np.concatenate([c.experts[-1][:, 0] for c in cases]))
    name = f"layers.{model.cfg.moe_layer_ids[-1]}.moe.experts.fc2.qweight"
    fc2 = next(t for t in proto.graph.initializer if t.name == name)
    b = onnx.numpy_helper.to_array(fc2).copy()  # [E, D, F/2]
    b[int(top1.argmax()), 0] ^= 0x0F  # output dim 0: the low nibbles of the first row, element 2i of each byte
    fc2.CopyFrom(onnx.numpy_helper.from_array(b, fc2.name))
    assert max_diff(session_of(proto), engine, cases) > 10 * TOL


def test_int4_group_not_a_power_of_two_falls_back_to_dequantized_experts(tmp_path):
    """QMoE's block_size is a power of two: int4 in groups of 96 keeps the MoE operator on dequantized experts, and the
    report says so (the linear maps still run as MatMulNBits, a group of 96 as 3 blocks of one scale)."""
    from moeserve.runtime.quant import QuantSpec, quantize_model_

    torch.manual_seed(0)
    model = make_weights_matter(Transformer(preset("tiny", d_model=96, d_ff=192)))
    quantize_model_(model, QuantSpec.parse("int4", 96))
    report = export_onnx(write_checkpoint(tmp_path / "ckpt", model), tmp_path / "m.onnx", "fused")
    assert report.passed and report.outputs["logits"]["max_abs_diff"] <= TOL
    L = model.cfg.n_layers
    counts = [op_count(tmp_path / "m.onnx", op) for op in ("QMoE", "MoE", "MatMulNBits")]
    assert counts == [0, n_moe(model.cfg), 4 * L + 1]
    assert report.extra["qmoe"] == []
    assert [(f["form"], f["fallback"]) for f in report.layers] == [("fused", None)] * n_moe(model.cfg)
    for b in model.cfg.moe_layer_ids:
        assert "power of two" in report.extra["dequantized"][f"layers.{b}.ffn.experts"]
        assert "power of two" in report.layers[model.cfg.moe_layer_ids.index(b)]["dequantized"]
    assert "group 96" in report.summary()


def test_an_int6_head_exports_as_8_bit_matmulnbits_with_parity(tmp_path):
    """A model 128 wide, so the int4 recipe's head is int6 (runtime/quant.py). ONNX Runtime's MatMulNBits takes 2, 4
    or 8 bits (1.32 refuses 6 at session start), so the head goes as bits=8: u + 96 on the default zero point 128 is
    int6's u - 32, the same float32 weight exactly; parity holds at the float tolerance and the report names it.
    Portable mode writes it dequantized, as every quantized weight."""
    import dataclasses

    from moeserve.export.moe_graph import WIDENED_INT6
    from moeserve.runtime.quant import QuantSpec, quantize_model_, unpack_int6

    torch.manual_seed(0)
    model = make_weights_matter(Transformer(dataclasses.replace(preset("tiny"), d_model=128, n_heads=4,
                                                                n_kv_heads=2)))
    quantize_model_(model, QuantSpec.parse("int4"))
    assert model.output.spec == QuantSpec(6, 32)
    ckpt = write_checkpoint(tmp_path / "ckpt", model)
    report = export_onnx(ckpt, tmp_path / "m.onnx", "fused")
    assert report.passed and report.outputs["logits"]["max_abs_diff"] <= TOL
    proto = onnx.load(str(tmp_path / "m.onnx"))
    assert op_count(proto, "MatMulNBits") == 4 * model.cfg.n_layers + 1
    head = next(n for n in proto.graph.node if n.op_type == "MatMulNBits" and n.input[1].startswith("output"))
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in head.attribute}
    assert attrs["bits"] == 8 and attrs["block_size"] == 32
    b = onnx.numpy_helper.to_array(next(t for t in proto.graph.initializer if t.name == head.input[1]))
    V, D = model.cfg.vocab_size, model.cfg.d_model
    assert b.shape == (V, D // 32, 32)
    assert np.array_equal(b.reshape(V, D), (unpack_int6(model.output.qweight) + 96).numpy())
    assert report.extra["widened"] == {"output": WIDENED_INT6} and "output" not in report.extra["dequantized"]
    assert f"output: {WIDENED_INT6}" in report.summary()
    portable = export_onnx(ckpt, tmp_path / "p.onnx", "portable")
    assert portable.passed and portable.extra["dequantized"]["output"] == PORTABLE_WHY
    assert portable.extra["widened"] == {}


def test_gelu_quantized_experts_stay_portable_with_a_reason():
    """QMoE's gelu is the tanh approximation, as the MoE operator's (run: ~3e-4 off exact gelu at these sizes): gelu
    experts stay portable and dequantized, the reason named."""
    from moeserve.export.moe_graph import dequantized

    model = quantized("gelu", "int8")
    proto, forms = build_graph(model, "fused")
    assert op_count(proto, "QMoE") == 0 and {f.form for f in forms} == {"portable"}
    why = dequantized(model, forms, True)
    assert all("gelu" in why[f"layers.{b}.ffn.experts"] for b in model.cfg.moe_layer_ids)
    engine = plain_engine(model)
    assert max_diff(session_of(proto), engine, torch_cases(engine)[-1:]) <= TOL


def test_older_onnxruntime_keeps_dequantized_experts(monkeypatch):
    """Under the onnxruntime QMoE was checked against (1.32), the experts stay dequantized on the MoE operator, as
    before, the version named."""
    model = quantized("softmax", "int4")
    monkeypatch.setattr(ort, "__version__", "1.23.1")
    proto, forms = build_graph(model, "fused")
    assert (op_count(proto, "QMoE"), op_count(proto, "MoE")) == (0, n_moe(model.cfg))
    assert all("onnxruntime 1.23.1" in f.dequantized for f in forms)
