"""Inference dispatch: every fast path equals the plain per-expert loop `moe_reference`.

Paths (backends/experts.py): `moe_gather` (few tokens), `moe_grouped` (many: a loop over experts, or one
`grouped_mm` call), each on plain or oneDNN-prepacked weights, and the VQ table (backends/eager.py) for
vq_input='code' (backends/eager.py). Checked here:
  1. each path on the same weights and routing as the reference: T from 1 to 2048, K in 1, 2, 4,
     gelu and swiglu, experts that receive no token, every token on the same experts;
  2. a whole MoELayer for every router kind: the path `TorchExperts.forward` picks (forced by
     gather_max) gives the layer's reference output, and the VQ code layer really uses its table;
  3. expert-load counts and the token mask (padding neither counted nor changing real tokens);
  4. a laid-out layer put back to plain (backends/layout.py) trains again: the training path, its gradients;
  5. the same on CUDA (grouped_mm), where a device is present.

Tolerances. fp32: 1e-5 absolute, inputs scaled so that outputs are O(1) (|y| < 10). bf16: against
the reference computed in fp32 from the same bf16 inputs, weights and gates, atol = rtol = 2^-4
(bf16 keeps 8 significant bits; the hidden activations, each expert's output, its product with the
gate and each of the K accumulations are rounded, in an order that differs by path. The largest
error in these cases, 0.05 for K=4 swiglu, is as large for the bf16 reference loop itself and
under half the tolerance), and a mean absolute error below 2^-7 (measured: at most 0.0036).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import moeserve.runtime.backends.experts as inference_mod
import moeserve.runtime.experts as experts_mod
from moeserve.config import MoEConfig
from moeserve.runtime import device
from moeserve.runtime.backends.packing import onednn_packing_available
from moeserve.runtime.experts import Experts, moe_reference
from moeserve.runtime.backends.experts import (
    InferenceWeights, expert_counts, fuse_expert_weights, moe_gather, moe_grouped,
)
from moeserve.runtime.backends.eager import TableMoELayer, lay_out_moe
from moeserve.runtime.backends.experts import TorchExperts, lay_out_experts
from moeserve.runtime.backends.layout import plain_
from moeserve.runtime.moe import MoELayer
from moeserve.runtime.routing import capacity_keep

E, D, FF = 8, 32, 48
UNUSED = (3, 6)  # experts that the "unused" routing pattern never picks
SAME = (5, 0, 2, 7)  # the experts every token picks in the "same" pattern (first K of them)
TOKENS = (1, 2, 7, 64, 513, 2048)

FP32_ATOL = 1e-5
BF16_TOL = 2**-4
BF16_MEAN = 2**-7

# path name -> (dispatch function, grouped_mm flag of the InferenceWeights)
PATHS = {"gather": (moe_gather, False), "grouped": (moe_grouped, False), "grouped_mm": (moe_grouped, True)}



pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one intra-op thread (tests/conftest.py)


def skip_unless_packing(pack: bool, dtype: torch.dtype, device: str = "cpu") -> None:
    if pack and not onednn_packing_available(device, dtype):
        pytest.skip(f"oneDNN weight packing not available for {dtype} on {device} here")


# ---------------------------------------------------------------------------------------------
# 1. each path on fixed weights and routing


@functools.cache
def expert_weights(act: str, dtype: torch.dtype, device: str = "cpu"):
    """w1, w2, w3 scaled so that x W1^T ~ N(0, 1) for x ~ N(0, I) and the output is O(1)."""
    g = torch.Generator().manual_seed(1 if act == "gelu" else 2)
    w1 = torch.randn(E, FF, D, generator=g) / D**0.5
    w2 = torch.randn(E, D, FF, generator=g) / FF**0.5
    w3 = torch.randn(E, FF, D, generator=g) / D**0.5 if act == "swiglu" else None
    return tuple(None if w is None else w.to(device=device, dtype=dtype) for w in (w1, w2, w3))


@functools.cache
def inference_weights(act: str, dtype: torch.dtype, pack: bool, grouped_mm: bool,
                      device: str = "cpu") -> InferenceWeights:
    w1, w2, w3 = expert_weights(act, dtype, device)
    return fuse_expert_weights(w1, w2, w3, act, pack, grouped_mm)


def assignments(T: int, K: int, pattern: str = "random", dtype: torch.dtype = torch.float32, seed: int = 0):
    """x [T, D], distinct expert ids [T, K] and positive gates [T, K].
    random: over all experts; unused: never the UNUSED experts; same: every token the same K."""
    g = torch.Generator().manual_seed(seed * 7919 + T * 31 + K)
    x = torch.randn(T, D, generator=g)
    scores = torch.randn(T, E, generator=g)
    if pattern == "unused":
        scores[:, list(UNUSED)] = -float("inf")
    ids = scores.topk(K, dim=-1).indices
    if pattern == "same":
        ids = torch.tensor(SAME[:K]).expand(T, K).contiguous()
    gates = torch.rand(T, K, generator=g) + 0.1
    return x.to(dtype), ids, gates.to(dtype)


def reference_fp32(x, ids, gates, act, dtype):
    """moe_reference in fp32 on exactly the values the path saw (after their rounding to `dtype`)."""
    w1, w2, w3 = expert_weights(act, dtype)
    return moe_reference(x.float(), ids, gates.float(), w1.float(), w2.float(), None if w3 is None else w3.float())


def check_bf16(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.dtype == torch.bfloat16
    err = (y.float() - ref).abs()
    torch.testing.assert_close(y.float(), ref, atol=BF16_TOL, rtol=BF16_TOL)
    assert err.mean() < BF16_MEAN, f"mean |error| {err.mean():.4g} >= {BF16_MEAN}"


def run_path(path: str, pack: bool, act: str, dtype: torch.dtype, x, ids, gates):
    fn, grouped_mm = PATHS[path]
    w = inference_weights(act, dtype, pack, grouped_mm)
    with torch.no_grad():
        return fn(x, ids, gates, w)


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("act", ["swiglu", "gelu"])
@pytest.mark.parametrize("pack", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("path", list(PATHS))
def test_path_equals_reference_fp32(path, pack, act, K, T):
    skip_unless_packing(pack, torch.float32)
    x, ids, gates = assignments(T, K)
    y = run_path(path, pack, act, torch.float32, x, ids, gates)
    ref = reference_fp32(x, ids, gates, act, torch.float32)
    assert ref.abs().max() < 10 and (T < 7 or ref.abs().mean() > 0.1)  # O(1) outputs: atol is meaningful
    torch.testing.assert_close(y, ref, atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("T", [1, 7, 513])
@pytest.mark.parametrize("pattern", ["unused", "same"])
@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("act", ["swiglu", "gelu"])
@pytest.mark.parametrize("pack", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("path", list(PATHS))
def test_path_equals_reference_with_idle_experts(path, pack, act, K, pattern, T):
    """Experts with no token (empty groups: zero-length blocks, repeated grouped_mm offsets)."""
    skip_unless_packing(pack, torch.float32)
    x, ids, gates = assignments(T, K, pattern)
    hit = set(ids.unique().tolist())
    assert hit.isdisjoint(UNUSED) if pattern == "unused" else hit == set(SAME[:K])
    y = run_path(path, pack, act, torch.float32, x, ids, gates)
    torch.testing.assert_close(y, reference_fp32(x, ids, gates, act, torch.float32), atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("T", [1, 7, 64, 513, 2048])
@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("act", ["swiglu", "gelu"])
@pytest.mark.parametrize("pack", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("path", list(PATHS))
def test_path_equals_reference_bf16(path, pack, act, K, T):
    skip_unless_packing(pack, torch.bfloat16)
    x, ids, gates = assignments(T, K, "unused" if T == 64 else "random", dtype=torch.bfloat16)
    y = run_path(path, pack, act, torch.bfloat16, x, ids, gates)
    check_bf16(y, reference_fp32(x, ids, gates, act, torch.bfloat16))


def test_fused_layout():
    """SwiGLU's gate and up rows stacked per expert; packing keeps stacked copies only for grouped_mm."""
    w1, w2, w3 = expert_weights("swiglu", torch.float32)
    w = fuse_expert_weights(w1, w2, w3, "swiglu", pack=False)
    assert w.n_experts == E and w.d_ff == FF and not w.packed and not w.grouped_mm
    assert torch.equal(w.w13[3], torch.cat([w1[3], w3[3]])) and torch.equal(w.w2[3], w2[3])
    assert w.w13_EFD.shape == (E, 2 * FF, D)
    if onednn_packing_available("cpu", torch.float32):
        assert fuse_expert_weights(w1, w2, w3, "swiglu", pack=True).w13_EFD is None
        assert fuse_expert_weights(w1, w2, w3, "swiglu", pack=True, grouped_mm=True).w13_EFD is not None


# ---------------------------------------------------------------------------------------------
# which path Experts.forward takes


@pytest.fixture
def calls(monkeypatch):
    """Records, in order, each dispatch function and kernel the experts code calls."""
    seen: list[str] = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            seen.append(name)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(experts_mod, "moe_sorted", spy("moe_sorted", experts_mod.moe_sorted))
    for name in ("moe_sorted", "moe_gather", "moe_grouped", "packed_linear"):
        monkeypatch.setattr(inference_mod, name, spy(name, getattr(inference_mod, name)))
    monkeypatch.setattr(inference_mod.F, "grouped_mm", spy("grouped_mm", inference_mod.F.grouped_mm))
    return seen


def make_experts(act: str = "swiglu") -> Experts:
    ex = Experts(E, D, FF, act)
    w1, w2, w3 = expert_weights(act, torch.float32)
    with torch.no_grad():
        ex.w1.copy_(w1)
        ex.w2.copy_(w2)
        if w3 is not None:
            ex.w3.copy_(w3)
    return ex


@pytest.mark.parametrize("gather_max", [0, 1, 16, 63])
@pytest.mark.parametrize("K", [1, 2, 4])
def test_experts_forward_picks_gather_up_to_gather_max(calls, K, gather_max):
    ex = lay_out_experts(make_experts(), pack=False, grouped_mm=False, gather_max=gather_max)
    for T in sorted({max(gather_max, 1), gather_max + 1}):
        x, ids, gates = assignments(T, K)
        calls.clear()
        with torch.no_grad():
            y = ex(x, ids, gates)
        want = "moe_gather" if T <= gather_max else "moe_grouped"  # a token count, whatever K is
        assert calls == [want], f"T={T} K={K} gather_max={gather_max}"
        torch.testing.assert_close(y, reference_fp32(x, ids, gates, "swiglu", torch.float32), atol=FP32_ATOL, rtol=0)


def test_experts_forward_defaults(calls):
    """Plain, or laid out but with a capacity mask, the sorted path; gather_max defaults to 1 token."""
    ex = make_experts()
    x, ids, gates = assignments(16, 1)
    with torch.no_grad():
        ex(x, ids, gates)
        assert calls == ["moe_sorted"]
        ex = lay_out_experts(ex, pack=False)
        w = ex.w
        assert isinstance(ex, TorchExperts) and w.gather_max == 1 and not w.grouped_mm  # grouped_mm=None: CUDA only
        calls.clear()
        ex(*assignments(1, 1))
        ex(*assignments(2, 1))
        assert calls == ["moe_gather", "moe_grouped"]
        calls.clear()
        keep = torch.ones_like(ids, dtype=torch.bool)
        keep[0] = False
        y = ex(x, ids, gates, keep)
        assert calls == ["moe_sorted"]
    w1, w2, w3 = expert_weights("swiglu", torch.float32)
    torch.testing.assert_close(y, moe_reference(x, ids, gates, w1, w2, w3, keep), atol=FP32_ATOL, rtol=0)
    assert torch.equal(y[0], torch.zeros(D))


# ---------------------------------------------------------------------------------------------
# 4. a layout put back to plain trains again


@pytest.mark.parametrize("act", ["swiglu", "gelu"])
@pytest.mark.parametrize("T", [1, 64])
def test_plain_again_after_lay_out_takes_the_training_path(calls, act, T):
    K = 2
    laid = lay_out_experts(make_experts(act), pack=onednn_packing_available("cpu", torch.float32), gather_max=10**9)
    ex = laid.plain()
    assert type(ex) is Experts and not hasattr(ex, "w") and ex.w1 is laid.w1
    x, ids, gates = assignments(T, K)
    gy = torch.randn(T, D, generator=torch.Generator().manual_seed(5))
    (ex(x, ids, gates) * gy).sum().backward()
    assert calls == ["moe_sorted"]

    params = [p for p in (ex.w1, ex.w2, ex.w3) if p is not None]
    leaves = [p.detach().clone().requires_grad_(True) for p in params]
    (moe_reference(x, ids, gates, *leaves) * gy).sum().backward()
    for name, p, leaf in zip(("w1", "w2", "w3"), params, leaves):
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        torch.testing.assert_close(p.grad, leaf.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"grad {name}: {m}")


# ---------------------------------------------------------------------------------------------
# 2. a whole MoELayer, every router kind

LD, LF = 64, 96  # the layer tests' d_model and d_ff

ROUTERS = {
    "softmax": dict(router="softmax"),
    "softmax_renorm": dict(router="softmax", renormalize=True),
    "sigmoid": dict(router="sigmoid"),
    "xmoe_softmax": dict(router="xmoe"),
    "xmoe_sigmoid": dict(router="xmoe", xmoe_gate="sigmoid"),
    "vq_mixed_code": dict(router="vq", vq_mode="mixed", vq_input="code"),
    "vq_mixed_code_proj": dict(router="vq", vq_mode="mixed", vq_input="code", vq_dim=16),
    "vq_mixed_blend": dict(router="vq", vq_mode="mixed", vq_input="blend"),
    "vq_discrete_code": dict(router="vq", vq_mode="discrete", vq_input="code"),
    "vq_discrete_code_proj_cos": dict(router="vq", vq_mode="discrete", vq_input="code", vq_dim=16,
                                      vq_distance="cosine"),
    "vq_discrete_blend": dict(router="vq", vq_mode="discrete", vq_input="blend"),
}


def is_discrete(name: str) -> bool:
    return ROUTERS[name].get("vq_mode") == "discrete"


def uses_table(name: str) -> bool:
    return ROUTERS[name].get("router") == "vq" and ROUTERS[name].get("vq_input") == "code"


# (router, K); K means nothing to the discrete VQ layer (one expert per token), so it runs once
ROUTER_K = [pytest.param(name, K, id=f"{name}-k{K}")
            for name in ROUTERS for K in ((1,) if is_discrete(name) else (1, 2, 4))]

# name -> (gather_max, grouped_mm) that forces the path
FORCE = {"gather": (10**9, False), "grouped": (0, False), "grouped_mm": (0, True)}


@functools.cache
def centres() -> torch.Tensor:
    return torch.randn(E, LD, generator=torch.Generator().manual_seed(11))


def layer_input(B: int, S: int, seed: int = 0) -> torch.Tensor:
    """Tokens scattered around E centres, so VQ codes (initialised at the centres) hit every expert."""
    g = torch.Generator().manual_seed(seed + 100 * B + S)
    which = torch.randint(0, E, (B, S), generator=g)
    return centres()[which] + 0.3 * torch.randn(B, S, LD, generator=g)


def make_layer(name: str, K: int = 2, dtype: torch.dtype = torch.float32, **overrides) -> MoELayer:
    cfg = MoEConfig(d_model=LD, d_ff=LF, n_experts=E, top_k=K, **ROUTERS[name], **overrides)
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    with torch.no_grad():
        ex = layer.experts
        for w, fan_in in ((ex.w1, LD), (ex.w2, LF), (ex.w3, LD)):
            if w is not None:
                w.normal_(0.0, fan_in**-0.5)  # O(1) outputs for |x| ~ sqrt(D), unlike the 0.02 default
        q = layer.quantizer
        if q is not None:
            # Eval mode never initialises the codebook from data (only the first training batch does);
            # the random N(0, 1) codebook would send most tokens to one or two codes. Start the codes at
            # the data's centres, as that initialisation would.
            q.codebook.copy_(q.encode(centres()))
            if cfg.vq_distance == "cosine":  # rows of any norm: cosine search and the table use the unit ones
                q.codebook.mul_(torch.rand(E, 1, generator=torch.Generator().manual_seed(3)) * 2 + 0.5)
            q.initialized.fill_(True)
    return layer.to(dtype).eval()


def layer_reference(layer: MoELayer, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, expert load) from moe_reference and the layer's router / quantizer (routers are
    tested against formulas in test_routing.py), composed as moe.py's docstring says."""
    cfg, ex = layer.cfg, layer.experts
    w = (ex.w1, ex.w2, ex.w3)
    if layer.router is not None:
        r = layer.router(x_TD)
        ids_TK = r.expert_ids
        keep_TK = None
        if cfg.capacity_factor is not None:
            capacity = math.ceil(cfg.capacity_factor * x_TD.shape[0] * ids_TK.shape[1] / E)  # ceil(cf T K / E)
            keep_TK = capacity_keep(ids_TK, E, capacity)
        continuous = moe_reference(x_TD, ids_TK, r.gates, *w, keep_TK=keep_TK)
        load = torch.bincount(ids_TK.reshape(-1) if keep_TK is None else ids_TK[keep_TK], minlength=E)
        if layer.quantizer is None:
            return continuous, load
    q = layer.quantizer
    codes_T = q.nearest(q.encode(x_TD))
    v_TC = q.vectors()[codes_T].to(x_TD.dtype)
    v_TD = q.up(v_TC) if q.up is not None else v_TC
    x_tilde = v_TD if cfg.vq_input == "code" else (1 - 2 * cfg.vq_blend_rate) * x_TD + cfg.vq_blend_rate * v_TD
    ones_T1 = torch.ones(x_TD.shape[0], 1, dtype=x_TD.dtype)
    discrete = moe_reference(x_tilde, codes_T[:, None], ones_T1, *w)
    if layer.mix is None:
        return discrete, torch.bincount(codes_T, minlength=E)
    g_T2 = layer.mix(x_TD).float().softmax(dim=-1).to(x_TD.dtype)
    return g_T2[:, :1] * continuous + g_T2[:, 1:] * discrete, load  # load: the continuous router's


def expected_calls(name: str, path: str) -> list[str]:
    """Dispatch calls of one layer forward: the continuous SMoE, then the discrete VQ experts
    unless the table replaces them."""
    n = (0 if is_discrete(name) else 1) + (0 if uses_table(name) else int(ROUTERS[name].get("router") == "vq"))
    return [{"gather": "moe_gather"}.get(path, "moe_grouped")] * n


@pytest.mark.parametrize("pack", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("path", list(FORCE))
@pytest.mark.parametrize("name,K", ROUTER_K)
def test_layer_inference_equals_reference(calls, name, K, path, pack):
    skip_unless_packing(pack, torch.float32)
    layer = make_layer(name, K)
    shapes = [(1, 1), (1, 7), (4, 50)]
    with torch.no_grad():
        xs = [layer_input(B, S) for B, S in shapes]
        refs = [layer_reference(layer, x.reshape(-1, LD)) for x in xs]
        calls.clear()
        ys_sorted = [layer(x)[0] for x in xs]  # no inference layout yet: the sorted (training) path
        assert set(calls) == {"moe_sorted"}

        gather_max, grouped_mm = FORCE[path]
        layer = lay_out_moe(layer, pack=pack, grouped_mm=grouped_mm, gather_max=gather_max)
        assert isinstance(layer, TableMoELayer) == uses_table(name)
        for (B, S), x, y_sorted, (ref, load) in zip(shapes, xs, ys_sorted, refs):
            calls.clear()
            y, aux = layer(x)
            msg = f"{name} K={K} {path} pack={pack} B,S={B},{S}"
            torch.testing.assert_close(y_sorted.reshape(-1, LD), ref, atol=FP32_ATOL, rtol=0)
            torch.testing.assert_close(y.reshape(-1, LD), ref, atol=FP32_ATOL, rtol=0, msg=lambda m: f"{msg}: {m}")
            assert torch.equal(aux.counts, load), msg
            assert int(load.sum()) == B * S * (1 if is_discrete(name) else K)

            want = expected_calls(name, path)
            dispatch = [c for c in calls if c.startswith("moe_")]
            assert dispatch == want, msg
            if want:  # the kernels the fused layout promised
                assert ("grouped_mm" in calls) == (path == "grouped_mm"), msg
                assert ("packed_linear" in calls) == (pack and path != "grouped_mm"), msg
            if ROUTERS[name].get("router") == "vq" and B * S >= 64:  # the test means something
                assert aux.codes.unique().numel() >= E - 1, aux.codes.bincount(minlength=E)


@pytest.mark.parametrize("name", ["vq_mixed_code", "vq_discrete_code", "vq_discrete_code_proj_cos"])
def test_vq_table_is_each_experts_output_on_its_code(name):
    """table[j] = f_j(x~_j): one row per expert, so a code layer's discrete path is a lookup (blend
    layers, whose x~ depends on x, get none: checked in test_layer_inference_equals_reference)."""
    layer = lay_out_moe(make_layer(name), pack=False)
    q = layer.quantizer
    with torch.no_grad():
        v = q.vectors()
        x_tilde = q.up(v) if q.up is not None else v
        want = moe_reference(x_tilde, torch.arange(E)[:, None], torch.ones(E, 1), *(
            layer.experts.w1, layer.experts.w2, layer.experts.w3))
    assert layer.table.shape == (E, LD)
    torch.testing.assert_close(layer.table, want, atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("K", [1, 2])
def test_capacity_limited_layer_stays_on_sorted_path(calls, K):
    """A capacity limit hands Experts a keep mask, which only the sorted path honours."""
    layer = lay_out_moe(make_layer("softmax", K, capacity_factor=0.5), pack=False, gather_max=10**9)
    x = layer_input(2, 40)
    with torch.no_grad():
        y, aux = layer(x)
        ref, load = layer_reference(layer, x.reshape(-1, LD))
    assert [c for c in calls if c.startswith("moe_")] == ["moe_sorted"]
    torch.testing.assert_close(y.reshape(-1, LD), ref, atol=FP32_ATOL, rtol=0)
    assert torch.equal(aux.counts, load) and int(load.sum()) < 80 * K


@pytest.mark.parametrize("name", ["softmax", "vq_mixed_code", "vq_discrete_code", "vq_discrete_blend"])
@pytest.mark.parametrize("pack", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("path", list(FORCE))
def test_layer_inference_bf16(name, path, pack):
    """bf16 layer: routing is decided in bf16, so the fast paths are compared with the same layer's
    sorted path (both bf16, same decisions) and, for the discrete code layer (the table), with
    moe_reference in fp32 on the bf16 weights and codes."""
    skip_unless_packing(pack, torch.bfloat16)
    layer = make_layer(name, 2, torch.bfloat16)
    x = layer_input(2, 40).bfloat16()
    with torch.no_grad():
        y_sorted, aux_sorted = layer(x)
        codes = aux_sorted.codes
        gather_max, grouped_mm = FORCE[path]
        layer = lay_out_moe(layer, pack=pack, grouped_mm=grouped_mm, gather_max=gather_max)
        y, aux = layer(x)
    if codes is not None:
        assert torch.equal(aux.codes, codes)
    torch.testing.assert_close(y.float(), y_sorted.float(), atol=BF16_TOL, rtol=BF16_TOL)
    if name == "vq_discrete_code":  # y = f_k(v_k): the fp32 reference on the bf16 weights and codes
        ex = layer.experts
        v = layer.quantizer.vectors().float()[codes]
        ref = moe_reference(v, codes[:, None], torch.ones(codes.shape[0], 1), ex.w1.float(), ex.w2.float(),
                            ex.w3.float())
        check_bf16(y.reshape(-1, LD), ref.detach())


@pytest.mark.parametrize("onednn_bf16", ["this cpu", "forced off"])
@pytest.mark.parametrize("path", list(FORCE))
def test_bf16_layout_follows_the_packing_probe(monkeypatch, onednn_bf16, path):
    """lay_out_experts' default in bf16 packs only where oneDNN can (AVX512 / AMX); elsewhere the weights
    stay plain and every path still equals the reference. The plain side is forced on every machine."""
    if onednn_bf16 == "forced off":
        monkeypatch.setattr(device, "onednn_bf16_available", lambda: False)
    layer = make_layer("softmax", 2, torch.bfloat16)
    x = layer_input(2, 40).bfloat16()
    with torch.no_grad():
        y_sorted, _ = layer(x)
        gather_max, grouped_mm = FORCE[path]
        layer.experts = lay_out_experts(layer.experts, grouped_mm=grouped_mm, gather_max=gather_max)
        w = layer.experts.w
        assert w.packed == onednn_packing_available("cpu", torch.bfloat16)
        if onednn_bf16 == "forced off":
            assert not w.packed
        y, _ = layer(x)
    torch.testing.assert_close(y.float(), y_sorted.float(), atol=BF16_TOL, rtol=BF16_TOL)


# ---------------------------------------------------------------------------------------------
# 3. token mask and expert load


@pytest.mark.parametrize("path", ["sorted"] + list(FORCE))
@pytest.mark.parametrize("name", ["softmax", "sigmoid", "xmoe_softmax", "vq_mixed_code", "vq_mixed_blend",
                                  "vq_discrete_code", "vq_discrete_blend"])
def test_token_mask_padding_is_not_routed_or_counted(name, path):
    layer = make_layer(name, 2)
    if path != "sorted":
        gather_max, grouped_mm = FORCE[path]
        layer = lay_out_moe(layer, pack=False, grouped_mm=grouped_mm, gather_max=gather_max)
    B, S = 3, 24
    x = layer_input(B, S, seed=4)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, 15:] = False  # right padding
    mask[2, :] = False  # a row of padding only
    mask[0, :3] = False  # left padding
    with torch.no_grad():
        y_full, aux_full = layer(x)
        counts_full = aux_full.counts
        y, aux = layer(x, mask)
        counts = aux.counts
        ref, load = layer_reference(layer, x[mask])
        # padding filled with garbage changes nothing
        y_garbage, _ = layer(torch.where(mask[..., None], x, torch.full_like(x, 1e4)), mask)
        y_all, _ = layer(x, torch.ones(B, S, dtype=torch.bool))
        y_none, aux_none = layer(x, torch.zeros(B, S, dtype=torch.bool))
        counts_none = aux_none.counts
    assert y.shape == x.shape
    assert torch.equal(y[~mask], torch.zeros_like(y[~mask]))
    torch.testing.assert_close(y[mask], ref, atol=FP32_ATOL, rtol=0)
    torch.testing.assert_close(y[mask], y_full[mask], atol=FP32_ATOL, rtol=0)  # padding changes no real token
    assert torch.equal(y_garbage, y)
    assert torch.equal(counts, load)
    assert int(counts.sum()) == int(mask.sum()) * (1 if is_discrete(name) else 2)
    assert int(counts_full.sum()) > int(counts.sum())
    assert torch.equal(y_all, y_full)
    assert torch.equal(y_none, torch.zeros_like(x)) and int(counts_none.sum()) == 0


@pytest.mark.parametrize("name", ["softmax", "vq_mixed_code", "vq_discrete_code"])
def test_layer_training_path_after_lay_out_and_plain(calls, name):
    """A laid-out layer put back to plain (the VQ table and the experts' layout gone) trains: gradients reach
    every expert weight, and the output is the reference one."""
    laid = lay_out_moe(make_layer(name, 2), pack=onednn_packing_available("cpu", torch.float32), gather_max=10**9)
    layer = laid.plain() if isinstance(laid, TableMoELayer) else laid
    plain_(layer)
    assert type(layer) is MoELayer and type(layer.experts) is Experts
    x = layer_input(1, 32, seed=2)
    calls.clear()
    y, _ = layer(x)
    assert {c for c in calls if c.startswith("moe_")} == {"moe_sorted"}
    with torch.no_grad():
        ref, _ = layer_reference(layer, x.reshape(-1, LD))
    torch.testing.assert_close(y.reshape(-1, LD), ref, atol=FP32_ATOL, rtol=0)
    y.square().sum().backward()
    ex = layer.experts
    for name_, p in (("w1", ex.w1), ("w2", ex.w2), ("w3", ex.w3)):
        assert p.grad is not None and p.grad.abs().sum() > 0, name_


# ---------------------------------------------------------------------------------------------
# 5. CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 7, 513, 2048])
@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("act", ["swiglu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", list(PATHS))
def test_path_equals_reference_cuda(path, dtype, act, K, T):
    fn, grouped_mm = PATHS[path]
    w = inference_weights(act, dtype, False, grouped_mm, "cuda")
    x, ids, gates = assignments(T, K, "unused" if T == 513 else "random", dtype=dtype)
    with torch.no_grad():
        y = fn(x.cuda(), ids.cuda(), gates.cuda(), w).cpu()
    ref = reference_fp32(x, ids, gates, act, dtype)  # on the CPU, from the same values
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, atol=FP32_ATOL, rtol=0)
    else:
        check_bf16(y, ref)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(ROUTERS))
def test_layer_inference_cuda(calls, name, dtype):
    """lay_out_moe's CUDA defaults: no oneDNN packing, grouped_mm for many tokens."""
    layer = make_layer(name, 2, dtype).cuda()
    x = layer_input(4, 50).to(device="cuda", dtype=dtype)
    with torch.no_grad():
        y_sorted, _ = layer(x)
        layer = lay_out_moe(layer, gather_max=0)
        w = layer.experts.w
        assert w.grouped_mm and not w.packed
        calls.clear()
        y, _ = layer(x)
    if expected_calls(name, "grouped_mm"):
        assert "grouped_mm" in calls
    tol = dict(atol=FP32_ATOL, rtol=0) if dtype == torch.float32 else dict(atol=BF16_TOL, rtol=BF16_TOL)
    torch.testing.assert_close(y, y_sorted, **tol)


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 8, 513])
def test_grouped_mm_path_never_waits_for_the_host(T):
    """moe_grouped with grouped_mm keeps the expert counts on the device (expert_counts, not bincount, which reads
    the largest id back to size its output): nothing in it synchronizes with the host, which a compiled decode
    step captured as a CUDA graph needs (DispatchPlan.decode_grouped), and a prefill gains from."""
    w = inference_weights("swiglu", torch.bfloat16, False, True, "cuda")
    x, ids, gates = assignments(T, 2, "random", dtype=torch.bfloat16)
    args = (x.cuda(), ids.cuda(), gates.cuda())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronizing call raises
    try:
        with torch.no_grad():
            y = moe_grouped(*args, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check_bf16(y.cpu(), reference_fp32(x, ids, gates, "swiglu", torch.bfloat16))


def test_expert_counts_are_bincounts():
    ids = torch.tensor([3, 0, 3, 1, 3, 0])
    got = expert_counts(ids, 5)
    assert got.dtype == torch.int32 and got.tolist() == torch.bincount(ids, minlength=5).tolist() == [2, 1, 0, 3, 0]
