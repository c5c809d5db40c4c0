"""Hugging Face Qwen2-MoE, Qwen3-MoE and OLMoE directories load as they are and compute what transformers computes.

As tests/test_hf_mixtral.py does for Mixtral (whose file also covers what the families share: sharded files, tied
heads, tokenizers, describe), every reference here is transformers' own model, built tiny and random and saved with
save_pretrained. Each family's config has what sets it apart from Mixtral: Qwen2-MoE a dense layer wider than its
experts, a gated shared expert and q/k/v biases; Qwen3-MoE a dense layer, a head width that is not hidden / heads,
per-head q/k norms and renormalised gates; OLMoE q/k norms over the whole projections. All use grouped-query attention.
The 1-D weights (biases, norms), which transformers initialises to 0 and 1, are made random so none is vacuous.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

from moeserve.checkpoint import (  # noqa: E402
    CheckpointError, is_expert_weight, load_checkpoint, load_expert_slice,
)
from moeserve.runtime.backends import cpu_kernel  # noqa: E402
from moeserve.runtime.backends.plan import DispatchPlan  # noqa: E402
from moeserve.runtime.backends.compiled import compile_unavailable  # noqa: E402
from moeserve.runtime.loading import load_model  # noqa: E402

from .test_hf_mixtral import edit_config  # noqa: E402

TOL = 1e-4  # fp32
V = 300
COMMON = dict(vocab_size=V, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              num_experts=4, num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)
FAMILIES = {  # model_type -> (config class, model class, what this family's tiny config sets)
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=80, moe_intermediate_size=48, shared_expert_intermediate_size=56,
                       mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=80, moe_intermediate_size=48, mlp_only_layers=[1], head_dim=24,
                       norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(intermediate_size=48)),
}
KERNEL = DispatchPlan(kernel_experts=True, kernel_dense=True, kernel_norms=True)


def hf_model(family: str, tmp: Path, save_kwargs: dict | None = None, seed: int = 0, **overrides):
    """A tiny random model of `family`, saved to `tmp` by transformers itself."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # biases (0) and norm weights (1) as transformers initialises them
                p.add_(0.2 * torch.randn_like(p))
    model.eval().save_pretrained(tmp, **(save_kwargs or {}))
    return model


def ids_of(shape: tuple[int, int], seed: int) -> torch.Tensor:
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


# ---- logits parity --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["per-expert", "fused"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(tmp_path: Path, family: str, layout: str) -> None:
    """1, 17 and 130 tokens, and a right-padded batch of unequal rows (the real positions' logits), within 1e-4."""
    hf = hf_model(family, tmp_path, {"save_original_format": False} if layout == "fused" else None)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:  # one file at these sizes
        keys = set(f.keys())
    assert ("model.layers.0.mlp.experts.gate_up_proj" in keys) == (layout == "fused")
    assert ("model.layers.0.mlp.experts.3.down_proj.weight" in keys) == (layout == "per-expert")
    model, ckpt = load_model(tmp_path)
    assert ckpt.manifest == {"format": f"hf-{family}"}
    with torch.no_grad():
        for n, seed in ((1, 0), (17, 1), (130, 2)):
            ids = ids_of((1, n), seed)
            torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=TOL, rtol=0)
        ids, mask = ids_of((3, 19), 3), torch.ones(3, 19, dtype=torch.long)
        mask[1, 11:], mask[2, 4:] = 0, 0
        real = mask.bool()
        ours, theirs = model(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits
        torch.testing.assert_close(ours[real], theirs[real], atol=TOL, rtol=0)


def test_configs_map_each_family_s_math(tmp_path: Path) -> None:
    for family in FAMILIES:
        hf_model(family, tmp_path / family)
    q2, q3, ol = (load_checkpoint(tmp_path / f).config for f in FAMILIES)
    for cfg in (q2, q3, ol):
        assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.n_experts, cfg.top_k) == (64, 3, 4, 2, 4, 2)
        assert cfg.router == "softmax" and cfg.expert_act == "swiglu" and cfg.tokenizer == "none"
    assert (q2.moe_layers, q2.d_ff, q2.dense_d_ff, q2.shared_d_ff, q2.shared_gate, q2.qkv_bias, q2.o_bias,
            q2.qk_norm, q2.renormalize, q2.head_dim) == ([0, 2], 48, 80, 56, True, True, False, None, False, 16)
    assert (q3.moe_layers, q3.d_ff, q3.dense_d_ff, q3.shared_d_ff, q3.qkv_bias, q3.qk_norm, q3.renormalize,
            q3.head_dim) == ([0, 2], 48, 80, None, False, "head", True, 24)
    assert (ol.moe_layers, ol.d_ff, ol.dense_d_ff, ol.qkv_bias, ol.qk_norm, ol.renormalize, ol.head_dim) == \
        (None, 48, None, False, "all", False, 16)


@pytest.mark.parametrize("family, overrides", [
    ("qwen2_moe", dict(decoder_sparse_step=2, mlp_only_layers=[], qkv_bias=False, norm_topk_prob=True)),
    ("qwen3_moe", dict(attention_bias=True, mlp_only_layers=[], tie_word_embeddings=True)),
    ("olmoe", dict(attention_bias=True, norm_topk_prob=True, num_key_value_heads=4)),
])
def test_variants_match_transformers(tmp_path: Path, family: str, overrides: dict) -> None:
    """The other settings of each family's switches: dense layers by decoder_sparse_step, no q/k/v bias, biases on
    o as well, renormalised gates, tied embeddings, multi-head attention."""
    hf = hf_model(family, tmp_path, **overrides)
    model, ckpt = load_model(tmp_path)
    if family == "qwen2_moe":
        assert ckpt.config.moe_layers == [1]
    ids = ids_of((2, 23), 4)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=TOL, rtol=0)


# ---- backends and the Engine ----------------------------------------------------------------------------------------
BACKENDS = {"eager": dict(plan=DispatchPlan()),
            "eager-packed": dict(plan=DispatchPlan(pack_dense=True, pack_experts=True)),
            "cpu-kernel": dict(plan=KERNEL), "compiled": dict(plan=DispatchPlan(), compile="on")}


def hf_greedy(family: str, path: str, prompt: tuple[int, ...]) -> list[int]:
    cls = getattr(transformers, FAMILIES[family][1])
    hf = cls.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                          min_new_tokens=32, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# compiled (slow on CPU) for one family: the one with the shared expert and a dense layer
ENGINE_CASES = [pytest.param(f, b, id=f"{f}-{b}") for f in FAMILIES for b in ("eager", "eager-packed", "cpu-kernel")]
ENGINE_CASES.append(pytest.param("qwen2_moe", "compiled", id="qwen2_moe-compiled", marks=pytest.mark.slow))


@pytest.mark.parametrize("family, backend", ENGINE_CASES)
def test_engine_greedy_32_tokens_equal_transformers_generate(tmp_path: Path, family: str, backend: str) -> None:
    from moeserve.runtime.engine import Engine, SamplingParams

    why = cpu_kernel.unavailable_reason() if backend == "cpu-kernel" else \
        compile_unavailable(torch.device("cpu")) if backend == "compiled" else None
    if why is not None:
        pytest.skip(why)
    hf_model(family, tmp_path, seed=3)
    engine = Engine.load(tmp_path, dtype="float32", device="cpu", **BACKENDS[backend])
    assert engine.runner.name == {"eager-packed": "eager"}.get(backend, backend)
    prompts = [[1, 17, 33, 5, 90], [1, 4], [1, 200, 3, 3, 3, 3, 3, 3, 3, 9]]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    theirs = [hf_greedy(family, str(tmp_path), tuple(p)) for p in prompts]
    for p, want in zip(prompts, theirs if backend != "compiled" else []):  # compiled: one batch bucket, one compile
        assert engine.complete([p], params)[0].token_ids == want
    # the batch of unequal prompts, decoded together, gives each prompt the same 32 tokens
    assert [c.token_ids for c in engine.complete(prompts, params)] == theirs


# ---- refusals ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_scores_are_transformers_log_probabilities(tmp_path: Path, family: str) -> None:
    """Engine.token_logprobs_ids (what /v1/score and `moeserve score` sum) of rows of unequal lengths, batched with
    padding, through the backend the machine picks: log_softmax of transformers' logits at each next token."""
    from moeserve.runtime.engine import Engine

    hf = hf_model(family, tmp_path, seed=5)
    engine = Engine.load(tmp_path, dtype="float32", device="cpu")
    rows = [ids_of((1, n), seed)[0].tolist() for n, seed in ((9, 1), (40, 2), (2, 3))]
    got = engine.token_logprobs_ids(rows)
    for row, lp in zip(rows, got):
        ids = torch.tensor([row])
        with torch.no_grad():
            want = torch.log_softmax(hf(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lp), want, atol=TOL, rtol=0)


@pytest.mark.parametrize("family, changes, message", [
    ("qwen3_moe", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type 'yarn'"),
    ("qwen3_moe", {"rope_parameters": None, "rope_scaling": {"type": "yarn", "factor": 4.0}},
     "'rope_scaling' has rope_type 'yarn'"),
    ("qwen3_moe", {"use_sliding_window": True}, "'use_sliding_window' = True"),
    ("qwen2_moe", {"layer_types": ["sliding_attention", "full_attention", "full_attention"]}, "'layer_types'"),
    ("qwen2_moe", {"hidden_act": "gelu"}, "'hidden_act' = 'gelu': expected 'silu'"),
    ("qwen2_moe", {"mlp_only_layers": [0, 1, 2]}, "leave no MoE layer"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0},
     "'shared_expert_intermediate_size' \\(moeserve 'shared_d_ff'\\) = 0"),
    ("qwen2_moe", {"architectures": ["Qwen2MoeForSequenceClassification"]}, "'architectures'"),
    ("qwen3_moe", {"num_local_experts": None}, "field 'num_experts' missing"),
    ("olmoe", {"clip_qkv": 8.0}, "'clip_qkv' = 8.0: not supported"),
    ("olmoe", {"head_dim": 32}, "'head_dim' = 32: expected hidden_size / num_attention_heads = 16"),
    ("olmoe", {"quantization_config": {"quant_method": "gptq"}}, "'quantization_config'"),
])
def test_config_refused_by_name(tmp_path: Path, family: str, changes: dict, message: str) -> None:
    hf_model(family, tmp_path)
    edit_config(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=f"model_type '{family}': .*{message}"):
        load_checkpoint(tmp_path)


def test_a_missing_tensor_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    hf_model("qwen2_moe", tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.2.mlp.shared_expert_gate.weight"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"Qwen2-MoE tensor 'model\.layers\.2\.mlp\.shared_expert_gate\.weight' "
                                              r"missing \(expected shape \(1, 64\)\)"):
        load_checkpoint(tmp_path)


# ---- expert slices (serve --ray --expert-parallel N) ----------------------------------------------------------------
@pytest.mark.parametrize("layout", ["per-expert", "fused"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_expert_slices_are_the_imported_stacks(tmp_path: Path, family: str, layout: str) -> None:
    """A rank's experts [start, stop) equal the whole import's; the dense part (a shared expert included) loads
    without any expert."""
    hf_model(family, tmp_path, {"save_original_format": False} if layout == "fused" else None)
    whole = load_checkpoint(tmp_path).state_dict
    for start, stop in ((0, 4), (1, 3), (3, 4)):
        _, part = load_expert_slice(tmp_path, start, stop)
        assert sorted(part) == sorted(k for k in whole if is_expert_weight(k))
        for k, t in part.items():
            assert torch.equal(t, whole[k][start:stop]), k
    dense = load_checkpoint(tmp_path, keep=lambda k: not is_expert_weight(k)).state_dict
    assert sorted(dense) == sorted(k for k in whole if not is_expert_weight(k))
    assert (family == "qwen2_moe") == ("layers.0.ffn.shared.w1.weight" in dense)


# ---- quantization (moeserve quantize) ----------------------------------------------------------------------------
def test_int8_quantizes_the_shared_expert_and_the_dense_layer(tmp_path: Path) -> None:
    """`moeserve quantize --bits 8` of a Qwen2-MoE directory: the shared expert and the dense layer are quantized as
    dense FFNs (their gate, a router, and the biased q/k/v maps stay float), and the written checkpoint's logits are
    the float model's within int8's error."""
    from moeserve.convert import convert
    from moeserve.runtime.quant import QuantSpec

    hf = hf_model("qwen2_moe", tmp_path / "hf")
    out = convert(tmp_path / "hf", tmp_path / "int8", quantize=QuantSpec.parse("int8"))
    state = load_checkpoint(out).state_dict
    for name in ("layers.0.ffn.shared.w1.qweight", "layers.1.ffn.w2.qweight", "layers.0.attention.wo.qweight"):
        assert state[name].dtype == torch.int8, name
    for name in ("layers.0.ffn.shared_gate.weight", "layers.0.attention.wq.weight", "layers.0.attention.wq.bias"):
        assert state[name].is_floating_point(), name
    model, _ = load_model(out)
    ids = ids_of((1, 17), 5)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=2e-2, rtol=0)


def test_a_qwen2_moe_on_an_expert_parallel_rank_gives_transformers_logits(tmp_path: Path) -> None:
    """Loaded as a rank loads it (the dense part, the shared expert among it, and its experts as safetensors slices
    behind the all-to-all), here the one rank of a gloo group of one."""
    from moeserve.bench.server_process import free_port
    from moeserve.runtime.ep_rank import load_rank_engine
    from moeserve.runtime.expert_parallel import ExpertParallelExperts, join_group

    hf = hf_model("qwen2_moe", tmp_path)
    group = join_group(f"tcp://127.0.0.1:{free_port()}", 0, 1, timeout_s=30)
    try:
        model = load_rank_engine(str(tmp_path), group).model
        assert all(isinstance(layer.experts, ExpertParallelExperts) and layer.shared is not None
                   for layer in model.moe_layers)
        ids = ids_of((2, 9), 0)
        with torch.inference_mode():
            torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=TOL, rtol=0)
    finally:
        group.leave()
