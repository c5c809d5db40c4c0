"""Every op of the C kernel checked against its torch reference when the library loads (cpu_kernel._library).

A library that builds can still be wrong on this machine: a compiler that miscompiles a vector path, flags in
$MOESERVE_KERNEL_CFLAGS that change what a sum means, or a header and a C file that drifted apart in what an
argument is. None of it fails loudly: the model would give other tokens. So each op runs once on a tiny problem,
in float32 and bfloat16, against torch (linear_nt: F.linear; rms_norm: F.rms_norm; attend_decode: SDPA; moe_ffn:
experts.moe_reference; route_tokens: routing.py's routers; linear_q and moe_ffn_q: quant_kernel's references of
their exact arithmetic), and decode_step against its parts called one by one
(bit for bit: it is those calls). The first that disagrees is named, and the library is not used.

The calls go to the library directly (cpu_kernel's wrappers would ask for the library being checked). The data
comes from a seeded Generator, and the routers are built with torch's global RNG put back after, so that loading
the kernel never changes a caller's random numbers.
"""

from __future__ import annotations

import ctypes
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

THREADS = 2  # what the checks run on: the results do not depend on it
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # max |kernel - torch| / max(1, max |torch|)


class Disagrees(Exception):
    """An op's result is not its reference's (the message says how)."""


def _error(got: Tensor, want: Tensor) -> float:
    want = want.float()
    return ((got.float() - want).abs().max() / want.abs().max().clamp(min=1.0)).item()


def _expect(got: Tensor, want: Tensor, dtype: torch.dtype, reference: str, tolerance: float | None = None) -> None:
    tol = TOLERANCE[dtype] if tolerance is None else tolerance
    err = _error(got, want)
    if not err <= tol:  # NaN included
        raise Disagrees(f"{reference} (error {err:.3g}, tolerance {tol:g})")


def _p(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


# ---- the ops, called as cpu_kernel and kernel_decode call them ------------------------------------
def _fn(lib: ctypes.CDLL, name: str, dtype: torch.dtype) -> Callable:
    return getattr(lib, name if dtype == torch.float32 else f"{name}_bf16")


def _linear(lib: ctypes.CDLL, x: Tensor, w: Tensor) -> Tensor:
    (n, I), O = x.shape, w.shape[0]
    y = torch.empty(n, O, dtype=x.dtype)
    _fn(lib, "linear_nt", x.dtype)(x.data_ptr(), I, w.data_ptr(), I, y.data_ptr(), O, n, O, I, THREADS)
    return y


def _rms_norm(lib: ctypes.CDLL, x: Tensor, w: Tensor, eps: float) -> Tensor:
    y = torch.empty_like(x)
    _fn(lib, "rms_norm", x.dtype)(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps)
    return y


def _attend(lib: ctypes.CDLL, q: Tensor, k: Tensor, v: Tensor, slots: Tensor, lo: Tensor, hi: Tensor, scale: float,
            new_kv: tuple[Tensor, Tensor] | None = None, rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
    (B, H, Dh), (_, G, L, _) = q.shape, k.shape
    y = torch.empty_like(q)
    kn, vn = new_kv or (None, None)
    cs, sn = rope or (None, None)
    _fn(lib, "attend_decode", q.dtype)(q.data_ptr(), _p(kn), _p(vn), _p(cs), _p(sn), k.data_ptr(), v.data_ptr(),
                                       y.data_ptr(), slots.data_ptr(), lo.data_ptr(), hi.data_ptr(), B, H, G, Dh, L,
                                       scale, THREADS)
    return y


def _route(lib: ctypes.CDLL, x: Tensor, args: ctypes.Structure) -> tuple[Tensor, Tensor]:
    T, K = x.shape[0], args.K
    ids, gates = torch.empty(T, K, dtype=torch.int64), torch.empty(T, K, dtype=x.dtype)
    if _fn(lib, "route_tokens", x.dtype)(x.data_ptr(), T, x.shape[1], ctypes.byref(args), ids.data_ptr(),
                                         gates.data_ptr(), THREADS):
        raise MemoryError("route_tokens: no memory")
    return ids, gates


def _moe(lib: ctypes.CDLL, x: Tensor, ids: Tensor, gates: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None) -> Tensor:
    (T, D), (E, F_, _) = x.shape, w1.shape
    out = torch.empty_like(x)
    if _fn(lib, "moe_ffn", x.dtype)(x.data_ptr(), ids.data_ptr(), gates.data_ptr(), T, ids.shape[1], w1.data_ptr(),
                                    _p(w3), w2.data_ptr(), w1.stride(0), 0 if w3 is None else w3.stride(0),
                                    w2.stride(0), out.data_ptr(), E, D, F_, THREADS):
        raise Disagrees("moe_ffn refused its arguments")
    return out


# ---- the references (module attributes, so that a test can put a wrong one in) -------------------
def linear_reference(x: Tensor, w: Tensor) -> Tensor:
    return F.linear(x.float(), w.float())


def rms_norm_reference(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps)


def attention_reference(q: Tensor, k: Tensor, v: Tensor, slots: Tensor, lo: Tensor, hi: Tensor, scale: float) -> Tensor:
    """SDPA of each row's query over its slot's positions lo..hi-1, kv heads repeated for the query heads."""
    H, G = q.shape[1], k.shape[1]
    rows = []
    for b, (s, a, z) in enumerate(zip(slots.tolist(), lo.tolist(), hi.tolist())):
        kb, vb = (t[s, :, a:z].float().repeat_interleave(H // G, dim=0) for t in (k, v))
        rows.append(F.scaled_dot_product_attention(q[b, :, None].float(), kb, vb, scale=scale)[:, 0])
    return torch.stack(rows)


def experts_reference(x: Tensor, ids: Tensor, gates: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None) -> Tensor:
    from moeserve.runtime.experts import moe_reference

    return moe_reference(x.float(), ids, gates.float(), w1.float(), w2.float(), None if w3 is None else w3.float())


def router_reference(router: torch.nn.Module, x: Tensor):
    with torch.no_grad():
        return router(x)


# ---- the checks ---------------------------------------------------------------------------------
def _data(g: torch.Generator, *shape: int, scale: float = 1.0) -> Tensor:
    return torch.randn(*shape, generator=g) * scale


def check_linear(lib: ctypes.CDLL, dtype: torch.dtype, g: torch.Generator) -> None:
    x, w = _data(g, 13, 77).to(dtype), _data(g, 29, 77).to(dtype)  # 13 rows: the one-pass and the blocked paths
    _expect(_linear(lib, x, w), linear_reference(x, w), dtype, "F.linear")


def check_rms_norm(lib: ctypes.CDLL, dtype: torch.dtype, g: torch.Generator) -> None:
    x, w = _data(g, 3, 37).to(dtype), (1 + _data(g, 37, scale=0.1)).to(dtype)
    _expect(_rms_norm(lib, x, w, 1e-5), rms_norm_reference(x, w, 1e-5), dtype, "F.rms_norm")


def check_attend_decode(lib: ctypes.CDLL, dtype: torch.dtype, g: torch.Generator) -> None:
    B, H, G, Dh, L = 2, 4, 2, 12, 6
    q, k, v = _data(g, B, H, Dh).to(dtype), _data(g, 3, G, L, Dh).to(dtype), _data(g, 3, G, L, Dh).to(dtype)
    slots, lo, hi = torch.tensor([2, 0]), torch.tensor([0, 1]), torch.tensor([5, 3])
    got = _attend(lib, q, k, v, slots, lo, hi, Dh**-0.5)
    _expect(got, attention_reference(q, k, v, slots, lo, hi, Dh**-0.5), dtype, "SDPA")


def check_moe_ffn(lib: ctypes.CDLL, dtype: torch.dtype, g: torch.Generator) -> None:
    T, D, E, K, F_ = 5, 16, 4, 2, 12
    x = _data(g, T, D).to(dtype)
    ids = torch.rand(T, E, generator=g).topk(K, dim=-1).indices.contiguous()
    gates = torch.rand(T, K, generator=g).to(dtype)
    w1, w2, w3 = _data(g, E, F_, D, scale=0.25), _data(g, E, D, F_, scale=0.25), _data(g, E, F_, D, scale=0.25)
    for up in (w3, None):  # swiglu, gelu
        ws = [w.to(dtype) for w in (w1, w2)] + [None if up is None else up.to(dtype)]
        _expect(_moe(lib, x, ids, gates, *ws), experts_reference(x, ids, gates, *ws), dtype,
                f"experts.moe_reference ({'gelu' if up is None else 'swiglu'})")


def _quantized(g: torch.Generator, *shape: int, bits: int):
    from moeserve.runtime.quant import QuantSpec, quantize

    spec = QuantSpec(bits, None if bits == 8 else 32)
    return spec, quantize(_data(g, *shape, scale=0.25), spec)


def check_linear_q(lib: ctypes.CDLL, dtype: torch.dtype, g: torch.Generator) -> None:
    """int8, int4 and int6 weights, 3 rows (one pass) and 11 (the blocked path), against quant_kernel's reference of
    the same arithmetic (the activations quantized as the C code does)."""
    from moeserve.runtime.backends.quant_reference import FMT, reference_linear_q

    for bits, I in ((8, 64), (4, 64), (6, 128)):  # int6 packs 128 elements at a time
        spec, (qw, sc) = _quantized(g, 13, I, bits=bits)
        x = _data(g, 11, I).to(dtype)
        for n in (3, 11):
            y = torch.empty(n, 13, dtype=dtype)
            if _fn(lib, "linear_q", dtype)(x.data_ptr(), I, qw.data_ptr(), sc.data_ptr(), FMT[bits], spec.group or 0,
                                           y.data_ptr(), 13, n, 13, I, THREADS):
                raise Disagrees(f"reference_linear_q: it refused int{bits}")
            _expect(y, reference_linear_q(x[:n], qw, sc, spec), dtype, f"reference_linear_q (int{bits}, {n} rows)")


def check_moe_ffn_q(lib: ctypes.CDLL, dtype: torch.dtype, g: torch.Generator) -> None:
    """Quantized swiglu and gelu experts against reference_moe_q. The tolerance in float32 admits one activation
    rounded to the neighbouring int8 step (a float32 difference at a half step), which would be 1e-3 here."""
    from moeserve.runtime.backends.quant_reference import FMT, reference_moe_q

    T, D, E, K, F_ = 5, 32, 4, 2, 64
    x = _data(g, T, D).to(dtype)
    ids = torch.rand(T, E, generator=g).topk(K, dim=-1).indices.contiguous()
    gates = torch.rand(T, K, generator=g).to(dtype)
    for bits in (8, 4):
        spec, w1 = _quantized(g, E, F_, D, bits=bits)
        w3, w2 = _quantized(g, E, F_, D, bits=bits)[1], _quantized(g, E, D, F_, bits=bits)[1]
        for up in (w3, None):
            ws = {"w1": w1, "w2": w2, "w3": up}
            out = torch.empty_like(x)
            a = [w1, up, w2]
            if _fn(lib, "moe_ffn_q", dtype)(
                    x.data_ptr(), ids.data_ptr(), gates.data_ptr(), T, K, FMT[bits], spec.group or 0,
                    *(None if w is None else w[0].data_ptr() for w in a), *(None if w is None else w[1].data_ptr() for w in a),
                    *(0 if w is None else w[0].stride(0) for w in a), *(0 if w is None else w[1].stride(0) for w in a),
                    out.data_ptr(), E, D, F_, THREADS):
                raise Disagrees(f"reference_moe_q: it refused int{bits}")
            _expect(out, reference_moe_q(x, ids, gates, ws, spec), dtype,
                    f"reference_moe_q (int{bits}, {'gelu' if up is None else 'swiglu'})",
                    1e-3 if dtype == torch.float32 else None)


def _routers(D: int, E: int, K: int) -> dict[str, torch.nn.Module]:
    from moeserve.runtime.routing import SigmoidRouter, SoftmaxRouter, XMoERouter

    with torch.random.fork_rng(devices=[]):  # their initialisation draws from the global RNG: put it back
        return {"softmax": SoftmaxRouter(D, E, K), "renormalized softmax": SoftmaxRouter(D, E, K, renormalize=True),
                "sigmoid": SigmoidRouter(D, E, K), "X-MoE softmax": XMoERouter(D, E, K, 4, "softmax", 0.3, 0.1),
                "X-MoE sigmoid": XMoERouter(D, E, K, 4, "sigmoid", 0.5, 0.1)}


def check_route_tokens(lib: ctypes.CDLL, dtype: torch.dtype, g: torch.Generator) -> None:
    """Values on a grid of quarters, so that w x is exact in any order of summation in either dtype: both sides
    then rank the same scores, and the ids are compared wherever the ranking has no tie."""
    from moeserve.runtime.backends.kernel_abi import router_args
    from moeserve.runtime.routing import SoftmaxRouter, XMoERouter

    D, E, K, T = 16, 6, 2, 8
    x = (torch.randint(-4, 5, (T, D), generator=g) / 4).to(dtype)
    for name, router in _routers(D, E, K).items():
        router = router.to(dtype)
        with torch.no_grad():
            w = router.proj.weight if isinstance(router, XMoERouter) else router.gate.weight
            w.copy_(torch.randint(-4, 5, tuple(w.shape), generator=g) / 4)
            if isinstance(router, XMoERouter):
                router.expert_embeddings.copy_(_data(g, E, 4))
                args, held = router_args(w, K, router.gate_kind, embeddings=router.expert_embeddings,
                                         tau=float(router.tau.float().clamp(min=1e-3)))
            elif isinstance(router, SoftmaxRouter):
                args, held = router_args(w, K, "softmax", router.renormalize)
            else:
                args, held = router_args(w, K, "sigmoid")
        ids, gates = _route(lib, x, args)
        ref = router_reference(router, x)
        top = ref.scores.float().sort(dim=-1, descending=True).values[:, : K + 1]
        clear = (top[:, :-1] - top[:, 1:]).min(dim=-1).values > 1e-4
        if not torch.equal(ids[clear], ref.expert_ids[clear]):
            raise Disagrees(f"routing.py's {name} router (experts {ids.tolist()}, not {ref.expert_ids.tolist()})")
        _expect(gates[clear], ref.gates[clear], dtype, f"routing.py's {name} router's gates")
        del held


def check_decode_step(lib: ctypes.CDLL, dtype: torch.dtype, g: torch.Generator) -> None:
    """Two layers, two rows at different positions and slots: logits, routes, counts and the caches written
    equal to the ops' own calls one by one (rms_norm, linear_nt, attend_decode with the cache write and RoPE,
    route_tokens, moe_ffn, the residual sums in torch)."""
    from moeserve.runtime.backends.kernel_abi import _Layer, _Model, router_args

    nL, D, H, G, Dh, E, K, F_, V, P, S = 2, 16, 2, 1, 8, 4, 2, 12, 11, 8, 2
    mk = lambda *shape, scale=0.3: _data(g, *shape, scale=scale).to(dtype)  # noqa: E731
    layers = [dict(n1=1 + mk(D), wq=mk(H * Dh, D), wk=mk(G * Dh, D), wv=mk(G * Dh, D), wo=mk(D, H * Dh), n2=1 + mk(D),
                   gate=mk(E, D), w1=mk(E, F_, D), w3=mk(E, F_, D), w2=mk(E, D, F_)) for _ in range(nL)]
    norm, head, emb, cos, sin = 1 + mk(D), mk(V, D), mk(V, D, scale=1.0), mk(P, Dh, scale=1.0), mk(P, Dh, scale=1.0)
    routers = [router_args(ly["gate"], K, "softmax") for ly in layers]
    structs = (_Layer * nL)(*(_Layer(*(ly[n].data_ptr() for n in ("n1", "wq", "wk", "wv", "wo", "n2")), 1e-5, 1e-6,
                                     r[0], *(ly[n].data_ptr() for n in ("w1", "w3", "w2")),
                                     *(ly[n].stride(0) for n in ("w1", "w3", "w2")))
                              for ly, r in zip(layers, routers)))
    model = _Model(nL, D, H, G, Dh, F_, V, structs, norm.data_ptr(), head.data_ptr(), 1e-5, emb.data_ptr(),
                   cos.data_ptr(), sin.data_ptr(), V, P, 0)
    tokens, slots, pos = torch.tensor([3, 7]), torch.tensor([1, 0]), torch.tensor([3, 5])
    caches = [[mk(S, G, P, Dh, scale=1.0) for _ in range(nL)] for _ in "kv"]
    mine = [[t.clone() for t in c] for c in caches]
    pointers = [(ctypes.c_void_p * nL)(*(t.data_ptr() for t in c)) for c in mine]
    logits, ids = torch.empty(2, V, dtype=dtype), torch.empty(nL, 2, K, dtype=torch.int64)
    gates, counts = torch.empty(nL, 2, K, dtype=dtype), torch.empty(nL, E, dtype=torch.int64)
    if _fn(lib, "decode_step", dtype)(ctypes.byref(model), tokens.data_ptr(), slots.data_ptr(), pos.data_ptr(), 2,
                                      *pointers, S, P, Dh**-0.5, logits.data_ptr(), ids.data_ptr(), gates.data_ptr(),
                                      counts.data_ptr(), THREADS):
        raise Disagrees("its parts: it refused its arguments")

    x, lo, hi, rope = emb[tokens], torch.zeros(2, dtype=torch.int64), pos + 1, (cos[pos], sin[pos])
    want_ids, want_gates, want_counts = [], [], []
    for ly, (args, _), k, v in zip(layers, routers, *caches):
        xn = _rms_norm(lib, x, ly["n1"], 1e-5)
        q, kn, vn = (_linear(lib, xn, ly[n]) for n in ("wq", "wk", "wv"))
        att = _attend(lib, q.view(2, H, Dh), k, v, slots, lo, hi, Dh**-0.5, (kn.view(2, G, Dh), vn.view(2, G, Dh)),
                      rope)
        h = x + _linear(lib, att.view(2, H * Dh), ly["wo"])
        hn = _rms_norm(lib, h, ly["n2"], 1e-6)
        i, gt = _route(lib, hn, args)
        x = h + _moe(lib, hn, i, gt, ly["w1"], ly["w2"], ly["w3"])
        want_ids.append(i), want_gates.append(gt), want_counts.append(torch.bincount(i.flatten(), minlength=E))
    want = _linear(lib, _rms_norm(lib, x, norm, 1e-5), head)
    for what, a, b in (("logits", logits, want), ("expert ids", ids, torch.stack(want_ids)),
                       ("gates", gates, torch.stack(want_gates)), ("counts", counts, torch.stack(want_counts)),
                       ("caches", torch.stack([t for c in mine for t in c]), torch.stack([t for c in caches for t in c]))):
        if not torch.equal(a, b):
            raise Disagrees(f"its parts called one by one (its {what} differ)")


CHECKS = {"linear_nt": check_linear, "rms_norm": check_rms_norm, "attend_decode": check_attend_decode,
          "moe_ffn": check_moe_ffn, "linear_q": check_linear_q, "moe_ffn_q": check_moe_ffn_q, "route_tokens": check_route_tokens, "decode_step": check_decode_step}


def self_check(lib: ctypes.CDLL) -> str | None:
    """None where every op agrees with its reference in float32 and bfloat16; else which op disagreed, and how."""
    for op, check in CHECKS.items():
        for dtype in (torch.float32, torch.bfloat16):
            try:
                check(lib, dtype, torch.Generator().manual_seed(0))
            except Disagrees as e:
                return f"the built kernel's {op} disagrees with {e} in {str(dtype).removeprefix('torch.')}: not used"
    return None
