"""The Transformer: KV-cached decoding equals a full forward, causality, classification with padding,
the per-layer MoEAux, gradients for every router kind, and MoEConfig validation and JSON."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from moeserve.config import ConfigError, MoEConfig, preset
from moeserve.runtime.kv_cache import KVCache
from moeserve.runtime.model import ModelOutput, Transformer
from moeserve.runtime.moe import MoEAux, MoELayer
from moeserve.training.losses import aux_losses

V = 259


def tiny(**overrides) -> Transformer:
    torch.manual_seed(0)
    return Transformer(preset("tiny", **overrides))


def rand_ids(shape, seed=1) -> torch.Tensor:
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# KV cache


@pytest.mark.parametrize("n_kv_heads", [None, 2])
@pytest.mark.parametrize("router", ["softmax", "xmoe"])
def test_kv_cache_decoding_equals_full_forward(n_kv_heads, router):
    model = tiny(n_kv_heads=n_kv_heads, router=router).eval()
    B, S, P = 2, 12, 5
    ids = rand_ids((B, S))
    with torch.no_grad():
        full = model(ids).logits
        cache = KVCache.for_model(model, B, 16)
        parts = [model(ids[:, :P], cache=cache.rows(list(range(B)), [0] * B, P)).logits]
        for t in range(P, S):
            parts.append(model(ids[:, t : t + 1], cache=cache.rows(list(range(B)), [t] * B, 1)).logits)
    inc = torch.cat(parts, dim=1)
    assert inc.shape == full.shape == (B, S, V)
    torch.testing.assert_close(inc, full, rtol=0, atol=1e-5)
    if n_kv_heads == 2:
        assert model.layers[0].attention.wk.weight.shape == (2 * 16, 64)


def test_kv_cache_one_token_at_a_time_from_start():
    model = tiny(n_kv_heads=2).eval()
    ids = rand_ids((1, 9), seed=4)
    with torch.no_grad():
        full = model(ids).logits
        cache = KVCache.for_model(model, 1, 9)
        inc = torch.cat([model(ids[:, t : t + 1], cache=cache.rows([0], [t], 1)).logits for t in range(9)], dim=1)
    torch.testing.assert_close(inc, full, rtol=0, atol=1e-5)


def test_windows_per_layer():
    """layer_windows (gpt-oss alternates windowed and full layers): a window on every layer is sliding_window; a
    window on one layer only is neither the windowed nor the full model, and its cached decode, one row at a time
    or rows of any lengths in one call (StepRows), equals its full forward."""
    S, P = 14, 5
    ids = rand_ids((2, S), seed=3)
    windowed, mixed, full = (tiny(n_kv_heads=2, **kw).eval() for kw in (
        dict(sliding_window=4), dict(layer_windows=[None, 4]), {}))
    same = tiny(n_kv_heads=2, layer_windows=[4, 4]).eval()
    assert [b.attention.window for b in mixed.layers] == [None, 4] and mixed.windows == [None, 4]
    assert mixed.cfg.extensions == ["layer_windows"] and windowed.cfg.extensions == []
    with torch.no_grad():
        logits = {m: m(ids).logits for m in (windowed, mixed, full, same)}
        torch.testing.assert_close(logits[same], logits[windowed], rtol=0, atol=0)
        assert (logits[mixed] - logits[windowed]).abs().amax() > 1e-3
        assert (logits[mixed] - logits[full]).abs().amax() > 1e-3
        cache = KVCache.for_model(mixed, 2, 16)
        parts = [mixed(ids[:, :P], cache=cache.rows([0, 1], [0, 0], P)).logits]
        parts += [mixed(ids[:, t:t + 1], cache=cache.rows([0, 1], [t, t], 1)).logits for t in range(P, S)]
        torch.testing.assert_close(torch.cat(parts, dim=1), logits[mixed], rtol=0, atol=1e-5)
        cache = KVCache.for_model(mixed, 2, 16)
        mixed(ids[:1, :S - 1], cache=cache.rows([0], [0], S - 1))
        starts = [S - 1, 0]  # row 0's decode token beside row 1's whole prompt
        rows = cache.step_rows([0, 1], starts, [1, S])
        flat = torch.cat([ids[b, starts[b]:] for b in rows.order])
        last = mixed(flat[None], cache=rows).logits[:, 0]
    torch.testing.assert_close(last, logits[mixed][rows.order, -1], rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# causality


def test_causal_model_earlier_positions_unchanged():
    model = tiny().eval()
    ids = rand_ids((2, 10))
    ids2 = ids.clone()
    ids2[:, 6] = (ids2[:, 6] + 1) % V
    with torch.no_grad():
        a, b = model(ids).logits, model(ids2).logits
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=1e-6)
    assert (a[:, 6:] - b[:, 6:]).abs().amax() > 1e-4


def test_bidirectional_model_earlier_positions_change():
    model = tiny(causal=False).eval()
    ids = rand_ids((2, 10))
    ids2 = ids.clone()
    ids2[:, 6] = (ids2[:, 6] + 1) % V
    with torch.no_grad():
        a, b = model(ids).logits, model(ids2).logits
    for s in range(6):
        assert (a[:, s] - b[:, s]).abs().amax() > 1e-5, s


# ---------------------------------------------------------------------------------------------
# classification


def test_classifier_shape_and_padding_invariance():
    model = tiny(task="classify", n_classes=3, causal=False).eval()
    lengths = [5, 8, 3]
    S = 8
    seqs = [rand_ids((1, n), seed=10 + i)[0] for i, n in enumerate(lengths)]
    with torch.no_grad():
        alone = torch.cat([model(s[None]).logits for s in seqs])
        assert alone.shape == (3, 3)
        for pad_id in (258, 7):
            ids = torch.full((3, S), pad_id, dtype=torch.long)
            mask = torch.zeros(3, S, dtype=torch.long)
            for i, s in enumerate(seqs):
                ids[i, : len(s)] = s
                mask[i, : len(s)] = 1
            out = model(ids, attention_mask=mask)
            assert isinstance(out, ModelOutput)
            assert out.logits.shape == (3, 3)
            torch.testing.assert_close(out.logits, alone, rtol=0, atol=1e-5)
        # without the mask the padding does change the result: the mask is what removes it
        unmasked = model(ids).logits
    assert (unmasked[0] - alone[0]).abs().max() > 1e-4


def test_classifier_pools_by_mean_over_real_tokens():
    model = tiny(task="classify", n_classes=3, causal=False).eval()
    ids = rand_ids((2, 6))
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    hidden = {}
    model.norm.register_forward_hook(lambda m, i, o: hidden.__setitem__("x", o))
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    x = hidden["x"]
    pooled = torch.stack([x[0, :4].mean(0), x[1].mean(0)])
    want = pooled @ model.classifier.weight.T + model.classifier.bias
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# aux


@pytest.mark.parametrize("moe_layers, top_k", [([1], 2), (None, 2), (None, 1), ([0], 3)])
def test_aux_one_per_moe_layer_and_counts(moe_layers, top_k):
    model = tiny(moe_layers=moe_layers, top_k=top_k)
    B, S = 3, 7
    out = model(rand_ids((B, S)))
    n_moe = 2 if moe_layers is None else len(moe_layers)
    assert len(out.aux) == n_moe
    assert len(model.moe_layers) == n_moe
    for a in out.aux:
        assert isinstance(a, MoEAux)
        assert a.counts.shape == (4,)
        assert int(a.counts.sum()) == B * S * top_k
        assert torch.equal(a.counts, torch.bincount(a.routing.expert_ids.reshape(-1), minlength=4))
        assert a.routing.expert_ids.shape == (B * S, top_k)
    # a dense layer is not an MoE layer
    if moe_layers == [1]:
        assert not isinstance(model.layers[0].ffn, MoELayer)
        assert isinstance(model.layers[1].ffn, MoELayer)


def test_aux_counts_discrete_vq_one_per_token():
    model = tiny(router="vq", vq_mode="discrete")
    out = model(rand_ids((2, 9)))
    for a in out.aux:
        assert a.routing is None
        assert int(a.counts.sum()) == 18
        assert torch.equal(a.counts, torch.bincount(a.codes, minlength=4))


# ---------------------------------------------------------------------------------------------
# every router kind trains

ROUTER_KINDS = {
    "softmax": dict(router="softmax"),
    "softmax_renorm_gelu": dict(router="softmax", renormalize=True, expert_act="gelu"),
    "sigmoid": dict(router="sigmoid"),
    "xmoe_softmax": dict(router="xmoe", xmoe_gate="softmax"),
    "xmoe_sigmoid": dict(router="xmoe", xmoe_gate="sigmoid"),
    "vq_mixed_code": dict(router="vq", vq_mode="mixed", vq_input="code"),
    "vq_mixed_blend": dict(router="vq", vq_mode="mixed", vq_input="blend"),
    "vq_discrete_code": dict(router="vq", vq_mode="discrete", vq_input="code"),
    "vq_discrete_blend": dict(router="vq", vq_mode="discrete", vq_input="blend"),
    "vq_discrete_code_proj_cos": dict(router="vq", vq_mode="discrete", vq_input="code", vq_dim=16,
                                      vq_distance="cosine"),
    "vq_mixed_code_proj": dict(router="vq", vq_mode="mixed", vq_input="code", vq_dim=16),
    "softmax_capacity": dict(router="softmax", capacity_factor=1.5),
}


def _nonzero(p: torch.Tensor) -> bool:
    return p.grad is not None and bool(p.grad.abs().sum() > 0)


@pytest.mark.parametrize("kind", list(ROUTER_KINDS))
def test_every_router_kind_forward_backward_grads(kind):
    overrides = ROUTER_KINDS[kind]
    model = tiny(**overrides)
    cfg = model.cfg
    ids = rand_ids((2, 24), seed=3)
    out = model(ids)
    assert out.logits.shape == (2, 24, V)
    assert torch.isfinite(out.logits).all()
    lm = F.cross_entropy(out.logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    lm.backward(retain_graph=True)
    code_input = cfg.router == "vq" and cfg.vq_input == "code"
    missing = [n for n, p in model.named_parameters()
               if not _nonzero(p) and not (code_input and n.endswith("quantizer.codebook"))]
    assert not missing, missing
    is_vq = cfg.router == "vq"
    if code_input:
        # x~ = v_k with a straight-through gradient: the LM loss does not reach the codebook ...
        for layer in model.moe_layers:
            g = layer.quantizer.codebook.grad
            assert g is None or g.abs().sum() == 0
    # ... the auxiliary losses do (VQ codebook loss), and the balance loss reaches the router
    model.zero_grad(set_to_none=True)
    losses = aux_losses(out.aux, cfg)
    losses.total(cfg).backward()
    for layer in model.moe_layers:
        if is_vq:
            assert _nonzero(layer.quantizer.codebook)
            assert float(losses.vq_codebook.detach()) > 0 and float(losses.vq_commitment.detach()) > 0
        if layer.router is not None:
            router_params = list(layer.router.named_parameters())
            assert any(_nonzero(p) for _, p in router_params), router_params
            assert float(losses.balance.detach()) > 0
        else:
            assert float(losses.balance.detach()) == 0
    # one SGD step changes the loss (the model does learn)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        before = F.cross_entropy(model(ids).logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = model(ids)
    loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1)) + aux_losses(out.aux, cfg).total(cfg)
    loss.backward()
    opt.step()
    model.constrain_()
    with torch.no_grad():
        after = F.cross_entropy(model(ids).logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    assert float(after) < float(before)


# ---------------------------------------------------------------------------------------------
# config


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(top_k=5), "top_k"),
        (dict(router="nope"), "router"),
        (dict(n_heads=6), "n_heads"),
        (dict(capacity_factor=-1.0), "capacity_factor"),
        (dict(moe_layers=[2]), "moe_layers"),
        (dict(moe_layers=[-1]), "moe_layers"),
        (dict(task="classify", n_classes=0), "n_classes"),
        (dict(n_kv_heads=3), "n_kv_heads"),
        (dict(vq_blend_rate=0.6), "vq_blend_rate"),
        (dict(expert_act="relu"), "expert_act"),
        (dict(d_model=0), "d_model"),
        (dict(task="classify", n_classes=2, labels=["a"]), "labels"),
        (dict(task="classify", n_classes=2, labels=["a", "a"]), "labels"),
        (dict(task="classify", n_classes=2, labels=["a", 1]), "labels"),
        (dict(labels=["a", "b"]), "labels"),  # a language model has no classes to name
    ],
)
def test_config_rejects_bad_values_naming_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        preset("tiny", **overrides)
    assert f"'{field}'" in str(err.value), str(err.value)


def test_config_good_values_accepted():
    cfg = preset("tiny", top_k=4, moe_layers=[0, 1], capacity_factor=1.0, task="classify", n_classes=2,
                 labels=["no", "yes"])
    assert cfg.top_k == 4 and cfg.moe_layer_ids == [0, 1] and cfg.labels == ["no", "yes"]


def test_config_json_round_trip():
    cfg = preset("small", router="xmoe", moe_layers=[1, 3], capacity_factor=1.25, extra={"source": "test"})
    text = cfg.to_json()
    assert json.loads(text)["format"] == "moeserve/1"
    back = MoEConfig.from_json(text)
    assert back == cfg
    assert back.to_json() == text
    assert MoEConfig.from_dict(cfg.to_dict()) == cfg
    assert back != cfg.replace(top_k=1)


def test_config_unknown_field_listed():
    data = preset("tiny").to_dict()
    data["n_expertz"] = 3
    with pytest.raises(ConfigError) as err:
        MoEConfig.from_dict(data)
    assert "n_expertz" in str(err.value)


def test_config_bad_json_and_format():
    with pytest.raises(ConfigError):
        MoEConfig.from_json("{not json")
    with pytest.raises(ConfigError) as err:
        MoEConfig.from_dict({"format": "other/9"})
    assert "format" in str(err.value)


def test_unknown_preset_raises():
    with pytest.raises(ConfigError) as err:
        preset("nope")
    assert "nope" in str(err.value)


def test_bidirectional_model_with_cache_ignores_unwritten_slots():
    """A cache longer than the prompt must not let a bidirectional model attend to its zero tail."""
    torch.manual_seed(0)
    model = Transformer(preset("tiny", causal=False)).eval()
    ids = torch.randint(0, 256, (1, 8))
    full = model(ids).logits
    cached = model(ids, cache=KVCache.for_model(model, 1, 16).rows([0], [0], 8)).logits
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)


def test_model_deepcopies_after_a_training_forward():
    """EMA and evaluation copies deepcopy the model; no graph tensor may stay behind in a layer."""
    import copy

    model = Transformer(preset("tiny", router="vq"))
    out = model(torch.randint(0, 256, (2, 8)))
    out.logits.float().mean().backward()
    assert len(out.aux) == 2 and all(a.counts.sum() > 0 for a in out.aux)
    clone = copy.deepcopy(model)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), clone.state_dict().values()))


@pytest.mark.parametrize("gated", [True, False])
def test_a_shared_expert_adds_its_output_to_the_routed_one(gated):
    """Qwen2-MoE's layer: y = routed(x) + sigmoid(w_s . x) f_s(x) (without the gate, + f_s(x)); padding stays 0."""
    torch.manual_seed(0)
    layer = MoELayer(preset("tiny", shared_d_ff=40, shared_gate=gated))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x, mask = torch.randn(2, 5, 64), torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    with torch.no_grad():
        y, _ = layer(x, mask)
        shared = layer.shared(x) * (torch.sigmoid(layer.shared_gate(x)) if gated else 1)
        layer.shared = None
        routed, _ = layer(x, mask)
    torch.testing.assert_close(y[mask], (routed + shared)[mask])
    assert not y[~mask].any()


def test_dense_layers_of_their_own_width_and_a_quantizable_shared_expert():
    model = tiny(moe_layers=[0], dense_d_ff=96, shared_d_ff=40)
    assert model.layers[1].ffn.w1.weight.shape == (96, 64) and model.layers[0].ffn.experts.w1.shape[1] == 128
    names = {(id(parent), attr) for parent, attr in model.quantizable()}
    assert all((id(model.layers[0].ffn.shared), w) in names for w in ("w1", "w2", "w3"))
