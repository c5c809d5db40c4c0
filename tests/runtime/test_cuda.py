"""The engine on a CUDA GPU against the same weights on the CPU, where a GPU is present (skipped with the
reason elsewhere; README, "On a GPU"). The step engine's contract (test_steps.py), the CUDA-graph decode step
(test_compiled.py), the dispatch paths (test_dispatch.py) and `bench engine --device cuda` (test_engine_bench.py)
run on the GPU from their own modules; here, what only a comparison across devices shows:

- fp32: every router's logits within 1e-4 of the CPU's (no TF32: torch leaves it off for float32 matmuls), the
  same greedy and seeded tokens, and the same expert-load counts to the token;
- bf16 on the GPU: logits within bf16's rounding of fp32 on the CPU (tokens may part: a near-tie in a router or
  at the head goes either way once every sum is rounded to 8 bits)."""

from __future__ import annotations

import pytest
import torch

from moeserve.runtime.sampling import SamplingParams

from .test_engine import PROMPTS, make_engine

pytestmark = pytest.mark.cuda

ROUTERS = ["softmax", "sigmoid", "xmoe", "vq"]


def padded(engine) -> tuple[torch.Tensor, torch.Tensor]:
    """PROMPTS as one right-padded batch: ids [B, S] and the attention mask."""
    rows = [engine.encode(p) for p in PROMPTS]
    S = max(map(len, rows))
    ids = torch.tensor([r + [0] * (S - len(r)) for r in rows])
    return ids, (torch.arange(S) < torch.tensor([len(r) for r in rows])[:, None]).long()


@pytest.mark.parametrize("router", ROUTERS)
def test_fp32_on_cuda_gives_the_cpus_logits_tokens_and_counts(router):
    cpu, gpu = make_engine(router), make_engine(router, device="cuda")
    assert gpu.device.type == "cuda" and gpu.dtype == torch.float32
    ids, mask = padded(cpu)
    want = cpu.forward(ids, mask)
    got = gpu.forward(ids, mask)
    assert got.device.type == "cuda"
    keep = mask.bool()  # padded positions are never read
    torch.testing.assert_close(got.cpu()[keep], want[keep], atol=1e-4, rtol=1e-4)

    params = [SamplingParams(max_new_tokens=16, ignore_eos=True),
              SamplingParams(max_new_tokens=12, temperature=0.9, top_k=40, seed=7, ignore_eos=True)] * 2
    for engine in (cpu, gpu):
        engine.expert_load.reset()
    want = [c.token_ids for c in cpu.complete(PROMPTS, params)]
    got = [c.token_ids for c in gpu.complete(PROMPTS, params)]
    assert got == want
    assert torch.equal(gpu.expert_load.snapshot().cpu(), cpu.expert_load.snapshot())


@pytest.mark.parametrize("router", ROUTERS)
def test_bf16_on_cuda_is_fp32_within_bf16_rounding(router):
    cpu, gpu = make_engine(router), make_engine(router, device="cuda", dtype="bfloat16")
    assert gpu.dtype == torch.bfloat16
    ids, mask = padded(cpu)
    keep = mask.bool()
    want = cpu.forward(ids, mask)[keep]
    got = gpu.forward(ids, mask).cpu()[keep]
    scale = want.abs().max()
    # bf16 on the CPU (AVX512-BF16 EPYC): max 0.3-1.5% of the largest logit, mean 0.04-0.05%; another router's
    # fp32 logits (same seed, so the same attention) differ by a mean of 0.3%
    assert (got - want).abs().max() <= 2**-5 * scale
    assert (got - want).abs().mean() <= 2**-10 * scale
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9  # the greedy choice, at most positions


@pytest.mark.parametrize("S", [1, 7])
def test_attention_runs_a_fused_sdpa_kernel(S):
    """A cached call's attention (a boolean mask over the cache, grouped-query heads) and an uncached causal one run
    one of SDPA's fused CUDA kernels in bf16, not its math fallback: SDPA limited to flash, memory-efficient and
    cuDNN raises where none of them takes the inputs. Same outputs as the math kernel, within bf16's rounding."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from moeserve.config import preset
    from moeserve.runtime.kv_cache import KVCache
    from moeserve.runtime.model import Transformer

    torch.manual_seed(0)
    model = Transformer(preset("small")).to("cuda", torch.bfloat16).eval()  # 8 heads over 4 kv heads
    assert model.cfg.kv_heads < model.cfg.n_heads
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    ids = torch.randint(0, model.cfg.vocab_size, (2, 20), device="cuda")
    outs = {}
    for name, backends in (("fused", fused), ("math", [SDPBackend.MATH])):
        cache = KVCache.for_model(model, 2, 64)
        with torch.inference_mode(), sdpa_kernel(backends):
            uncached = model(ids).logits
            model(ids, cache=cache.rows([0, 1], [0, 0], 20))
            cached = model(ids[:, :S], cache=cache.rows([0, 1], [20, 20], S)).logits
        outs[name] = (uncached.float(), cached.float())
    for got, want in zip(outs["fused"], outs["math"]):
        assert (got - want).abs().max() <= 2**-5 * want.abs().max()
