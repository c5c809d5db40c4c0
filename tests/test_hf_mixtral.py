"""Hugging Face Mixtral directories load as they are and compute what transformers computes.

Every reference here is transformers' own MixtralForCausalLM, built tiny and random, saved with
save_pretrained: the layouts it writes are the ones a user's directory has.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402

from moeserve.checkpoint import (  # noqa: E402
    CheckpointError, describe, is_expert_weight, load_checkpoint, load_expert_slice, verify_checkpoint,
)
from moeserve.runtime.loading import load_model  # noqa: E402
from moeserve.runtime.kv_cache import KVCache  # noqa: E402
from moeserve.tokenizer import HFTokenizer, load_checkpoint_tokenizer, load_tokenizer  # noqa: E402
from moeserve.runtime.backends.plan import default_plan  # noqa: E402
from moeserve.runtime.backends.eager import EagerBackend  # noqa: E402
from moeserve.runtime.backends.experts import lay_out_experts  # noqa: E402
from moeserve.runtime.model import TiedHead  # noqa: E402

TOL = 1e-4  # fp32
V = 211


def hf_mixtral(tmp: Path, save_kwargs: dict | None = None, seed: int = 0, **overrides) -> MixtralForCausalLM:
    """A tiny random Mixtral, saved to `tmp` by transformers itself."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128)
    model = MixtralForCausalLM(MixtralConfig(**{**cfg, **overrides})).eval()
    model.save_pretrained(tmp, **(save_kwargs or {}))
    return model


def saved_keys(path: Path) -> set[str]:
    keys: set[str] = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            keys |= set(f.keys())
    return keys


def assert_logits_match(path: Path, hf: MixtralForCausalLM, shapes=((1, 5), (3, 17))) -> None:
    model, _ = load_model(path)
    with torch.no_grad():
        for shape in shapes:
            ids = torch.randint(0, V, shape, generator=torch.Generator().manual_seed(sum(shape)))
            ours, theirs = model(ids).logits, hf(ids).logits
            assert ours.shape == theirs.shape == (*shape, V)
            torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)


def edit_config(path: Path, **changes) -> None:
    data = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is ...:
            data.pop(key, None)
        else:
            data[key] = value
    (path / "config.json").write_text(json.dumps(data))


# ---- logits parity --------------------------------------------------------------------------------
def test_default_save_is_per_expert_and_matches(tmp_path: Path) -> None:
    hf = hf_mixtral(tmp_path)
    keys = saved_keys(tmp_path)
    # transformers 5 fuses experts in memory but save_pretrained writes the original per-expert names
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in keys
    assert "model.layers.0.block_sparse_moe.gate.weight" in keys
    assert not any("gate_up_proj" in k for k in keys)
    assert_logits_match(tmp_path, hf)
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.manifest == {"format": "hf-mixtral"} and ckpt.train_state is None
    cfg = ckpt.config
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.d_ff, cfg.n_experts, cfg.top_k) == \
        (64, 2, 4, 2, 96, 4, 2)
    assert cfg.router == "softmax" and cfg.renormalize and cfg.expert_act == "swiglu" and cfg.rope_theta == 1e6
    assert cfg.tokenizer == "none" and not cfg.tie_embeddings and cfg.sliding_window is None


def test_fused_layout_matches(tmp_path: Path) -> None:
    hf = hf_mixtral(tmp_path, {"save_original_format": False})
    keys = saved_keys(tmp_path)
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys and "model.layers.1.mlp.gate.weight" in keys
    assert_logits_match(tmp_path, hf)


def test_legacy_layout_under_mlp_name_matches(tmp_path: Path) -> None:
    """transformers reads the MoE block as block_sparse_moe or mlp; both expert layouts under either."""
    hf = hf_mixtral(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    save_file({k.replace(".block_sparse_moe.", ".mlp."): v for k, v in state.items()},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert_logits_match(tmp_path, hf, shapes=((2, 7),))


def test_sharded_save_loads(tmp_path: Path) -> None:
    hf = hf_mixtral(tmp_path, {"max_shard_size": "100KB"})
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    assert_logits_match(tmp_path, hf, shapes=((2, 9),))


def test_tied_embeddings(tmp_path: Path) -> None:
    hf = hf_mixtral(tmp_path, tie_word_embeddings=True)
    assert "lm_head.weight" not in saved_keys(tmp_path)
    model, ckpt = load_model(tmp_path)
    assert ckpt.config.tie_embeddings and isinstance(model.output, TiedHead)
    assert "output.weight" not in model.state_dict()
    assert_logits_match(tmp_path, hf, shapes=((2, 9),))


def test_sliding_window_matches(tmp_path: Path) -> None:
    hf = hf_mixtral(tmp_path, sliding_window=4)
    assert load_checkpoint(tmp_path).config.sliding_window == 4
    assert_logits_match(tmp_path, hf, shapes=((2, 13),))
    ids = torch.randint(0, V, (1, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the window changes the answer: the test above is not vacuous
        full = MixtralForCausalLM(hf.config.__class__(**{**hf.config.to_dict(), "sliding_window": None}))
        full.load_state_dict(hf.state_dict())
        assert (full.eval()(ids).logits - hf(ids).logits).abs().max() > 1e-3


def test_old_style_rope_theta(tmp_path: Path) -> None:
    """Configs written before transformers 5 keep rope_theta at the top level, without rope_parameters."""
    hf = hf_mixtral(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    edit_config(tmp_path, rope_parameters=..., rope_theta=500.0, rope_scaling=None)
    assert load_checkpoint(tmp_path).config.rope_theta == 500.0
    assert_logits_match(tmp_path, hf, shapes=((1, 30),))


def test_inference_layout_matches(tmp_path: Path) -> None:
    """The fused / packed expert layout the engine runs (the eager backend's default) on imported weights."""
    hf = hf_mixtral(tmp_path)
    model, _ = load_model(tmp_path)
    EagerBackend(model, default_plan("cpu", torch.float32))
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=TOL, rtol=0)
        torch.testing.assert_close(model(ids[:1, :1]).logits, hf(ids[:1, :1]).logits, atol=TOL, rtol=0)


@pytest.mark.parametrize("save_kwargs", [{}, {"save_original_format": False}], ids=["per-expert", "fused"])
def test_import_is_stacked_once_in_the_asked_dtype(tmp_path: Path, save_kwargs: dict) -> None:
    """Both layouts come in as one [E, 2F, D] gate-up tensor whose halves are w1 and w3, which the
    inference layout takes as it is; bf16 is converted while stacking and equals converting after."""
    hf_mixtral(tmp_path, save_kwargs)
    model, _ = load_model(tmp_path)
    experts = model.layers[0].ffn.experts
    assert experts.w3.data_ptr() == experts.w1.data_ptr() + experts.w1[0].numel() * 4
    assert lay_out_experts(experts, pack=False).w.w13_EFD.data_ptr() == experts.w1.data_ptr()
    bf16, _ = load_model(tmp_path, dtype=torch.bfloat16)
    for name, t in model.state_dict().items():
        assert torch.equal(bf16.state_dict()[name], t.to(torch.bfloat16)), name


@pytest.mark.parametrize("window", [None, 3])
def test_kv_cached_decode_matches_full_forward(tmp_path: Path, window: int | None) -> None:
    hf = hf_mixtral(tmp_path, sliding_window=window)
    model, _ = load_model(tmp_path)
    n, prefill = 12, 5
    ids = torch.randint(0, V, (1, n), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = hf(ids).logits
        cache = KVCache.for_model(model, 1, n)
        out = model(ids[:, :prefill], cache=cache.rows([0], [0], prefill)).logits
        torch.testing.assert_close(out, reference[:, :prefill], atol=TOL, rtol=0)
        for pos in range(prefill, n):
            step = model(ids[:, pos:pos + 1], cache=cache.rows([0], [pos], 1)).logits[:, -1]
            torch.testing.assert_close(step, reference[:, pos], atol=TOL, rtol=0)


def test_bf16_weights_load(tmp_path: Path) -> None:
    hf = hf_mixtral(tmp_path / "fp32").to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "bf16")
    ckpt = load_checkpoint(tmp_path / "bf16")
    assert ckpt.state_dict["layers.0.ffn.experts.w1"].dtype == torch.bfloat16  # as stored; the engine casts
    assert_logits_match(tmp_path / "bf16", hf.float(), shapes=((1, 6),))


# ---- describe / inspect -----------------------------------------------------------------------------
def test_describe_and_verify(tmp_path: Path) -> None:
    hf = hf_mixtral(tmp_path, {"max_shard_size": "100KB"})
    text = describe(tmp_path)
    n = sum(p.numel() for p in hf.parameters())
    assert "format: hf-mixtral" in text and "  d_model = 64" in text and "hashes: none" in text
    assert f"total: {n / 1e6:.2f}M ({n:,})" in text
    assert "model.safetensors.index.json" in text
    with pytest.raises(CheckpointError, match="Hugging Face directory .* no hashes to verify"):
        verify_checkpoint(tmp_path)


def test_describe_reads_headers_only(tmp_path: Path) -> None:
    """describe() reads shapes from the headers: no tensor is copied, so the meta-device ops that would
    import torch._dynamo (1.5 s of `moeserve inspect`) never run."""
    import subprocess
    import sys

    hf_mixtral(tmp_path)
    code = (f"import sys; from moeserve.checkpoint import describe; t = describe({str(tmp_path)!r}); "
            "assert 'format: hf-mixtral' in t; print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ---- refusals -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, message", [
    ({"model_type": "llama"}, "model_type 'llama' is not supported"),
    ({"hidden_act": "gelu"}, "'hidden_act' = 'gelu': expected 'silu'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}, "rope_type 'linear'"),
    ({"rope_parameters": ..., "rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling.*rope_type 'yarn'"),
    ({"head_dim": 32}, "'head_dim' = 32: expected hidden_size / num_attention_heads = 16"),
    ({"attention_bias": True}, "'attention_bias' = True: not supported"),
    ({"quantization_config": {"quant_method": "gptq"}}, "'quantization_config'"),
    ({"architectures": ["MixtralForSequenceClassification"]}, "'architectures'"),
    ({"num_local_experts": ...}, "field 'num_local_experts' missing"),
    ({"num_key_value_heads": 3}, "field 'num_key_value_heads' \\(moeserve 'n_kv_heads'\\) = 3"),
    ({"num_experts_per_tok": 5}, "field 'num_experts_per_tok' \\(moeserve 'top_k'\\) = 5"),
])
def test_config_refused_by_name(tmp_path: Path, changes: dict, message: str) -> None:
    hf_mixtral(tmp_path)
    edit_config(tmp_path, **changes)
    for call in (load_checkpoint, load_model, describe):
        with pytest.raises(CheckpointError, match=message):
            call(tmp_path)


def rewrite(path: Path, edit) -> None:
    state = load_file(str(path / "model.safetensors"))
    edit(state)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop("model.layers.1.self_attn.k_proj.weight"),
     r"tensor 'model\.layers\.1\.self_attn\.k_proj\.weight' missing \(expected shape \(32, 64\)\)"),
    (lambda s: s.pop("model.layers.0.block_sparse_moe.experts.3.w2.weight"), r"experts\.3\.w2\.weight' missing"),
    (lambda s: s.pop("lm_head.weight"), r"'lm_head\.weight' missing"),
    (lambda s: s.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 32)}),
     r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.q_proj\.weight' has shape \(64, 32\), "
     r"config\.json implies \(64, 64\)"),
    (lambda s: s.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}),
     r"unexpected tensor\(s\) \['model\.layers\.0\.self_attn\.q_proj\.bias'\]"),
    (lambda s: s.update({"model.layers.0.block_sparse_moe.experts.4.w1.weight": torch.zeros(96, 64)}),
     r"unexpected tensor\(s\) \['model\.layers\.0\.block_sparse_moe\.experts\.4\.w1\.weight'\]"),
])
def test_tensors_refused_by_name(tmp_path: Path, edit, message: str) -> None:
    hf_mixtral(tmp_path)
    rewrite(tmp_path, edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(tmp_path)


def test_wrong_fused_shape_names_the_tensor(tmp_path: Path) -> None:
    hf_mixtral(tmp_path, {"save_original_format": False})
    rewrite(tmp_path, lambda s: s.update({"model.layers.1.mlp.experts.gate_up_proj": torch.zeros(4, 96, 64)}))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.experts\.gate_up_proj' has shape "
                                              r"\(4, 96, 64\), config\.json implies \(4, 192, 64\)"):
        load_checkpoint(tmp_path)


def test_pickle_only_directory_is_refused(tmp_path: Path) -> None:
    hf_mixtral(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="refusing to load pickle file"):
        load_model(tmp_path)


# ---- tokenizer ------------------------------------------------------------------------------------------
def write_tokenizer(path: Path) -> None:
    """A WordLevel tokenizer.json whose specials are not '<s>' / '</s>': only the config's ids can find them."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<bos>", "<eos>", "<end>", "hello", "world", "mixture", "of", "experts"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<bos>", "<eos>", "<end>"])
    tok.save(str(path / "tokenizer.json"))


def test_tokenizer_uses_config_ids(tmp_path: Path) -> None:
    hf_mixtral(tmp_path, bos_token_id=1, eos_token_id=[3, 2])
    write_tokenizer(tmp_path)
    model, ckpt = load_model(tmp_path)
    assert ckpt.config.tokenizer == "hf"
    tok = load_checkpoint_tokenizer(tmp_path, ckpt.config)
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 3, 3)  # several eos ids: the first
    assert tok.encode("hello mixture of experts", bos=True) == [1, 4, 6, 7, 8]
    assert tok.decode([1, 4, 5, 3]) == "hello world"
    explicit = load_tokenizer("hf", tmp_path, bos_id=1, eos_id=2)
    assert (explicit.bos_id, explicit.eos_id) == (1, 2)
    assert load_tokenizer("hf", tmp_path).bos_id is None  # no '<s>' in this vocabulary
    with pytest.raises(ValueError, match=r"eos_id = 99: expected a token id in \[0, 9\)"):
        load_tokenizer("hf", tmp_path, eos_id=99)


def test_no_tokenizer_json(tmp_path: Path) -> None:
    hf_mixtral(tmp_path)
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.config.tokenizer == "none" and ckpt.config.extra["eos_token_id"] == 2
    assert load_checkpoint_tokenizer(tmp_path, ckpt.config) is None
    with pytest.raises(ValueError, match="has no tokenizer"):
        load_tokenizer("none", tmp_path)


# ---- the Engine on a Mixtral directory ----------------------------------------------------------
@pytest.mark.parametrize("backend", ["eager", "grouped_mm"])
def test_engine_greedy_32_tokens_equal_transformers_generate(tmp_path: Path, backend: str) -> None:
    from moeserve.runtime.engine import Engine, SamplingParams

    hf_mixtral(tmp_path, seed=3)
    hf = MixtralForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, experts_implementation=backend).eval()
    hf.generation_config.eos_token_id = None
    engine = Engine.load(tmp_path, dtype="float32", device="cpu")
    assert engine.tokenizer is None and engine.dtype == torch.float32
    prompts = [[1, 17, 33, 5, 90], [1, 4], [1, 200, 3, 3, 3, 3, 3, 3, 3, 9]]
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                                 min_new_tokens=32, pad_token_id=0)[0, len(p):].tolist()
        ours = [c.token_ids for c in engine.complete([p], SamplingParams(max_new_tokens=32, ignore_eos=True))]
        assert ours[0] == theirs
    # The batch of unequal prompts gives each prompt the same 32 tokens.
    done = engine.complete(prompts, SamplingParams(max_new_tokens=32, ignore_eos=True))
    batch, reasons = [c.token_ids for c in done], [c.finish_reason for c in done]
    alone = [engine.complete([p], SamplingParams(max_new_tokens=32, ignore_eos=True))[0].token_ids for p in prompts]
    assert batch == alone and reasons == ["length"] * 3


def test_engine_text_api_needs_a_tokenizer(tmp_path: Path) -> None:
    from moeserve.runtime.engine import Engine, EngineError

    hf_mixtral(tmp_path)
    engine = Engine.load(tmp_path, dtype="float32")
    with pytest.raises(EngineError, match="has no tokenizer"):
        engine.generate("hello")
    logits = engine.forward(torch.tensor([[1, 2, 3]]))
    assert logits.shape == (1, 3, V)


# ---- expert slices of a Mixtral directory (serve --ray --expert-parallel N) ----------------------------------
@pytest.mark.parametrize("layout", ["per-expert", "fused", "mlp", "sharded files"])
def test_expert_slices_are_the_imported_stacks(tmp_path: Path, layout: str) -> None:
    """A rank reads experts [start, stop) straight from the directory (safetensors slices, no other
    expert read); they equal the whole import's stacks, and the dense part loads without any expert."""
    kwargs = {"fused": {"save_original_format": False}, "sharded files": {"max_shard_size": "100KB"}}.get(layout)
    hf_mixtral(tmp_path, kwargs)
    if layout == "mlp":
        state = load_file(str(tmp_path / "model.safetensors"))
        save_file({k.replace(".block_sparse_moe.", ".mlp."): v for k, v in state.items()},
                  str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    whole = load_checkpoint(tmp_path).state_dict
    for start, stop in ((0, 4), (1, 3), (3, 4)):
        cfg, part = load_expert_slice(tmp_path, start, stop, dtype=torch.bfloat16)
        assert sorted(part) == sorted(k for k in whole if is_expert_weight(k))
        for k, t in part.items():
            assert t.dtype == torch.bfloat16 and torch.equal(t, whole[k][start:stop].to(torch.bfloat16)), k
    dense = load_checkpoint(tmp_path, keep=lambda k: not is_expert_weight(k)).state_dict
    assert sorted(dense) == sorted(k for k in whole if not is_expert_weight(k))
    with pytest.raises(CheckpointError, match=r"experts \[2, 5\): expected a range within the model's 4"):
        load_expert_slice(tmp_path, 2, 5)


def test_a_mixtral_on_an_expert_parallel_rank_gives_transformers_logits(tmp_path: Path) -> None:
    """The directory loaded as a rank loads it (the dense part, and its experts as safetensors slices behind the
    all-to-all: runtime/ep_rank.load_rank_engine), here the one rank of a gloo group of one, as `--ray` without
    --expert-parallel serves it; two ranks of a Mixtral are tests/serve/test_ep_deploy.py's."""
    from moeserve.bench.server_process import free_port
    from moeserve.runtime.ep_rank import load_rank_engine
    from moeserve.runtime.expert_parallel import ExpertParallelExperts, join_group

    hf = hf_mixtral(tmp_path)
    group = join_group(f"tcp://127.0.0.1:{free_port()}", 0, 1, timeout_s=30)
    try:
        model = load_rank_engine(str(tmp_path), group).model
        assert all(isinstance(layer.experts, ExpertParallelExperts) for layer in model.moe_layers)
        ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=TOL, rtol=0)
    finally:
        group.leave()


def test_a_missing_expert_tensor_is_named_by_the_slice(tmp_path: Path) -> None:
    hf_mixtral(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    load_expert_slice(tmp_path, 0, 2)  # experts 0 and 1: the missing one is not theirs to read
    with pytest.raises(CheckpointError, match=r"Mixtral tensor 'model\.layers\.1\.block_sparse_moe\.experts\.2\.w3"):
        load_expert_slice(tmp_path, 2, 4)
