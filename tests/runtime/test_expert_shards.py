"""A layer's experts split into contiguous shards, as expert-parallel ranks hold them (dispatch -> each shard's
blocks -> combine), equal the reference loop over the whole layer's experts; a shard on the C kernel equals its torch
loop. The exchange between ranks around these shards is tests/runtime/test_expert_parallel.py's."""

from __future__ import annotations

import pytest
import torch

from moeserve.runtime.backends.expert_shards import ExpertShard, contiguous_ranges
from moeserve.runtime.experts import Experts, combine, dispatch, moe_reference

E, D, FF = 8, 16, 24


def experts(act: str, seed: int = 0) -> Experts:
    torch.manual_seed(seed)
    return Experts(E, D, FF, act)


def through_shards(ex: Experts, n_shards: int, x, ids, gates, keep=None):
    """dispatch -> each shard of contiguous_ranges on its experts' blocks only -> combine, as the ranks of a group
    compute a layer between them."""
    d = dispatch(x, ids, gates, E, keep)
    blocks = d.blocks()
    ys = []
    for r in contiguous_ranges(E, n_shards):
        shard = ExpertShard.of(ex, r)
        ys.append(shard(torch.cat([blocks[e] for e in r]), [d.counts[e] for e in r]))
    return combine(d, torch.cat(ys), x)


@pytest.mark.parametrize("act", ["swiglu", "gelu"])
@pytest.mark.parametrize("n_shards", [1, 3, 8])
@pytest.mark.parametrize("with_keep", [False, True])
def test_shards_equal_the_reference_loop(act, n_shards, with_keep):
    ex = experts(act)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, D, generator=g)
    ids = torch.randn(11, E, generator=g).topk(2, dim=-1).indices
    ids[ids == 5] = 6  # expert 5 gets no token: its shard computes an empty block
    ids[:, 1] = torch.where(ids[:, 0] == ids[:, 1], (ids[:, 1] + 1) % E, ids[:, 1])
    gates = torch.rand(11, 2, generator=g)
    keep = torch.rand(11, 2, generator=g) < 0.7 if with_keep else None
    with torch.no_grad():
        want = moe_reference(x, ids, gates, ex.w1, ex.w2, ex.w3, keep)
        torch.testing.assert_close(through_shards(ex, n_shards, x, ids, gates, keep), want, atol=1e-6, rtol=0)


def test_contiguous_ranges_and_a_bad_shard():
    assert contiguous_ranges(8, 3) == [range(0, 2), range(2, 5), range(5, 8)]
    assert contiguous_ranges(4, 4) == [range(i, i + 1) for i in range(4)]
    ex = experts("gelu")
    with pytest.raises(ValueError, match="3 expert ids for 4 stacked experts"):
        ExpertShard([0, 1, 2], ex.w1[:4], ex.w2[:4], None)


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
