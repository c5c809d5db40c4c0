"""A decode step on the C kernel (kernels/linear.c) in as few calls as its layers allow: a decode layer's
attention half in one call (KernelDecodeBlock), a MoE layer's router (KernelRouter), and a whole step, every
layer and the LM head, in one call (KernelDecodeStep).

Each is the calls it replaces, made in the same order on the same roundings, so the same numbers; what goes is
the Python between them. On the 644M Mixtral at batch 1 the C calls of a bf16 token took 9.5 of its 11.3 ms:
the rest was ~70 torch operations a step (the router's softmax and top-k, the residual sums, views, casts and
their dispatch), slowed further by running on caches the streamed weights had just flushed. The weights are
checked once, when these are built (Transformer.prepare_inference), and used where the model holds them; a
call checks only what it is given.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from moeserve.runtime.cpu_kernel import (
    DTYPES,
    KernelError,
    KernelExperts,
    _check_rows,
    _library,
    unavailable_reason,
)

GATES = ("softmax", "sigmoid")  # the order of linear.c's GATE_ enum


def _lib() -> ctypes.CDLL:
    why = unavailable_reason()
    if why is not None:
        raise KernelError(f"the CPU kernel is not available: {why}")
    return _library()


def _check_weights(what: str, dtype: torch.dtype, want: dict[str, tuple[Tensor, tuple[int, ...]]]) -> None:
    for name, (t, shape) in want.items():
        if (t.dtype != dtype or dtype not in DTYPES or tuple(t.shape) != shape or not t.is_contiguous()
                or not t.is_cpu):
            raise KernelError(f"{what}: {name} must be a contiguous {dtype} CPU tensor of shape {list(shape)} "
                              f"(float32 or bfloat16), not {t.dtype} {list(t.shape)}")


def _check_rope(what: str, dtype: torch.dtype, B: int, Dh: int, rope: tuple[Tensor, Tensor]) -> None:
    """A decode call's RoPE rows (cos, sin): contiguous [B, Dh] in the model's dtype, as the C code reads them."""
    for t in rope:
        if t.dtype != dtype or t.shape != (B, Dh) or not t.is_contiguous():
            raise KernelError(f"{what}: rope tables are contiguous {dtype} [{B}, {Dh}], not {t.dtype} {list(t.shape)}")


class KernelDecodeBlock:
    """A decode layer's attention half in one call: for x [B, D] (one token a row), h = x + attention(RMSNorm(x))
    and RMSNorm(h), the MoE half's input. The same operations, in the same order, as rms_norm, linear and
    attend_decode called one by one, so the same numbers, without the Python between them. The weights (the two
    norms' (weight, eps), and wq, wk, wv, wo as nn.Linear holds them) are checked once, here, and used where
    they lie."""

    def __init__(self, norms: tuple[tuple[Tensor, float], tuple[Tensor, float]],
                 weights: tuple[Tensor, Tensor, Tensor, Tensor], n_heads: int, n_kv_heads: int):
        lib = _lib()
        (n1, self.eps1), (n2, self.eps2) = norms
        wq, wk, wv, wo = weights
        D, dtype, H, G = n1.shape[0], n1.dtype, n_heads, n_kv_heads
        Dh = wq.shape[0] // H
        want = {"attention norm": (n1, (D,)), "FFN norm": (n2, (D,)), "wq": (wq, (H * Dh, D)),
                "wk": (wk, (G * Dh, D)), "wv": (wv, (G * Dh, D)), "wo": (wo, (D, H * Dh))}
        _check_weights("decode block", dtype, want)
        if H % G or Dh % 2:
            raise KernelError(f"decode block: {H} query heads over {G} kv heads of {Dh} (the kv heads must divide "
                              f"the query heads, and rotate-half RoPE needs an even head dim)")
        self.lib, self.dtype, self.D, self.H, self.G, self.Dh = lib, dtype, D, H, G, Dh
        self.weights = (n1, wq, wk, wv, wo, n2)  # their storage does not move while this holds them
        self._fn = self.lib.decode_block if dtype == torch.float32 else self.lib.decode_block_bf16

    def __call__(self, x_BD: Tensor, rope: tuple[Tensor, Tensor], k_cache: Tensor, v_cache: Tensor, slots_B: Tensor,
                 lo_B: Tensor, hi_B: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """-> (h, hn) [B, D]. rope (cos, sin) [B, Dh] and the cache arguments as attend_decode takes them: this
        step's keys and values are written into the cache, at position hi_B[b] - 1 of row b's slot."""
        B, D, Dh, dtype = x_BD.shape[0], self.D, self.Dh, self.dtype
        if (x_BD.dtype != dtype or x_BD.shape != (B, D) or not x_BD.is_contiguous() or not x_BD.is_cpu
                or k_cache.dtype != dtype or v_cache.dtype != dtype or v_cache.shape != k_cache.shape
                or k_cache.dim() != 4 or k_cache.shape[1] != self.G or k_cache.shape[3] != Dh
                or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
            raise KernelError(f"decode block: x {x_BD.dtype} {list(x_BD.shape)} and a cache of {k_cache.dtype} "
                              f"{list(k_cache.shape)}, for contiguous {dtype} CPU rows of {D} and caches of "
                              f"[slots, {self.G}, max_len, {Dh}]")
        _check_rope("decode block", dtype, B, Dh, rope)
        _check_rows("decode block", B, slots_B, lo_B, hi_B)
        scratch = torch.empty(B * (2 * D + 2 * (self.H + self.G) * Dh), dtype=dtype)
        h, hn = torch.empty_like(x_BD), torch.empty_like(x_BD)
        n1, wq, wk, wv, wo, n2 = self.weights
        self._fn(x_BD.data_ptr(), n1.data_ptr(), self.eps1, wq.data_ptr(), wk.data_ptr(), wv.data_ptr(), wo.data_ptr(),
                 n2.data_ptr(), self.eps2, rope[0].data_ptr(), rope[1].data_ptr(), k_cache.data_ptr(),
                 v_cache.data_ptr(), slots_B.data_ptr(), lo_B.data_ptr(), hi_B.data_ptr(), B, D, self.H, self.G, Dh,
                 k_cache.shape[2], scale, scratch.data_ptr(), h.data_ptr(), hn.data_ptr(), torch.get_num_threads())
        return h, hn


class _Router(ctypes.Structure):  # linear.c's struct router
    _fields_ = [("w", ctypes.c_void_p), ("emb", ctypes.c_void_p), ("P", ctypes.c_long), ("E", ctypes.c_long),
                ("K", ctypes.c_long), ("tau", ctypes.c_float), ("gate", ctypes.c_int), ("renormalize", ctypes.c_int)]


class KernelRouter:
    """A MoE layer's router on the kernel, for any number of tokens: softmax or sigmoid gates over w x (w the
    gate [E, D]), or, with `embeddings` [E, R] (X-MoE, w its projection [R, D]), over the cosines of w x with
    them divided by `tau`; the top_k experts and their gates (renormalized over them where asked). routing.py's
    routers, computed in float32 by the C code (the tests hold the two within the last bits of exp); where the
    plan puts a layer's experts on the kernel, this routes it in prefill and decode alike."""

    def __init__(self, w_PD: Tensor, top_k: int, gate: str = "softmax", renormalize: bool = False,
                 embeddings: Tensor | None = None, tau: float = 1.0):
        self.lib, self.dtype = _lib(), w_PD.dtype
        P, D = w_PD.shape
        E = P if embeddings is None else embeddings.shape[0]
        _check_weights("router", self.dtype, {"w": (w_PD, (P, D))})
        if gate not in GATES or not 0 < top_k <= E or not tau > 0:
            raise KernelError(f"router: gate {gate!r} (one of {GATES}), top_k {top_k} of {E} experts, tau {tau} > 0")
        emb = None
        if embeddings is not None:
            if embeddings.shape != (E, P):
                raise KernelError(f"router: embeddings [{E}, {P}] for a projection to {P}, not {list(embeddings.shape)}")
            emb = torch.nn.functional.normalize(embeddings.detach().float(), dim=-1).contiguous()
        self.D, self.E, self.K = D, E, top_k
        self._held = (w_PD, emb)
        self.args = _Router(w_PD.data_ptr(), None if emb is None else emb.data_ptr(), P, E, top_k, tau,
                            GATES.index(gate), int(renormalize))
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


class _Layer(ctypes.Structure):  # linear.c's struct layer
    _fields_ = [*((n, ctypes.c_void_p) for n in ("n1", "wq", "wk", "wv", "wo", "n2")), ("eps1", ctypes.c_float),
                ("eps2", ctypes.c_float), ("router", _Router),
                *((n, ctypes.c_void_p) for n in ("w1", "w3", "w2")), *((n, ctypes.c_long) for n in ("s1", "s3", "s2"))]


class _Model(ctypes.Structure):  # linear.c's struct model
    _fields_ = [*((n, ctypes.c_long) for n in ("L", "D", "H", "G", "Dh", "F", "V")), ("layers", ctypes.POINTER(_Layer)),
                ("norm", ctypes.c_void_p), ("head", ctypes.c_void_p), ("eps", ctypes.c_float),
                *((n, ctypes.c_void_p) for n in ("emb", "cos", "sin")),
                *((n, ctypes.c_long) for n in ("n_emb", "n_pos", "window"))]


class KernelDecodeStep:
    """A whole decode step in one call: for B rows of one token each, the token's embedding and its position's
    RoPE angles, every layer's attention half (KernelDecodeBlock), router (KernelRouter), experts
    (KernelExperts.moe) and residual sum, then the final RMSNorm and the LM head. Built from those parts and the
    model's tables, whose weights it uses where they lie; a model qualifies when every layer is a MoE layer whose
    parts are all on the kernel (Transformer.prepare_inference). The rows come as token ids, slots and positions
    and nothing else: whatever torch did around the call ran on caches the step had just flushed (see
    linear.c)."""

    def __init__(self, layers: list[tuple[KernelDecodeBlock, KernelRouter, KernelExperts]], norm: tuple[Tensor, float],
                 head_VD: Tensor, embedding_ND: Tensor, rope: tuple[Tensor, Tensor], window: int | None = None):
        self.lib = _lib()
        block0 = layers[0][0]
        dtype, D, F_ = block0.dtype, block0.D, layers[0][2].F
        self.dtype, self.D, self.L = dtype, D, len(layers)
        self.H, self.G, self.Dh = block0.H, block0.G, block0.Dh
        self.E, self.K = layers[0][1].E, layers[0][1].K
        V, N, P = head_VD.shape[0], embedding_ND.shape[0], rope[0].shape[0]
        cos, sin = (t.to(dtype).contiguous() for t in rope)  # the rows it looks up, in the model's dtype
        _check_weights("decode step", dtype, {"norm": (norm[0], (D,)), "head": (head_VD, (V, D)),
                                              "embedding": (embedding_ND, (N, D)), "rope cos": (cos, (P, self.Dh)),
                                              "rope sin": (sin, (P, self.Dh))})
        structs = []
        for i, (block, router, experts) in enumerate(layers):
            same = (block.dtype, block.D, block.H, block.G, block.Dh, router.dtype, router.D, router.E, router.K,
                    experts.dtype, experts.D, experts.E, experts.F)
            if same != (dtype, D, self.H, self.G, self.Dh, dtype, D, self.E, self.K, dtype, D, self.E, F_):
                raise KernelError(f"decode step: layer {i}'s parts are not of the first layer's sizes and dtype")
            n1, wq, wk, wv, wo, n2 = block.weights
            w1, w3, w2, s1, s3, s2 = experts.pointers
            structs.append(_Layer(n1.data_ptr(), wq.data_ptr(), wk.data_ptr(), wv.data_ptr(), wo.data_ptr(),
                                  n2.data_ptr(), block.eps1, block.eps2, router.args, w1, w3, w2, s1, s3, s2))
        self._layers = (_Layer * len(structs))(*structs)
        # the weights' storage does not move while this holds them
        self._held = (layers, norm[0], head_VD, embedding_ND, cos, sin)
        self.args = _Model(len(structs), D, self.H, self.G, self.Dh, F_, V, self._layers, norm[0].data_ptr(),
                           head_VD.data_ptr(), norm[1], embedding_ND.data_ptr(), cos.data_ptr(), sin.data_ptr(), N, P,
                           window or 0)
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
