"""fp8 weights (issue 39): float8 e4m3 with a float32 scale per output channel, a GPU format.

Apart from quant.py's int8 and int4 because it is another kind of format: its arithmetic is only fast where the
GPU multiplies fp8 itself (NVIDIA compute capability 8.9 or newer: Ada, Hopper, Blackwell), through
`torch._scaled_mm` with the activations quantized per row too (backends/quant_gpu.py). On a CPU, or an older GPU,
it would be a slower int8 with worse rounding, so it is refused there (Fp8Unavailable: exit 2 from the CLI), and
`moeserve quantize` does not write it: `--quantize fp8` quantizes a float checkpoint as it loads on such a GPU.

The format, exactly:

  fp8    q [O, I] float8_e4m3fn, scale [O] float32.  w[o, i] = q[o, i] * scale[o]
         scale = max_i |w[o, i]| / 448 (448: e4m3's largest finite value; 0 for a zero row),
         q = e4m3(clamp(w / scale, -448, 448)): torch's cast, round to nearest even (the clamp only catches a
         division that lands a hair past 448, which the cast would make NaN: e4m3fn has no infinity).
  rows   (the GPU layout's activations, at each call) x [M, I]: a = max_i |x[m, i]| / 448 per row (at least
         1e-12, so a zero row stays zero), xq = e4m3(clamp(x / a, -448, 448)); y = (xq @ q^T) * a * scale,
         accumulated in float32 and rounded once to x's dtype.

The modules are QuantLinear and QuantExperts with fp8 buffers (so that everything that asks "is this model
quantized" sees them, and the CPU kernel, which checks for its own exact types, does not take them); their
forward is the weight-only reference, as theirs is: the weight dequantized, then torch's GEMM in x's dtype.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moeserve.runtime.experts import Experts
from moeserve.runtime.quant import QuantError, QuantExperts, QuantLinear, check_quantizable

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
ROW_SCALE_MIN = 1e-12  # the least activation scale: a zero row quantizes to zeros, not to 0 / 0
CONFIG = {"format": "fp8"}  # MoEConfig.quantization of an fp8 model
MIN_CAPABILITY = (8, 9)
_AS_INT = {torch.float32: torch.int32, torch.float8_e4m3fn: torch.uint8}  # bits kept through Module.to(dtype)


class Fp8Unavailable(QuantError):
    """fp8 weights asked for where no fp8 arithmetic runs: a CPU, or a GPU older than compute capability 8.9."""


def fp8_unavailable(device: torch.device | str) -> str | None:
    """Why fp8 weights cannot run on `device`, or None."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return (f"fp8 (e4m3) weights are a GPU format: they run on NVIDIA GPUs of compute capability "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (torch._scaled_mm), not on a {dev.type.upper()}; "
                "use --quantize int8 or int4 there")
    if not torch.cuda.is_available():
        return "fp8 (e4m3) weights need a CUDA GPU, and torch sees none"
    if torch.version.hip is not None:
        return "fp8 (e4m3fn) weights are laid out for NVIDIA GPUs; this torch is built for ROCm"
    cap = torch.cuda.get_device_capability(dev)
    if cap < MIN_CAPABILITY:
        return (f"{torch.cuda.get_device_name(dev)} has compute capability {cap[0]}.{cap[1]}; fp8 (e4m3) arithmetic "
                f"needs {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (Ada, Hopper, Blackwell): use --quantize "
                "int8 or int4")
    return None


def check_fp8(device: torch.device | str) -> None:
    """Raise Fp8Unavailable, naming the device, where fp8 weights cannot run."""
    why = fp8_unavailable(device)
    if why is not None:
        raise Fp8Unavailable(f"--quantize fp8: {why}")


def is_fp8_config(quantization: dict | None) -> bool:
    return quantization == CONFIG


# ---- the format ---------------------------------------------------------------------------------
def quantize_fp8(w: Tensor) -> tuple[Tensor, Tensor]:
    """(q float8_e4m3fn [..., O, I], scale float32 [..., O]) of w [..., O, I]."""
    w = w.detach().float()
    scale = w.abs().amax(-1) / FP8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (w / safe[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: Tensor, scale: Tensor) -> Tensor:
    """The float32 weight an fp8 one stands for."""
    return q.float() * scale[..., None]


def quantize_rows_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, I] -> (xq float8_e4m3fn [M, I], a float32 [M, 1]), the activations as the GPU layout quantizes them (the
    module docstring): no host sync, no data-dependent shape."""
    xf = x.float()
    a = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_(min=ROW_SCALE_MIN)
    return (xf / a).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), a


@dataclass(frozen=True)
class Fp8Spec:
    """The fp8 format where a module reads its `spec` (QuantLinear's repr, a layout's checks)."""

    name: str = "fp8"
    group: None = None

    def check_width(self, in_features: int, what: str = "a weight") -> None:
        """Any width quantizes; the GPU layout takes multiples of 16 and leaves others to the reference."""

    def as_dict(self) -> dict:
        return dict(CONFIG)

    def bytes_per_weight(self) -> float:
        return 1.0


FP8 = Fp8Spec()


def _apply_keeping_bits(module: nn.Module, fn, recurse: bool):
    """Module._apply with the fp8 weights and float32 scales moved as integer views of their bits: `.to(bfloat16)`
    casts every floating-point tensor, and float8 is one."""
    kept = {id(b) for b in module._buffers.values() if b is not None and b.dtype in _AS_INT}

    def keep(t: Tensor) -> Tensor:
        if id(t) in kept:
            return fn(t.view(_AS_INT[t.dtype])).view(t.dtype)
        return fn(t)

    return nn.Module._apply(module, keep, recurse)


# ---- modules ------------------------------------------------------------------------------------
class Fp8Linear(QuantLinear):
    """A bias-free linear map on an fp8 weight; the forward is the weight-only reference (QuantLinear's)."""

    def __init__(self, in_features: int, out_features: int, spec: Fp8Spec = FP8, device=None):
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.spec = in_features, out_features, FP8
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn,
                                                    device=device))
        self.register_buffer("scale", torch.zeros(out_features, dtype=torch.float32, device=device))

    def _apply(self, fn, recurse=True):
        return _apply_keeping_bits(self, fn, recurse)

    @classmethod
    def of(cls, weight: Tensor, spec: Fp8Spec = FP8) -> "Fp8Linear":
        O, I = weight.shape
        m = cls(I, O, device=weight.device)
        m.qweight, m.scale = quantize_fp8(weight)
        return m

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        return dequantize_fp8(self.qweight, self.scale).to(dtype)


class Fp8Experts(QuantExperts):
    """A layer's E experts on fp8 stacked weights (quantized per expert and output row); the forward is
    QuantExperts' reference, each expert's weights dequantized when it has rows."""

    def __init__(self, n_experts: int, d_model: int, d_ff: int, act: str, spec: Fp8Spec = FP8, device=None):
        nn.Module.__init__(self)
        self.act, self.spec, self.observer = act, FP8, None
        shapes = {"w1": (n_experts, d_ff, d_model), "w2": (n_experts, d_model, d_ff), "w3": (n_experts, d_ff, d_model)}
        for name in self.WEIGHTS:
            if name == "w3" and act != "swiglu":
                continue
            self.register_buffer(f"{name}_qweight", torch.zeros(shapes[name], dtype=torch.float8_e4m3fn, device=device))
            self.register_buffer(f"{name}_scale", torch.zeros(shapes[name][:-1], dtype=torch.float32, device=device))

    def _apply(self, fn, recurse=True):
        return _apply_keeping_bits(self, fn, recurse)

    @classmethod
    def of(cls, experts: Experts, spec: Fp8Spec = FP8) -> "Fp8Experts":
        E, Fh, D = experts.w1.shape
        m = cls(E, D, Fh, experts.act, device=experts.w1.device)
        for name in cls.WEIGHTS:
            w = getattr(experts, name)
            if w is not None:
                q, s = quantize_fp8(w)
                setattr(m, f"{name}_qweight", q)
                setattr(m, f"{name}_scale", s)
        return m

    def weight(self, name: str, e: int, dtype: torch.dtype) -> Tensor | None:
        if name == "w3" and not self.has_w3:
            return None
        return dequantize_fp8(getattr(self, f"{name}_qweight")[e], getattr(self, f"{name}_scale")[e]).to(dtype)


def quantize_fp8_(model: nn.Module, weights: bool = True) -> int:
    """quant.quantize_'s fp8 twin: each of `model.quantizable()` replaced by its fp8 module, from its weights or
    empty (weights=False: a checkpoint's tensors will be assigned). How many were replaced."""
    targets = model.quantizable()
    for parent, name in targets:
        m = getattr(parent, name)
        if isinstance(m, (QuantLinear, QuantExperts)):
            raise QuantError(f"{name} is already quantized ({m.spec.name}); quantize the unquantized checkpoint")
        if isinstance(m, Experts):
            new = Fp8Experts.of(m) if weights else Fp8Experts(m.n_experts, m.w1.shape[2], m.w1.shape[1], m.act,
                                                             device=m.w1.device)
        else:
            O, I = m.weight.shape
            new = Fp8Linear.of(m.weight) if weights else Fp8Linear(I, O, device=m.weight.device)
        setattr(parent, name, new)
    return len(targets)


def quantize_model_fp8_(model: nn.Module) -> None:
    """`--quantize fp8` on a loaded float model, in place, its config saying so (quant.quantize_model_'s twin). The
    device is checked first (check_fp8): a CPU or an older GPU is refused before any weight is touched."""
    check_fp8(model.tok_embeddings.weight.device)
    if model.cfg.quantization is not None:
        raise QuantError(f"the model is already quantized ({model.cfg.quantization}); quantize the unquantized "
                         "checkpoint instead")
    check_quantizable(model, "fp8")
    quantize_fp8_(model)
    model.cfg = dataclasses.replace(model.cfg, quantization=dict(CONFIG))


def is_fp8(model: nn.Module) -> bool:
    return any(isinstance(m, (Fp8Linear, Fp8Experts)) for m in model.modules())
