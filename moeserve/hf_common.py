"""What every Hugging Face family's reader (hf_mixtral.py, hf_gpt_oss.py, ...) does the same way: the token ids of
config.json, taking a tensor by name and shape, the embedding, final norm and LM head, and refusing tensors left
over. Plain functions over dicts, importing nothing of moeserve but the config and errors."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, NoReturn

import torch

from moeserve.config import MoEConfig
from moeserve.errors import HFError

# take(key, *shape, convert=True) -> the tensor, popped from the reader's tensors, checked, in the asked dtype
Take = Callable[..., torch.Tensor]


def token_ids(raw: dict, fail: Callable[[str], NoReturn]) -> dict:
    """{"bos_token_id", "eos_token_id"} of a config.json for MoEConfig.extra: several eos ids give the first (the
    tokenizer's own eos); anything but a token id or null is refused by name."""
    eos = raw.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    for name, value in (("bos_token_id", raw.get("bos_token_id")), ("eos_token_id", eos)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            fail(f"field {name!r} = {raw.get(name)!r}: expected a token id (integer >= 0) or null")
    return {"bos_token_id": raw.get("bos_token_id"), "eos_token_id": eos}


def copied_fields(raw: dict, mapping: dict[str, str], defaults: dict, fail: Callable[[str], NoReturn]) -> dict:
    """MoEConfig's fields that a config.json holds as they are (mapping: ours -> theirs), each its family's default
    where config.json leaves it out; a size with no default that is missing is refused by name."""
    fields: dict = {}
    for ours, theirs in mapping.items():
        if raw.get(theirs) is None and theirs not in defaults:
            fail(f"field {theirs!r} missing")
        fields[ours] = raw[theirs] if raw.get(theirs) is not None else defaults[theirs]
    return fields


def taker(src: dict[str, tuple[str, torch.Tensor]], origin: dict[str, Path], where: Path, dtype: torch.dtype | None,
          error: type[HFError], family: str) -> Take:
    """take(key, *shape, convert=True): the tensor `src` holds under `key` (src: key -> (its name in the files, it)),
    popped, its shape checked against what config.json implies, in `dtype` unless convert=False; errors name the
    tensor and its file."""

    def take(key: str, *shape: int, convert: bool = True) -> torch.Tensor:
        if key not in src:
            raise error(f"{where}: {family} tensor {key!r} missing (expected shape {shape})")
        name, t = src.pop(key)
        if tuple(t.shape) != shape:
            raise error(f"{origin.get(name, where)}: tensor {name!r} has shape {tuple(t.shape)}, "
                        f"config.json implies {shape}")
        return t if dtype is None or not convert else t.to(dtype)

    return take


def embedding_and_head(take: Take, src: dict, c: MoEConfig) -> dict[str, torch.Tensor]:
    """The embedding, the final norm and (untied) the LM head, under the Transformer's names. Tied: transformers ties
    the head to the embedding and ignores a saved copy, and so does this."""
    V, D = c.vocab_size, c.d_model
    out = {"tok_embeddings.weight": take("model.embed_tokens.weight", V, D), "norm.weight": take("model.norm.weight", D)}
    if not c.tie_embeddings:
        out["output.weight"] = take("lm_head.weight", V, D)
    elif "lm_head.weight" in src:
        take("lm_head.weight", V, D)
    return out


def refuse_leftovers(names: list[str], where: Path, error: type[HFError], family: str) -> None:
    """Tensors no weight of the model took (a RoPE table, recomputed, aside): refused by name, never ignored."""
    unexpected = sorted(name for name in names if not name.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise error(f"{where}: unexpected tensor(s) {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
                    f" for a {family} model as config.json describes it")
