"""Tests for moeserve.training.omoe: R steps are the base optimizer, O steps are orthogonal to the other
experts' recorded inputs (paper 003 eq. 7-10), the RLS math, and state that survives safetensors."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeserve.config import preset
from moeserve.runtime.experts import Experts
from moeserve.runtime.model import Transformer
from moeserve.training.omoe import OMoE, OMoEConfig, rls_update


def tiny(**overrides) -> Transformer:
    torch.manual_seed(0)
    return Transformer(preset("tiny", **overrides))


def batches(n: int, seed: int = 1, shape: tuple[int, int] = (4, 32)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 259, shape, generator=g) for _ in range(n)]


def backward(model: Transformer, ids: torch.Tensor) -> None:
    model(ids).logits.float().pow(2).mean().backward()


def train(model: Transformer, opt, data: list[torch.Tensor]) -> None:
    for ids in data:
        opt.zero_grad()
        backward(model, ids)
        opt.step()


def test_config_validation_names_field_and_value():
    for field, value in (("every", 0), ("a0", -1.0), ("decay", 1.5), ("total_steps", 0), ("every", True)):
        with pytest.raises(ValueError, match=rf"'{field}' = {re.escape(repr(value))}"):
            OMoEConfig(**{field: value})


def test_step_numbering():
    model = tiny(n_experts=2, top_k=1)
    opt = OMoE(model, torch.optim.AdamW(model.parameters()), OMoEConfig(every=5))
    assert [i for i in range(1, 16) if opt.is_o_step(i)] == [5, 10, 15]
    assert opt.step_count == 0 and not opt.is_o_step()
    train(model, opt, batches(4))
    assert opt.step_count == 4 and opt.is_o_step()


def test_r_steps_equal_base_optimizer():
    model = tiny(n_experts=2, top_k=1)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = OMoE(model, torch.optim.AdamW(model.parameters(), lr=1e-2), OMoEConfig(every=5))
    data = batches(4)
    train(ref, ref_opt, data)
    train(model, opt, data)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), name
    x, has = opt.mean_inputs("layers.0.ffn.experts", "in")
    assert x.shape == (4, 2, 64) and has.any()  # the four R steps were recorded


def test_eval_and_no_grad_forwards_record_nothing():
    model = tiny(n_experts=2, top_k=1)
    opt = OMoE(model, torch.optim.SGD(model.parameters(), lr=0.1), OMoEConfig())
    ids = batches(1)[0]
    assert all(m.observer is None for m in copy.deepcopy(model).modules() if isinstance(m, Experts))
    with torch.no_grad():
        model(ids)
    model.eval()
    backward(model, ids)
    assert opt.mean_inputs("layers.0.ffn.experts", "in")[0].shape[0] == 0
    model.train()
    backward(model, ids)
    assert opt.mean_inputs("layers.0.ffn.experts", "in")[0].shape[0] == 1


@pytest.mark.parametrize("w_name,proj", [("w1", "in"), ("w2", "hidden")])
def test_o_step_update_is_orthogonal_to_other_experts_inputs(w_name, proj):
    # alpha must be small against |x̄|^2: the mean hidden row (w2's input) of this tiny model has |x̄|^2 ~ 1e-3,
    # so a0 = 1e-3 would only shrink it ~2x; 1e-8 makes P a near-exact projector for both maps.
    model = tiny(n_experts=2, top_k=1)
    opt = OMoE(model, torch.optim.SGD(model.parameters(), lr=0.1), OMoEConfig(every=3, a0=1e-8, total_steps=10))
    data = batches(3)
    train(model, opt, data[:2])  # R steps 1 and 2 record inputs
    opt.zero_grad()
    backward(model, data[2])
    assert opt.is_o_step()
    layer = "layers.0.ffn.experts"
    experts = opt.experts[layer]
    x_SEI, has_SE = opt.mean_inputs(layer, proj)  # steps 1, 2 and this step's forward: the whole window
    assert x_SEI.shape[0] == 3 and has_SE.all()
    w = getattr(experts, w_name)
    before, raw_grad = w.detach().clone(), w.grad.detach().clone()
    expert_ids = {id(p) for m in opt.experts.values() for p in m.parameters()}
    others = {n: p.detach().clone() for n, p in model.named_parameters() if id(p) not in expert_ids}
    assert "layers.0.ffn.router.gate.weight" in others and "layers.0.ffn.experts.w1" not in others
    opt.step()
    dW = w.detach() - before
    for e, other in ((0, 1), (1, 0)):
        assert dW[e].norm() > 0
        for x in x_SEI[:, other]:
            ratio = (dW[e] @ x).norm() / (dW[e].norm() * x.norm())
            assert ratio <= 1e-3, (e, float(ratio))
            # The plain gradient is far from orthogonal, so the bound above is the projection's doing.
            raw = (raw_grad[e] @ x).norm() / (raw_grad[e].norm() * x.norm())
            assert raw > 1e-2, (e, float(raw))
    for n, p in model.named_parameters():  # non-expert (router, attention, norms, embedding): not stepped
        if n in others:
            assert torch.equal(p, others[n]), n
    assert not torch.equal(w, before)  # expert: stepped
    assert opt.mean_inputs(layer, proj)[0].shape[0] == 0  # window cleared

def test_rls_single_update_matches_hand_computation():
    torch.manual_seed(0)
    E, I, a = 3, 16, 0.5
    x = torch.randn(E, I)
    P = rls_update(torch.eye(I).expand(E, I, I).clone(), x, a)
    for e in range(E):
        expected = a / (a + x[e] @ x[e]) * x[e]  # (I - x xᵀ / (a + xᵀx)) x
        torch.testing.assert_close(P[e] @ x[e], expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(P[e], torch.linalg.inv(torch.eye(I) + torch.outer(x[e], x[e]) / a))
    # symmetric, also after a second update of a non-identity P
    assert torch.equal(P, P.transpose(1, 2))
    P2 = rls_update(P, torch.randn(E, I), a)
    assert torch.equal(P2, P2.transpose(1, 2))
    # experts without inputs keep their projector
    P3 = rls_update(P, torch.randn(E, I), a, torch.tensor([True, False, True]))
    assert torch.equal(P3[1], P[1]) and not torch.equal(P3[0], P[0])


def test_state_survives_safetensors_save_and_resume(tmp_path):
    model = tiny(n_experts=2, top_k=1)
    cfg = OMoEConfig(every=5, a0=1e-2, total_steps=20)
    opt = OMoE(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg)
    data = batches(12)
    train(model, opt, data[:7])  # O step at 5, pending inputs from 6 and 7
    state = opt.state_dict()
    assert state["omoe.step"].dtype == torch.int64 and state["omoe.step"].dim() == 0
    assert state["omoe.layers.1.ffn.experts.in.P"].shape == (2, 64, 64)
    assert state["omoe.layers.1.ffn.experts.hidden.pending"].shape == (2, 2, 128)
    assert not torch.equal(state["omoe.layers.1.ffn.experts.in.P"][0], torch.eye(64))
    save_file(state, str(tmp_path / "omoe.safetensors"))
    base_state = copy.deepcopy(opt.base.state_dict())

    # The resumed model: same weights, built afresh and loaded from the state dict as a resumed run's is
    # (no layer keeps its MoEAux any more, so a deepcopy would also work; the state dict is what resuming uses).
    model2 = tiny(n_experts=2, top_k=1)
    model2.load_state_dict(model.state_dict())
    opt2 = OMoE(model2, torch.optim.AdamW(model2.parameters(), lr=1e-2), cfg)
    opt2.base.load_state_dict(base_state)
    opt2.load_state_dict(load_file(str(tmp_path / "omoe.safetensors")))
    assert opt2.step_count == 7
    for key, value in opt2.state_dict().items():
        assert torch.equal(value, state[key]), key

    train(model, opt, data[7:])  # steps 8..12, O step at 10 uses the restored pending inputs
    train(model2, opt2, data[7:])
    for (name, p), (_, q) in zip(model.named_parameters(), model2.named_parameters()):
        assert torch.equal(p, q), name


def test_load_state_dict_missing_key_or_bad_shape_names_it():
    model = tiny(n_experts=2, top_k=1)
    opt = OMoE(model, torch.optim.SGD(model.parameters(), lr=0.1), OMoEConfig())
    state = opt.state_dict()
    key = "omoe.layers.0.ffn.experts.hidden.P"
    missing = {k: v for k, v in state.items() if k != key}
    with pytest.raises(ValueError, match=re.escape(key)):
        opt.load_state_dict(missing)
    bad = dict(state, **{key: torch.zeros(2, 3, 3)})
    with pytest.raises(ValueError, match=re.escape(key)):
        opt.load_state_dict(bad)
