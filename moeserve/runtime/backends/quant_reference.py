"""The torch references of the C kernel's arithmetic on quantized weights (kernels/quant.c): the activations
quantized per 32-element block, exact integer block sums, then the float32 scaling. quant_kernel.py's module
docstring spells the arithmetic out; these functions are it, in torch. Apart from the kernel's bindings so that
the load-time self-checks (kernel_checks.py, imported by cpu_kernel.py) can use them without an import cycle."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moeserve.runtime.quant import QuantSpec, unpack_int4, unpack_int6

FMT = {8: 1, 4: 2, 6: 3}  # QuantSpec.bits -> moeserve_kernels.h's QUANT_INT8, QUANT_INT4, QUANT_INT6
BLOCK = 32  # the activations' quantization block


# ---- the references ------------------------------------------------------------------------------------------------
def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., I] (I a multiple of 32) -> (q int8 [..., I], d float32 [..., I/32]), as the kernel quantizes them."""
    *lead, I = x.shape
    xb = x.float().reshape(*lead, I // BLOCK, BLOCK)
    d = xb.abs().amax(-1) / 127
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.where(d[..., None] > 0, torch.round(xb / safe[..., None]), torch.zeros_like(xb))
    return q.to(torch.int8).reshape(*lead, I), d


def weight_integers(qweight: Tensor, spec: QuantSpec) -> Tensor:
    """The weight's integers [..., O, I] as int8: int8's q, int4's u - 8, int6's u - 32."""
    if spec.bits == 6:
        return (unpack_int6(qweight).to(torch.int16) - 32).to(torch.int8)
    return qweight if spec.bits == 8 else (unpack_int4(qweight).to(torch.int16) - 8).to(torch.int8)


def reference_linear_q(x: Tensor, qweight: Tensor, scale: Tensor, spec: QuantSpec,
                       out_dtype: torch.dtype | None = None) -> Tensor:
    """x [n, I] @ w^T [O, I] as linear_q computes it (quant_kernel's docstring), exactly in float64, rounded to
    out_dtype (x's dtype unless given)."""
    n, I = x.shape
    nb = I // BLOCK
    q, d = quantize_activations(x)
    v = weight_integers(qweight, spec)
    O = v.shape[0]
    s = torch.einsum("nbk,obk->nob", q.double().view(n, nb, BLOCK), v.double().view(O, nb, BLOCK))  # exact
    if spec.bits == 8:
        y = (s * d.double()[:, None, :]).sum(-1) * scale.double()[None, :]
    else:
        per_block = scale.double().repeat_interleave(spec.group // BLOCK, dim=-1)  # [O, nb]
        y = (s * d.double()[:, None, :] * per_block[None]).sum(-1)
    return y.to(out_dtype or x.dtype)


def _activate(h1: Tensor, h3: Tensor | None) -> Tensor:
    """experts.c's activation in float32: swiglu g / (1 + exp(-g)) * up, else gelu (erf)."""
    return F.silu(h1) * h3 if h3 is not None else F.gelu(h1)


def reference_moe_q(x: Tensor, ids: Tensor, gates: Tensor, weights: dict[str, tuple[Tensor, Tensor] | None],
                    spec: QuantSpec) -> Tensor:
    """moe_ffn_q's arithmetic in torch: per expert, its rows' first GEMMs (reference_linear_q, float32), the
    activation in float32 (rounded to bf16 for bf16 rows), the second GEMM in x's dtype; each token's outputs times
    their gates summed back as moe_reference does (bf16: each product rounded, the sum in float32, rounded once).
    weights: {"w1": (q, scale) [E, ...], "w2": ..., "w3": ... or None}."""
    T, D = x.shape
    out = torch.zeros(T, D, dtype=torch.float32)
    for e in range(weights["w1"][0].shape[0]):
        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        at = lambda name: tuple(t[e] for t in weights[name])  # noqa: E731
        h1 = reference_linear_q(xe, *at("w1"), spec, torch.float32)
        h3 = None if weights.get("w3") is None else reference_linear_q(xe, *at("w3"), spec, torch.float32)
        h = _activate(h1, h3).to(x.dtype)
        y = reference_linear_q(h, *at("w2"), spec)
        prod = y * gates[tok, slot, None].to(x.dtype)  # rounded to x's dtype, as the kernel's products
        out.index_add_(0, tok, prod.float())
    return out.to(x.dtype)
