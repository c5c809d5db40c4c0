"""Hugging Face OLMoE directories, read as they are: config.json mapped to an MoEConfig, tensors renamed and stacked
into the Transformer's layout by hf_common (checkpoint.py calls these through hf_families.FAMILIES). Like
hf_mixtral.py, this module only maps dicts and imports nothing of the runtime.

What OLMoE adds to Mixtral's decoder, as transformers 5 computes it (modeling_olmoe.py): RMSNorm over the whole q
projection [H * Dh] and the whole k projection [G * Dh] before the heads are split and RoPE applied (qk_norm "all");
a router that renormalises its top-k gates only where `norm_topk_prob` (default false); optional `attention_bias` on
q, k, v and o. `clip_qkv` (clamping q, k and v) is not implemented and is refused unless null.
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

_OLMOE_FIELDS = {**COMMON_FIELDS, "d_ff": "intermediate_size", "n_experts": "num_experts"}
# OlmoeConfig's defaults (transformers 5.24) for the fields a config.json may leave out.
_OLMOE_DEFAULTS = {"num_key_value_heads": None, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                   "tie_word_embeddings": False, "rope_theta": 10000.0}


class OlmoeError(HFError):
    """An OLMoE config.json or tensor set that cannot be read as it is; the message names the file."""


OLMOE = Layout("OLMoE", OlmoeError, "mlp", GATE_UP_DOWN)


def olmoe_config(raw: dict, where: Path, has_tokenizer: bool) -> MoEConfig:
    """MoEConfig of a Hugging Face OLMoE config.json; every field that would change the math and that the
    Transformer does not implement is refused by name, never ignored."""

    def fail(problem: str) -> NoReturn:
        raise OlmoeError(f"{where}: Hugging Face model_type 'olmoe': {problem}")

    raw = {**raw, "num_experts": raw.get("num_experts", raw.get("num_local_experts"))}  # alias in transformers
    theta = check_common(raw, fail, "OlmoeForCausalLM")
    for name in ("clip_qkv", "sliding_window"):
        if raw.get(name) is not None:
            fail(f"field {name!r} = {raw[name]!r}: not supported (expected it absent or null)")
    heads, width = raw.get("num_attention_heads"), raw.get("hidden_size")
    if raw.get("head_dim") is not None and isinstance(heads, int) and isinstance(width, int) and heads > 0 \
            and raw["head_dim"] != width // heads:  # transformers' k_norm is (hidden_size / heads) * kv heads wide
        fail(f"field 'head_dim' = {raw['head_dim']!r}: expected hidden_size / num_attention_heads = {width // heads}")
    bias = bool(raw.get("attention_bias", False))
    return build_config(raw, fail, _OLMOE_FIELDS, _OLMOE_DEFAULTS, "olmoe", has_tokenizer, theta,
                        renormalize=bool(raw.get("norm_topk_prob", False)), qkv_bias=bias, o_bias=bias, qk_norm="all")


from_olmoe = partial(import_tensors, OLMOE)
olmoe_expert_slice = partial(expert_slice, OLMOE)
