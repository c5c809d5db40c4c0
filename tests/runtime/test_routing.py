"""Routers (softmax, sigmoid, X-MoE, VQ), the VQ MoE layers and the capacity limit, each checked
against a computation written out here: plain formulas, brute-force loops, torch.cdist."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moeserve.config import preset
from moeserve.runtime.model import Transformer
from moeserve.runtime.moe import MoELayer
from moeserve.runtime.routing import (
    Routing,
    SigmoidRouter,
    SoftmaxRouter,
    VectorQuantizer,
    XMoERouter,
)
from moeserve.training.losses import aux_losses

# ---------------------------------------------------------------------------------------------
# helpers written for the tests (independent of the package's math)


def init_layer(layer: nn.Module, std: float = 0.1) -> None:
    """MoELayer leaves its stacked expert weights as torch.empty (the Transformer initialises them);
    give every parameter of a stand-alone layer defined random values."""
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, std)


def ffn_by_hand(layer: MoELayer, e: int, x_D: torch.Tensor) -> torch.Tensor:
    """Expert e's FFN on one vector, from the stacked [E, out, in] weights."""
    ex = layer.experts
    w1, w2 = ex.w1[e], ex.w2[e]
    if ex.w3 is None:
        h = F.gelu(w1 @ x_D)
    else:
        h = F.silu(w1 @ x_D) * (ex.w3[e] @ x_D)
    return w2 @ h


def smoe_by_hand(layer: MoELayer, x_TD: torch.Tensor, ids_TK: torch.Tensor, gates_TK: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        for k in range(ids_TK.shape[1]):
            out[t] += gates_TK[t, k] * ffn_by_hand(layer, int(ids_TK[t, k]), x_TD[t])
    return out


class FixedRouter(nn.Module):
    """Stub router: always the same expert ids and gates (torchtitan style)."""

    def __init__(self, ids_TK: torch.Tensor, gates_TK: torch.Tensor):
        super().__init__()
        self.ids, self.gates = ids_TK, gates_TK

    def forward(self, x_TD: torch.Tensor) -> Routing:
        return Routing(self.ids, self.gates)


def lm_loss(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    logits = out.logits
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return ce, out


# ---------------------------------------------------------------------------------------------
# X-MoE


@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
def test_xmoe_scores_are_cosines_and_gates_follow_eq7(gate):
    torch.manual_seed(0)
    D, E, R, K = 32, 8, 4, 2
    tau = 0.3 if gate == "softmax" else 0.07
    router = XMoERouter(D, E, K, R, gate, tau, 0.1)
    x = torch.randn(50, D)

    W = router.proj.weight  # [R, D]
    h = x @ W.T
    e = router.expert_embeddings
    expected = F.cosine_similarity(h[:, None, :], e[None, :, :], dim=-1)  # [T, E]
    manual = (h[:, None, :] * e[None, :, :]).sum(-1) / (h.norm(dim=-1)[:, None] * e.norm(dim=-1)[None, :])
    s = router.scores(x)
    torch.testing.assert_close(s, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(s, manual, rtol=0, atol=1e-5)
    assert s.abs().max() <= 1 + 1e-5

    r = router(x)
    order = expected.argsort(dim=-1, descending=True)[:, :K]
    assert torch.equal(r.expert_ids, order)
    if gate == "softmax":
        probs = torch.exp(expected / tau) / torch.exp(expected / tau).sum(-1, keepdim=True)
        want = probs.gather(1, order)
    else:
        want = 1 / (1 + torch.exp(-expected.gather(1, order) / tau))
    torch.testing.assert_close(r.gates, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r.scores, expected, rtol=0, atol=1e-5)


def test_xmoe_default_dim_and_tau():
    cfg = preset("tiny", router="xmoe", n_experts=8)
    assert cfg.router_dim == 4
    assert cfg.tau_init == 0.3
    assert preset("tiny", router="xmoe", xmoe_gate="sigmoid").tau_init == 0.07
    layer = MoELayer(cfg)
    assert layer.router.proj.weight.shape == (4, cfg.d_model)
    assert float(layer.router.tau.detach()) == pytest.approx(0.3)


def _train_xmoe(constrain: bool, steps: int = 50):
    torch.manual_seed(0)
    cfg = preset("tiny", router="xmoe")
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    init_norms = [layer.router.expert_embeddings.detach().norm(dim=-1).clone() for layer in model.moe_layers]
    init_tau = [float(layer.router.tau.detach()) for layer in model.moe_layers]
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
        ce, out = lm_loss(model, ids)
        loss = ce + aux_losses(out.aux, cfg).total(cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if constrain:
            model.constrain_()
    norms = [layer.router.expert_embeddings.detach().norm(dim=-1) for layer in model.moe_layers]
    taus = [float(layer.router.tau.detach()) for layer in model.moe_layers]
    return init_norms, norms, init_tau, taus


def test_xmoe_expert_norm_kept_at_0p1_by_constrain_and_tau_learns():
    init_norms, norms, init_tau, taus = _train_xmoe(constrain=True)
    for n in init_norms:
        torch.testing.assert_close(n, torch.full_like(n, 0.1), rtol=0, atol=1e-6)
    for n in norms:
        torch.testing.assert_close(n, torch.full_like(n, 0.1), rtol=0, atol=1e-6)
    for t0, t1 in zip(init_tau, taus):
        assert t0 == pytest.approx(0.3)
        assert abs(t1 - t0) > 1e-3, (t0, t1)

    # Without constrain_ the same training moves the norms away from 0.1: the constraint is what holds it.
    _, free_norms, _, _ = _train_xmoe(constrain=False)
    drift = max(float((n - 0.1).abs().max()) for n in free_norms)
    assert drift > 1e-2, drift


# ---------------------------------------------------------------------------------------------
# softmax and sigmoid routers


@pytest.mark.parametrize("renormalize", [False, True])
def test_softmax_router_topk_of_softmax(renormalize):
    torch.manual_seed(0)
    D, E, K = 16, 8, 3
    router = SoftmaxRouter(D, E, K, renormalize=renormalize)
    x = torch.randn(40, D)
    s = x @ router.gate.weight.T
    p = torch.exp(s - s.max(-1, keepdim=True).values)
    p = p / p.sum(-1, keepdim=True)
    order = p.argsort(dim=-1, descending=True)[:, :K]
    want = p.gather(1, order)
    if renormalize:
        want = want / want.sum(-1, keepdim=True)
    r = router(x)
    assert torch.equal(r.expert_ids, order)
    torch.testing.assert_close(r.gates, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r.scores, s, rtol=1e-5, atol=1e-6)
    sums = r.gates.sum(-1)
    if renormalize:
        torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=1e-6)
    else:
        assert (sums < 1 - 1e-3).all()  # K < E: the top-k of a softmax never sums to 1


def test_sigmoid_router_ids_are_topk_of_scores_gates_sigmoid():
    torch.manual_seed(0)
    D, E, K = 16, 8, 2
    router = SigmoidRouter(D, E, K)
    x = torch.randn(40, D)
    s = x @ router.gate.weight.T
    order = s.argsort(dim=-1, descending=True)[:, :K]
    r = router(x)
    assert torch.equal(r.expert_ids, order)
    want = 1 / (1 + torch.exp(-s.gather(1, order)))
    torch.testing.assert_close(r.gates, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# vector quantizer


def _assert_nearest_matches(chosen: torch.Tensor, dist_TK: torch.Tensor, best_is_min: bool) -> None:
    """chosen == brute-force arg-best; where two codes tie to float32 precision either one is accepted."""
    ref = dist_TK.argmin(-1) if best_is_min else dist_TK.argmax(-1)
    best = dist_TK.gather(1, ref[:, None])[:, 0]
    got = dist_TK.gather(1, chosen[:, None])[:, 0]
    assert (got - best).abs().max() <= 1e-4 * max(1.0, float(best.abs().max()))
    assert (chosen == ref).float().mean() >= 0.995
    assert (chosen != ref).sum() <= 2


def test_vq_nearest_l2_is_cdist_argmin():
    torch.manual_seed(0)
    n_codes, C = 256, 12
    vq = VectorQuantizer(C, n_codes, C, "l2", "code", 0.05)
    z = torch.randn(1000, C) * 1.5
    chosen = vq.nearest(z)
    d = torch.cdist(z.double(), vq.codebook.detach().double())
    _assert_nearest_matches(chosen, d, best_is_min=True)
    # the codes cover much of the codebook: a broken search (e.g. always 0) fails
    assert chosen.unique().numel() > 100


def test_vq_nearest_cosine_is_argmax_cosine_similarity():
    torch.manual_seed(0)
    n_codes, C = 256, 12
    vq = VectorQuantizer(C, n_codes, C, "cosine", "code", 0.05)
    with torch.no_grad():  # codes of very different norms: a search that ignored the cosine would differ
        vq.codebook.mul_(torch.rand(n_codes, 1) * 10 + 0.1)
    z = torch.randn(1000, C) * 3
    cos = F.cosine_similarity(z.double()[:, None, :], vq.codebook.detach().double()[None, :, :], dim=-1)
    _assert_nearest_matches(vq.nearest(z), cos, best_is_min=False)
    # encode() normalises; the search on the encoded vectors gives the same codes
    _assert_nearest_matches(vq.nearest(vq.encode(z)), cos, best_is_min=False)
    l2 = torch.cdist(z.double(), vq.codebook.detach().double()).argmin(-1)
    assert (vq.nearest(z) != l2).any()


def _vq_layer(**overrides) -> MoELayer:
    torch.manual_seed(0)
    cfg = preset("tiny", router="vq", **overrides)
    layer = MoELayer(cfg)
    init_layer(layer)
    with torch.no_grad():
        layer.quantizer.codebook.normal_(0.0, 1.0)
    layer.quantizer.initialized.fill_(True)  # keep the codebook set here
    return layer


def test_vq_code_input_is_chosen_code_and_straight_through():
    layer = _vq_layer(vq_mode="discrete", vq_input="code")
    q = layer.quantizer
    x = torch.randn(30, 64, requires_grad=True)
    codes, x_tilde, z, v = q(x)
    book = q.codebook.detach()
    want_codes = torch.cdist(x.detach().double(), book.double()).argmin(-1)
    assert torch.equal(codes, want_codes)
    assert torch.equal(x_tilde, book[want_codes])
    assert torch.equal(v, book[want_codes])
    assert torch.equal(z, x)

    g = torch.randn_like(x_tilde)
    (x_tilde * g).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert torch.equal(x.grad, g)
    assert q.codebook.grad is None or q.codebook.grad.abs().sum() == 0


def test_vq_discrete_layer_grad_reaches_x_as_grad_of_x_tilde():
    layer = _vq_layer(vq_mode="discrete", vq_input="code")
    x = torch.randn(2, 10, 64, requires_grad=True)
    y, aux = layer(x)
    gy = torch.randn_like(y)
    (y * gy).sum().backward()

    # the same loss with x~ as a leaf, computed by hand
    codes = aux.codes
    xt = layer.quantizer.codebook.detach()[codes].clone().requires_grad_(True)
    y_hand = torch.stack([ffn_by_hand(layer, int(codes[t]), xt[t]) for t in range(xt.shape[0])])
    (y_hand * gy.reshape(-1, 64)).sum().backward()
    assert x.grad.abs().sum() > 0
    torch.testing.assert_close(x.grad.reshape(-1, 64), xt.grad, rtol=1e-4, atol=1e-6)


def test_vq_blend_input():
    layer = _vq_layer(vq_mode="discrete", vq_input="blend", vq_blend_rate=0.05)
    q = layer.quantizer
    x = torch.randn(30, 64)
    codes, x_tilde, _, _ = q(x)
    book = q.codebook.detach()
    k = torch.cdist(x.double(), book.double()).argmin(-1)
    assert torch.equal(codes, k)
    c = 0.05
    torch.testing.assert_close(x_tilde, (1 - 2 * c) * x + c * book[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize("vq_input", ["code", "blend"])
def test_vq_projection_when_vq_dim_set(vq_input):
    layer = _vq_layer(vq_mode="discrete", vq_input=vq_input, vq_dim=16)
    q = layer.quantizer
    assert q.codebook.shape == (4, 16)
    assert q.down.weight.shape == (16, 64) and q.up.weight.shape == (64, 16)
    x = torch.randn(30, 64, requires_grad=True)
    codes, x_tilde, z, v = q(x)
    z_hand = x.detach() @ q.down.weight.detach().T
    torch.testing.assert_close(z, z_hand, rtol=1e-5, atol=1e-6)
    book = q.codebook.detach()
    k = torch.cdist(z_hand.double(), book.double()).argmin(-1)
    assert torch.equal(codes, k)
    up_v = book[k] @ q.up.weight.detach().T
    if vq_input == "code":
        torch.testing.assert_close(x_tilde, up_v, rtol=1e-5, atol=1e-6)
        # straight-through: d x~/d x = up.W @ down.W
        g = torch.randn_like(x_tilde)
        (x_tilde * g).sum().backward()
        want = g @ q.up.weight.detach() @ q.down.weight.detach()
        torch.testing.assert_close(x.grad, want, rtol=1e-4, atol=1e-6)
    else:
        torch.testing.assert_close(x_tilde, 0.9 * x.detach() + 0.05 * up_v, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# VQ MoE layers


@pytest.mark.parametrize("act", ["swiglu", "gelu"])
@pytest.mark.parametrize("vq_input", ["code", "blend"])
def test_vq_discrete_layer_output_by_hand(act, vq_input):
    layer = _vq_layer(vq_mode="discrete", vq_input=vq_input, expert_act=act)
    names = [n for n, _ in layer.named_parameters()]
    assert not any("router" in n or "mix" in n for n in names), names
    assert layer.router is None and layer.mix is None

    torch.manual_seed(1)
    book = layer.quantizer.codebook.detach()
    # tokens near each code so every expert is used
    x = book[torch.arange(24) % 4] + 0.3 * torch.randn(24, 64)
    y, aux = layer(x[None])
    y = y[0]
    k = torch.cdist(x.double(), book.double()).argmin(-1)
    assert torch.equal(aux.codes, k)
    assert k.unique().numel() == 4
    x_tilde = book[k] if vq_input == "code" else 0.9 * x + 0.05 * book[k]
    want = torch.stack([ffn_by_hand(layer, int(k[t]), x_tilde[t]) for t in range(24)])
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(aux.counts, torch.bincount(k, minlength=4))
    assert aux.routing is None


def test_vq_discrete_code_output_depends_on_code_only():
    layer = _vq_layer(vq_mode="discrete", vq_input="code")
    book = layer.quantizer.codebook.detach()
    torch.manual_seed(2)
    base = book[torch.tensor([0, 1, 2, 3, 0, 2])]
    x1 = base + 0.05 * torch.randn_like(base)
    x2 = base + 0.05 * torch.randn_like(base)
    assert not torch.equal(x1, x2)
    y1, aux1 = layer(x1[None])
    y1 = y1[0]
    c1 = aux1.codes.clone()
    y2, aux2 = layer(x2[None])
    y2 = y2[0]
    c2 = aux2.codes.clone()
    assert torch.equal(c1, c2)
    assert torch.equal(y1, y2)

    # blend: same codes, different outputs
    blend = _vq_layer(vq_mode="discrete", vq_input="blend")
    with torch.no_grad():
        blend.load_state_dict(layer.state_dict())
    assert not torch.equal(blend(x1[None])[0], blend(x2[None])[0])


@pytest.mark.parametrize("vq_input", ["code", "blend"])
def test_vq_mixed_layer_output_by_hand(vq_input):
    layer = _vq_layer(vq_mode="mixed", vq_input=vq_input)
    assert layer.mix.weight.shape == (2, 64)
    torch.manual_seed(3)
    x = torch.randn(20, 64)
    y = layer(x[None])[0][0]

    book = layer.quantizer.codebook.detach()
    k = torch.cdist(x.double(), book.double()).argmin(-1)
    x_tilde = book[k] if vq_input == "code" else 0.9 * x + 0.05 * book[k]
    discrete = torch.stack([ffn_by_hand(layer, int(k[t]), x_tilde[t]) for t in range(20)])

    s = x @ layer.router.gate.weight.T
    p = s.softmax(-1)
    ids = p.argsort(-1, descending=True)[:, :2]
    continuous = smoe_by_hand(layer, x, ids, p.gather(1, ids))

    m = x @ layer.mix.weight.T
    g = torch.exp(m) / torch.exp(m).sum(-1, keepdim=True)
    want = g[:, :1] * continuous + g[:, 1:] * discrete
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    # both paths matter: neither gate is ~0 or ~1 everywhere
    assert not torch.allclose(y, continuous, atol=1e-4) and not torch.allclose(y, discrete, atol=1e-4)


def test_vq_codebook_initialised_from_first_training_batch():
    torch.manual_seed(0)
    layer = MoELayer(preset("tiny", router="vq", vq_mode="discrete"))
    init_layer(layer)
    layer.quantizer.initialized.fill_(False)
    x = torch.randn(40, 64)
    layer.train()
    layer(x[None])
    book = layer.quantizer.codebook.detach()
    # every code is one of the batch's inputs
    d = (book[:, None, :] - x[None, :, :]).abs().amax(-1).min(-1).values
    assert d.max() == 0
    assert bool(layer.quantizer.initialized)


# ---------------------------------------------------------------------------------------------
# capacity factor


def test_capacity_drops_overflow_with_zero_output():
    torch.manual_seed(0)
    cfg = preset("tiny", top_k=1, capacity_factor=1.0)
    layer = MoELayer(cfg)
    init_layer(layer)
    T, E = 8, cfg.n_experts
    gates = torch.rand(T, 1) + 0.5
    layer.router = FixedRouter(torch.zeros(T, 1, dtype=torch.long), gates)
    x = torch.randn(T, 64)
    y, aux = layer(x[None])
    y = y[0]
    cap = math.ceil(1.0 * T * 1 / E)  # 2
    assert cap == 2
    counts = aux.counts
    assert counts.tolist() == [cap, 0, 0, 0]
    for t in range(T):
        if t < cap:
            torch.testing.assert_close(y[t], gates[t, 0] * ffn_by_hand(layer, 0, x[t]), rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(y[t], torch.zeros(64)), t
    keep = aux.routing.keep
    assert keep[:, 0].tolist() == [True] * cap + [False] * (T - cap)


@pytest.mark.parametrize("cf", [0.5, 1.0, 1.25, 2.0])
def test_capacity_limit_on_all_to_expert_zero(cf):
    torch.manual_seed(0)
    cfg = preset("tiny", top_k=2, capacity_factor=cf)
    layer = MoELayer(cfg)
    init_layer(layer)
    T, K, E = 24, 2, cfg.n_experts
    ids = torch.stack([torch.zeros(T, dtype=torch.long), 1 + torch.arange(T) % 3], dim=1)
    layer.router = FixedRouter(ids, torch.full((T, K), 0.5))
    x = torch.randn(T, 64)
    y, aux = layer(x[None])
    y = y[0]
    cap = math.ceil(cf * T * K / E)
    counts = aux.counts
    assert counts.max() <= cap
    assert int(counts[0]) == min(cap, T)
    # by hand: the first `cap` tokens of each expert in slot-major order are kept
    seen = [0] * E
    keep = torch.zeros(T, K, dtype=torch.bool)
    for k in range(K):
        for t in range(T):
            e = int(ids[t, k])
            if seen[e] < cap:
                keep[t, k] = True
            seen[e] += 1
    assert torch.equal(aux.routing.keep, keep)
    assert counts.tolist() == torch.bincount(ids[keep], minlength=E).tolist()
    want = smoe_by_hand(layer, x, ids, 0.5 * keep.float())
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)


def test_capacity_first_choices_take_priority_over_second():
    torch.manual_seed(0)
    cfg = preset("tiny", top_k=2, capacity_factor=1.0)
    layer = MoELayer(cfg)
    init_layer(layer)
    T, K, E = 8, 2, 4
    cap = math.ceil(1.0 * T * K / E)  # 4
    # tokens 0-3: second choice expert 0 (earlier tokens); tokens 4-7: first choice expert 0
    ids = torch.tensor([[1, 0], [2, 0], [3, 0], [1, 0], [0, 2], [0, 3], [0, 1], [0, 2]])
    layer.router = FixedRouter(ids, torch.full((T, K), 0.5))
    x = torch.randn(T, 64)
    y, aux = layer(x[None])
    y = y[0]
    keep = aux.routing.keep
    assert keep[4:, 0].all()  # all first choices to expert 0 kept
    assert not keep[:4, 1].any()  # the earlier tokens' second choices to expert 0 dropped
    assert int(aux.counts[0]) == cap
    # token 0's output is only its first choice (expert 1)
    torch.testing.assert_close(y[0], 0.5 * ffn_by_hand(layer, 1, x[0]), rtol=1e-5, atol=1e-6)
    # token 4's output has both its choices
    want4 = 0.5 * ffn_by_hand(layer, 0, x[4]) + 0.5 * ffn_by_hand(layer, 2, x[4])
    torch.testing.assert_close(y[4], want4, rtol=1e-5, atol=1e-6)
