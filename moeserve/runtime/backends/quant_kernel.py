"""The C kernel on quantized weights (runtime/quant.py's int8 and int4 formats): the ctypes-level calls taking torch
tensors (linear_q, KernelQuantExperts); quant_reference.py holds the torch references of their exact arithmetic.

The kernel quantizes the activations to int8 per 32-element block and takes integer dot products against the
weights' integers (llama.cpp's Q8_0 x Q8_0 way), chosen over widening the weights to float32 by measurement
(docs/bench/log.md has the tables). That quantization is part of the arithmetic, so the references do it exactly
as the C code does:

  per row of x (bf16 widened to float32 exactly) and block b of 32 elements:
      d_b = max |x| / 127            (float32 division)
      q   = round_half_even(x / d_b) (float32 division; 0 where d_b = 0), so |q| <= 127
  per weight row o: s_b = sum over the block of q * v, v the weight's integer (int8: q_w; int4: u - 8), exact
      int8: y = scale[o] * sum_b d_b s_b
      int4: y = sum_b d_b scale[o, b * 32 // G] s_b

The references compute the last line in float64 (the exact value of the defined arithmetic); the kernel sums it in
float32, so the two agree within float32 rounding, and within one bf16 rounding for bf16 outputs. A kernel op
that feeds one quantization from another (the experts: the activation between w1/w3 and w2) can round a value
that lies within float32 rounding of a half step the other way from its reference: the tests allow for that
(a few 1/127 steps of one block), not for anything more.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from moeserve.runtime.backends.cpu_kernel import _library, unavailable_reason
from moeserve.runtime.backends.kernel_abi import DTYPES, KernelError
from moeserve.runtime.backends.quant_reference import BLOCK, FMT
from moeserve.runtime.quant import QuantError, QuantSpec


def _lib() -> ctypes.CDLL:
    why = unavailable_reason()
    if why is not None:
        raise KernelError(f"the CPU kernel is not available: {why}")
    return _library()


# ---- the kernel calls --------------------------------------------------------------------------------------------
def check_weight(what: str, qweight: Tensor, scale: Tensor, spec: QuantSpec, lead: tuple[int, ...] = ()) -> tuple[int, int]:
    """A quantized weight [*lead, O, I bits/8] and its scales as the kernel reads them: (O, I), or KernelError."""
    k = len(lead)
    want_q = torch.int8 if spec.bits == 8 else torch.uint8
    want_s = torch.float32 if spec.bits == 8 else torch.float16
    if qweight.dim() != k + 2 or tuple(qweight.shape[:k]) != lead:
        dims = '[' + ', '.join(map(str, lead)) + ', O, I]' if k else '[O, I]'
        raise KernelError(f"{what}: a {spec.name} weight of {k + 2} dims {dims}, not {list(qweight.shape)}")
    O, I = qweight.shape[k], qweight.shape[k + 1] * 8 // spec.bits
    if I % BLOCK or qweight.shape[k + 1] * 8 % spec.bits:
        raise KernelError(f"{what}: the kernel takes widths that are multiples of {BLOCK}, not {I}")
    if spec.bits != 8:
        try:
            spec.check_width(I, what)
        except QuantError as e:
            raise KernelError(str(e)) from None
    s_shape = (*lead, O) if spec.bits == 8 else (*lead, O, I // spec.group)
    if qweight.dtype != want_q or scale.dtype != want_s or tuple(scale.shape) != s_shape:
        raise KernelError(f"{what}: {spec.name} takes a {want_q} weight and {want_s} scales {list(s_shape)}, not "
                          f"{qweight.dtype} {list(qweight.shape)} and {scale.dtype} {list(scale.shape)}")
    if not (qweight.is_cpu and scale.is_cpu) or qweight.stride()[k:] != (qweight.shape[k + 1], 1) \
            or scale.stride()[k:] != ((I // spec.group, 1) if spec.bits != 8 else (1,)):
        raise KernelError(f"{what}: the kernel takes CPU weights and scales with contiguous rows")
    return O, I


def _check_rows_dtype(what: str, x: Tensor) -> None:
    if x.dtype not in DTYPES or not x.is_cpu:
        raise KernelError(f"{what}: float32 or bfloat16 CPU rows, not {x.dtype} on {x.device.type}")


def linear_q(x: Tensor, qweight: Tensor, scale: Tensor, spec: QuantSpec) -> Tensor:
    """x [..., I] @ w^T on a quantized weight (qweight [O, I] int8 with float32 scale [O], or [O, I/2] uint8 nibbles
    (int6: [O, 3I/4]) with float16 scale [O, I/G], as quant.quantize makes them) -> [..., O] in x's dtype (float32 or bfloat16). The
    same numbers whatever rows share the call; reference_linear_q is its arithmetic."""
    lib = _lib()
    _check_rows_dtype("linear_q", x)
    O, I = check_weight("linear_q", qweight, scale, spec)
    if x.shape[-1] != I:
        raise KernelError(f"linear_q: shapes do not match: x {list(x.shape)} and w [{O}, {I}]")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, I)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = x2.shape[0]
    y = torch.empty(n, O, dtype=x.dtype)
    if n and O:
        fn = lib.linear_q if x.dtype == torch.float32 else lib.linear_q_bf16
        status = fn(x2.data_ptr(), x2.stride(0), qweight.data_ptr(), scale.data_ptr(), FMT[spec.bits],
                    spec.group or 0, y.data_ptr(), O, n, O, I, torch.get_num_threads())
        if status == -2:
            raise MemoryError(f"linear_q: no memory for {n} rows' quantized activations")
        if status:
            raise KernelError(f"linear_q refused {spec.name} (group {spec.group}) at width {I}")
    return y.reshape(*lead, O)


class KernelQuantExperts:
    """One MoE layer's quantized stacked experts (QuantExperts' buffers: w1, w3 [E, F, D], w2 [E, D, F] quantized per
    expert and row) as moe_ffn_q takes them, used where they lie; .moe runs the whole layer for routed tokens, as
    KernelExperts.moe does for float weights. w3 None: gelu. The rows may be float32 or bfloat16."""

    def __init__(self, spec: QuantSpec, w1: tuple[Tensor, Tensor], w2: tuple[Tensor, Tensor],
                 w3: tuple[Tensor, Tensor] | None = None):
        self.lib, self.spec = _lib(), spec
        E = w1[0].shape[0]
        F_, D = check_weight("experts' w1", *w1, spec, (E,))
        if check_weight("experts' w2", *w2, spec, (E,)) != (D, F_) or (
                w3 is not None and check_weight("experts' w3", *w3, spec, (E,)) != (F_, D)):
            raise KernelError(f"experts: w1, w3 [E, F, D] and w2 [E, D, F] of one E, D and F, not "
                              f"{[list(t[0].shape) for t in (w1, w2, w3) if t is not None]}")
        self.E, self.D, self.F = E, D, F_
        self._held = (w1, w2, w3)
        q = lambda w: (None, None, 0, 0) if w is None else (w[0].data_ptr(), w[1].data_ptr(), w[0].stride(0),
                                                             w[1].stride(0))  # noqa: E731
        (a1, b1, s1, t1), (a3, b3, s3, t3), (a2, b2, s2, t2) = q(w1), q(w3), q(w2)
        # moe_ffn_q's arguments after (x, ids, gates, n_tok, K), held for KernelDecodeStep's layers too
        self.pointers = (FMT[spec.bits], spec.group or 0, a1, a3, a2, b1, b3, b2, s1, s3, s2, t1, t3, t2)

    @classmethod
    def of(cls, experts) -> "KernelQuantExperts":
        """From a quant.QuantExperts module."""
        w = lambda n: (getattr(experts, f"{n}_qweight"), getattr(experts, f"{n}_scale"))  # noqa: E731
        return cls(experts.spec, w("w1"), w("w2"), w("w3") if experts.has_w3 else None)

    def moe(self, x_TD: Tensor, ids_TK: Tensor, gates_TK: Tensor) -> Tensor:
        """y_t = sum_k gates[t, k] * expert_{ids[t, k]}(x_t) (reference_moe_q's arithmetic); ids int64 [T, K]
        (other integer dtypes widened), gates in x's dtype."""
        _check_rows_dtype("quantized experts", x_TD)
        if x_TD.dim() != 2 or x_TD.shape[1] != self.D or ids_TK.dim() != 2 or ids_TK.shape[0] != x_TD.shape[0]:
            raise KernelError(f"quantized experts: rows of {self.D} and [T, K] ids, not {list(x_TD.shape)} and "
                              f"{list(ids_TK.shape)}")
        if gates_TK.shape != ids_TK.shape:
            raise KernelError(f"gates {list(gates_TK.shape)} for ids {list(ids_TK.shape)}")
        T, K = ids_TK.shape
        x_TD, gates_TK = x_TD.contiguous(), gates_TK.to(x_TD.dtype).contiguous()
        ids_TK = ids_TK.to(torch.int64).contiguous()
        out = torch.empty_like(x_TD)
        fn = self.lib.moe_ffn_q if x_TD.dtype == torch.float32 else self.lib.moe_ffn_q_bf16
        status = fn(x_TD.data_ptr(), ids_TK.data_ptr(), gates_TK.data_ptr(), T, K, *self.pointers, out.data_ptr(),
                    self.E, self.D, self.F, torch.get_num_threads())
        if status == -1:
            raise KernelError(f"expert ids outside [0, {self.E}): {sorted(set(ids_TK.flatten().tolist()))}")
        if status == -4:
            raise KernelError(f"quantized experts: {self.spec.name} (group {self.spec.group}) at widths {self.D}, "
                              f"{self.F}")
        if status:
            raise MemoryError(f"quantized experts: no memory for the scratch of {T} x {K} rows")
        return out
