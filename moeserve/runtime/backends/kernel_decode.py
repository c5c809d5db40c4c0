"""A decode step on the C kernel in as few calls as its layers allow: a MoE layer's router (KernelRouter, router.c),
and a whole step, every layer and the LM head, in one call (KernelDecodeStep, step.c), the only fused decode path.

The step is the calls it replaces, made in the same order on the same roundings, so the same numbers; what goes
is the Python between them, ~70 torch operations a step that ran on caches the streamed weights had just flushed
(figures in docs/design-notes.md). The weights are checked once, when these are built
(CpuKernelBackend), and used where the model holds them; a call checks only what it is given. The
Structures below mirror kernels/moeserve_kernels.h's structs, and are checked against them when the library loads
(check_structures): a field out of place would have the C code read one weight as another.
"""

from __future__ import annotations

import ctypes

from dataclasses import dataclass

import torch
from torch import Tensor

from moeserve.runtime.backends.cpu_kernel import KernelExperts, _check_rows, _library, unavailable_reason
from moeserve.runtime.backends.kernel_abi import KernelError, _check_weights, _Layer, _Model, router_args
from moeserve.runtime.backends.quant_kernel import FMT, KernelQuantExperts, check_weight
from moeserve.runtime.quant import QuantSpec

QK_NORMS = ("head", "all")  # struct layer's qk, less one

def _lib() -> ctypes.CDLL:
    why = unavailable_reason()
    if why is not None:
        raise KernelError(f"the CPU kernel is not available: {why}")
    return _library()


@dataclass(frozen=True)
class DecodeAttention:
    """A decode layer's attention half as the whole step takes it: the two norms' (weight, eps) around it and wq,
    wk, wv, wo as nn.Linear holds them (and its QK-norm's weights where it has one), checked here once. h = x + attention(RMSNorm(x)), and RMSNorm(h) the MoE
    half's input, computed by step.c inside KernelDecodeStep (not an op of its own).

    Quantized (specs given, one a map: an int4 model may keep wv at int8): weights are the quantized wq, wk, wv, wo
    (quant.quantize's, [out, in] or [out, in/2]) and scales theirs; the norms stay in the step's float dtype."""

    norms: tuple[tuple[Tensor, float], tuple[Tensor, float]]
    weights: tuple[Tensor, Tensor, Tensor, Tensor]
    n_heads: int
    n_kv_heads: int
    specs: tuple[QuantSpec, QuantSpec, QuantSpec, QuantSpec] | None = None
    scales: tuple[Tensor, Tensor, Tensor, Tensor] | None = None
    # QK-norm: (model.Attention.qk_norm, "head" or "all"; the q and k norms' weights; their eps)
    qk_norm: tuple[str, Tensor, Tensor, float] | None = None

    def __post_init__(self) -> None:
        (n1, _), (n2, _) = self.norms
        wq, wk, wv, wo = self.weights
        D, H, G = n1.shape[0], self.n_heads, self.n_kv_heads
        Dh = wq.shape[0] // H
        shapes = {"wq": (H * Dh, D), "wk": (G * Dh, D), "wv": (G * Dh, D), "wo": (D, H * Dh)}
        want = {"attention norm": (n1, (D,)), "FFN norm": (n2, (D,))}
        if self.specs is None:
            want |= {name: (w, shapes[name]) for name, w in zip(shapes, self.weights)}
        else:
            if self.scales is None or len(self.scales) != 4 or len(self.specs) != 4:
                raise KernelError("decode attention: quantized weights need their four scales and formats")
            for (name, shape), w, sc, spec in zip(shapes.items(), self.weights, self.scales, self.specs):
                if check_weight(f"decode attention's {name}", w, sc, spec) != shape:
                    raise KernelError(f"decode attention: {name} must be {list(shape)} (as a float weight), not "
                                      f"{list(w.shape)} {spec.name}")
        if self.qk_norm is not None:
            kind, qn, kn, _ = self.qk_norm
            if kind not in QK_NORMS:
                raise KernelError(f"decode attention: QK-norm {kind!r}, expected one of {QK_NORMS}")
            want |= {"q norm": (qn, (Dh,) if kind == "head" else (H * Dh,)),
                     "k norm": (kn, (Dh,) if kind == "head" else (G * Dh,))}
        _check_weights("decode attention", n1.dtype, want)
        if H % G or Dh % 2:
            raise KernelError(f"decode attention: {H} query heads over {G} kv heads of {Dh} (the kv heads must divide "
                              f"the query heads, and rotate-half RoPE needs an even head dim)")

    @property
    def dtype(self) -> torch.dtype:
        return self.norms[0][0].dtype

    @property
    def D(self) -> int:
        return self.norms[0][0].shape[0]

    @property
    def Dh(self) -> int:
        return self.weights[0].shape[0] // self.n_heads


class KernelRouter:
    """A MoE layer's router on the kernel, for any number of tokens: softmax or sigmoid gates over w x (w the
    gate [E, D]), or, with `embeddings` [E, R] (X-MoE, w its projection [R, D]), over the cosines of w x with
    them divided by `tau`; the top_k experts and their gates (renormalized over them where asked). routing.py's
    routers, computed in float32 by the C code (the tests hold the two within the last bits of exp); where the
    plan puts a layer's experts on the kernel, this routes it in prefill and decode alike."""

    def __init__(self, w_PD: Tensor, top_k: int, gate: str = "softmax", renormalize: bool = False,
                 embeddings: Tensor | None = None, tau: float = 1.0):
        self.lib, self.dtype = _lib(), w_PD.dtype
        self.args, self._held = router_args(w_PD, top_k, gate, renormalize, embeddings, tau)
        self.D, self.E, self.K = w_PD.shape[1], self.args.E, top_k
        self._fn = self.lib.route_tokens if self.dtype == torch.float32 else self.lib.route_tokens_bf16

    def __call__(self, x_TD: Tensor) -> tuple[Tensor, Tensor]:
        """-> (expert ids [T, K] int64, gates [T, K] in x's dtype)."""
        if x_TD.dtype != self.dtype or x_TD.dim() != 2 or x_TD.shape[1] != self.D or not x_TD.is_cpu:
            raise KernelError(f"router: {self.dtype} CPU rows of {self.D}, not {x_TD.dtype} {list(x_TD.shape)}")
        x_TD = x_TD.contiguous()
        T = x_TD.shape[0]
        ids = torch.empty(T, self.K, dtype=torch.int64)
        gates = torch.empty(T, self.K, dtype=self.dtype)
        if T and self._fn(x_TD.data_ptr(), T, self.D, ctypes.byref(self.args), ids.data_ptr(), gates.data_ptr(),
                          torch.get_num_threads()):
            raise MemoryError(f"router: no memory for the scores of {T} tokens")
        return ids, gates


class KernelDecodeStep:
    """A whole decode step in one call: for B rows of one token each, the token's embedding and its position's
    RoPE angles, every layer's attention half (DecodeAttention), router (KernelRouter), experts
    (KernelExperts.moe) and residual sum, then the final RMSNorm and the LM head. Built from those parts and the
    model's tables, whose weights it uses where they lie; a model qualifies when every layer is a MoE layer whose
    parts are all on the kernel (CpuKernelBackend). The rows come as token ids, slots and positions
    and nothing else: whatever torch did around the call ran on caches the step had just flushed."""

    def __init__(self, layers: list[tuple[DecodeAttention, KernelRouter, KernelExperts | KernelQuantExperts]],
                 norm: tuple[Tensor, float], head_VD: Tensor, embedding_ND: Tensor, rope: tuple[Tensor, Tensor],
                 window: int | None = None, head_quant: tuple[Tensor, QuantSpec] | None = None):
        """Quantized weights: a layer's DecodeAttention with specs and KernelQuantExperts (both quantized or
        neither, per layer; the formats may differ map by map); head_quant = (scale, spec): head_VD is then the quantized head
        (quant.quantize's). The norms, routers, embedding and RoPE tables stay in the step's float dtype."""
        self.lib = _lib()
        first = layers[0][0]
        dtype, D, F_ = first.dtype, first.D, layers[0][2].F
        self.dtype, self.D, self.L = dtype, D, len(layers)
        self.H, self.G, self.Dh = first.n_heads, first.n_kv_heads, first.Dh
        self.E, self.K = layers[0][1].E, layers[0][1].K
        V, N, P = head_VD.shape[0], embedding_ND.shape[0], rope[0].shape[0]
        cos, sin = (t.to(dtype).contiguous() for t in rope)  # the rows it looks up, in the model's dtype
        tables = {"norm": (norm[0], (D,)), "embedding": (embedding_ND, (N, D)), "rope cos": (cos, (P, self.Dh)),
                  "rope sin": (sin, (P, self.Dh))}
        if head_quant is None:
            tables["head"] = (head_VD, (V, D))
            head_q = (None, 0, 0)
        else:
            if check_weight("decode step's head", head_VD, head_quant[0], head_quant[1]) != (V, D):
                raise KernelError(f"decode step: a quantized head of [{V}, {D}], not {list(head_VD.shape)}")
            head_q = (head_quant[0].data_ptr(), FMT[head_quant[1].bits], head_quant[1].group or 0)
        _check_weights("decode step", dtype, tables)
        structs = []
        for i, (a, router, experts) in enumerate(layers):
            quantized = isinstance(experts, KernelQuantExperts)
            same = (a.dtype, a.D, a.n_heads, a.n_kv_heads, a.Dh, router.dtype, router.D, router.E, router.K,
                    dtype if quantized else experts.dtype, experts.D, experts.E, experts.F)
            if same != (dtype, D, self.H, self.G, self.Dh, dtype, D, self.E, self.K, dtype, D, self.E, F_):
                raise KernelError(f"decode step: layer {i}'s parts are not of the first layer's sizes and dtype")
            if quantized != (a.specs is not None):
                raise KernelError(f"decode step: layer {i}'s attention is {'quantized' if a.specs else 'float'} and "
                                  f"its experts {experts.spec.name if quantized else 'float'}: both or neither")
            (n1, eps1), (n2, eps2) = a.norms
            wq, wk, wv, wo = a.weights
            if quantized:
                fmt, group, w1, w3, w2, c1, c3, c2, s1, s3, s2, t1, t3, t2 = experts.pointers
                if (self.H * self.Dh) % 32:
                    raise KernelError(f"decode step: quantized attention needs H * Dh a multiple of 32, not "
                                      f"{self.H * self.Dh}")
                cq, ck, cv, co = (t.data_ptr() for t in a.scales)
                extra = (cq, ck, cv, co, c1, c3, c2, t1, t3, t2, fmt, group, *(FMT[s.bits] for s in a.specs),
                         *(s.group or 0 for s in a.specs))
            else:
                w1, w3, w2, s1, s3, s2 = experts.pointers
                extra = ()
            qk = {}
            if a.qk_norm is not None:
                kind, qn, kn, qk_eps = a.qk_norm
                qk = dict(qn=qn.data_ptr(), kn=kn.data_ptr(), qk_eps=qk_eps, qk=1 + QK_NORMS.index(kind))
            structs.append(_Layer(n1.data_ptr(), wq.data_ptr(), wk.data_ptr(), wv.data_ptr(), wo.data_ptr(),
                                  n2.data_ptr(), eps1, eps2, router.args, w1, w3, w2, s1, s3, s2, *extra, **qk))
        self._layers = (_Layer * len(structs))(*structs)
        # the weights' storage does not move while this holds them
        self._held = (layers, norm[0], head_VD, embedding_ND, cos, sin, head_quant)
        self.args = _Model(len(structs), D, self.H, self.G, self.Dh, F_, V, self._layers, norm[0].data_ptr(),
                           head_VD.data_ptr(), norm[1], embedding_ND.data_ptr(), cos.data_ptr(), sin.data_ptr(), N, P,
                           window or 0, *head_q)
        self.V = V
        self._fn = self.lib.decode_step if dtype == torch.float32 else self.lib.decode_step_bf16
        self._caches: tuple[list[Tensor], list[Tensor], ctypes.Array, ctypes.Array] | None = None

    def __call__(self, tokens_B: Tensor, slots_B: Tensor, positions_B: Tensor, k_cache: list[Tensor],
                 v_cache: list[Tensor], scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Row b: token tokens[b] at position positions[b] of slot slots[b] (contiguous int64 [B] each), seeing
        the positions before it in its slot (within the model's sliding window); each layer's cache [slots, G,
        max_len, Dh]. -> (logits [B, V], expert ids [L, B, K] int64, gates [L, B, K], expert counts [L, E]
        int64). A token, slot or position out of range is a ValueError, raised before anything is written."""
        B = tokens_B.shape[0]
        _check_rows("decode step", B, tokens_B, slots_B, positions_B, names="tokens, slots and positions")
        kp, vp = self._cache_pointers(k_cache, v_cache)
        logits = torch.empty(B, self.V, dtype=self.dtype)
        ids = torch.empty(self.L, B, self.K, dtype=torch.int64)
        gates = torch.empty(self.L, B, self.K, dtype=self.dtype)
        counts = torch.empty(self.L, self.E, dtype=torch.int64)
        status = self._fn(ctypes.byref(self.args), tokens_B.data_ptr(), slots_B.data_ptr(), positions_B.data_ptr(), B,
                          kp, vp, k_cache[0].shape[0], k_cache[0].shape[2], scale, logits.data_ptr(), ids.data_ptr(),
                          gates.data_ptr(), counts.data_ptr(), torch.get_num_threads())
        if status == -3:
            raise ValueError(f"decode step: tokens {tokens_B.tolist()} at positions {positions_B.tolist()} of slots "
                             f"{slots_B.tolist()}: expected tokens below {self.args.n_emb}, slots below "
                             f"{k_cache[0].shape[0]} and positions below {min(k_cache[0].shape[2], self.args.n_pos)}")
        if status == -4:
            raise KernelError("decode step: a quantized weight's format does not suit its widths")
        if status:
            raise MemoryError(f"decode step: no memory for the scratch of {B} rows")
        return logits, ids, gates, counts

    def _cache_pointers(self, k_cache: list[Tensor], v_cache: list[Tensor]) -> tuple[ctypes.Array, ctypes.Array]:
        """The layers' cache tensors as arrays of pointers, checked and built once per cache."""
        held = self._caches
        if held is not None and held[0] is k_cache and held[1] is v_cache:
            return held[2], held[3]
        shape = k_cache[0].shape if k_cache else None
        if (len(k_cache) != self.L or len(v_cache) != self.L or len(shape) != 4 or shape[1] != self.G
                or shape[3] != self.Dh or any(t.shape != shape or t.dtype != self.dtype or not t.is_contiguous()
                                              or not t.is_cpu for t in (*k_cache, *v_cache))):
            raise KernelError(f"decode step: {self.L} layers' caches of contiguous {self.dtype} "
                              f"[slots, {self.G}, max_len, {self.Dh}], not {len(k_cache)} of {shape}")
        arrays = [(ctypes.c_void_p * self.L)(*(t.data_ptr() for t in c)) for c in (k_cache, v_cache)]
        self._caches = (k_cache, v_cache, *arrays)
        return arrays[0], arrays[1]
