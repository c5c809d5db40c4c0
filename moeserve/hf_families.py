"""The Hugging Face MoE families moeserve reads as they are, by config.json's `model_type`.

Each family is three functions over plain dicts (config.json in, MoEConfig out; tensors in, the Transformer's names
out; an expert-parallel rank's slice of the experts), in its own module beside this one (hf_mixtral.py, ...), so that
checkpoint.py knows the directory format and this table, and nothing of any family's names. A family's errors are
`HFError`s naming the file; checkpoint.py turns them into CheckpointErrors. A new family is a module and one line in FAMILIES.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from moeserve import hf_gpt_oss, hf_mixtral, hf_olmoe, hf_qwen_moe
from moeserve.config import MoEConfig
from moeserve.errors import HFError

__all__ = ["Family", "HFError", "FAMILIES", "by_format", "family"]


# (raw config.json, its path, whether the directory has tokenizer.json) -> MoEConfig
ConfigMap = Callable[[dict, Path, bool], MoEConfig]
# (tensors by name (consumed), config, tensor name -> its file, the weights' path, dtype or None, experts?) -> state
TensorMap = Callable[[dict[str, torch.Tensor], MoEConfig, dict[str, Path], Path, "torch.dtype | None", bool],
                     dict[str, torch.Tensor]]
# (read(name) -> a safetensors slice, tensor names, config, start, stop, where, dtype) -> experts [start, stop)
SliceMap = Callable[[Callable[[str], Any], Iterable[str], MoEConfig, int, int, Path, "torch.dtype | None"],
                    dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Family:
    name: str  # LoadedCheckpoint.manifest["format"], "hf-<model_type>"
    config: ConfigMap
    tensors: TensorMap
    expert_slice: SliceMap


FAMILIES: dict[str, Family] = {
    "mixtral": Family("hf-mixtral", hf_mixtral.mixtral_config, hf_mixtral.from_mixtral, hf_mixtral.mixtral_expert_slice),
    "qwen2_moe": Family("hf-qwen2_moe", hf_qwen_moe.qwen2_moe_config, hf_qwen_moe.from_qwen2_moe,
                        hf_qwen_moe.qwen2_moe_expert_slice),
    "qwen3_moe": Family("hf-qwen3_moe", hf_qwen_moe.qwen3_moe_config, hf_qwen_moe.from_qwen3_moe,
                        hf_qwen_moe.qwen3_moe_expert_slice),
    "olmoe": Family("hf-olmoe", hf_olmoe.olmoe_config, hf_olmoe.from_olmoe, hf_olmoe.olmoe_expert_slice),
    "gpt_oss": Family("hf-gpt_oss", hf_gpt_oss.gpt_oss_config, hf_gpt_oss.from_gpt_oss, hf_gpt_oss.gpt_oss_expert_slice),
}


def family(model_type: Any) -> Family | None:
    """The family of a config.json's model_type, None where it is not one moeserve reads."""
    return FAMILIES.get(model_type) if isinstance(model_type, str) else None


def by_format(fmt: str) -> Family:
    """The family of a LoadedCheckpoint.manifest["format"] ("hf-mixtral", ...)."""
    return next(f for f in FAMILIES.values() if f.name == fmt)
