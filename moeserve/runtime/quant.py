"""Weight-only quantization (issue 39): int8 with a scale per output channel, int4 in groups with a scale per group.

On a CPU, decode streams every weight it uses once a token, so its speed is bytes per weight: float32 4, bf16 2,
int8 1 (plus 4 bytes a row), int4 0.5 (plus a float16 scale per group of 32: 4.5 bits, llama.cpp's Q4_0). A MoE
model's total parameters are 4-8x its active ones, so the bytes also decide whether the model fits at all.

The formats, exactly (the C kernel and every torch path compute with these numbers):

  int8   q [O, I] int8 in [-127, 127], scale [O] float32.  w[o, i] = q[o, i] * scale[o]
         scale = max_i |w[o, i]| / 127 (0 for a zero row), q = round(w / scale) (half to even).
  int4   packed [O, I/2] uint8, scale [O, I/G] float16, G the group (a multiple of 32 dividing I).
         w[o, i] = (u[o, i] - 8) * scale[o, i // G], with u in [0, 15].
         Per group, m is the element of largest magnitude (its sign kept) and scale = fp16(m / -8), so that m
         maps to u = 0 exactly and the 16 levels all serve (llama.cpp's Q4_0 rule); u = clamp(round(w / scale) + 8).
         Packing: each run of 32 elements i0 .. i0+31 of a row is 16 bytes; byte i0/2 + j holds element i0 + j in
         its low nibble and element i0 + 16 + j in its high nibble (j < 16): one shift and one mask give 16
         consecutive elements to a vector unit.
  int6   packed [O, 3I/4] uint8, scale [O, I/G] float16, as int4 with 64 levels: w = (u - 32) * scale, u in [0, 63],
         scale = fp16(m / -32), u = clamp(round(w / scale) + 32). Packed in chunks of 128 elements (I a multiple of
         128), each 96 bytes: 64 bytes of the low four bits of u, laid out as int4's nibbles, then 32 bytes of the
         high two bits. Nibble byte m (m < 64) holds two elements; crumb byte k (k < 32) holds the high bits of
         nibble byte k's low and high element in bits 0-1 and 2-3, and of nibble byte k + 32's in bits 4-5 and 6-7:
         one 64-bit shift and a mask bring them beside the nibbles they complete, so the kernel reads int4's
         nibbles as int4 does and ORs the high bits in (kernels/quant.c). An int4 model's LM head is int6 by default
         (`QuantSpec.int6`): 6.5 bits a weight, llama.cpp's Q6_K's 6.56.

Leading dims pass through: stacked experts [E, O, I] quantize per expert and output row. The embedding, routers,
norms and VQ codebooks stay in full precision (few bytes a token: one embedding row; routers decide which weights
are read at all).

An int4 model keeps some weights at more bits (`QuantSpec.int8`, by default attention's wk and wv; `QuantSpec.int6`,
by default the LM head), as llama.cpp's Q4_0 files of an 8-expert model keep attn_k and attn_v at Q8_0 and the output
at Q6_K: they are few bytes a token, and int4 errors there cost the most. Measured on the 644M Mixtral
(docs/bench/log.md, "The int4 recipe"), mean KL with the weights dequantized and scored on the same tokens: 0.047
with every weight at int4, 0.0315 with these three at int8, 0.0315 with the head at int6 instead (19% fewer head
bytes), against 0.0316 for llama.cpp's own Q4_0 file of those weights. A head whose width is not a multiple of 128
stays at int8 (`QuantSpec.for_weight`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moeserve.config import describe_quantization
from moeserve.errors import UserError
from moeserve.runtime import QUANT_FORMATS
from moeserve.runtime.experts import BiasedExperts, Experts, combine, dispatch, expert_forward

# A scale is viewed as an integer while a module is converted (Module.to(dtype), .half(), ...): a float cast would
# round int8's float32 scales to the model's bf16 (0.4% off every weight) and leave int4's no longer float16.
_AS_INT = {torch.float32: torch.int32, torch.float16: torch.int16}

FORMATS = QUANT_FORMATS
DEFAULT_GROUP = 32
# what an int4 model may keep at int8 or int6, by Transformer.quantizable()'s attribute names: attention's maps, the
# dense FFNs' and the LM head ("output"); the experts are most of the bytes, so int8 there is the int8 format
INT8_KEEPABLE = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "output")
DEFAULT_INT8 = ("wk", "wv")
DEFAULT_INT6 = ("output",)
INT6_CHUNK = 128  # int6 packs 128 elements in 96 bytes: a width it keeps must be a multiple


class QuantError(UserError):
    """A quantization request that cannot be met (a bad format or group size, an already quantized model)."""


@dataclass(frozen=True)
class QuantSpec:
    """One model's weight format: bits 8 (per output channel) or 4 (groups of `group` input elements), int4 with the
    weights named in `int8` kept at int8 and those in `int6` at int6 (INT8_KEEPABLE's names; each module's own spec
    is `for_weight(name, width)`). bits 6 is only ever such a module's own spec: no model is int6 throughout."""

    bits: int
    group: int | None = None
    int8: tuple[str, ...] = ()
    int6: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.bits not in (8, 6, 4):
            raise QuantError(f"bits = {self.bits!r}: expected 8 (int8) or 4 (int4)")
        if self.bits == 8 and self.group is not None:
            raise QuantError("int8 has one scale per output channel: no group size")
        if self.bits in (6, 4):
            g = self.group
            if isinstance(g, bool) or not isinstance(g, int) or g < 32 or g % 32:
                raise QuantError(f"group size {g!r}: expected a multiple of 32 (32, 64, 128, ...)")
        for kept, names in (("int8", self.int8), ("int6", self.int6)):
            if not isinstance(names, tuple) or any(n not in INT8_KEEPABLE for n in names):
                raise QuantError(f"weights kept at {kept} {list(names)!r}: expected names among "
                                 f"{', '.join(INT8_KEEPABLE)}")
            if names and self.bits != 4:
                raise QuantError(f"keeping weights at {kept} is int4's: an int{self.bits} model has every weight at "
                                 f"int{self.bits}")
            if len(set(names)) != len(names):
                raise QuantError(f"weights kept at {kept} {list(names)!r}: a name twice")
        if both := sorted(set(self.int8) & set(self.int6)):
            raise QuantError(f"{', '.join(both)} kept at both int8 and int6: name each once")

    @classmethod
    def parse(cls, name: str, group: int | None = None, int8: tuple[str, ...] | None = None,
              int6: tuple[str, ...] | None = None) -> "QuantSpec":
        """'int8' or 'int4' (group: int4's, default 32; int8 and int6: the weights int4 keeps at more bits, default
        DEFAULT_INT8 and DEFAULT_INT6, a name given to one leaving the other's default)."""
        if name == "int8":
            if group is not None:
                raise QuantError("--group-size is int4's: int8 has one scale per output channel")
            for flag, names in (("--int8-weights", int8), ("--int6-weights", int6)):
                if names:
                    raise QuantError(f"{flag} is int4's: an int8 model has every weight at int8")
            return cls(8)
        if name == "int4":
            k8 = DEFAULT_INT8 if int8 is None else tuple(int8)
            k6 = tuple(n for n in DEFAULT_INT6 if n not in k8) if int6 is None else tuple(int6)
            if int8 is None:
                k8 = tuple(n for n in k8 if n not in k6)
            return cls(4, DEFAULT_GROUP if group is None else group, k8, k6)
        raise QuantError(f"format {name!r}: expected one of {', '.join(FORMATS)}")

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    def for_weight(self, name: str, in_features: int) -> "QuantSpec":
        """The format of the weight quantizable() calls `name`, `in_features` wide (plain: no lists of its own).
        int6 packs 128 elements at a time, so a kept weight of another width is int8 instead: the same rule at
        quantization and at load, so the config need not say which."""
        if name in self.int6:
            return QuantSpec(6, self.group) if in_features % INT6_CHUNK == 0 else QuantSpec(8)
        return QuantSpec(8) if name in self.int8 else QuantSpec(self.bits, self.group)

    def as_dict(self) -> dict:
        """The config's `quantization` ("int8" and "int6" only where some weights are kept so, so a uniform model's
        config is what it was before the keys existed)."""
        return {"bits": self.bits, "group": self.group} | ({"int8": list(self.int8)} if self.int8 else {}) | (
            {"int6": list(self.int6)} if self.int6 else {})

    @classmethod
    def from_dict(cls, d: dict) -> "QuantSpec":
        if not isinstance(d, dict) or not {"bits", "group"} <= set(d) <= {"bits", "group", "int8", "int6"} or \
                not all(isinstance(d.get(k, []), list) for k in ("int8", "int6")) or d["bits"] == 6:
            raise QuantError(f"quantization {d!r}: expected {{'bits': 8 or 4, 'group': null or an int, and "
                             f"optionally 'int8': [names], 'int6': [names]}}")
        return cls(d["bits"], d["group"], tuple(d.get("int8", ())), tuple(d.get("int6", ())))

    def check_width(self, in_features: int, what: str = "a weight") -> None:
        if self.bits in (6, 4) and in_features % self.group:
            raise QuantError(f"{what}: group size {self.group} does not divide its input width {in_features}")
        if self.bits == 6 and in_features % INT6_CHUNK:
            raise QuantError(f"{what}: int6 packs {INT6_CHUNK} elements at a time, not a divisor of {in_features}")

    def bytes_per_weight(self) -> float:
        """Bytes streamed per weight of this format, scales included (int8's per-row scale counted as nothing)."""
        return 1.0 if self.bits == 8 else self.bits / 8 + 2 / self.group


# ---- int8 ---------------------------------------------------------------------------------------
def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """(q int8 [..., O, I], scale float32 [..., O]) of w [..., O, I]."""
    w = w.detach().float()
    scale = w.abs().amax(-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    return q.float() * scale[..., None]


# ---- int4 ---------------------------------------------------------------------------------------
def pack_int4(u: Tensor) -> Tensor:
    """u [..., I] uint8 values in [0, 15] -> [..., I/2]: per 32 elements, 16 bytes of (low j, high j + 16)."""
    *lead, I = u.shape
    b = u.reshape(*lead, I // 32, 2, 16)
    return (b[..., 0, :] | (b[..., 1, :] << 4)).reshape(*lead, I // 2)


def unpack_int4(packed: Tensor) -> Tensor:
    """pack_int4's inverse: [..., I/2] -> [..., I] uint8 in [0, 15]."""
    *lead, half = packed.shape
    b = packed.reshape(*lead, half // 16, 1, 16)
    return torch.cat([b & 0xF, b >> 4], dim=-2).reshape(*lead, half * 2)


def _levels(w: Tensor, group: int, zero: int) -> tuple[Tensor, Tensor]:
    """(u uint8 [..., O, I] in [0, 2 zero), scale float16 [..., O, I/group]): per group, m the element of largest
    magnitude (signed), scale = fp16(m / -zero), u = clamp(round(w / scale) + zero); a zero group all `zero`."""
    w = w.detach().float()
    *lead, I = w.shape
    g = w.reshape(*lead, I // group, group)
    m = g.gather(-1, g.abs().argmax(-1, keepdim=True))  # the element of largest magnitude, signed
    scale = (m / -zero).to(torch.float16)
    d = scale.float()
    safe = torch.where(d != 0, d, torch.ones_like(d))
    u = (torch.round(g / safe) + zero).clamp_(0, 2 * zero - 1)
    u = torch.where(d != 0, u, torch.full_like(u, zero)).to(torch.uint8)
    return u.reshape(*lead, I), scale.squeeze(-1)


def _dequantize_levels(u: Tensor, scale: Tensor, zero: int) -> Tensor:
    *lead, I = u.shape
    G = I // scale.shape[-1]
    return ((u.float() - zero).reshape(*lead, I // G, G) * scale.float()[..., None]).reshape(*lead, I)


def quantize_int4(w: Tensor, group: int = DEFAULT_GROUP) -> tuple[Tensor, Tensor]:
    """(packed uint8 [..., O, I/2], scale float16 [..., O, I/group]) of w [..., O, I]."""
    QuantSpec(4, group).check_width(w.shape[-1])
    u, scale = _levels(w, group, 8)
    return pack_int4(u), scale


def dequantize_int4(packed: Tensor, scale: Tensor) -> Tensor:
    return _dequantize_levels(unpack_int4(packed), scale, 8)


# ---- int6 ---------------------------------------------------------------------------------------
def pack_int6(u: Tensor) -> Tensor:
    """u [..., I] uint8 values in [0, 63] (I a multiple of 128) -> [..., 3I/4]: per 128 elements, int4's 64 bytes
    of their low nibbles, then 32 bytes of their high two bits (crumb byte k: nibble byte k's low and high element
    in bits 0-1 and 2-3, nibble byte k + 32's in bits 4-5 and 6-7)."""
    *lead, I = u.shape
    nib = pack_int4(u & 0xF).reshape(*lead, I // 128, 64)
    hi = (u >> 4).reshape(*lead, I // 128, 4, 2, 16)  # [chunk, run of 32, low | high nibble's element, j]
    e = (hi[..., 0, :] | (hi[..., 1, :] << 2)).reshape(*lead, I // 128, 2, 32)  # nibble byte 16 run + j's high bits
    crumbs = e[..., 0, :] | (e[..., 1, :] << 4)
    return torch.cat([nib, crumbs], dim=-1).reshape(*lead, I * 3 // 4)


def unpack_int6(packed: Tensor) -> Tensor:
    """pack_int6's inverse: [..., 3I/4] -> [..., I] uint8 in [0, 63]."""
    *lead, n = packed.shape
    chunks = packed.reshape(*lead, n // 96, 96)
    low = unpack_int4(chunks[..., :64].reshape(*lead, n // 96 * 64)).reshape(*lead, n // 96, 4, 2, 16)
    c = chunks[..., 64:]
    e = torch.cat([c & 0xF, c >> 4], dim=-1).reshape(*lead, n // 96, 4, 16)  # nibble byte 16 run + j's high bits
    hi = torch.stack([e & 3, e >> 2], dim=-2)  # [chunk, run, low | high nibble's element, j]
    return (low | (hi << 4)).reshape(*lead, n // 96 * 128)


def quantize_int6(w: Tensor, group: int = DEFAULT_GROUP) -> tuple[Tensor, Tensor]:
    """(packed uint8 [..., O, 3I/4], scale float16 [..., O, I/group]) of w [..., O, I]."""
    QuantSpec(6, group).check_width(w.shape[-1])
    u, scale = _levels(w, group, 32)
    return pack_int6(u), scale


def dequantize_int6(packed: Tensor, scale: Tensor) -> Tensor:
    return _dequantize_levels(unpack_int6(packed), scale, 32)


def quantize(w: Tensor, spec: QuantSpec) -> tuple[Tensor, Tensor]:
    if spec.bits == 6:
        return quantize_int6(w, spec.group)
    return quantize_int8(w) if spec.bits == 8 else quantize_int4(w, spec.group)


def dequantize(q: Tensor, scale: Tensor, spec: QuantSpec) -> Tensor:
    """The float32 weight a quantized one stands for."""
    if spec.bits == 6:
        return dequantize_int6(q, scale)
    return dequantize_int8(q, scale) if spec.bits == 8 else dequantize_int4(q, scale)


def storage_shapes(shape: tuple[int, ...], spec: QuantSpec) -> tuple[tuple, torch.dtype, tuple, torch.dtype]:
    """(q's shape and dtype, scale's shape and dtype) for a float weight of `shape` [..., O, I]."""
    *lead, I = shape
    if spec.bits == 8:
        return (*lead, I), torch.int8, tuple(lead), torch.float32
    return (*lead, I * spec.bits // 8), torch.uint8, (*lead, I // spec.group), torch.float16


# ---- modules ------------------------------------------------------------------------------------
class QuantLinear(nn.Module):
    """A bias-free linear map on a quantized weight. This forward is the weight-only reference (the weight
    dequantized, then torch's GEMM in x's dtype); a backend lays it out on faster kernels, the CPU kernel's quantizing
    the activations too (backends/quant_kernel.py spells its arithmetic out)."""

    def __init__(self, in_features: int, out_features: int, spec: QuantSpec, device=None):
        super().__init__()
        spec.check_width(in_features)
        self.in_features, self.out_features, self.spec = in_features, out_features, spec
        qs, qt, ss, st = storage_shapes((out_features, in_features), spec)
        self.register_buffer("qweight", torch.zeros(qs, dtype=qt, device=device))
        self.register_buffer("scale", torch.zeros(ss, dtype=st, device=device))

    def _apply(self, fn, recurse=True):
        return _apply_keeping_scales(self, fn, recurse)

    @classmethod
    def of(cls, weight: Tensor, spec: QuantSpec) -> "QuantLinear":
        O, I = weight.shape
        m = cls(I, O, spec, device=weight.device)
        m.qweight, m.scale = quantize(weight, spec)
        return m

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        return dequantize(self.qweight, self.scale, self.spec).to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.dequantized(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.spec.name}" + (
            f", group={self.spec.group}" if self.spec.group else "")


class QuantExperts(nn.Module):
    """A layer's E experts on quantized stacked weights ([E, out, in] each, quantized per expert and row). The
    forward is the reference: Experts' dispatch, each expert's weights dequantized when it has rows."""

    WEIGHTS = ("w1", "w2", "w3")

    def __init__(self, n_experts: int, d_model: int, d_ff: int, act: str, spec: QuantSpec, device=None):
        super().__init__()
        self.act, self.spec, self.observer = act, spec, None
        shapes = {"w1": (n_experts, d_ff, d_model), "w2": (n_experts, d_model, d_ff), "w3": (n_experts, d_ff, d_model)}
        for name in self.WEIGHTS:
            if name == "w3" and act != "swiglu":
                continue
            spec.check_width(shapes[name][-1], f"experts' {name}")
            qs, qt, ss, st = storage_shapes(shapes[name], spec)
            self.register_buffer(f"{name}_qweight", torch.zeros(qs, dtype=qt, device=device))
            self.register_buffer(f"{name}_scale", torch.zeros(ss, dtype=st, device=device))

    @classmethod
    def of(cls, experts: Experts, spec: QuantSpec) -> "QuantExperts":
        E, Fh, D = experts.w1.shape
        m = cls(E, D, Fh, experts.act, spec, device=experts.w1.device)
        for name in cls.WEIGHTS:
            w = getattr(experts, name)
            if w is not None:
                q, s = quantize(w, spec)
                setattr(m, f"{name}_qweight", q)
                setattr(m, f"{name}_scale", s)
        return m

    def _apply(self, fn, recurse=True):
        return _apply_keeping_scales(self, fn, recurse)

    @property
    def n_experts(self) -> int:
        return self.w1_qweight.shape[0]

    @property
    def has_w3(self) -> bool:
        return hasattr(self, "w3_qweight")

    def weight(self, name: str, e: int, dtype: torch.dtype) -> Tensor | None:
        """Expert e's `name` dequantized, or None (w3 of a gelu layer)."""
        if name == "w3" and not self.has_w3:
            return None
        return dequantize(getattr(self, f"{name}_qweight")[e], getattr(self, f"{name}_scale")[e], self.spec).to(dtype)

    def forward(self, x_TD: Tensor, expert_ids_TK: Tensor, gates_TK: Tensor, keep_TK: Tensor | None = None) -> Tensor:
        d = dispatch(x_TD, expert_ids_TK, gates_TK, self.n_experts, keep_TK)
        dt = x_TD.dtype
        ys = [expert_forward(e, x_ND, self.weight("w1", e, dt), self.weight("w2", e, dt), self.weight("w3", e, dt),
                             self.observer)
              for e, x_ND in enumerate(d.blocks()) if x_ND.shape[0]]
        return combine(d, torch.cat(ys) if ys else x_TD.new_zeros(0, x_TD.shape[1]), x_TD)


def _apply_keeping_scales(module: nn.Module, fn, recurse: bool):
    """Module._apply with every scale buffer moved as the integer view of its bits: device moves happen, float
    casts do not (they only touch floating-point tensors)."""
    scales = {id(b) for n, b in module._buffers.items() if b is not None and n.endswith("scale")}

    def keep(t: Tensor) -> Tensor:
        if id(t) in scales and t.dtype in _AS_INT:
            return fn(t.view(_AS_INT[t.dtype])).view(t.dtype)
        return fn(t)

    return nn.Module._apply(module, keep, recurse)


def quantize_(model: nn.Module, spec: QuantSpec, weights: bool = True) -> int:
    """Replace each of `model.quantizable()` (runtime/model.py) by its quantized module: from its weights, or empty
    (weights=False: a checkpoint's tensors will be assigned). How many were replaced."""
    targets = model.quantizable()
    for parent, name in targets:
        m = getattr(parent, name)
        if isinstance(m, (QuantLinear, QuantExperts)):
            raise QuantError(f"{name} is already quantized ({m.spec.name}); quantize the unquantized checkpoint")
        if isinstance(m, Experts):
            s = spec.for_weight(name, m.w1.shape[2])
            new = QuantExperts.of(m, s) if weights else QuantExperts(
                m.n_experts, m.w1.shape[2], m.w1.shape[1], m.act, s, device=m.w1.device)
        else:
            O, I = m.weight.shape
            s = spec.for_weight(name, I)
            new = QuantLinear.of(m.weight, s) if weights else QuantLinear(I, O, s, device=m.weight.device)
        setattr(parent, name, new)
    return len(targets)


def describe(quantization: dict | None) -> str:
    """A config's `quantization` in words (config.describe_quantization), checked as a QuantSpec first."""
    if quantization is not None and quantization != {"format": "fp8"}:  # fp8: quant_fp8.py's GPU format
        QuantSpec.from_dict(quantization)
    return describe_quantization(quantization)


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (QuantLinear, QuantExperts)) for m in model.modules())


def check_quantizable(model: nn.Module, fmt: str) -> None:
    """QuantError where quantizing `model` would leave its experts, the bulk of its bytes, in float: experts with
    biases or the clamped SwiGLU (gpt-oss's BiasedExperts) have no quantized form here, and its biased maps stay float
    too, so `fmt` would quantize little more than the head while the config said the model was quantized."""
    if any(isinstance(layer.experts, BiasedExperts) for layer in model.moe_layers):
        raise QuantError(f"{fmt}: this model's experts have biases or the clamped SwiGLU (gpt-oss), which have no "
                         f"quantized form here; serve it in float32 or bfloat16")


def quantize_model_(model: nn.Module, spec: QuantSpec) -> None:
    """Quantize a loaded float model in place (`--quantize` at load), its config saying so, as a quantized
    checkpoint's does: saved, it is one."""
    if model.cfg.quantization is not None:
        raise QuantError(f"the model is already quantized ({QuantSpec.from_dict(model.cfg.quantization).name}); "
                         "quantize the unquantized checkpoint instead")
    check_quantizable(model, spec.name)
    names = {id(m): n for n, m in model.named_modules()}
    for parent, name in model.quantizable():
        m = getattr(parent, name)
        where = names.get(id(m), name)
        for w in (m.w1, m.w2) if isinstance(m, Experts) else (m.weight,):
            spec.for_weight(name, w.shape[-1]).check_width(w.shape[-1], f"{where} {list(w.shape)}")
    quantize_(model, spec)
    model.cfg = dataclasses.replace(model.cfg, quantization=spec.as_dict())
