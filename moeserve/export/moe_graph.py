"""One MoE layer as ONNX nodes, in the form an export mode asks for (runtime/moe.py is the math).

  portable  every expert on every token, weighted by a dense [T, E] gate matrix that is zero off the
            top-k: two GEMMs over all experts' stacked weights, standard operators only (TensorRT
            parses it). E/k times the expert FLOPs of a sparse kernel: the price of portability.
  fused     the router as a few nodes producing logits, then ONNX Runtime's com.microsoft MoE
            operator (softmax over all E, top-k, optional renormalisation, sparse experts).
  table     discrete VQ with vq_input='code': nearest code, then one row of the precomputed
            table T[k] = f_k(v_k) (paper 002, eq. 5); no expert matrices at all.

The MoE operator's facts that decide what it can express (docs/design.md "Export", checked against
onnxruntime's CPU kernel): gates are softmax(logits) over all E; its gelu is the tanh approximation;
its CPU kernel takes SwiGLU only fused and interleaved (gate row, up row, gate row, ...).

A quantized model's experts (runtime/quant.py) go to its QMoE operator instead, on their own bytes. QMoE's facts
(onnxruntime 1.32's schema, and contrib_ops/cpu/moe/moe_quantization_cpu.cc, checked by running it):
  - weights uint8 [E, N, K*bits/8] (weights_prepacked=0: this raw layout), row n of expert e holding its K inputs;
    int4 element 2i in byte i's low nibble, 2i + 1 in its high one; with no zero-point input the zero point is
    2^(bits-1): int4's u as it is, int8 as u = q + 128 (the bytes MatMulNBits reads);
  - scales of the activations' type (float32 here; int4's float16 ones widen exactly): [E, N] with no block_size
    (one per row: int8's per-channel), [E, N, K/block_size] with one (int4's groups; a power of two, 16 or more);
  - the CPU kernel dequantizes to float32 and runs an fp32 GEMM (weight-only), except block-wise 8-bit, which it
    runs on int8 activations at every accuracy_level: int8 goes per row, without block_size;
  - SwiGLU only fused and interleaved (swiglu_fusion=1), g * sigmoid(alpha g) * (u + beta), alpha 1 and beta 0
    written out; its gelu is the tanh approximation, as the MoE operator's;
  - routing: top-k of router_probs picks the experts; the gates are the optional router_weights input at those
    k (renormalised if normalize_routing_weights), else a softmax over the k picked values alone. The graph
    gives router_weights = softmax or sigmoid of the logits, so every softmax and sigmoid router is exact.
    A gate of 1e-8 or less is skipped (its expert adds under 1e-8 of its output).
Older onnxruntime versions (the package allows 1.23) lack router_weights or differ in these, so under 1.32 the
experts stay dequantized, as before, with that reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moeserve.config import MoEConfig
from moeserve.export.graph import FLOAT, MS_DOMAIN, Graph
from moeserve.runtime.experts import Experts
from moeserve.runtime.moe import MoELayer
from moeserve.runtime.quant import QuantExperts, QuantLinear, QuantSpec, unpack_int4, unpack_int6
from moeserve.runtime.routing import SigmoidRouter, SoftmaxRouter, XMoERouter


@dataclass
class LayerForm:
    """How one MoE layer was written, for the export report."""

    layer: int  # block index
    form: str  # portable | fused | table, or path+path for VQ's mixed layer (continuous+discrete)
    fallback: str | None = None  # why the mode's own form could not express it
    dequantized: str | None = None  # why quantized experts are written as float32 (None: QMoE runs their bytes)


def np32(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy()


# ---- quantized weights (runtime/quant.py) ----------------------------------------------------------
NBITS_BLOCK = 32  # MatMulNBits' block along K: int4's group where it is 32, and int8's per-row scale repeated


def float_weight(m: torch.nn.Module) -> np.ndarray:
    """A linear map's weight [out, in] as float32; a quantized one dequantized (the graph then holds it in float)."""
    return np32(m.dequantized(torch.float32)) if isinstance(m, QuantLinear) else np32(m.weight)


def expert_arrays(experts) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A layer's stacked w1, w2, w3 (None for gelu) as float32, quantized ones dequantized."""
    if isinstance(experts, QuantExperts):
        return tuple(None if w is None else np32(w) for w in (
            torch.stack([experts.weight(n, e, torch.float32) for e in range(experts.n_experts)])
            if n != "w3" or experts.has_w3 else None for n in ("w1", "w2", "w3")))
    return np32(experts.w1), np32(experts.w2), None if experts.w3 is None else np32(experts.w3)


# MatMulNBits' bits for each of our formats: its CPU kernel takes 2, 4 or 8 (onnxruntime 1.32's matmul_nbits.cc
# refuses others at session start, though the schema's text says 2 to 8), so int6 goes as 8 bits: u + 96 on the zero
# point 128 is (u - 32) exactly, the same float32 weight as ours, in 8 bits a weight rather than 6.5
ORT_BITS = {8: 8, 6: 8, 4: 4}
WIDENED_INT6 = ("int6 as MatMulNBits with bits=8 (ONNX Runtime's takes 2, 4 or 8): the same weights exactly, 8 bits "
                "a weight in the file")


def ort_bytes(q: torch.Tensor, spec: QuantSpec) -> np.ndarray:
    """A quantized weight (int8 q [..., N, K], int4 packed [..., N, K/2], int6 packed [..., N, 3K/4]) as ONNX
    Runtime's MatMulNBits and QMoE read it: uint8 [..., N, K*bits/8] (bits: ORT_BITS) on their default zero point
    2^(bits-1), elements 2i and 2i+1 of a 4-bit row in byte i's low and high nibbles. int4's (u - 8) * scale is then
    its u as it is, int8's q * scale is u = q + 128, int6's (u - 32) * scale is u + 96 on 8 bits."""
    if spec.bits == 8:
        return (q.to(torch.int16) + 128).to(torch.uint8).numpy()
    if spec.bits == 6:
        return (unpack_int6(q) + 96).numpy()  # [..., N, K] in 96..159
    u = unpack_int4(q)  # [..., N, K] in 0..15
    return (u[..., 0::2] | (u[..., 1::2] << 4)).numpy()


def nbits_arrays(m: QuantLinear) -> tuple[np.ndarray, np.ndarray, int]:
    """(B [N, K/32, 32*bits/8] uint8, scales [N, K/32] float32, bits) for ONNX Runtime's MatMulNBits (ort_bytes in
    blocks of 32); int8's per-row scale repeated per block, a group of 64 as 2 blocks of one scale."""
    N, K, bits = m.out_features, m.in_features, ORT_BITS[m.spec.bits]
    b = ort_bytes(m.qweight, m.spec).reshape(N, K // NBITS_BLOCK, NBITS_BLOCK * bits // 8)
    if m.spec.group is None:  # int8: one scale a row
        scales = m.scale.float()[:, None].expand(N, K // NBITS_BLOCK)
    else:
        scales = m.scale.float().repeat_interleave(m.spec.group // NBITS_BLOCK, dim=1)
    return b, np.ascontiguousarray(scales.numpy()), bits


NBITS_LINEARS = ("wq", "wk", "wv", "wo", "output")  # the maps the graph writes through linear() (attention, the head)


def as_nbits(m: torch.nn.Module, nbits: bool) -> bool:
    """Whether `linear` writes module m as MatMulNBits: a quantized map whose width is whole blocks, in a graph for
    ONNX Runtime."""
    return nbits and isinstance(m, QuantLinear) and m.in_features % NBITS_BLOCK == 0


def linear(g: Graph, x: str, m: torch.nn.Module, hint: str, nbits: bool = False) -> str:
    """x @ W^T (+ b) of a linear module (nn.Linear, the tied head, QuantLinear). A quantized one with `nbits` is ONNX
    Runtime's MatMulNBits on its own bytes (no float copy), else its weight dequantized into a float MatMul. A bias
    (Qwen2-MoE's q, k, v; gpt-oss's o) is an Add after it; a map with one is never quantized (Transformer.quantizable),
    so it is always the float MatMul's."""
    if as_nbits(m, nbits):
        b, scales, bits = nbits_arrays(m)
        y = g.op("MatMulNBits", x, g.weight(b, f"{hint}.qweight"), g.weight(scales, f"{hint}.scales"),
                 domain=MS_DOMAIN, K=m.in_features, N=m.out_features, bits=bits, block_size=NBITS_BLOCK, hint=hint)
    else:
        y = g.linear(x, float_weight(m), hint)
    bias = getattr(m, "bias", None)
    return y if bias is None else g.op("Add", y, g.weight(np32(bias), f"{hint}.bias"))


PORTABLE_WHY = "portable graphs hold standard operators only (TensorRT's parser's set)"


def dequantized(model: torch.nn.Module, forms: list[LayerForm], nbits: bool) -> dict[str, str]:
    """The quantized modules a graph holds as float32 weights, each with why: every one but the linear maps
    MatMulNBits runs and the experts QMoE runs (and the experts of a VQ table layer, which the graph does not hold)."""
    experts_why = {id(layer.experts): f.dequantized for layer, f in zip(model.moe_layers, forms)}
    why = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantExperts) and experts_why.get(id(m)):
            why[name] = experts_why[id(m)]
        elif isinstance(m, QuantLinear) and not nbits:
            why[name] = PORTABLE_WHY
        elif isinstance(m, QuantLinear) and not name.endswith(NBITS_LINEARS):
            why[name] = "the dense FFN is written as float MatMuls"
        elif isinstance(m, QuantLinear) and not as_nbits(m, nbits):
            why[name] = f"input width {m.in_features} is not whole blocks of {NBITS_BLOCK}"
    return why


def widened(model: torch.nn.Module, nbits: bool) -> dict[str, str]:
    """The quantized linear maps MatMulNBits runs at more bits than they are stored in (int6 as 8), each with why."""
    return {name: WIDENED_INT6 for name, m in model.named_modules()
            if isinstance(m, QuantLinear) and m.spec.bits == 6 and name.endswith(NBITS_LINEARS) and as_nbits(m, nbits)}


def qmoe_experts(model: torch.nn.Module, forms: list[LayerForm]) -> list[str]:
    """The quantized experts a graph runs as QMoE on their own bytes (the rest are in `dequantized`)."""
    written = {id(layer.experts) for layer, f in zip(model.moe_layers, forms)
               if f.dequantized is None and f.form != "table"}  # a table layer holds no experts
    return [name for name, m in model.named_modules() if isinstance(m, QuantExperts) and id(m) in written]


QMOE_ONNXRUNTIME = (1, 32)  # the onnxruntime whose QMoE (router_weights, the CPU kernel's formats) was checked


def onnxruntime_version() -> tuple[int, ...]:
    import onnxruntime

    return tuple(int(p) if p.isdigit() else 0 for p in onnxruntime.__version__.split(".")[:2])


def qmoe_fallback(experts: QuantExperts) -> str | None:
    """Why ONNX Runtime's QMoE cannot run these quantized experts on their own bytes; None when it can."""
    spec = experts.spec
    if onnxruntime_version() < QMOE_ONNXRUNTIME:
        import onnxruntime

        return (f"onnxruntime {onnxruntime.__version__}: QMoE export needs {'.'.join(map(str, QMOE_ONNXRUNTIME))} "
                f"or newer (its router_weights input and CPU kernel as checked)")
    if experts.act != "swiglu":
        return f"{experts.act} experts: QMoE's gelu is the tanh approximation, these experts use exact (erf) gelu"
    if spec.bits == 4 and spec.group & (spec.group - 1):
        return (f"int4 group {spec.group}: QMoE's block_size is a power of two; the experts go to the MoE operator "
                f"dequantized")
    return None


def as_qmoe(experts) -> bool:
    return isinstance(experts, QuantExperts) and qmoe_fallback(experts) is None


def dequantized_why(experts, path: str, fallback: str | None) -> str | None:
    """Why a layer's quantized experts are written as float32 weights; None where QMoE runs their own bytes (or the
    experts are float)."""
    if not isinstance(experts, QuantExperts):
        return None
    if path == "portable":
        return fallback or PORTABLE_WHY
    return qmoe_fallback(experts)


# ---- expert computations ---------------------------------------------------------------------------
def activation(g: Graph, h: str, act: str, d_split: int | None = None) -> str:
    """gelu (exact, erf) or SwiGLU on h = [gate | up] split at `d_split` columns."""
    if act == "gelu":
        half = g.op("Mul", h, g.const(0.5, np.float32))
        erf = g.op("Erf", g.op("Mul", h, g.const(1 / np.sqrt(2), np.float32)))
        return g.op("Mul", half, g.op("Add", erf, g.const(1.0, np.float32)))
    gate, up = g.op("Split", h, g.const([d_split, d_split]), axis=-1, outputs=2)
    return g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)


def dense_ffn(g: Graph, x: str, w1_FD: np.ndarray, w2_DF: np.ndarray, w3_FD: np.ndarray | None, hint: str) -> str:
    """The dense FFN of non-MoE blocks: w2(act(w1 x) [* w3 x])."""
    if w3_FD is None:
        return g.linear(activation(g, g.linear(x, w1_FD, f"{hint}.w1"), "gelu"), w2_DF, f"{hint}.w2")
    h = g.linear(x, np.concatenate([w1_FD, w3_FD]), f"{hint}.w13")
    return g.linear(activation(g, h, "swiglu", w1_FD.shape[0]), w2_DF, f"{hint}.w2")


def feed_forward(g: Graph, x: str, ffn: torch.nn.Module, hint: str) -> str:
    """A FeedForward module (a dense layer's FFN, a shared expert) as dense_ffn, quantized weights dequantized."""
    w3 = None if ffn.w3 is None else float_weight(ffn.w3)
    return dense_ffn(g, x, float_weight(ffn.w1), float_weight(ffn.w2), w3, hint)


def all_experts(g: Graph, x_TD: str, gates_TE: str, experts: Experts, hint: str) -> str:
    """y = sum_e G[t, e] f_e(x_t) = [G_1 h_1, ..., G_E h_E] @ [W2_1; ...; W2_E]: two GEMMs, no transposes."""
    w1, w2, w3 = expert_arrays(experts)
    E, F, D = w1.shape
    if w3 is None:
        h = activation(g, g.linear(x_TD, w1.reshape(E * F, D), f"{hint}.w1"), "gelu")
    else:
        w13 = np.concatenate([w1.reshape(E * F, D), w3.reshape(E * F, D)])
        h = activation(g, g.linear(x_TD, w13, f"{hint}.w13"), "swiglu", E * F)
    gated = g.op("Mul", g.reshape(h, [-1, E, F]), g.unsqueeze(gates_TE, [-1]))
    w2_all = w2.transpose(1, 0, 2).reshape(D, E * F)  # [D, E*F]: expert e's columns at e*F..
    return g.linear(g.reshape(gated, [-1, E * F]), w2_all, f"{hint}.w2")


def dense_gates(g: Graph, ids_TK: str, gates_TK: str, n_experts: int) -> str:
    """[T, E] matrix holding each token's K gates at its K experts, zeros elsewhere."""
    onehot_TKE = g.op("Cast", g.op("Equal", g.unsqueeze(ids_TK, [-1]), g.const(np.arange(n_experts))), to=FLOAT)
    return g.op("ReduceSum", g.op("Mul", onehot_TKE, g.unsqueeze(gates_TK, [-1])), g.const([1]), keepdims=0)


def interleaved(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """[E, 2F, ...] of two [E, F, ...]: row 2i = gate row i, row 2i + 1 = up row i (the operators' fused SwiGLU)."""
    out = np.empty((gate.shape[0], 2 * gate.shape[1], *gate.shape[2:]), gate.dtype)
    out[:, 0::2], out[:, 1::2] = gate, up
    return out


def moe_op(g: Graph, x_TD: str, logits_TE: str, experts: Experts, k: int, normalize: bool, hint: str) -> str:
    """ONNX Runtime's MoE operator: softmax(logits) over all E, top-k, gates renormalised if asked."""
    w1, w2, w3 = expert_arrays(experts)
    return g.op("MoE", x_TD, logits_TE, g.weight(interleaved(w1, w3), f"{hint}.fc1"), "", g.weight(w2, f"{hint}.fc2"),
                domain=MS_DOMAIN, k=k, activation_type="swiglu", swiglu_fusion=1,
                normalize_routing_weights=int(normalize), hint=hint)


def qmoe_op(g: Graph, x_TD: str, logits_TE: str, weights_TE: str | None, experts: QuantExperts, k: int,
            normalize: bool, hint: str) -> str:
    """ONNX Runtime's QMoE on the experts' own bytes: top-k of logits picks the experts, weights_TE at those k are
    the gates (renormalised if asked); with no weights, the gates are a softmax over the k picked logits."""
    spec = experts.spec

    def stacked(name: str) -> tuple[np.ndarray, np.ndarray]:  # bytes [E, N, K*bits/8], scales [E, N] or [E, N, K/G]
        return ort_bytes(getattr(experts, f"{name}_qweight"), spec), np32(getattr(experts, f"{name}_scale"))

    (b1, s1), (b3, s3), (b2, s2) = stacked("w1"), stacked("w3"), stacked("w2")
    blocks = {} if spec.bits == 8 else {"block_size": spec.group}  # int8 per row: block-wise 8-bit quantizes x
    router_weights = [] if weights_TE is None else [""] * 7 + [weights_TE]  # inputs 7-13: fc2 bias .. fc3 zero point
    return g.op("QMoE", x_TD, logits_TE, g.weight(interleaved(b1, b3), f"{hint}.fc1.qweight"),
                g.weight(interleaved(s1, s3), f"{hint}.fc1.scales"), "", g.weight(b2, f"{hint}.fc2.qweight"),
                g.weight(s2, f"{hint}.fc2.scales"), *router_weights, domain=MS_DOMAIN, k=k,
                expert_weight_bits=spec.bits, **blocks, weights_prepacked=0, activation_type="swiglu",
                swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0, normalize_routing_weights=int(normalize),
                hint=hint)


# ---- routers -----------------------------------------------------------------------------------------
@dataclass
class RouterGraph:
    logits: str  # [T, E]: for xmoe already divided by tau, so that the gates are softmax or sigmoid of it
    gate: str  # softmax | sigmoid
    top_k: int
    renormalize: bool


def router_graph(g: Graph, x_TD: str, router, hint: str) -> RouterGraph:
    """The router reduced to its logits: W_g h for softmax / sigmoid; for X-MoE (eq. 6-7) the projection,
    its normalisation, and one MatMul with the unit expert embeddings divided by tau (folded at export;
    top-k of s / tau is top-k of s since tau > 0)."""
    if isinstance(router, XMoERouter):
        h_TR = g.l2_normalize(g.linear(x_TD, np32(router.proj.weight), f"{hint}.proj"))
        tau = float(router.tau.detach().float().clamp(min=1e-3))
        e_ER = np32(torch.nn.functional.normalize(router.expert_embeddings.detach().float(), dim=-1)) / tau
        return RouterGraph(g.linear(h_TR, e_ER, f"{hint}.experts_over_tau"), router.gate_kind, router.top_k, False)
    logits = g.linear(x_TD, np32(router.gate.weight), f"{hint}.gate")
    if isinstance(router, SigmoidRouter):
        return RouterGraph(logits, "sigmoid", router.top_k, False)
    assert isinstance(router, SoftmaxRouter), type(router)
    return RouterGraph(logits, "softmax", router.top_k, router.renormalize)


def topk(g: Graph, x: str, k: int) -> tuple[str, str]:
    return g.op("TopK", x, g.const([k]), axis=-1, largest=1, sorted=1, outputs=2)


def portable_route(g: Graph, r: RouterGraph) -> tuple[str, str]:
    """(gates [T, K], expert ids [T, K]) exactly as routing.py computes them."""
    if r.gate == "sigmoid":
        top, ids = topk(g, r.logits, r.top_k)
        return g.op("Sigmoid", top), ids
    gates, ids = topk(g, g.op("Softmax", r.logits, axis=-1), r.top_k)
    if r.renormalize:
        gates = g.op("Div", gates, g.op("ReduceSum", gates, g.const([-1]), keepdims=1))
    return gates, ids


def fused_fallback(cfg: MoEConfig, r: RouterGraph | None, experts) -> str | None:
    """Why the MoE (or QMoE) operator cannot run this layer's experts exactly; None when it can. QMoE takes the
    gates as an input, so any sigmoid router is exact there."""
    if cfg.expert_act != "swiglu":
        return ("gelu experts: the MoE and QMoE operators' gelu is the tanh approximation, these experts use exact "
                "(erf) gelu")
    if r is not None and r.gate == "sigmoid" and r.top_k > 1 and not as_qmoe(experts):
        return (f"sigmoid gates with top_k={r.top_k}: each gate is sigmoid(s_k) on its own, the MoE operator's "
                f"gates are a softmax over all experts")
    return None


def fused_route(g: Graph, x_TD: str, r: RouterGraph, experts: Experts, hint: str) -> tuple[str, str]:
    """(y [T, D], expert ids [T, K]) through the MoE operator, or QMoE for quantized experts. A sigmoid gate with
    k = 1 is the MoE operator's renormalised (= 1) gate times sigmoid of the top logit, applied outside; QMoE is
    given the gates, softmax or sigmoid of every logit, as its router_weights."""
    _, ids = topk(g, r.logits, r.top_k)  # what the operator picks, for the expert-load output
    if as_qmoe(experts):
        gates = g.op("Softmax", r.logits, axis=-1) if r.gate == "softmax" else g.op("Sigmoid", r.logits)
        return qmoe_op(g, x_TD, r.logits, gates, experts, r.top_k, r.renormalize, hint), ids
    if r.gate == "sigmoid":
        y = moe_op(g, x_TD, r.logits, experts, 1, True, hint)
        top = g.op("ReduceMax", r.logits, axes=[-1], keepdims=1)
        return g.op("Mul", y, g.op("Sigmoid", top)), ids
    return moe_op(g, x_TD, r.logits, experts, r.top_k, r.renormalize, hint), ids


# ---- VQ ------------------------------------------------------------------------------------------------
def nearest_code(g: Graph, x_TD: str, layer: MoELayer, hint: str) -> tuple[str, str]:
    """(codes [T], distances [T, K]): argmin_j ||v_j||^2 - 2 z . v_j, as VectorQuantizer.nearest."""
    q = layer.quantizer
    z = x_TD if q.down is None else g.linear(x_TD, np32(q.down.weight), f"{hint}.down")
    if q.distance == "cosine":
        z = g.l2_normalize(z)
    v_KC = np32(q.vectors())
    zv = g.linear(z, v_KC, f"{hint}.codebook")
    dist = g.op("Sub", g.const((v_KC ** 2).sum(-1), np.float32), g.op("Mul", g.const(2.0, np.float32), zv))
    return g.op("ArgMin", dist, axis=-1, keepdims=0), dist


def code_vectors(layer: MoELayer) -> np.ndarray:
    """up(v_j) for every code j: [E, D], what the chosen expert sees as x~ (vq_input='code')."""
    q = layer.quantizer
    with torch.no_grad():
        v = q.vectors().float()
        return np32(q.up(v) if q.up is not None else v)


def discrete_path(g: Graph, x_TD: str, layer: MoELayer, form: str, hint: str) -> tuple[str, str]:
    """(f_{k(x)}(x~) [T, D], codes [T]) for VQ's discrete path, as `form`: table, fused or portable."""
    cfg = layer.cfg
    codes, dist = nearest_code(g, x_TD, layer, hint)
    if form == "table":
        return g.op("Gather", g.weight(np32(layer.table), f"{hint}.table"), codes, axis=0), codes
    v_ED = g.op("Gather", g.weight(code_vectors(layer), f"{hint}.code_vectors"), codes, axis=0)
    if cfg.vq_input == "code":
        x_tilde = v_ED
    else:
        c = cfg.vq_blend_rate
        x_tilde = g.op("Add", g.op("Mul", g.const(1 - 2 * c, np.float32), x_TD),
                       g.op("Mul", g.const(c, np.float32), v_ED))
    if form == "fused":  # nearest code = top-1 of -distance; the renormalised single gate is 1
        neg = g.op("Neg", dist)
        if as_qmoe(layer.experts):
            return qmoe_op(g, x_tilde, neg, None, layer.experts, 1, True, hint), codes
        return moe_op(g, x_tilde, neg, layer.experts, 1, True, hint), codes
    onehot = g.op("Cast", g.op("Equal", g.unsqueeze(codes, [-1]), g.const(np.arange(cfg.n_experts))), to=FLOAT)
    return all_experts(g, x_tilde, onehot, layer.experts, hint), codes


def shared_expert(g: Graph, x_TD: str, layer: MoELayer, hint: str) -> str:
    """Qwen2-MoE's shared expert f_s(x) [T, D], scaled by sigmoid(w_s . x) where it has a gate (MoELayer._shared): a
    dense FFN every token goes through, written as the dense layers' (float MatMuls, quantized weights dequantized)."""
    y = feed_forward(g, x_TD, layer.shared, f"{hint}.shared")
    if layer.shared_gate is None:
        return y
    return g.op("Mul", g.op("Sigmoid", g.linear(x_TD, np32(layer.shared_gate.weight), f"{hint}.shared_gate")), y)


def moe_layer(g: Graph, x_TD: str, layer: MoELayer, mode: str, block: int) -> tuple[str, str, LayerForm]:
    """(y [T, D], expert ids [T, K] as the engine counts them, how it was written): the routed experts in the form
    `mode` asks for (routed_experts), plus the shared expert where the layer has one, whatever that form."""
    y, ids, form = routed_experts(g, x_TD, layer, mode, block)
    if layer.shared is not None:
        y = g.op("Add", y, shared_expert(g, x_TD, layer, f"layers.{block}.moe"))
    return y, ids, form


def routed_experts(g: Graph, x_TD: str, layer: MoELayer, mode: str, block: int) -> tuple[str, str, LayerForm]:
    """moe_layer's routed part: (y [T, D], expert ids [T, K], how it was written)."""
    cfg, hint = layer.cfg, f"layers.{block}.moe"
    r = router_graph(g, x_TD, layer.router, f"{hint}.router") if layer.router is not None else None
    want_fused = mode in ("fused", "vq-table")
    fallback = fused_fallback(cfg, r, layer.experts) if want_fused else None
    path = "fused" if want_fused and fallback is None else "portable"
    why = dequantized_why(layer.experts, path, fallback)

    ids = y_cont = None
    if r is not None:
        if path == "fused":
            y_cont, ids = fused_route(g, x_TD, r, layer.experts, f"{hint}.experts")
        else:
            gates, ids = portable_route(g, r)
            y_cont = all_experts(g, x_TD, dense_gates(g, ids, gates, cfg.n_experts), layer.experts, f"{hint}.experts")
    if layer.quantizer is None:
        return y_cont, ids, LayerForm(block, path, fallback, why)

    table = mode == "vq-table" and cfg.vq_input == "code"
    d_form = "table" if table else path
    y_disc, codes = discrete_path(g, x_TD, layer, d_form, f"{hint}.discrete")
    if layer.mix is None:
        return y_disc, g.unsqueeze(codes, [-1]), LayerForm(block, d_form, *(None, None) if table else (fallback, why))
    g_c, g_d = g.op("Split", g.op("Softmax", g.linear(x_TD, np32(layer.mix.weight), f"{hint}.mix"), axis=-1),
                    g.const([1, 1]), axis=-1, outputs=2)
    y = g.op("Add", g.op("Mul", g_c, y_cont), g.op("Mul", g_d, y_disc))
    return y, ids, LayerForm(block, f"{path}+{d_form}", fallback, why)
