"""Auxiliary losses (balance, VQ), their weighted total, and the load entropy, each against a
computation written out here from the formulas of docs/design.md."""

from __future__ import annotations

import math

import pytest
import torch

from moeserve.config import preset
from moeserve.runtime.moe import MoEAux
from moeserve.runtime.routing import Routing
from moeserve.training.losses import aux_losses, balance_loss, load_entropy, vq_losses


def balance_by_hand(ids, scores, keep, N, tau0):
    T, K = ids.shape
    f = [0.0] * N
    for t in range(T):
        for k in range(K):
            if keep is None or bool(keep[t, k]):
                f[int(ids[t, k])] += 1.0 / (T * K)
    P = [0.0] * N
    for t in range(T):
        ex = [math.exp(float(scores[t, i]) / tau0) for i in range(N)]
        z = sum(ex)
        for i in range(N):
            P[i] += ex[i] / z / T
    return N * sum(f[i] * P[i] for i in range(N)), f


def random_routing(T=13, N=6, K=2, seed=0, with_keep=False):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(T, N, generator=g) * 2
    ids = torch.rand(T, N, generator=g).argsort(-1)[:, :K]  # not tied to the scores
    gates = torch.rand(T, K, generator=g)
    keep = (torch.rand(T, K, generator=g) < 0.6) if with_keep else None
    return Routing(ids, gates, scores, keep)


@pytest.mark.parametrize("tau0", [1.0, 0.3, 0.07])
@pytest.mark.parametrize("K", [1, 2, 3])
def test_balance_loss_by_hand(tau0, K):
    r = random_routing(K=K, seed=K)
    want, _ = balance_by_hand(r.expert_ids, r.scores, None, 6, tau0)
    got = balance_loss(r, 6, tau0)
    assert float(got) == pytest.approx(want, rel=1e-5)


def test_balance_loss_perfect_balance_is_one():
    for N, K in ((4, 2), (8, 1), (8, 3)):
        T = 4 * N
        ids = torch.stack([(torch.arange(T) + k) % N for k in range(K)], dim=1)
        assert torch.bincount(ids.reshape(-1), minlength=N).unique().numel() == 1
        r = Routing(ids, torch.ones(T, K), torch.zeros(T, N))
        for tau0 in (1.0, 0.3):
            assert float(balance_loss(r, N, tau0)) == pytest.approx(1.0, abs=1e-6)
    # imbalance raises it: everything on expert 0 with scores favouring expert 0
    T, N = 8, 4
    scores = torch.zeros(T, N)
    scores[:, 0] = 3.0
    r = Routing(torch.zeros(T, 1, dtype=torch.long), torch.ones(T, 1), scores)
    assert float(balance_loss(r, N, 1.0)) > 2.0


def test_balance_loss_ignores_dropped_assignments():
    r = random_routing(K=2, seed=7, with_keep=True)
    assert not bool(r.keep.all()) and bool(r.keep.any())
    want, f = balance_by_hand(r.expert_ids, r.scores, r.keep, 6, 1.0)
    assert sum(f) == pytest.approx(float(r.keep.sum()) / r.expert_ids.numel())
    assert float(balance_loss(r, 6, 1.0)) == pytest.approx(want, rel=1e-5)
    all_kept, _ = balance_by_hand(r.expert_ids, r.scores, None, 6, 1.0)
    assert abs(want - all_kept) > 1e-3


def test_balance_loss_gradient_flows_only_through_scores():
    r = random_routing(seed=3)
    scores = r.scores.clone().requires_grad_(True)
    loss = balance_loss(Routing(r.expert_ids, r.gates, scores), 6, 0.5)
    loss.backward()
    # d/ds of N * sum_i f_i * mean_t softmax(s_t / tau)_i, by hand
    T, N = scores.shape
    f = torch.bincount(r.expert_ids.reshape(-1), minlength=N).double() / r.expert_ids.numel()
    p = torch.softmax(r.scores.double() / 0.5, -1)
    # d p_ti / d s_tj = p_ti (delta_ij - p_tj) / tau
    want = N / T * (p * f[None, :] - p * (p * f[None, :]).sum(-1, keepdim=True)) / 0.5
    torch.testing.assert_close(scores.grad.double(), want, rtol=1e-4, atol=1e-7)


def test_vq_losses_values_and_gradients():
    torch.manual_seed(0)
    z = torch.randn(10, 7, requires_grad=True)
    v = torch.randn(10, 7, requires_grad=True)
    codebook, commitment = vq_losses(z, v)
    want = ((z.detach() - v.detach()) ** 2).sum() / z.numel()
    assert float(codebook.detach()) == pytest.approx(float(want), rel=1e-6)
    assert float(commitment.detach()) == pytest.approx(float(want), rel=1e-6)

    codebook.backward(retain_graph=True)
    assert z.grad is None or z.grad.abs().sum() == 0
    torch.testing.assert_close(v.grad, 2 * (v.detach() - z.detach()) / z.numel(), rtol=1e-5, atol=1e-7)
    v.grad = None
    z.grad = None
    commitment.backward()
    assert v.grad is None or v.grad.abs().sum() == 0
    torch.testing.assert_close(z.grad, 2 * (z.detach() - v.detach()) / z.numel(), rtol=1e-5, atol=1e-7)


def test_aux_losses_total_and_layer_means():
    torch.manual_seed(0)
    cfg = preset("tiny", router="vq", balance_alpha=0.02, vq_alpha=0.1, vq_beta=0.25)
    N = cfg.n_experts
    auxes, bals, cbs = [], [], []
    for seed in (1, 2):
        r = random_routing(T=10, N=N, K=2, seed=seed)
        z, v = torch.randn(10, 64), torch.randn(10, 64)
        auxes.append(MoEAux(torch.zeros(N, dtype=torch.long), r, torch.zeros(10, dtype=torch.long), z, v))
        bals.append(balance_by_hand(r.expert_ids, r.scores, None, N, cfg.tau0)[0])
        cbs.append(float(((z - v) ** 2).mean()))
    # a discrete VQ layer has no routing: it adds to the VQ losses only
    z3, v3 = torch.randn(10, 64) * 2, torch.randn(10, 64)
    auxes.append(MoEAux(torch.zeros(N, dtype=torch.long), None, torch.zeros(10, dtype=torch.long), z3, v3))
    cbs.append(float(((z3 - v3) ** 2).mean()))

    losses = aux_losses(auxes, cfg)
    bal, cb = sum(bals) / 2, sum(cbs) / 3
    assert float(losses.balance) == pytest.approx(bal, rel=1e-5)
    assert float(losses.vq_codebook) == pytest.approx(cb, rel=1e-5)
    assert float(losses.vq_commitment) == pytest.approx(cb, rel=1e-5)
    want_total = 0.02 * bal + 0.1 * (cb + 0.25 * cb)
    assert float(losses.total(cfg)) == pytest.approx(want_total, rel=1e-5)

    # the weights come from the config given to total()
    cfg2 = cfg.replace(balance_alpha=1.0, vq_alpha=0.0)
    assert float(losses.total(cfg2)) == pytest.approx(bal, rel=1e-5)
    cfg3 = cfg.replace(balance_alpha=0.0, vq_alpha=1.0, vq_beta=1.0)
    assert float(losses.total(cfg3)) == pytest.approx(2 * cb, rel=1e-5)


def test_aux_losses_total_with_distinct_codebook_and_commitment():
    # codebook and commitment differ in gradient, not value; the total weighs them by hand
    cfg = preset("tiny", router="vq", balance_alpha=0.0, vq_alpha=0.5, vq_beta=0.25)
    z = torch.randn(6, 64, requires_grad=True)
    v = torch.randn(6, 64, requires_grad=True)
    aux = [MoEAux(torch.zeros(4, dtype=torch.long), None, None, z, v)]
    aux_losses(aux, cfg).total(cfg).backward()
    d = 2 * (z.detach() - v.detach()) / z.numel()
    torch.testing.assert_close(z.grad, 0.5 * 0.25 * d, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(v.grad, -0.5 * d, rtol=1e-5, atol=1e-8)


def test_aux_losses_uses_config_tau0():
    cfg = preset("tiny", router="xmoe")  # tau0 = 0.3
    r = random_routing(T=9, N=4, K=2, seed=5)
    losses = aux_losses([MoEAux(torch.zeros(4, dtype=torch.long), r)], cfg)
    want = balance_by_hand(r.expert_ids, r.scores, None, 4, 0.3)[0]
    assert float(losses.balance) == pytest.approx(want, rel=1e-5)
    other = balance_by_hand(r.expert_ids, r.scores, None, 4, 1.0)[0]
    assert abs(want - other) > 1e-3
    assert float(losses.vq_codebook) == 0 and float(losses.vq_commitment) == 0


def test_load_entropy():
    for E in (2, 4, 8, 16):
        assert load_entropy(torch.full((E,), 7)) == pytest.approx(math.log2(E), abs=1e-6)
        onehot = torch.zeros(E, dtype=torch.long)
        onehot[E // 2] = 30
        assert load_entropy(onehot) == pytest.approx(0.0, abs=1e-9)
    counts = torch.tensor([3, 1, 0, 4])
    p = [3 / 8, 1 / 8, 4 / 8]
    assert load_entropy(counts) == pytest.approx(-sum(q * math.log2(q) for q in p), abs=1e-6)
