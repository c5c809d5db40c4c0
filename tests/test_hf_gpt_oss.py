"""Hugging Face gpt-oss directories load as they are and compute what transformers computes.

Every reference here is transformers' own GptOssForCausalLM, built tiny and random (its biases and sinks made
large enough to matter), saved with save_pretrained: sliding and full attention alternating with a window of 8,
a head width of its own (24, not 64 / 4), grouped-query attention, YaRN RoPE, attention sinks, a router bias and
biased clamped-SwiGLU experts. MXFP4 directories are written here from weights packed by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import GptOssConfig, GptOssForCausalLM  # noqa: E402

from moeserve.checkpoint import (  # noqa: E402
    CheckpointError, describe, is_expert_weight, load_checkpoint, load_expert_slice,
)
from moeserve.hf_gpt_oss import FP4_VALUES, dequantize_mxfp4  # noqa: E402
from moeserve.runtime.backends.plan import DispatchPlan  # noqa: E402
from moeserve.runtime.backends.experts import moe_indexed_biased  # noqa: E402
from moeserve.runtime.experts import BiasedExperts  # noqa: E402
from moeserve.runtime.kv_cache import KVCache  # noqa: E402
from moeserve.runtime.loading import load_model  # noqa: E402
from moeserve.runtime.model import attend_with_sinks  # noqa: E402
from moeserve.runtime.routing import SoftmaxRouter  # noqa: E402

from .test_hf_mixtral import edit_config  # noqa: E402

TOL = 1e-4  # fp32
V = 300
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 64, "rope_theta": 150000.0}


def hf_gpt_oss(tmp: Path, seed: int = 0, save: bool = True, **overrides) -> GptOssForCausalLM:
    """A tiny random gpt-oss, saved to `tmp` by transformers itself: weights of std 0.2 (at transformers' 0.02 greedy
    decoding repeats one token) and a SwiGLU limit of 1.5, which the experts' pre-activations cross."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=24, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
               max_position_embeddings=256, rope_parameters=YARN, swiglu_limit=1.5, initializer_range=0.2)
    model = GptOssForCausalLM(GptOssConfig(**{**cfg, **overrides})).eval()
    assert model.config._attn_implementation == "eager"  # the implementation with sinks, on a CPU
    with torch.no_grad():  # transformers initialises biases to zero and sinks near it: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("sinks"):
                p.normal_(0.0, 0.5)
    if save:
        model.save_pretrained(tmp)
    return model


def assert_logits_match(path: Path, hf: GptOssForCausalLM, lengths=(1, 17, 130)) -> None:
    model, _ = load_model(path)
    with torch.no_grad():
        for n in lengths:
            ids = torch.randint(0, V, (2, n), generator=torch.Generator().manual_seed(n))
            torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=TOL, rtol=0)


# ---- logits parity ---------------------------------------------------------------------------------------------------
def test_logits_match_transformers(tmp_path: Path) -> None:
    hf = hf_gpt_oss(tmp_path)
    assert_logits_match(tmp_path, hf)
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.manifest == {"format": "hf-gpt_oss"}
    cfg = ckpt.config
    assert (cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.d_ff, cfg.n_experts, cfg.top_k) == \
        (64, 4, 2, 24, 64, 4, 2)
    assert cfg.layer_windows == [8, None] and cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_theta == 150000.0
    assert set(cfg.extensions) == {"d_head", "qkv_bias", "o_bias", "attention_sinks", "layer_windows", "rope_scaling",
                                   "router_bias", "expert_bias", "clamped_swiglu"}
    assert isinstance(load_model(tmp_path)[0].layers[0].ffn.experts, BiasedExperts)
    n, experts = sum(p.numel() for p in hf.parameters()), 2 * 4 * (64 * 128 + 64 * 64 + 128 + 64)  # biases too
    text = describe(tmp_path)
    assert f"total: {n / 1e6:.2f}M ({n:,})" in text and f"experts: {experts / 1e6:.2f}M ({experts:,})" in text


def test_a_released_checkpoints_config_json(tmp_path: Path) -> None:
    """The config.json of the released checkpoints (written by transformers 4.55): rope_scaling and rope_theta at the
    top level, experts_per_token beside num_experts_per_tok, initial_context_length, a list of eos ids."""
    hf = hf_gpt_oss(tmp_path)
    edit_config(tmp_path, rope_parameters=..., rope_theta=150000,
                rope_scaling={k: v for k, v in YARN.items() if k != "rope_theta"}, experts_per_token=2,
                initial_context_length=64, eos_token_id=[7, 3], pad_token_id=5, transformers_version="4.55.0.dev0")
    cfg = load_checkpoint(tmp_path).config
    assert cfg.rope_theta == 150000.0 and cfg.rope_scaling["factor"] == 4.0 and cfg.extra["eos_token_id"] == 7
    assert_logits_match(tmp_path, hf, lengths=(70,))
    edit_config(tmp_path, experts_per_token=3)
    with pytest.raises(CheckpointError, match="field 'experts_per_token' = 3 and field 'num_experts_per_tok' = 2"):
        load_checkpoint(tmp_path)


def test_every_piece_changes_the_answer(tmp_path: Path) -> None:
    """The parity above is not vacuous: without the window, YaRN, the sinks or the expert biases the logits differ."""
    hf = hf_gpt_oss(tmp_path, save=False)
    ids = torch.randint(0, V, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = hf(ids).logits
        for change in ({"sliding_window": 64}, {"rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}},
                       {"swiglu_limit": 7.0}):
            other = GptOssForCausalLM(GptOssConfig(**{**hf.config.to_dict(), **change})).eval()
            other.load_state_dict(hf.state_dict())
            assert (other(ids).logits - reference).abs().max() > 1e-3, change
        for name in ("self_attn.sinks", "mlp.experts.down_proj_bias", "mlp.router.bias"):
            other = GptOssForCausalLM(hf.config).eval()
            other.load_state_dict({k: (torch.zeros_like(t) if k.endswith(name) else t)
                                   for k, t in hf.state_dict().items()})
            assert (other(ids).logits - reference).abs().max() > 1e-3, name


def test_padded_batch_matches(tmp_path: Path) -> None:
    """Rows of one batch padded on the right and on the left: each real token's logits are transformers'."""
    hf = hf_gpt_oss(tmp_path)
    model, _ = load_model(tmp_path)
    ids = torch.randint(0, V, (3, 30), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 19:] = 0
    mask[2, :11] = 0
    with torch.no_grad():
        ours, theirs = model(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], atol=TOL, rtol=0)


def test_kv_cached_decode_matches_full_forward(tmp_path: Path) -> None:
    """Two sequences in two cache slots: each prefilled (5 and 9 tokens), then decoded together a token a step past
    the window of 8; the cached paths attend with the sinks and each layer's window too."""
    hf = hf_gpt_oss(tmp_path)
    model, _ = load_model(tmp_path)
    n, starts = 22, (5, 9)
    ids = torch.randint(0, V, (2, n), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = hf(ids).logits
        cache = KVCache.for_model(model, 2, n)
        for row, start in enumerate(starts):
            got = model(ids[row:row + 1, :start], cache=cache.rows([row], [0], start)).logits
            torch.testing.assert_close(got, reference[row:row + 1, :start], atol=TOL, rtol=0)
        for step in range(n - max(starts)):
            pos = [start + step for start in starts]
            x = torch.stack([ids[row, p] for row, p in enumerate(pos)])[:, None]
            got = model(x, cache=cache.rows([0, 1], pos, 1)).logits[:, -1]
            torch.testing.assert_close(got, reference[[0, 1], pos], atol=TOL, rtol=0)


def test_rows_of_any_lengths_in_one_call_match(tmp_path: Path) -> None:
    """StepRows (the step engine's call): a decode row and a prompt's chunk of 6 together, each row's last logits
    transformers' at its position (the chunk crosses the window of 8)."""
    hf = hf_gpt_oss(tmp_path)
    model, _ = load_model(tmp_path)
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        reference = hf(ids).logits
        cache = KVCache.for_model(model, 2, 16)
        model(ids[:, :5], cache=cache.rows([0, 1], [0, 0], 5))
        lengths = [1, 6]  # slot 0: its token 5; slot 1: tokens 5..10
        rows = cache.step_rows([0, 1], [5, 5], lengths)
        tokens = torch.cat([ids[b, 5:5 + lengths[b]] for b in rows.order])[None]
        got = model(tokens, cache=rows).logits[:, -1]
    torch.testing.assert_close(got, reference[[0, 1], [5, 10]], atol=TOL, rtol=0)


def test_router_is_gpt_oss_top_k_then_softmax() -> None:
    """softmax over all E, top K, renormalised (SoftmaxRouter) is gpt-oss's softmax over the top K logits."""
    torch.manual_seed(0)
    router = SoftmaxRouter(64, 32, 4, renormalize=True, bias=True)
    with torch.no_grad():
        router.gate.bias.normal_()
    x = torch.randn(2000, 64)
    routing = router(x)
    logits = router.gate(x)
    top, ids = logits.topk(4, dim=-1)
    assert torch.equal(routing.expert_ids, ids)
    torch.testing.assert_close(routing.gates, top.softmax(dim=-1), atol=1e-6, rtol=0)


# ---- the modules, against plain references ---------------------------------------------------------------------------
def test_attention_with_sinks_is_sdpa_with_a_sink_column() -> None:
    """attend_with_sinks equals SDPA over one more key and value of zeros whose mask entry is the sink (the exact
    SDPA form), with grouped-query heads and a windowed mask."""
    torch.manual_seed(0)
    B, H, G, S, L, Dh = 2, 8, 2, 5, 12, 16
    q, k, v, sinks = torch.randn(B, H, S, Dh), torch.randn(B, G, L, Dh), torch.randn(B, G, L, Dh), torch.randn(H) * 3
    pos_S1, key_1L = torch.arange(L - S, L)[:, None], torch.arange(L)[None, :]
    mask = ((key_1L <= pos_S1) & (key_1L > pos_S1 - 4))[None, None].expand(B, 1, S, L)
    column = torch.zeros(B, H, S, L + 1).masked_fill(~torch.cat([mask, mask[..., :1] | True], dim=-1), float("-inf"))
    column[..., L] = sinks.view(1, H, 1)
    zero = torch.zeros(B, G, 1, Dh)
    ref = torch.nn.functional.scaled_dot_product_attention(q, torch.cat([k, zero], 2), torch.cat([v, zero], 2),
                                                           attn_mask=column, enable_gqa=True)
    torch.testing.assert_close(attend_with_sinks(q, k, v, sinks, mask, False), ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(attend_with_sinks(q, k, v, sinks, mask, False, block=2), ref, atol=1e-6, rtol=0)
    # is_causal with no mask: the S queries are the last S of the L positions, whole or two queries at a time
    causal = (key_1L <= pos_S1)[None, None]
    explicit = attend_with_sinks(q, k, v, sinks, causal, False)
    torch.testing.assert_close(attend_with_sinks(q, k, v, sinks, None, True), explicit)
    torch.testing.assert_close(attend_with_sinks(q, k, v, sinks, None, True, block=2), explicit)


def test_biased_experts_paths_equal_the_per_token_sum() -> None:
    """BiasedExperts' sorted dispatch and the compiled step's indexed path (moe_indexed_biased) give
    sum_k g_k (h W2^T + b2), computed one token and one expert at a time."""
    torch.manual_seed(0)
    experts = BiasedExperts(6, 32, 24, "clamped_swiglu", bias=True, limit=1.0, alpha=1.702)
    with torch.no_grad():
        for b in (experts.b1, experts.b2, experts.b3):
            b.normal_()
        for w in (experts.w1, experts.w2, experts.w3):
            w.normal_(0, 0.3)
    x, ids = torch.randn(9, 32), torch.randint(0, 6, (9, 2))
    gates = torch.rand(9, 2)
    ref = torch.zeros(9, 32)
    for t in range(9):
        for j in range(2):
            e = int(ids[t, j])
            gate, up = x[t] @ experts.w1[e].T + experts.b1[e], x[t] @ experts.w3[e].T + experts.b3[e]
            h = (up.clamp(-1.0, 1.0) + 1) * gate.clamp(max=1.0) * torch.sigmoid(1.702 * gate.clamp(max=1.0))
            ref[t] += gates[t, j] * (h @ experts.w2[e].T + experts.b2[e])
    with torch.no_grad():
        torch.testing.assert_close(experts(x, ids, gates), ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(moe_indexed_biased(x, ids, gates, experts), ref, atol=1e-5, rtol=0)
        keep = torch.rand(9, 2) > 0.3  # a capacity limit's dropped assignments add nothing
        torch.testing.assert_close(experts(x, ids, gates, keep), experts(x, ids, gates * keep), atol=1e-6, rtol=0)


# ---- the Engine ------------------------------------------------------------------------------------------------------
PLANS = {"eager": DispatchPlan(), "eager-packed": DispatchPlan(pack_dense=True, pack_experts=True),
         "cpu-kernel": DispatchPlan(kernel_experts=True, kernel_dense=True, kernel_norms=True)}


@pytest.mark.parametrize("backend", [*sorted(PLANS), pytest.param("compiled", marks=pytest.mark.slow)])
def test_engine_greedy_32_tokens_equal_transformers_generate(tmp_path: Path, backend: str) -> None:
    from moeserve.runtime.backends import cpu_kernel
    from moeserve.runtime.backends.compiled import compile_unavailable
    from moeserve.runtime.backends.packing import onednn_packing_available
    from moeserve.runtime.engine import Engine, SamplingParams

    if backend == "cpu-kernel" and cpu_kernel.unavailable_reason() is not None:
        pytest.skip(cpu_kernel.unavailable_reason())
    if backend == "eager-packed" and not onednn_packing_available("cpu", torch.float32):
        pytest.skip("no oneDNN packing in this build of torch")
    if backend == "compiled" and compile_unavailable(torch.device("cpu")) is not None:
        pytest.skip(compile_unavailable(torch.device("cpu")))
    hf = hf_gpt_oss(tmp_path, seed=3)
    hf.generation_config.eos_token_id = None
    engine = Engine.load(tmp_path, dtype="float32", device="cpu", plan=PLANS.get(backend, DispatchPlan()),
                         compile="on" if backend == "compiled" else "off")
    assert engine.runner.name == backend.split("-packed")[0]
    if backend == "cpu-kernel":  # sinks, biases, the clamped experts: not the kernel's whole step; the ops one by one
        assert engine.runner.step is None
    prompts = [[1, 17, 33, 5, 90], [1, 4], [1, 200, 3, 3, 3, 3, 3, 3, 3, 9, 12, 250]]
    theirs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            theirs.append(hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                                      min_new_tokens=32, pad_token_id=0)[0, len(p):].tolist())
        assert len(set(theirs[-1])) > 4  # a model that says something, not one token again and again
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    # The prompts together (the step engine's rows of different lengths decoded as one batch), and each alone
    assert [c.token_ids for c in engine.complete(prompts, params)] == theirs
    if backend != "compiled":  # compiled, each batch size is a graph of its own: a minute of compiling on a CPU
        assert [engine.complete([p], params)[0].token_ids for p in prompts] == theirs


def test_calibration_times_the_clamped_swiglu_as_the_swiglu(tmp_path: Path) -> None:
    """A measured plan (Engine.load's default outside the tests) times plain Experts of the model's shape: gpt-oss's
    three matrices, as the SwiGLU's (an Experts of act 'clamped_swiglu' would have no w3)."""
    from moeserve.runtime.backends.calibration import ExpertShape

    hf_gpt_oss(tmp_path)
    assert ExpertShape.of(load_checkpoint(tmp_path).config) == ExpertShape(64, 64, 4, 2, "swiglu")


# ---- MXFP4 -----------------------------------------------------------------------------------------------------------
def random_mxfp4(*shape: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks [*shape, 16] and scales [*shape] (2^-7 .. 2^-3: weights of a sensible size)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8),
            torch.randint(120, 125, shape, generator=g, dtype=torch.uint8))


def reference_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The format's definition, one value at a time in float64: nibble 2b is byte b's low four bits."""
    lo, hi = (blocks & 0x0F).long(), (blocks >> 4).long()
    codes = torch.stack([lo, hi], dim=-1).flatten(-2)  # [..., G, 32]
    values = torch.tensor(FP4_VALUES, dtype=torch.float64)[codes] * torch.exp2(scales.double() - 127)[..., None]
    return values.flatten(-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantization_is_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_mxfp4(3, 40, 4)
    blocks[0, 0, 0, :2] = torch.tensor([0x80, 0x08], dtype=torch.uint8)  # -0.0 in both nibbles
    ours = dequantize_mxfp4(blocks, scales, dtype)
    assert ours.shape == (3, 40, 128) and ours.dtype == dtype
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)  # theirs is [E, in, out]
    assert torch.equal(ours.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       theirs.contiguous().view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert torch.equal(ours.double(), reference_mxfp4(blocks, scales).to(dtype).double())


def write_mxfp4(path: Path, hf: GptOssForCausalLM) -> None:
    """`hf` with its experts replaced by random MXFP4 weights, saved as released gpt-oss checkpoints store them
    (blocks, scales; biases as they are), and `hf` given the dequantized weights to compare against."""
    cfg = hf.config
    E, D, F = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    packed = {}
    for i, layer in enumerate(hf.model.layers):
        m = f"model.layers.{i}.mlp.experts."
        for name, rows, cols in (("gate_up_proj", 2 * F, D), ("down_proj", D, F)):
            blocks, scales = random_mxfp4(E, rows, cols // 32, seed=10 * i + rows)
            packed[m + name + "_blocks"], packed[m + name + "_scales"] = blocks, scales
            with torch.no_grad():
                getattr(layer.mlp.experts, name).copy_(reference_mxfp4(blocks, scales).float().transpose(1, 2))
    hf.save_pretrained(path)
    state = load_file(str(path / "model.safetensors"))
    state = {k: t for k, t in state.items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**state, **packed}, str(path / "model.safetensors"), metadata={"format": "pt"})
    edit_config(path, quantization_config={"quant_method": "mxfp4",
                                           "modules_to_not_convert": ["model.layers.*.self_attn"]})


def test_mxfp4_directory_loads_dequantized_and_matches(tmp_path: Path) -> None:
    hf = hf_gpt_oss(tmp_path, save=False)
    write_mxfp4(tmp_path, hf)
    assert_logits_match(tmp_path, hf, lengths=(1, 17))
    state = load_checkpoint(tmp_path).state_dict
    assert state["layers.0.ffn.experts.w1"].dtype == torch.float32  # dequantized at load, to the biases' dtype
    bf16 = load_checkpoint(tmp_path, dtype=torch.bfloat16).state_dict
    assert bf16["layers.1.ffn.experts.w2"].dtype == torch.bfloat16
    assert torch.equal(bf16["layers.1.ffn.experts.w2"], state["layers.1.ffn.experts.w2"].bfloat16())  # exact values
    assert "format: hf-gpt_oss" in describe(tmp_path)


# ---- expert slices (serve --ray --expert-parallel N) -----------------------------------------------------------------
@pytest.mark.parametrize("mxfp4", [False, True], ids=["float", "mxfp4"])
def test_expert_slices_are_the_imported_stacks(tmp_path: Path, mxfp4: bool) -> None:
    hf = hf_gpt_oss(tmp_path, save=not mxfp4)
    if mxfp4:
        write_mxfp4(tmp_path, hf)
    whole = load_checkpoint(tmp_path).state_dict
    for start, stop in ((0, 4), (1, 3), (3, 4)):
        _, part = load_expert_slice(tmp_path, start, stop)
        assert sorted(part) == sorted(k for k in whole if is_expert_weight(k))
        assert {"layers.0.ffn.experts.b1", "layers.1.ffn.experts.b2"} <= set(part)
        for k, t in part.items():
            assert torch.equal(t, whole[k][start:stop]), k
    dense = load_checkpoint(tmp_path, keep=lambda k: not is_expert_weight(k)).state_dict
    assert sorted(dense) == sorted(k for k in whole if not is_expert_weight(k))


@pytest.mark.parametrize("mxfp4", [False, True], ids=["float", "mxfp4"])
def test_an_expert_parallel_rank_computes_as_the_model(tmp_path: Path, mxfp4: bool) -> None:
    """A rank's experts (BiasedExpertShard: the slices above, MXFP4 dequantized as the loader does, with their
    biases and the clamped SwiGLU) behind the exchange, in a group of one rank: the single-process model's logits.
    Two ranks serving a gpt-oss directory: tests/runtime/test_expert_parallel.py."""
    from moeserve.bench.server_process import free_port
    from moeserve.runtime.backends.expert_shards import BiasedExpertShard
    from moeserve.runtime.ep_rank import load_rank_engine
    from moeserve.runtime.expert_parallel import join_group

    hf = hf_gpt_oss(tmp_path, save=not mxfp4)
    if mxfp4:
        write_mxfp4(tmp_path, hf)
    model, _ = load_model(tmp_path)
    group = join_group(f"tcp://127.0.0.1:{free_port()}", 0, 1, timeout_s=30)
    try:
        rank = load_rank_engine(str(tmp_path), group, verify=False).model
        shard = rank.layers[1].ffn.experts.local
        assert isinstance(shard, BiasedExpertShard) and shard.experts.limit == 1.5
        assert torch.equal(shard.experts.b2, model.layers[1].ffn.experts.b2)
        with torch.inference_mode():
            ids = torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(0))
            torch.testing.assert_close(rank(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
    finally:
        group.leave()


# ---- refusals --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, message", [
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}},
     "'quantization_config' = .*'gptq'.*only quant_method 'mxfp4'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_type 'linear'"),
    ({"rope_parameters": {**YARN, "partial_rotary_factor": 0.5}}, "partial_rotary_factor 0.5"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "field 'layer_types' = .*'chunked_attention'"),
    ({"attention_chunk_size": 64}, r"field\(s\) \['attention_chunk_size'\] not supported"),
    ({"architectures": ["GptOssForSequenceClassification"]}, "'architectures'"),
    ({"num_local_experts": ...}, "field 'num_local_experts' missing"),
    ({"num_key_value_heads": 3}, "field 'num_key_value_heads' \\(moeserve 'n_kv_heads'\\) = 3"),
])
def test_config_refused_by_name(tmp_path: Path, changes: dict, message: str) -> None:
    hf_gpt_oss(tmp_path)
    edit_config(tmp_path, **changes)
    for call in (load_checkpoint, describe):
        with pytest.raises(CheckpointError, match=message):
            call(tmp_path)


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 2.0}, {"rope_type": "yarn", "factor": 4.0}])
def test_a_moeserve_config_takes_yarn_only(scaling: dict) -> None:
    from moeserve.config import ConfigError, MoEConfig

    with pytest.raises(ConfigError, match="config field 'rope_scaling' = .*expected null or .*yarn"):
        MoEConfig(rope_scaling=scaling)


def test_tensors_refused_by_name(tmp_path: Path) -> None:
    hf_gpt_oss(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.self_attn.sinks"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError,
                       match=r"tensor 'model\.layers\.1\.self_attn\.sinks' missing \(expected shape \(4,\)\)"):
        load_checkpoint(tmp_path)


def test_quantizing_it_is_refused_by_name(tmp_path: Path, capsys) -> None:
    """Its experts (biased, clamped) have no quantized form and its biased maps stay float: --quantize would quantize
    the head alone under a quantized config, so it says why instead (the Engine, and `moeserve quantize` exit 2)."""
    from moeserve.cli import main
    from moeserve.runtime.engine import Engine

    hf_gpt_oss(tmp_path / "oss")
    with pytest.raises(ValueError, match="int8: this model's experts have biases or the clamped SwiGLU"):
        Engine.load(tmp_path / "oss", dtype="float32", device="cpu", quantize="int8")
    assert main(["quantize", str(tmp_path / "oss"), "--bits", "4", "--out", str(tmp_path / "q")]) == 2
    assert "no quantized form here" in capsys.readouterr().err and not (tmp_path / "q").exists()
