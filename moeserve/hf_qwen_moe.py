"""Hugging Face Qwen2-MoE (Qwen1.5-MoE) and Qwen3-MoE directories, read as they are: config.json mapped to an
MoEConfig, tensors renamed and stacked into the Transformer's layout by hf_common (checkpoint.py calls these through
hf_families.FAMILIES). Like hf_mixtral.py, this module only maps dicts and imports nothing of the runtime.

What the two add to Mixtral's decoder, as transformers 5 computes it (modeling_qwen2_moe.py, modeling_qwen3_moe.py):
- router: softmax over all experts in float32, top-k, renormalised only where `norm_topk_prob` (default false), the
  gates cast back to the model's dtype: the SoftmaxRouter with `renormalize`;
- dense layers: those in `mlp_only_layers`, and those whose (index + 1) is not a multiple of `decoder_sparse_step`,
  are a SwiGLU FFN of width `intermediate_size`; the experts' width is `moe_intermediate_size`;
- Qwen2-MoE: biases on q, k and v (`qkv_bias`, default true), and a shared expert of width
  `shared_expert_intermediate_size` beside the routed ones, scaled by sigmoid(shared_expert_gate . x);
- Qwen3-MoE: RMSNorm of each head's q and k (over Dh, before RoPE), a head width of its own (`head_dim`), and
  `attention_bias` on q, k, v and o.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import NoReturn

from moeserve.config import MoEConfig
from moeserve.errors import HFError
from moeserve.hf_common import (
    COMMON_FIELDS, GATE_UP_DOWN, Layout, build_config, check_common, expert_slice, import_tensors,
)

_QWEN_FIELDS = {**COMMON_FIELDS, "d_ff": "moe_intermediate_size", "n_experts": "num_experts"}
# Qwen2MoeConfig's / Qwen3MoeConfig's defaults (transformers 5.24) for the fields a config.json may leave out.
_DEFAULTS = {
    "qwen2_moe": {"num_key_value_heads": 16, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                  "tie_word_embeddings": False, "rope_theta": 10000.0, "shared_expert_intermediate_size": 5632},
    "qwen3_moe": {"num_key_value_heads": 4, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                  "tie_word_embeddings": False, "rope_theta": 10000.0},
}
_ARCHITECTURES = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


class QwenMoeError(HFError):
    """A Qwen2-MoE or Qwen3-MoE config.json or tensor set that cannot be read as it is; the message names the file."""


QWEN2_MOE = Layout("Qwen2-MoE", QwenMoeError, "mlp", GATE_UP_DOWN)
QWEN3_MOE = Layout("Qwen3-MoE", QwenMoeError, "mlp", GATE_UP_DOWN)


def _qwen_config(raw: dict, where: Path, has_tokenizer: bool, model_type: str) -> MoEConfig:
    """The two families' mapping, one config class's fields apart (module docstring)."""

    def fail(problem: str) -> NoReturn:
        raise QwenMoeError(f"{where}: Hugging Face model_type {model_type!r}: {problem}")

    raw = {**raw, "num_experts": raw.get("num_experts", raw.get("num_local_experts"))}  # alias in transformers
    theta = check_common(raw, fail, _ARCHITECTURES[model_type])
    if raw.get("use_sliding_window"):
        fail(f"field 'use_sliding_window' = {raw['use_sliding_window']!r}: sliding-window attention is not supported "
             f"for {model_type} (expected false)")
    if (types := raw.get("layer_types")) is not None and any(t != "full_attention" for t in types):
        fail(f"field 'layer_types' = {types!r}: expected every layer 'full_attention'")
    n_layers, step = raw.get("num_hidden_layers"), raw.get("decoder_sparse_step", 1)
    dense_only = raw.get("mlp_only_layers") or []
    if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
        fail(f"field 'decoder_sparse_step' = {step!r}: expected a positive integer")
    if not isinstance(dense_only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense_only):
        fail(f"field 'mlp_only_layers' = {dense_only!r}: expected a list of layer indices")
    if not isinstance(n_layers, int) or isinstance(n_layers, bool):
        fail(f"field 'num_hidden_layers' = {n_layers!r}: expected a positive integer")
    moe = [i for i in range(n_layers) if i not in dense_only and (i + 1) % step == 0]
    if not moe:
        fail(f"fields 'mlp_only_layers' = {dense_only!r} and 'decoder_sparse_step' = {step!r} leave no MoE layer")
    dense_d_ff = None
    if len(moe) < n_layers:
        if raw.get("intermediate_size") is None:
            fail("field 'intermediate_size' missing (the width of the dense layers)")
        dense_d_ff = raw["intermediate_size"] if raw["intermediate_size"] != raw.get("moe_intermediate_size") else None
    heads, width, d_head = raw.get("num_attention_heads"), raw.get("hidden_size"), raw.get("head_dim")
    if d_head is not None and isinstance(heads, int) and isinstance(width, int) and d_head * heads == width:
        d_head = None  # the default width
    math: dict = dict(moe_layers=moe if len(moe) < n_layers else None, dense_d_ff=dense_d_ff, d_head=d_head,
                      renormalize=bool(raw.get("norm_topk_prob", False)))
    if model_type == "qwen2_moe":
        math.update(qkv_bias=bool(raw.get("qkv_bias", True)), shared_gate=True)
        fields = {**_QWEN_FIELDS, "shared_d_ff": "shared_expert_intermediate_size"}
    else:
        bias = bool(raw.get("attention_bias", False))
        math.update(qkv_bias=bias, o_bias=bias, qk_norm="head")
        fields = _QWEN_FIELDS
    return build_config(raw, fail, fields, _DEFAULTS[model_type], model_type, has_tokenizer, theta, **math)


def qwen2_moe_config(raw: dict, where: Path, has_tokenizer: bool) -> MoEConfig:
    """MoEConfig of a Hugging Face Qwen2-MoE config.json; every field that would change the math and that the
    Transformer does not implement is refused by name, never ignored."""
    return _qwen_config(raw, where, has_tokenizer, "qwen2_moe")


def qwen3_moe_config(raw: dict, where: Path, has_tokenizer: bool) -> MoEConfig:
    """MoEConfig of a Hugging Face Qwen3-MoE config.json; refusals as qwen2_moe_config's."""
    return _qwen_config(raw, where, has_tokenizer, "qwen3_moe")


from_qwen2_moe = partial(import_tensors, QWEN2_MOE)
from_qwen3_moe = partial(import_tensors, QWEN3_MOE)
qwen2_moe_expert_slice = partial(expert_slice, QWEN2_MOE)
qwen3_moe_expert_slice = partial(expert_slice, QWEN3_MOE)
