"""Hugging Face Mixtral directories, read as they are: config.json mapped to an MoEConfig, tensors renamed
and stacked into the Transformer's layout. checkpoint.py finds the files and calls these functions (through
hf_families.FAMILIES) when config.json says model_type 'mixtral'; they only map (dicts in, dicts out), so this
module imports nothing of moeserve but the config, the errors and hf_common (what the families share), and
checkpoint.py turns a MixtralError into its CheckpointError."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import NoReturn

from moeserve.config import MoEConfig
from moeserve.errors import HFError
from moeserve.hf_common import COMMON_FIELDS, Layout, build_config, check_common, expert_slice, import_tensors

# MoEConfig field <- transformers MixtralConfig field, for the fields that are copied as they are.
_MIXTRAL_FIELDS = {**COMMON_FIELDS, "d_ff": "intermediate_size", "n_experts": "num_local_experts",
                   "sliding_window": "sliding_window"}
# MixtralConfig's defaults for the fields a config.json may leave out (transformers 5.23); sizes have none here.
_MIXTRAL_DEFAULTS = {"num_key_value_heads": None, "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5,
                     "tie_word_embeddings": False, "sliding_window": None, "rope_theta": 1e6}


class MixtralError(HFError):
    """A Mixtral config.json or tensor set that cannot be read as it is; the message names the file."""


# transformers reads a layer's MoE block as `block_sparse_moe` or `mlp`; experts' w1 (gate), w3 (up), w2 (down).
MIXTRAL = Layout("Mixtral", MixtralError, "block_sparse_moe", {"w1": "w1", "w2": "w2", "w3": "w3"}, aliases=("mlp",))


def mixtral_config(raw: dict, where: Path, has_tokenizer: bool) -> MoEConfig:
    """MoEConfig of a Hugging Face Mixtral config.json: softmax over all experts, top-k, renormalised
    (Mixtral's router), SwiGLU experts, RMSNorm, rotate-half RoPE. Every field that would change the
    math and that the Transformer does not implement is refused by name, never ignored."""

    def fail(problem: str) -> NoReturn:
        raise MixtralError(f"{where}: Hugging Face model_type 'mixtral': {problem}")

    raw = {**raw, "num_local_experts": raw.get("num_local_experts", raw.get("num_experts"))}  # alias in transformers
    theta = check_common(raw, fail, "MixtralForCausalLM")
    if raw.get("attention_bias"):
        fail(f"field 'attention_bias' = {raw['attention_bias']!r}: not supported (expected it absent, null or false)")
    heads, width = raw.get("num_attention_heads"), raw.get("hidden_size")
    if raw.get("head_dim") is not None and isinstance(heads, int) and isinstance(width, int) and heads > 0 \
            and raw["head_dim"] != width // heads:
        fail(f"field 'head_dim' = {raw['head_dim']!r}: expected hidden_size / num_attention_heads = {width // heads}")
    return build_config(raw, fail, _MIXTRAL_FIELDS, _MIXTRAL_DEFAULTS, "mixtral", has_tokenizer, theta,
                        renormalize=True)


# Hugging Face Mixtral tensors -> the Transformer's names and [E, out, in] expert stacks (hf_common.import_tensors);
# both expert layouts, under either name of the MoE block.
from_mixtral = partial(import_tensors, MIXTRAL)
# Experts [start, stop) of every MoE layer of a Mixtral directory, as an expert-parallel rank holds them.
mixtral_expert_slice = partial(expert_slice, MIXTRAL)
