"""Expert dispatch: the sorted training path equals the reference loop (values and gradients), the
reference loop equals a per-token brute force, and the observer sees each expert's own rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.runtime.experts import FeedForward, moe_reference, moe_sorted

E, D, FF = 8, 16, 24
EMPTY = (3, 6)  # experts no token is routed to


def make_case(T: int, K: int, act: str, with_keep: bool, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g, dtype=dtype)
    scores = torch.randn(T, E, generator=g, dtype=dtype)
    scores[:, list(EMPTY)] = -float("inf")
    ids = scores.topk(K, dim=-1).indices  # distinct experts per token
    gates = torch.rand(T, K, generator=g, dtype=dtype) + 0.1
    w1 = torch.randn(E, FF, D, generator=g, dtype=dtype) * 0.3
    w2 = torch.randn(E, D, FF, generator=g, dtype=dtype) * 0.3
    w3 = torch.randn(E, FF, D, generator=g, dtype=dtype) * 0.3 if act == "swiglu" else None
    keep = None
    if with_keep:
        keep = torch.rand(T, K, generator=g) < 0.7
        if T > 1:
            keep[0] = False  # one token fully dropped
        keep[-1, 0] = True  # at least one assignment kept
    return x, ids, gates, w1, w2, w3, keep


def ffn_vec(x_D, w1_FD, w2_DF, w3_FD):
    a = (w1_FD * x_D[None, :]).sum(-1)
    if w3_FD is None:
        h = 0.5 * a * (1 + torch.erf(a / 2**0.5))
    else:
        b = (w3_FD * x_D[None, :]).sum(-1)
        h = a * torch.sigmoid(a) * b
    return (w2_DF * h[None, :]).sum(-1)


def brute_force(x, ids, gates, w1, w2, w3, keep):
    T, K = ids.shape
    out = torch.zeros_like(x)
    for t in range(T):
        for k in range(K):
            if keep is not None and not bool(keep[t, k]):
                continue
            e = int(ids[t, k])
            out[t] = out[t] + gates[t, k] * ffn_vec(x[t], w1[e], w2[e], None if w3 is None else w3[e])
    return out


@pytest.mark.parametrize("act", ["gelu", "swiglu"])
@pytest.mark.parametrize("with_keep", [False, True])
def test_reference_equals_brute_force(act, with_keep):
    x, ids, gates, w1, w2, w3, keep = make_case(9, 2, act, with_keep, seed=5, dtype=torch.float64)
    got = moe_reference(x, ids, gates, w1, w2, w3, keep)
    want = brute_force(x, ids, gates, w1, w2, w3, keep)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    if with_keep:
        assert torch.equal(got[0], torch.zeros(D, dtype=torch.float64))  # fully dropped token
    assert got.abs().sum() > 0


def _grads(fn, x, ids, gates, w1, w2, w3, keep, gy):
    leaves = [t.clone().requires_grad_(True) for t in (x, gates, w1, w2)]
    w3l = w3.clone().requires_grad_(True) if w3 is not None else None
    y = fn(leaves[0], ids, leaves[1], leaves[2], leaves[3], w3l, keep)
    (y * gy).sum().backward()
    grads = [t.grad for t in leaves] + ([w3l.grad] if w3l is not None else [])
    return y.detach(), grads


@pytest.mark.parametrize("act", ["gelu", "swiglu"])
@pytest.mark.parametrize("with_keep", [False, True])
@pytest.mark.parametrize("T", [1, 7, 64, 300])
@pytest.mark.parametrize("K", [1, 2, 4])
def test_sorted_equals_reference(K, T, with_keep, act):
    x, ids, gates, w1, w2, w3, keep = make_case(T, K, act, with_keep, seed=T * 10 + K)
    gy = torch.randn(T, D, generator=torch.Generator().manual_seed(99))
    y_ref, g_ref = _grads(moe_reference, x, ids, gates, w1, w2, w3, keep, gy)
    y_srt, g_srt = _grads(moe_sorted, x, ids, gates, w1, w2, w3, keep, gy)
    torch.testing.assert_close(y_srt, y_ref, rtol=1e-5, atol=1e-5)
    names = ["x", "gates", "w1", "w2", "w3"]
    for name, a, b in zip(names, g_srt, g_ref):
        assert a is not None and b is not None, name
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"grad {name}: {m}")
    # experts without tokens get exactly zero gradient in both paths
    for e in EMPTY:
        assert torch.equal(g_srt[2][e], torch.zeros(FF, D))
        assert torch.equal(g_srt[3][e], torch.zeros(D, FF))
    # and the values are the brute-force ones (so the two paths cannot agree on a wrong answer)
    if T <= 7:
        torch.testing.assert_close(y_srt, brute_force(x, ids, gates, w1, w2, w3, keep), rtol=1e-5, atol=1e-5)
    if keep is not None:
        dropped_gate_grad = g_srt[1][~keep]
        assert torch.equal(dropped_gate_grad, torch.zeros_like(dropped_gate_grad))


def _rows_match(observed: torch.Tensor | None, expected: torch.Tensor, atol: float) -> None:
    """observed and expected hold the same multiset of rows (order free)."""
    if expected.shape[0] == 0:
        assert observed is None or observed.shape[0] == 0
        return
    assert observed is not None and observed.shape == expected.shape
    d = torch.cdist(observed.double(), expected.double())
    # a one-to-one matching: each row's nearest partner is within atol, in both directions, and
    # the nearest partners are a permutation
    nearest = d.argmin(-1)
    assert d.min(-1).values.max() <= atol
    assert d.min(0).values.max() <= atol
    assert nearest.unique().numel() == expected.shape[0]


@pytest.mark.parametrize("path", [moe_reference, moe_sorted])
@pytest.mark.parametrize("act", ["gelu", "swiglu"])
@pytest.mark.parametrize("with_keep", [False, True])
def test_observer_sees_each_experts_rows(path, act, with_keep):
    T, K = 40, 2
    x, ids, gates, w1, w2, w3, keep = make_case(T, K, act, with_keep, seed=3)
    seen: dict[tuple[int, str], list[torch.Tensor]] = {}

    def observer(e, name, rows):
        seen.setdefault((e, name), []).append(rows.detach().clone())

    path(x, ids, gates, w1, w2, w3, keep, observer)
    names = ["w1", "w2"] + (["w3"] if w3 is not None else [])
    assert {n for (_, n) in seen} <= set(names)
    for e in range(E):
        kept = torch.ones_like(ids, dtype=torch.bool) if keep is None else keep
        toks = [t for t in range(T) for k in range(K) if int(ids[t, k]) == e and bool(kept[t, k])]
        x_rows = x[toks] if toks else torch.zeros(0, D)
        a = x_rows @ w1[e].T
        if w3 is None:
            h_rows = F.gelu(a)
        else:
            h_rows = F.silu(a) * (x_rows @ w3[e].T)
        for name in names:
            obs = torch.cat(seen[(e, name)]) if (e, name) in seen else None
            want = h_rows if name == "w2" else x_rows
            _rows_match(obs, want, atol=1e-5)
        if e in EMPTY:
            assert not any(key[0] == e for key in seen)


def test_feedforward_matches_formula():
    torch.manual_seed(0)
    for act in ("gelu", "swiglu"):
        ff = FeedForward(D, FF, act)
        x = torch.randn(5, D)
        want = torch.stack([
            ffn_vec(x[t], ff.w1.weight, ff.w2.weight, None if ff.w3 is None else ff.w3.weight) for t in range(5)
        ])
        torch.testing.assert_close(ff(x), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", ["moe_indexed", "moe_reduced"])
@pytest.mark.parametrize("act", ["gelu", "swiglu"])
@pytest.mark.parametrize("T, K", [(1, 1), (1, 2), (5, 2), (16, 3)])
def test_indexed_decode_paths_equal_reference(path, act, T, K):
    """moe_indexed (CUDA's sync-free few-token path) and moe_reduced (a compiled step's GEMVs) on CPU: the same sums
    as the reference loop."""
    from moeserve.runtime.backends import experts as backend

    x, ids, gates, w1, w2, w3, _ = make_case(T, K, act, with_keep=False, seed=T + K)
    w = backend.fuse_expert_weights(w1, w2, w3, act, pack=False, sync_free=True)
    torch.testing.assert_close(getattr(backend, path)(x, ids, gates, w), moe_reference(x, ids, gates, w1, w2, w3),
                               atol=1e-5, rtol=1e-5)


def test_the_reduced_path_in_bf16_sums_in_float32():
    """bf16 weights and rows, the products summed in float32 and rounded once: within bf16's rounding of the
    reference computed in float32 on the same bf16 values."""
    from moeserve.runtime.backends.experts import fuse_expert_weights, moe_reduced

    x, ids, gates, w1, w2, w3, _ = make_case(4, 2, "swiglu", with_keep=False, seed=3, dtype=torch.bfloat16)
    w = fuse_expert_weights(w1, w2, w3, "swiglu", pack=False, sync_free=True)
    got = moe_reduced(x, ids, gates, w)
    want = moe_reference(x.float(), ids, gates.float(), w1.float(), w2.float(), w3.float())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2 ** -7)


def test_a_compiled_step_takes_the_reduced_path_up_to_its_rows(monkeypatch):
    """GraphExperts, traced: up to decode_reduce_max rows moe_reduced, past them grouped_mm or indexing, as the
    row count (static in each bucket's graph) says. Tracing is stood in for by is_compiling; the path's results are
    the test above's. One fullgraph compile of moe_reduced shows it traces whole (no graph break)."""
    from moeserve.runtime.backends import compiled, experts as backend
    from moeserve.runtime.experts import Experts

    torch.manual_seed(0)
    ex = backend.lay_out_experts(Experts(E, D, FF, "swiglu"), pack=False, sync_free=True, graph=True,
                                 decode_reduce_max=2)
    taken = []
    for name in ("moe_reduced", "moe_indexed"):
        real = getattr(backend, name)
        monkeypatch.setattr(backend, name, lambda *a, real=real, name=name: taken.append(name) or real(*a))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for T in (1, 2, 3):
        x, ids, gates = torch.randn(T, D), torch.randint(0, E, (T, 2)), torch.rand(T, 2)
        ex(x, ids, gates)
    assert taken == ["moe_reduced", "moe_reduced", "moe_indexed"]
    monkeypatch.undo()
    if compiled.compile_unavailable(torch.device("cpu")) is not None:
        pytest.skip("no C++ compiler: inductor cannot build a CPU graph here")
    x, ids, gates = torch.randn(1, D), torch.tensor([[1, 4]]), torch.rand(1, 2)
    step = torch.compile(backend.moe_reduced, fullgraph=True, dynamic=False)
    torch.testing.assert_close(step(x, ids, gates, ex.w), backend.moe_reduced(x, ids, gates, ex.w),
                               atol=1e-5, rtol=1e-5)


def test_sync_free_layout_is_chosen_on_cuda_only_by_default():
    from moeserve.runtime.backends.experts import lay_out_experts
    from moeserve.runtime.experts import Experts

    experts = Experts(E, D, FF, "swiglu")
    assert lay_out_experts(experts).w.sync_free is False  # CPU: the gather path, which groups ids on the host
    assert lay_out_experts(experts, sync_free=True).w.w13_EFD is not None  # the stacked weights it indexes
