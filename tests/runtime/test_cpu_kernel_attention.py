"""Decode attention on the C kernel (cpu_kernel.attend_decode): against SDPA on the same keys for every row's
slot and causal window, grouped-query heads, float32 and bfloat16; a row's result the same whatever rows
share the call; RoPE and the cache write in the same call bit for bit torch's (apply_rope, CacheRows.write);
a model whose plan puts norms and attention on the kernel attends with it at decode steps and prefills (a prompt
in chunks bit for bit the prompt whole), giving the plain model's tokens, with and without a sliding window. (The
attention half fused into the whole decode step: test_kernel_decode.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.runtime.backends import cpu_kernel
from moeserve.runtime.backends.cpu import KernelAttention
from moeserve.runtime.backends.cpu_kernel import KernelError
from moeserve.runtime.engine import Engine, SamplingParams
from moeserve.runtime.kv_cache import KVCache
from moeserve.runtime.model import apply_rope, rope_tables
from moeserve.runtime.steps import Sequence
from moeserve.tokenizer import ByteTokenizer

from .test_cpu_kernel import KERNEL_PLAN, requires_kernel
from .test_engine import PROMPTS, make_engine


def reference(q_BHD, k, v, slots, lo, hi):
    """SDPA per row on its slot's keys lo..hi-1, the kv heads repeated for their query heads, in float64."""
    H, G = q_BHD.shape[1], k.shape[1]
    out = []
    for b in range(q_BHD.shape[0]):
        kk = k[slots[b], :, lo[b]:hi[b]].double().repeat_interleave(H // G, 0)
        vv = v[slots[b], :, lo[b]:hi[b]].double().repeat_interleave(H // G, 0)
        out.append(F.scaled_dot_product_attention(q_BHD[b].double()[:, None], kk, vv)[:, 0])
    return torch.stack(out)


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,G,Dh", [(4, 4, 16), (6, 2, 36), (8, 1, 7)])
def test_equals_sdpa_on_each_rows_slot_and_window(H, G, Dh, dtype):
    g = torch.Generator().manual_seed(H * 100 + Dh)
    n_slots, L = 5, 40
    k, v = (torch.randn(n_slots, G, L, Dh, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(4, H, Dh, generator=g).to(dtype)
    slots, lo, hi = torch.tensor([4, 0, 2, 1]), torch.tensor([0, 0, 30, 3]), torch.tensor([17, 1, 40, 4])
    y = cpu_kernel.attend_decode(q, k, v, slots, lo, hi, Dh**-0.5)
    assert y.dtype == dtype and y.shape == q.shape
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2**-7)
    torch.testing.assert_close(y.double(), reference(q, k, v, slots, lo, hi), **tol)
    alone = torch.cat([cpu_kernel.attend_decode(q[b:b + 1], k, v, slots[b:b + 1], lo[b:b + 1], hi[b:b + 1], Dh**-0.5)
                       for b in range(4)])
    assert torch.equal(alone, y)


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,G,Dh", [(4, 4, 16), (6, 2, 36), (8, 1, 10)])
def test_rope_and_the_cache_write_in_the_same_call_are_torchs(H, G, Dh, dtype):
    """new_kv and rope: the cache afterwards holds what apply_rope + CacheRows.write put there, and the output is
    attention over it with apply_rope's query, bit for bit, in either dtype."""
    g = torch.Generator().manual_seed(H * 10 + Dh)
    n_slots, L, B = 5, 40, 3
    cache = KVCache(1, n_slots, L, G, Dh, dtype)
    for t in (*cache.k, *cache.v):
        t.copy_(torch.randn(t.shape, generator=g))
    rows = cache.rows([4, 0, 2], [16, 0, 39], 1)
    q, k, v = (torch.randn(B, n, 1, Dh, generator=g).to(dtype) for n in (H, G, G))  # [B, heads, S=1, Dh]
    cos, sin = (t[rows.positions][:, None].to(dtype) for t in rope_tables(Dh, L, 10000.0))  # as the model's forward
    lo, hi = rows.decode_bounds(None)
    want_k, want_v = cache.k[0].clone(), cache.v[0].clone()
    k_cache, v_cache = cache.k[0].clone(), cache.v[0].clone()
    cache.k[0], cache.v[0] = want_k, want_v
    rows.write(0, apply_rope(k, cos, sin), v)
    want = cpu_kernel.attend_decode(apply_rope(q, cos, sin)[:, :, 0], want_k, want_v, rows.slots, lo, hi, Dh**-0.5)
    y = cpu_kernel.attend_decode(q[:, :, 0], k_cache, v_cache, rows.slots, lo, hi, Dh**-0.5,
                                 new_kv=(k[:, :, 0], v[:, :, 0]), rope=(cos.reshape(B, Dh), sin.reshape(B, Dh)))
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert torch.equal(y, want)
    unrotated = cpu_kernel.attend_decode(q[:, :, 0], k_cache, v_cache, rows.slots, lo, hi, Dh**-0.5,
                                         new_kv=(k[:, :, 0], v[:, :, 0]))  # no rope: the keys written as given
    assert torch.equal(k_cache[rows.slots, :, rows.positions[:, 0]], k[:, :, 0])
    assert unrotated.shape == y.shape and not torch.equal(unrotated, y)


@requires_kernel
def test_what_it_cannot_take_is_named():
    k = torch.randn(2, 2, 8, 4)
    q, idx = torch.randn(1, 3, 4), torch.zeros(1, dtype=torch.long)
    with pytest.raises(KernelError, match="heads dividing"):  # 3 query heads over 2 kv heads
        cpu_kernel.attend_decode(q, k, k, idx, idx, idx + 1, 0.5)
    with pytest.raises(KernelError, match="1 contiguous int64s, not torch.int32"):
        cpu_kernel.attend_decode(torch.randn(1, 2, 4), k, k, idx.int(), idx, idx + 1, 0.5)
    q = torch.randn(1, 2, 4)
    with pytest.raises(KernelError, match=r"new_kv takes torch.float32 \[1, 2, 4\], not torch.float32 \[1, 4\]"):
        cpu_kernel.attend_decode(q, k, k, idx, idx, idx + 1, 0.5, new_kv=(torch.randn(1, 4), torch.randn(1, 4)))
    with pytest.raises(KernelError, match=r"rope takes torch.float32 \[1, 4\], not torch.bfloat16"):
        cpu_kernel.attend_decode(q, k, k, idx, idx, idx + 1, 0.5, rope=(torch.randn(1, 4).bfloat16(),) * 2)
    odd = torch.randn(2, 2, 8, 5)
    with pytest.raises(KernelError, match="even head dim, not 5"):
        cpu_kernel.attend_decode(torch.randn(1, 2, 5), odd, odd, idx, idx, idx + 1, 0.5, rope=(torch.randn(1, 5),) * 2)
    cache = KVCache(1, 2, 8, 2, 4, torch.float32)
    rows = cache.rows([1], [7], 1)
    rows.positions = rows.positions + 1  # past the cache: refused before anything reads it
    with pytest.raises(ValueError, match="outside the cache"):
        rows.decode_bounds(None)


@requires_kernel
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_model_on_the_kernel_attends_with_it_and_gives_the_same_tokens(window, dtype, monkeypatch):
    plain = Engine.from_model(make_engine("softmax", sliding_window=window).model, ByteTokenizer(), dtype=dtype)
    kern = Engine.from_model(make_engine("softmax", sliding_window=window).model, ByteTokenizer(), dtype=dtype,
                             plan=KERNEL_PLAN)
    assert all(isinstance(layer.attention, KernelAttention) for layer in kern.model.layers)
    assert not any(isinstance(layer.attention, KernelAttention) for layer in plain.model.layers)
    kern.runner.step = None  # attend_decode called on its own (the whole step has its tests)
    calls = []
    attend = cpu_kernel.attend_decode
    monkeypatch.setattr(cpu_kernel, "attend_decode", lambda *a, **kw: calls.append(a[0].shape[0]) or attend(*a, **kw))
    alone = [kern.generate([p], max_new_tokens=12)[0] for p in PROMPTS]
    layers = len(kern.model.layers)  # every layer: a prompt's queries in one call, then each decode step's one row
    assert sorted(calls) == sorted([len(kern.encode(p)) for p in PROMPTS] * layers + [1] * 11 * layers * len(PROMPTS))
    assert kern.generate(PROMPTS, max_new_tokens=12) == alone  # and in a batch: the same tokens
    if dtype == "float32":  # bf16 rounds differently from torch's kernels: tokens may part, as they do elsewhere
        assert alone == [plain.generate([p], max_new_tokens=12)[0] for p in PROMPTS]
    ids = torch.tensor(plain.encode("import os\nimport sys\n"))  # 19 tokens: a decode query past the window
    tol = dict(atol=1e-4, rtol=0) if dtype == "float32" else dict(atol=0.1, rtol=0.05)
    torch.testing.assert_close(decode_logits(kern, ids), decode_logits(plain, ids), **tol)


@requires_kernel
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prompt_in_chunks_is_the_prompt_whole_bit_for_bit(window, dtype):
    """A cached prefill attends each query as a decode step would, so a prompt written in chunks (as the step
    engine writes one while others run) gives the logits and cache of the prompt written at once, exactly, in
    bf16 too; and a prompt joining running sequences mid-flight, chunked, samples the tokens it samples alone."""
    engine = Engine.from_model(make_engine("softmax", sliding_window=window).model, ByteTokenizer(), dtype=dtype,
                               plan=KERNEL_PLAN)
    ids = torch.tensor(engine.encode("import os\nimport sys\nclass A:\n"))
    n, cache = len(ids), KVCache.for_model(engine.model, 2)
    with torch.inference_mode():
        whole = engine.runner.prefill(cache, 0, ids, 0).logits[0, -1]
        for a in range(0, n, 3):
            chunked = engine.runner.prefill(cache, 1, ids[a:a + 3], a).logits[0, -1]
    assert torch.equal(whole, chunked)
    for kv in (*cache.k, *cache.v):
        assert torch.equal(kv[0, :, :n], kv[1, :, :n])
    params = [SamplingParams(max_new_tokens=10, temperature=0.9, seed=5 + i, ignore_eos=True) for i in range(3)]
    alone = [engine.complete([p], [sp])[0].token_ids for p, sp in zip(PROMPTS, params)]
    steps = engine.step_engine(slots=3, prefill_chunk=4)
    seqs = [Sequence(engine.encode(p), sp) for p, sp in zip(PROMPTS, params)]
    steps.add(seqs[0])
    steps.step()
    for seq in seqs[1:]:
        steps.add(seq)
    steps.run([])
    assert [s.out for s in seqs] == alone


def decode_logits(engine: Engine, ids: torch.Tensor) -> torch.Tensor:
    """The logits of one decode step: ids[:-1] prefilled into a cache, then ids[-1] at the next position."""
    model, n = engine.model, len(ids)
    cache = KVCache.for_model(model, 1)
    with torch.no_grad():
        model(ids[None, :-1], cache=cache.rows([0], [0], n - 1))
        return model(ids[None, -1:], cache=cache.rows([0], [n - 1], 1)).logits.float()
