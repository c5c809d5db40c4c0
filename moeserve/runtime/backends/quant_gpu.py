"""Quantized weights on torch's own quantized kernels (issue 39): the GPU layouts of int8, int4 and fp8.

Shape legend: T tokens, D model dim, F expert hidden dim, K experts per token; a linear map is x [M, I] -> [M, O].

The reference (quant.QuantLinear's forward) dequantizes the whole weight at every call, then runs torch's GEMM. These
forms run the formats on the ops torch ships (aten's native_functions.yaml, torch 2.13):

  int8  Int8PackLinear   torch._weight_int8pack_mm (kernels for CPU and CUDA). Its CUDA kernel (cuda/int8mm.cu) is
                         one thread per output element in a float32 loop, x cast to float32 and the output back:
                         it reads each int8 weight once, which is what decode's few rows need, but it runs no tensor
                         core, so past INT8PACK_MAX_ROWS rows the reference's dequantize-then-GEMM runs instead.
                         Arithmetic: sum_i x[m, i] * q[o, i] in float32, times scale[o], rounded once to x's dtype.
  int4  Int4PackLinear   tinygemm, torch._weight_int4pack_mm (CUDA, compute capability 8.0+, bfloat16 rows only; on
                         a CPU its twin _weight_int4pack_mm_for_cpu). Converted once at load: our nibbles to its
                         tensor-core tiles (_convert_weight_to_int4pack) and our float16 scales to its
                         scales_and_zeros [I/G, O, 2] in bfloat16 with zero 0, since tinygemm computes
                         (u - 8) * scale + zero, our formula with zero 0. Not bit-equal to the reference: tinygemm's
                         scales are bfloat16, so each group's float16 scale is rounded to 8 bits of mantissa (relative
                         error at most 2^-8), and its dequantized weight is rounded to bfloat16 as the reference's is.
                         Groups of 32, 64, 128 or 256; out widths a multiple of 8. Every row count (tinygemm runs
                         tensor cores; with many rows cuBLAS on a dequantized weight may be faster: not measured yet).
  int6  DequantizedLinear  torch has no 6-bit kernel (no int6 op in native_functions.yaml), so an int6 weight (an
                         int4 model's LM head by default, quant.py) is dequantized once at lay-out to the model's
                         dtype and runs torch's GEMM: the reference's arithmetic, bit for bit, without dequantizing at
                         every call. It holds the float copy beside the int6 bytes (which `plain` and the checkpoint
                         keep), so on a GPU the head costs its float bytes, not 6.5 bits a weight.
  fp8   Fp8ScaledLinear  torch._scaled_mm with row-wise scales (quant_fp8.py's docstring has the arithmetic): the
                         activations quantized per row at each call, e4m3 x e4m3 on the tensor cores (CUTLASS on
                         compute capability 8.9, cuBLAS on 9.0+ with CUDA 12.9), float32 accumulation, output
                         bfloat16 then x's dtype. Widths a multiple of 16 (_scaled_mm's requirement).

A weight whose shape a form does not take keeps the reference forward (`linear_form` returns None for it).

Experts (IndexedQuantExperts), for every format: up to `gather_max` tokens, and always inside a compiled step, each
token's K experts' quantized weights are indexed out of the stack and dequantized in torch (gpt-fast's way for int8
MoE): fixed shapes, no host sync, only the hit experts read; int8 and fp8 apply their per-row scale after the GEMM
(exact algebra: sum_i x_i q_oi s_o = s_o sum_i x_i q_oi). Past `gather_max`, the reference's sorted dispatch
dequantizes each expert that has rows once and runs torch's GEMM. Why not a quantized GEMM per expert or a grouped
one: per expert, the rows per expert are known on the host only after a sync (no CUDA graph); dequantizing every
expert for one torch._grouped_mm call would read the whole layer's weights at each decode step, E/K times the hit
ones; torch has no grouped int8 or int4 GEMM. So the experts' quantized bytes are what decode reads (a quarter or
half of bfloat16's), and the GEMMs are torch's in x's dtype.

Nothing here syncs with the host or makes a shape from data: the compiled decode step traces these forms
(tests/runtime/test_quant_gpu.py compiles them with fullgraph=True on a CPU, with the CPU twins of the ops).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moeserve.runtime.backends.layout import Laid
from moeserve.runtime.quant import QuantExperts, QuantLinear, dequantize, unpack_int4
from moeserve.runtime.quant_fp8 import Fp8Experts, Fp8Linear, fp8_unavailable, quantize_rows_fp8

# Measured on an H200 (`python -m moeserve.bench.quant_gpu`, weight [4096, 4096], 2026-11-27): _weight_int8pack_mm
# 0.151 ms at 1 row against 0.149 for dequantize-then-GEMM, 0.333 against 0.148 at 8, 0.634 at 16: its CUDA kernel
# runs no tensor core, so its time grows with the rows where a GEMM's does not. Both read far below the bandwidth
# (111 GB/s of int8 weight at 1 row), so int8 on a GPU decodes slower than bf16 until a fused kernel replaces them.
INT8PACK_MAX_ROWS = 1
TINYGEMM_GROUPS = (32, 64, 128, 256)  # int4mm.cu's qGroupSize
INT4_MIN_CAPABILITY = (8, 0)  # int4mm.cu's mma.sync m16n8k16 bf16


def _has_kernel(op: str, key: str) -> bool:
    """Whether torch registered a kernel of aten::op for dispatch key `key` (a CPU-only build has no CUDA ones)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", key)


def _key(device: torch.device) -> str:
    return "CUDA" if device.type == "cuda" else device.type.upper()


# ---- int8 ---------------------------------------------------------------------------------------
def int8pack_unavailable(device: torch.device) -> str | None:
    if not _has_kernel("_weight_int8pack_mm", _key(device)):
        return f"this torch ({torch.__version__}) has no {_key(device)} kernel for _weight_int8pack_mm"
    return None


class Int8PackLinear(Laid, QuantLinear):
    """An int8 linear map on torch._weight_int8pack_mm up to `max_rows` rows, the reference past them (module
    docstring). `op_scale`: the scales as the op takes them (float32 on CUDA, whose kernel casts them to float32
    itself; x's dtype on a CPU, whose kernel requires it)."""

    op_scale: Tensor
    max_rows: int = INT8PACK_MAX_ROWS

    def forward(self, x: Tensor) -> Tensor:
        x_MI = x.reshape(-1, self.in_features)
        if x_MI.shape[0] > self.max_rows:
            return super().forward(x)
        y = torch._weight_int8pack_mm(x_MI.contiguous(), self.qweight, self.op_scale)
        return y.view(*x.shape[:-1], self.out_features)


# ---- int4 ---------------------------------------------------------------------------------------
def int4pack_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why tinygemm cannot run a model on `device` in `dtype`, or None (shape checks: tinygemm_unfit)."""
    if device.type == "cuda":
        if not _has_kernel("_weight_int4pack_mm", "CUDA") or torch.version.hip is not None:
            return f"this torch ({torch.__version__}) has no CUDA kernel for _weight_int4pack_mm (tinygemm)"
        cap = torch.cuda.get_device_capability(device)
        if cap < INT4_MIN_CAPABILITY:
            return f"tinygemm needs compute capability 8.0 or newer; this GPU has {cap[0]}.{cap[1]}"
    elif not _has_kernel("_weight_int4pack_mm_for_cpu", _key(device)):
        return f"this torch has no {_key(device)} kernel for tinygemm"
    if dtype != torch.bfloat16:
        return f"tinygemm takes bfloat16 rows; the model is {str(dtype).removeprefix('torch.')}"
    return None


def tinygemm_unfit(out_features: int, in_features: int, group: int) -> str | None:
    """Why a weight [O, I] in groups of `group` does not fit tinygemm's layout, or None."""
    if group not in TINYGEMM_GROUPS:
        return f"group size {group}: tinygemm takes {', '.join(map(str, TINYGEMM_GROUPS))}"
    if out_features % 8:
        return f"{out_features} outputs: tinygemm's tiles take a multiple of 8"
    if in_features % 32:
        return f"{in_features} inputs: tinygemm's tiles take a multiple of 32"
    return None


def inner_k_tiles(in_features: int) -> int:
    """The most 16-wide k-tiles tinygemm packs together (8, 4 or 2) that divide the input width."""
    return next(n for n in (8, 4, 2) if in_features % (16 * n) == 0)


def tinygemm_bytes(packed: Tensor) -> Tensor:
    """Our nibbles [O, I/2] (quant.pack_int4) -> the [O, I/2] uint8 _convert_weight_to_int4pack (CUDA) reads: byte j
    holds element 2j in its high nibble and 2j + 1 in its low one (int4mm.cu's matrix_to_m16n8k16_Bint4_layout)."""
    u = unpack_int4(packed)
    return (u[:, 0::2] << 4) | u[:, 1::2]


def tinygemm_scales(scale: Tensor) -> Tensor:
    """Our scales [O, I/G] float16 -> tinygemm's scales_and_zeros [I/G, O, 2] bfloat16, every zero 0."""
    s = scale.t().to(torch.bfloat16)
    return torch.stack([s, torch.zeros_like(s)], dim=-1).contiguous()


def tinygemm_weight(packed: Tensor, device: torch.device) -> Tensor:
    """Our nibbles [O, I/2] in tinygemm's tiles for `device`: CUDA's op takes bytes (tinygemm_bytes), the CPU twin
    the values u in [0, 15] as int32 [O, I]."""
    k_tiles = inner_k_tiles(packed.shape[-1] * 2)
    if device.type == "cuda":
        return torch._convert_weight_to_int4pack(tinygemm_bytes(packed).contiguous(), k_tiles)
    return torch._convert_weight_to_int4pack_for_cpu(unpack_int4(packed).to(torch.int32), k_tiles)


class Int4PackLinear(Laid, QuantLinear):
    """An int4 linear map on tinygemm (module docstring), its weight converted once (`tiles`, `scales_zeros`)."""

    tiles: Tensor
    scales_zeros: Tensor

    def forward(self, x: Tensor) -> Tensor:
        x_MI = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        op = torch._weight_int4pack_mm if x.is_cuda else torch._weight_int4pack_mm_for_cpu
        y = op(x_MI, self.tiles, self.spec.group, self.scales_zeros)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)


# ---- int6 ---------------------------------------------------------------------------------------
class DequantizedLinear(Laid, QuantLinear):
    """A quantized linear map whose weight torch has no kernel for (int6), dequantized once at lay-out: `weight_OI`
    in the model's dtype, torch's GEMM on it (module docstring)."""

    weight_OI: Tensor

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight_OI.to(x.dtype))


# ---- fp8 ----------------------------------------------------------------------------------------
def scaled_mm_unfit(out_features: int, in_features: int) -> str | None:
    if out_features % 16 or in_features % 16:
        return f"a weight [{out_features}, {in_features}]: torch._scaled_mm takes widths that are multiples of 16"
    return None


class Fp8ScaledLinear(Laid, Fp8Linear):
    """An fp8 linear map on torch._scaled_mm, activations quantized per row (quant_fp8.py). `scale_1O`: the weight's
    scales as the op's row-wise scale_b, [1, O] float32."""

    scale_1O: Tensor

    def forward(self, x: Tensor) -> Tensor:
        xq_MI, a_M1 = quantize_rows_fp8(x.reshape(-1, self.in_features))
        y = torch._scaled_mm(xq_MI, self.qweight.t(), a_M1, self.scale_1O, out_dtype=torch.bfloat16)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)


# ---- choosing a form ------------------------------------------------------------------------------
def quantized_ops_unavailable(quantization: dict | None, device: torch.device | str,
                              dtype: torch.dtype) -> str | None:
    """Why a model of this `quantization` (MoEConfig's) runs no torch quantized op on `device`, or None."""
    device = torch.device(device)
    if quantization == {"format": "fp8"}:
        return fp8_unavailable(device)
    if quantization is None:
        return "the model is not quantized"
    if quantization.get("bits") == 8:
        return int8pack_unavailable(device)
    return int4pack_unavailable(device, dtype)


def linear_form(m: QuantLinear, dtype: torch.dtype, max_rows: int = INT8PACK_MAX_ROWS) -> QuantLinear | None:
    """`m` on torch's quantized op for its format, device and the model's `dtype`, or None where the op does not
    take it (the reference forward stays). Whether fp8 may run on the device at all is the plan's question
    (plan.quantized_plan refuses it where it cannot): on a CPU, _scaled_mm runs too, which the tests use."""
    dev, O, I = m.qweight.device, m.out_features, m.in_features
    if isinstance(m, Fp8Linear):
        if scaled_mm_unfit(O, I) is not None:
            return None
        return Fp8ScaledLinear.of(m, scale_1O=m.scale[None, :].contiguous())
    if m.spec.bits == 6:  # no torch op at all: dequantized once, whatever the device
        return DequantizedLinear.of(m, weight_OI=m.dequantized(dtype))
    if m.spec.bits == 8:
        if int8pack_unavailable(dev) is not None:
            return None
        # the op's scales: float32 on CUDA (its kernel casts them to float32 itself); x's dtype on a CPU (required)
        op_scale = m.scale if dev.type == "cuda" else m.scale.to(dtype)
        return Int8PackLinear.of(m, op_scale=op_scale, max_rows=max_rows)
    if int4pack_unavailable(dev, dtype) is not None or tinygemm_unfit(O, I, m.spec.group) is not None:
        return None
    return Int4PackLinear.of(m, tiles=tinygemm_weight(m.qweight, dev), scales_zeros=tinygemm_scales(m.scale))


# ---- experts ------------------------------------------------------------------------------------
def _indexed(experts: QuantExperts, name: str, ids_TK: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """(weights [T, K, O, I] in `dtype`, per-row scales [T, K, O] float32 or None) of each assignment's expert: int8
    and fp8 as their integers or e4m3 values, exact in bfloat16, with the scale for after the GEMM; int4 dequantized."""
    q = getattr(experts, f"{name}_qweight")[ids_TK]
    s = getattr(experts, f"{name}_scale")[ids_TK]
    if isinstance(experts, Fp8Experts) or experts.spec.group is None:
        return q.to(dtype), s
    return dequantize(q, s, experts.spec).to(dtype), None


def _apply_rows(h: Tensor, s: Tensor | None, dtype: torch.dtype) -> Tensor:
    return h if s is None else (h.float() * s).to(dtype)


def moe_indexed_q(x_TD: Tensor, expert_ids_TK: Tensor, gates_TK: Tensor, experts: QuantExperts) -> Tensor:
    """y_t = sum_k g_tk f_{e_tk}(x_t), each token's experts indexed out of the quantized stack (module docstring)."""
    dt = x_TD.dtype
    w1, s1 = _indexed(experts, "w1", expert_ids_TK, dt)
    h_TKF = _apply_rows(torch.einsum("td,tkfd->tkf", x_TD, w1), s1, dt)
    if experts.has_w3:
        w3, s3 = _indexed(experts, "w3", expert_ids_TK, dt)
        a_TKF = F.silu(h_TKF) * _apply_rows(torch.einsum("td,tkfd->tkf", x_TD, w3), s3, dt)
    else:
        a_TKF = F.gelu(h_TKF)
    w2, s2 = _indexed(experts, "w2", expert_ids_TK, dt)
    y_TKD = _apply_rows(torch.einsum("tkf,tkdf->tkd", a_TKF, w2), s2, dt)
    return (y_TKD * gates_TK[..., None].to(dt)).sum(dim=1)


class IndexedQuantExperts(Laid, QuantExperts):
    """Quantized experts (int8, int4 or fp8) by token count: indexed up to `gather_max` tokens and inside a compiled
    step, the reference's sorted dispatch past it (module docstring). A capacity limit's mask takes the reference."""

    gather_max: int = 1

    def forward(self, x_TD: Tensor, expert_ids_TK: Tensor, gates_TK: Tensor, keep_TK: Tensor | None = None) -> Tensor:
        if keep_TK is None and (torch.compiler.is_compiling() or x_TD.shape[0] <= self.gather_max):
            return moe_indexed_q(x_TD, expert_ids_TK, gates_TK, self)
        return super().forward(x_TD, expert_ids_TK, gates_TK, keep_TK)


class IndexedFp8Experts(IndexedQuantExperts, Fp8Experts):
    """IndexedQuantExperts over fp8 experts: past gather_max, Fp8Experts' reference (its own dequantization)."""


def indexed_experts(m: QuantExperts, gather_max: int) -> IndexedQuantExperts:
    """A layer's quantized experts (int8, int4 or fp8) as IndexedQuantExperts."""
    return (IndexedFp8Experts if isinstance(m, Fp8Experts) else IndexedQuantExperts).of(m, gather_max=gather_max)


def describe_forms(quantization: dict | None) -> str:
    """What runs a model of this quantization on a GPU, in words (the plan's reason)."""
    if quantization == {"format": "fp8"}:
        dense = "dense layers fp8 x fp8 on torch._scaled_mm (row-wise scales)"
    elif quantization is not None and quantization.get("bits") == 8:
        dense = f"dense layers on torch._weight_int8pack_mm up to {INT8PACK_MAX_ROWS} rows, dequantized past them"
    else:
        kept = quantization or {}
        dense = "dense layers on tinygemm (torch._weight_int4pack_mm)" + (
            ", those kept at int8 on torch._weight_int8pack_mm" if kept.get("int8") else "") + (
            ", those kept at int6 dequantized once (torch has no 6-bit kernel)" if kept.get("int6") else "")
    return (f"{dense}; experts indexed and dequantized per token for few rows (and in a compiled step), "
            "each hit expert dequantized once for many")
