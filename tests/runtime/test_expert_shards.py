"""Experts split into shards (dispatch -> each shard's blocks -> combine) equal the whole layer's experts,
and a model built through `experts_factory` with them gives the same logits and the same generation."""

from __future__ import annotations

import pytest
import torch

from moeserve.config import preset
from moeserve.runtime.engine import Engine
from moeserve.runtime.backends.expert_shards import ExpertShard, ShardedExperts
from moeserve.runtime.experts import Experts, moe_reference
from moeserve.runtime.model import Transformer
from moeserve.tokenizer import ByteTokenizer

E, D, FF = 8, 16, 24


def experts(act: str, seed: int = 0) -> Experts:
    torch.manual_seed(seed)
    return Experts(E, D, FF, act)


@pytest.mark.parametrize("act", ["swiglu", "gelu"])
@pytest.mark.parametrize("n_shards", [1, 3, 8])
@pytest.mark.parametrize("with_keep", [False, True])
def test_sharded_equals_the_reference_loop(act, n_shards, with_keep):
    ex = experts(act)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, D, generator=g)
    ids = torch.randn(11, E, generator=g).topk(2, dim=-1).indices
    ids[ids == 5] = 6  # expert 5 gets no token: its shard sends an empty block
    ids[:, 1] = torch.where(ids[:, 0] == ids[:, 1], (ids[:, 1] + 1) % E, ids[:, 1])
    gates = torch.rand(11, 2, generator=g)
    keep = torch.rand(11, 2, generator=g) < 0.7 if with_keep else None
    sharded = ShardedExperts.split(ex, n_shards)
    with torch.no_grad():
        want = moe_reference(x, ids, gates, ex.w1, ex.w2, ex.w3, keep)
        torch.testing.assert_close(sharded(x, ids, gates, keep), want, atol=1e-6, rtol=0)


def test_each_shard_sees_only_its_experts_rows():
    ex = experts("swiglu")
    seen: list[tuple[int, list[int]]] = []
    shards = [ExpertShard.of(ex, ids) for ids in ([0, 1, 2, 3], [4, 5, 6, 7])]

    def spy(i):
        def call(x, counts):
            seen.append((i, counts))
            return shards[i](x, counts)
        return call

    sharded = ShardedExperts(E, [spy(0), spy(1)], [[0, 1, 2, 3], [4, 5, 6, 7]])
    x = torch.randn(3, D)
    ids = torch.tensor([[0, 7], [1, 7], [6, 0]])
    with torch.no_grad():
        sharded(x, ids, torch.ones(3, 2))
    assert seen == [(0, [2, 1, 0, 0]), (1, [0, 0, 1, 2])]


def test_a_shard_order_other_than_the_experts_order():
    ex = experts("swiglu")
    ids_per_shard = [[5, 0, 3], [7, 1], [2, 6, 4]]
    sharded = ShardedExperts(E, [ExpertShard.of(ex, ids) for ids in ids_per_shard], ids_per_shard)
    x, ids, gates = torch.randn(9, D), torch.randint(0, E, (9, 1)), torch.rand(9, 1)
    with torch.no_grad():
        torch.testing.assert_close(sharded(x, ids, gates), moe_reference(x, ids, gates, ex.w1, ex.w2, ex.w3),
                                   atol=1e-6, rtol=0)


def test_bad_placements_are_refused():
    ex = experts("gelu")
    with pytest.raises(ValueError, match="expert 7 is on no shard"):
        ShardedExperts(E, [ExpertShard.of(ex, range(7))], [list(range(7))])
    with pytest.raises(ValueError, match="expert 3 is out of range or on two shards"):
        ShardedExperts(E, [ExpertShard.of(ex, range(4)), ExpertShard.of(ex, range(3, 8))], [range(4), range(3, 8)])
    with pytest.raises(ValueError, match="n_shards = 9"):
        ShardedExperts.split(ex, 9)
    bad = ShardedExperts(E, [lambda x, counts: x[:0]], [list(range(E))])
    with pytest.raises(RuntimeError, match="returned 0 rows for 2"):
        bad(torch.randn(1, D), torch.tensor([[0, 1]]), torch.ones(1, 2))


@pytest.mark.parametrize("router", ["softmax", "vq"])
def test_a_model_built_with_sharded_experts_matches_the_whole_model(router):
    torch.manual_seed(0)
    cfg = preset("tiny", router=router)
    whole = Transformer(cfg).eval()
    layers = {i: b.ffn.experts for i, b in enumerate(whole.layers) if i in cfg.moe_layer_ids}
    sharded = Transformer(cfg, experts_factory=lambda i: ShardedExperts.split(layers[i], 2)).eval()
    state = {k: v for k, v in whole.state_dict().items() if ".ffn.experts." not in k}
    missing, unexpected = sharded.load_state_dict(state, strict=False)
    assert not unexpected and all(".ffn.experts.shards." in k for k in missing)
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(sharded(ids).logits, whole(ids).logits, atol=1e-5, rtol=0)
    tok = ByteTokenizer()
    a = Engine.from_model(whole, tok, calibration="off").generate(["def f(x):"], max_new_tokens=8)
    b = Engine.from_model(sharded, tok, calibration="off").generate(["def f(x):"], max_new_tokens=8)
    assert a == b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["swiglu", "gelu"])
def test_a_shard_on_the_cpu_kernel_equals_its_torch_loop(act, dtype, monkeypatch):
    from moeserve.runtime.backends import cpu_kernel

    shard = ExpertShard.of(experts(act).to(dtype), [2, 3, 4])
    g = torch.Generator().manual_seed(2)
    cases = [[1, 0, 2], [0, 0, 0], [5, 9, 1], [0, 13, 0]]
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)  # bf16: a rounding
    with torch.inference_mode():
        want = [shard(torch.randn(sum(c), D, generator=g).to(dtype), c) for c in cases]
        monkeypatch.setenv(cpu_kernel.ENV, "off")
        assert shard.prepare_inference() is False and shard.kernel is None  # the probe's other side: torch's loop
        monkeypatch.delenv(cpu_kernel.ENV)
        if not cpu_kernel.available():
            pytest.skip(f"the C kernel is not built here: {cpu_kernel.unavailable_reason()}")
        assert shard.prepare_inference() is True
        kernel, calls = shard.kernel, []
        shard.kernel = lambda x, counts: calls.append(counts.tolist()) or kernel(x, counts)
        g.manual_seed(2)
        for c, w in zip(cases, want):
            torch.testing.assert_close(shard(torch.randn(sum(c), D, generator=g).to(dtype), c), w, **tol)
    assert calls == cases  # computed by the kernel, not torch's loop
