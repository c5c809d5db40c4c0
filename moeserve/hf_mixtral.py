"""Hugging Face Mixtral directories, read as they are: config.json mapped to an MoEConfig, tensors renamed
and stacked into the Transformer's layout. checkpoint.py finds the files and calls these functions (through
hf_families.FAMILIES) when config.json says model_type 'mixtral'; they only map (dicts in, dicts out), so this
module imports nothing of moeserve but the config and errors, and checkpoint.py turns a MixtralError into its
CheckpointError."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Iterable, NoReturn

import torch

from moeserve.config import ConfigError, MoEConfig
from moeserve.errors import HFError
from moeserve.hf_common import copied_fields, embedding_and_head, refuse_leftovers, taker, token_ids

# MoEConfig field <- transformers MixtralConfig field, for the fields that are copied as they are.
_MIXTRAL_FIELDS = {
    "vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads", "d_ff": "intermediate_size", "n_experts": "num_local_experts",
    "top_k": "num_experts_per_tok", "n_kv_heads": "num_key_value_heads",
    "max_seq_len": "max_position_embeddings", "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings", "sliding_window": "sliding_window",
}
# MixtralConfig's defaults for the fields a config.json may leave out (transformers 5.23); sizes have none here.
_MIXTRAL_DEFAULTS = {"num_key_value_heads": None, "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5,
                     "tie_word_embeddings": False, "sliding_window": None, "rope_theta": 1e6}


class MixtralError(HFError):
    """A Mixtral config.json or tensor set that cannot be read as it is; the message names the file."""


def mixtral_config(raw: dict, where: Path, has_tokenizer: bool) -> MoEConfig:
    """MoEConfig of a Hugging Face Mixtral config.json: softmax over all experts, top-k, renormalised
    (Mixtral's router), SwiGLU experts, RMSNorm, rotate-half RoPE. Every field that would change the
    math and that the Transformer does not implement is refused by name, never ignored."""

    def fail(problem: str) -> NoReturn:
        raise MixtralError(f"{where}: Hugging Face model_type 'mixtral': {problem}")

    raw = {**raw, "num_local_experts": raw.get("num_local_experts", raw.get("num_experts"))}  # alias in transformers
    if (arch := raw.get("architectures")) is not None and arch != ["MixtralForCausalLM"]:
        fail(f"field 'architectures' = {arch!r}: expected ['MixtralForCausalLM'] (a language-model head)")
    if (act := raw.get("hidden_act", "silu")) != "silu":
        fail(f"field 'hidden_act' = {act!r}: expected 'silu' (SwiGLU experts)")
    for name in ("attention_bias", "mlp_bias", "quantization_config"):
        if raw.get(name):
            fail(f"field {name!r} = {raw[name]!r}: not supported (expected it absent, null or false)")
    theta = raw.get("rope_theta")
    for name in ("rope_parameters", "rope_scaling"):  # transformers 5 / earlier
        if (rope := raw.get(name)) is None:
            continue
        if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
            fail(f"field {name!r} = {rope!r}: expected one object with 'rope_type' (one RoPE for every layer)")
        if (kind := rope.get("rope_type", rope.get("type", "default"))) != "default":
            fail(f"field {name!r} has rope_type {kind!r}: only 'default' RoPE is supported")
        theta = rope.get("rope_theta", theta)
    heads, width = raw.get("num_attention_heads"), raw.get("hidden_size")
    if raw.get("head_dim") is not None and isinstance(heads, int) and isinstance(width, int) and heads > 0 \
            and raw["head_dim"] != width // heads:
        fail(f"field 'head_dim' = {raw['head_dim']!r}: expected hidden_size / num_attention_heads = {width // heads}")
    fields = copied_fields(raw, _MIXTRAL_FIELDS, _MIXTRAL_DEFAULTS, fail)
    ids = token_ids(raw, fail)
    try:
        return MoEConfig(
            **fields, rope_theta=float(theta if theta is not None else _MIXTRAL_DEFAULTS["rope_theta"]),
            norm="rmsnorm", causal=True, task="lm", expert_act="swiglu", router="softmax", renormalize=True,
            tokenizer="hf" if has_tokenizer else "none",
            extra={"hf_model_type": "mixtral", **ids},
        )
    except (ConfigError, TypeError, ValueError) as e:
        msg = str(e)
        for ours, theirs in _MIXTRAL_FIELDS.items():
            msg = msg.replace(f"config field '{ours}'", f"field '{theirs}' (moeserve '{ours}')")
        fail(msg)


def from_mixtral(tensors: dict[str, torch.Tensor], config: MoEConfig, origin: dict[str, Path],
                 where: Path, dtype: torch.dtype | None = None, experts: bool = True) -> dict[str, torch.Tensor]:
    """Hugging Face Mixtral tensors -> the Transformer's state_dict names and [E, out, in] expert stacks.

    Two expert layouts are read: per expert `block_sparse_moe.experts.{e}.w1|w2|w3.weight` (w1 gate,
    w3 up, w2 down: what save_pretrained writes by default, and every Mixtral before transformers 5),
    and fused `experts.gate_up_proj` [E, 2F, D] (gate rows first) + `experts.down_proj` [E, D, F]
    (transformers 5's modules, saved with save_original_format=False). transformers reads the MoE
    block as `block_sparse_moe` or `mlp`; so does this. `tensors` is consumed: each expert's matrices
    are freed once stacked. RoPE is rotate-half in both, so q and k need no permutation.

    w1 and w3 come back as the two halves of one [E, 2F, D] tensor, the layout inference runs on
    (backends/experts.fuse_expert_weights takes it without a copy); every tensor is in `dtype` (None: as stored),
    converted while it is copied into its stack rather than after. experts=False: the experts are left out
    (not stacked, not copied): the dense part of an expert-parallel rank, whose own experts come from
    `mixtral_expert_slice`."""
    src: dict[str, tuple[str, torch.Tensor]] = {}
    for name in list(tensors):
        canon = _canonical(name)
        if canon in src:
            raise MixtralError(f"{where}: tensors {src[canon][0]!r} and {name!r} are the same Mixtral weight")
        src[canon] = (name, tensors.pop(name))

    take = taker(src, origin, where, dtype, MixtralError, "Mixtral")

    def stack(m: str, *names: str) -> torch.Tensor:
        """[E, rows, cols]: expert e's matrices `names`, one under the other, copied and converted once."""
        shapes = {"w1": (F, D), "w2": (D, F), "w3": (F, D)}
        parts = [[take(f"{m}experts.{e}.{w}.weight", *shapes[w], convert=False) for w in names] for e in range(E)]
        first = parts[0][0]
        out = torch.empty(E, sum(shapes[w][0] for w in names), first.shape[1], dtype=dtype or first.dtype,
                          device=first.device)
        if first.is_meta:  # shapes only (describe): nothing to copy, and a meta copy would import torch._dynamo
            return out
        for e, mats in enumerate(parts):
            torch.cat(mats, out=out[e])
        return out

    c = config
    D, F, E, q, kv = c.d_model, c.d_ff, c.n_experts, c.n_heads * c.head_dim, c.kv_heads * c.head_dim
    out = embedding_and_head(take, src, c)
    for i in range(c.n_layers):
        p, m, o = f"model.layers.{i}.", f"model.layers.{i}.block_sparse_moe.", f"layers.{i}."
        out[o + "attention_norm.weight"] = take(p + "input_layernorm.weight", D)
        out[o + "ffn_norm.weight"] = take(p + "post_attention_layernorm.weight", D)
        for ours, theirs, shape in (("wq", "q_proj", (q, D)), ("wk", "k_proj", (kv, D)), ("wv", "v_proj", (kv, D)),
                                    ("wo", "o_proj", (D, q))):
            out[f"{o}attention.{ours}.weight"] = take(f"{p}self_attn.{theirs}.weight", *shape)
        out[o + "ffn.router.gate.weight"] = take(m + "gate.weight", E, D)
        if not experts:
            for canon in [k for k in src if k.startswith(m + "experts.")]:
                src.pop(canon)
            continue
        if m + "experts.gate_up_proj" in src:
            gate_up_E2FD = take(m + "experts.gate_up_proj", E, 2 * F, D)
            out[o + "ffn.experts.w2"] = take(m + "experts.down_proj", E, D, F)
        else:
            gate_up_E2FD, out[o + "ffn.experts.w2"] = stack(m, "w1", "w3"), stack(m, "w2")
        out[o + "ffn.experts.w1"], out[o + "ffn.experts.w3"] = gate_up_E2FD[:, :F], gate_up_E2FD[:, F:]
    refuse_leftovers([name for name, _ in src.values()], where, MixtralError, "Mixtral")
    return out


def mixtral_expert_slice(read: Callable[[str], Any], names: Iterable[str], config: MoEConfig, start: int, stop: int,
                         where: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Experts [start, stop) of every MoE layer of a Mixtral directory, as the Transformer's stacked
    `layers.{i}.ffn.experts.w1|w2|w3` [stop - start, out, in]; `read(name)` is a safetensors slice of a
    tensor in `names`. A fused layout is sliced on its expert axis; per-expert tensors outside the range
    are never read. What an expert-parallel rank holds (runtime/ep_rank.py), so no rank holds every expert."""
    D, F = config.d_model, config.d_ff
    names = {_canonical(k): k for k in names}

    def get(canon: str, shape: tuple[int, ...], rows: slice = slice(None)) -> torch.Tensor:
        if canon not in names:
            raise MixtralError(f"{where}: Mixtral tensor {canon!r} missing (expected shape {shape})")
        sl = read(names[canon])
        if tuple(sl.get_shape()) != shape:
            raise MixtralError(f"{where}: tensor {names[canon]!r} has shape {tuple(sl.get_shape())}, config.json "
                               f"implies {shape}")
        t = sl[rows]
        return t if dtype is None else t.to(dtype)

    out: dict[str, torch.Tensor] = {}
    for i in config.moe_layer_ids:
        m, o = f"model.layers.{i}.block_sparse_moe.experts.", f"layers.{i}.ffn.experts."
        if m + "gate_up_proj" in names:
            gate_up = get(m + "gate_up_proj", (config.n_experts, 2 * F, D), slice(start, stop))
            out[o + "w1"], out[o + "w3"] = gate_up[:, :F], gate_up[:, F:]
            out[o + "w2"] = get(m + "down_proj", (config.n_experts, D, F), slice(start, stop))
            continue
        shapes = {"w1": (F, D), "w2": (D, F), "w3": (F, D)}
        for w, shape in shapes.items():
            out[o + w] = torch.stack([get(f"{m}{e}.{w}.weight", shape) for e in range(start, stop)])
    return out


def _canonical(name: str) -> str:
    """transformers reads a layer's MoE block as `block_sparse_moe` or `mlp`: one name for both."""
    return re.sub(r"^(model\.layers\.\d+)\.mlp\.", r"\1.block_sparse_moe.", name)
