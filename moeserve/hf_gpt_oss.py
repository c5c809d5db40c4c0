"""Hugging Face gpt-oss directories (transformers' GptOssForCausalLM), read as they are: config.json mapped to an
MoEConfig, tensors renamed and laid out as the Transformer's, and released checkpoints' MXFP4 experts dequantized at
load to the model's dtype. checkpoint.py calls these functions (through hf_families.FAMILIES) when config.json says
model_type 'gpt_oss'; they only map (dicts in, dicts out), as hf_mixtral.py does.

What gpt-oss adds to a Mixtral (OpenAI, "gpt-oss-120b & gpt-oss-20b model card", 2025, sec. 2.1; transformers'
modeling_gpt_oss.py), each a MoEConfig field the runtime implements: a head width of its own (d_head), biases on
q, k, v and o (qkv_bias, o_bias), a learned sink logit per head (attention_sinks), sliding and full attention
alternating by layer (layer_windows), YaRN RoPE (rope_scaling), a router bias and top-k-then-softmax routing
(router_bias, renormalize), experts with biases and the clamped SwiGLU (expert_bias, clamped_swiglu).

MXFP4 (OCP Microscaling Formats v1.0, 2023): blocks of 32 e2m1 values (4 bits: sign, two exponent bits, one
mantissa bit; two values a byte, the low nibble first) sharing one e8m0 scale byte 2^(s - 127). Stored as
`*_blocks` uint8 [E, rows, cols / 32, 16] and `*_scales` uint8 [E, rows, cols / 32]; rows are the output features,
so a dequantized gate_up is our [E, 2F, D] stack with gate and up interleaved by row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, NoReturn

import torch

from moeserve.config import ConfigError, MoEConfig
from moeserve.errors import HFError
from moeserve.hf_common import copied_fields, embedding_and_head, refuse_leftovers, taker, token_ids

# MoEConfig field <- transformers GptOssConfig field, for the fields copied as they are.
_FIELDS = {
    "vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads", "d_ff": "intermediate_size", "n_experts": "num_local_experts",
    "top_k": "num_experts_per_tok", "n_kv_heads": "num_key_value_heads", "d_head": "head_dim",
    "max_seq_len": "max_position_embeddings", "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings",
    "swiglu_limit": "swiglu_limit", "swiglu_alpha": "swiglu_alpha",
}
# GptOssConfig's defaults (transformers 5.24) for the fields a config.json may leave out; sizes have none here.
_DEFAULTS = {"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
             "tie_word_embeddings": False, "swiglu_limit": 7.0, "swiglu_alpha": 1.702, "sliding_window": 128,
             "attention_bias": True, "rope_theta": 150000.0}
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
_YARN_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
              "beta_slow", "truncate", "attention_factor", "mscale", "mscale_all_dim", "partial_rotary_factor"}
# The fields read below, and those that change nothing at inference (training's dropout and aux loss, init,
# outputs, the cache flag, provenance), and hidden_act, which transformers' gpt-oss never reads (its experts are the
# clamped SwiGLU whatever it says). Any other field is refused by name.
_KNOWN = {"architectures", "model_type", "bos_token_id", "eos_token_id", "experts_per_token", "num_experts",
          "rope_theta", "rope_parameters", "rope_scaling", "layer_types", "sliding_window", "attention_bias",
          "quantization_config", "attention_dropout", "router_aux_loss_coef", "initializer_range",
          "output_router_logits", "use_cache", "hidden_act", "initial_context_length", "pad_token_id", "dtype",
          "torch_dtype", "transformers_version"}
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # e2m1 codes


class GptOssError(HFError):
    """A gpt-oss config.json or tensor set that cannot be read as it is; the message names the file."""


def gpt_oss_config(raw: dict, where: Path, has_tokenizer: bool) -> MoEConfig:
    """MoEConfig of a Hugging Face gpt-oss config.json. Every field that would change the math and that the
    Transformer does not implement is refused by name, never ignored; so is a field this reader does not know."""

    def fail(problem: str) -> NoReturn:
        raise GptOssError(f"{where}: Hugging Face model_type 'gpt_oss': {problem}")

    unknown = sorted(k for k in raw if k not in _KNOWN and k not in _FIELDS.values())
    if unknown:
        fail(f"field(s) {unknown} not supported (not a field moeserve reads for gpt-oss)")
    if (arch := raw.get("architectures")) is not None and arch != ["GptOssForCausalLM"]:
        fail(f"field 'architectures' = {arch!r}: expected ['GptOssForCausalLM'] (a language-model head)")
    q = raw.get("quantization_config")
    if q is not None and (not isinstance(q, dict) or q.get("quant_method") != "mxfp4"):
        fail(f"field 'quantization_config' = {q!r}: only quant_method 'mxfp4' (experts dequantized at load) is "
             f"supported")
    for name in ("num_experts_per_tok", "num_local_experts"):  # aliases a config.json may hold instead
        alias = {"num_experts_per_tok": "experts_per_token", "num_local_experts": "num_experts"}[name]
        if raw.get(name) is None and raw.get(alias) is not None:
            raw = {**raw, name: raw[alias]}
        elif raw.get(alias) is not None and raw[alias] != raw[name]:
            fail(f"field {alias!r} = {raw[alias]!r} and field {name!r} = {raw[name]!r}: expected them equal")
    fields = copied_fields(raw, _FIELDS, _DEFAULTS, fail)
    rope, theta = _rope(raw, fail)
    n_layers = raw["num_hidden_layers"]
    types = raw.get("layer_types")
    if types is None:  # GptOssConfig's default: sliding, full, sliding, ...
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)] \
            if isinstance(n_layers, int) else []
    if not isinstance(types, list) or len(types) != n_layers or \
            any(t not in ("sliding_attention", "full_attention") for t in types):
        fail(f"field 'layer_types' = {types!r}: expected num_hidden_layers={n_layers!r} entries, each "
             f"'sliding_attention' or 'full_attention'")
    window = raw.get("sliding_window", _DEFAULTS["sliding_window"])
    if "sliding_attention" in types and window is None:
        fail("field 'sliding_window' = None: expected a window for the layers that 'layer_types' makes sliding")
    bias = raw.get("attention_bias", _DEFAULTS["attention_bias"])
    if not isinstance(bias, bool):
        fail(f"field 'attention_bias' = {bias!r}: expected true or false")
    ids = token_ids(raw, fail)
    try:
        return MoEConfig(
            **fields, rope_theta=theta, rope_scaling=rope, norm="rmsnorm", causal=True, task="lm",
            layer_windows=[window if t == "sliding_attention" else None for t in types],
            qkv_bias=bias, o_bias=bias, attention_sinks=True, router="softmax", renormalize=True, router_bias=True,
            expert_bias=True, expert_act="clamped_swiglu", tokenizer="hf" if has_tokenizer else "none",
            extra={"hf_model_type": "gpt_oss", **ids, "mxfp4": raw.get("quantization_config") is not None},
        )
    except (ConfigError, TypeError, ValueError) as e:
        msg = str(e)
        for ours, theirs in {**_FIELDS, "layer_windows": "sliding_window"}.items():
            msg = msg.replace(f"config field '{ours}'", f"field '{theirs}' (moeserve '{ours}')")
        fail(msg)


def _rope(raw: dict, fail: Callable[[str], NoReturn]) -> tuple[dict | None, float]:
    """(MoEConfig.rope_scaling, rope_theta) of rope_parameters (transformers 5) or rope_scaling and rope_theta
    (earlier, and the released checkpoints): YaRN or plain RoPE, one for every layer."""
    theta = raw.get("rope_theta")
    name = "rope_parameters" if raw.get("rope_parameters") is not None else "rope_scaling"
    rope = raw.get(name)
    if rope is None:
        rope = _DEFAULT_ROPE if "rope_parameters" not in raw and "rope_scaling" not in raw else {"rope_type": "default"}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        fail(f"field {name!r} = {rope!r}: expected one object with 'rope_type' (one RoPE for every layer)")
    theta = float(rope.get("rope_theta", theta if theta is not None else _DEFAULTS["rope_theta"]))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None, theta
    if kind != "yarn":
        fail(f"field {name!r} has rope_type {kind!r}: only 'yarn' and 'default' RoPE are supported")
    if unknown := sorted(set(rope) - _YARN_KEYS):
        fail(f"field {name!r} has key(s) {unknown}: not supported for rope_type 'yarn'")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        fail(f"field {name!r} has partial_rotary_factor {rope['partial_rotary_factor']!r}: only 1.0 is supported")
    if not isinstance(rope.get("original_max_position_embeddings"), int):
        fail(f"field {name!r}: 'original_max_position_embeddings' = {rope.get('original_max_position_embeddings')!r}"
             f": expected an integer")
    factor = rope.get("factor")
    if factor is None:  # as transformers: the ratio of the extended context to the original one
        factor = raw.get("max_position_embeddings", _DEFAULTS["max_position_embeddings"]) / \
            rope["original_max_position_embeddings"]
    scaling = {k: v for k, v in rope.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
    return {**scaling, "rope_type": "yarn", "factor": float(factor)}, theta


# ---- MXFP4 -------------------------------------------------------------------------------------------------------
def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., G, 16] uint8 blocks and [..., G] uint8 e8m0 scales -> [..., G * 32] in `dtype`: the low nibble of byte
    b is value 2b, the high one value 2b + 1, each e2m1 code times 2^(scale - 127). The same operations as
    transformers' integrations/mxfp4.convert_moe_packed_tensors (a table in `dtype`, then torch.ldexp), so the
    same bits, without its final transpose (our stacks are [E, out, in], the checkpoint's row order)."""
    if blocks.is_meta:  # shapes only (describe): the headers' shapes, whatever dtype they were given
        return torch.empty(*blocks.shape[:-2], blocks.shape[-2] * 32, dtype=dtype, device="meta")
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape \
            or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype}: expected uint8 [..., G, 16] and uint8 [..., G]")
    *prefix, G, B = blocks.shape
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    blocks_RB, exp_R1 = blocks.reshape(-1, B), scales.reshape(-1, 1).to(torch.int32) - 127
    out = torch.empty(blocks_RB.shape[0], 2 * B, dtype=dtype, device=blocks.device)
    out[:, 0::2] = lut[(blocks_RB & 0x0F).to(torch.int)]
    out[:, 1::2] = lut[(blocks_RB >> 4).to(torch.int)]
    torch.ldexp(out, exp_R1, out=out)
    return out.view(*prefix, G * 2 * B)


# ---- tensors -----------------------------------------------------------------------------------------------------
def _expert_tensors(get: Callable[[str, tuple[int, ...]], torch.Tensor], has: Callable[[str], bool], o: str, E: int,
                    D: int, F: int, dtype: torch.dtype | None, where: Path) -> dict[str, torch.Tensor]:
    """One layer's experts (E of them: all, or a rank's slice) as the Transformer's w1, w3 (the halves of one
    [E, 2F, D] tensor), w2 [E, D, F] and biases b1, b3 [E, F], b2 [E, D]. `get(name, shape)` reads the layer's
    experts' tensor `name`: bf16 / fp32 `gate_up_proj` [E, D, 2F] (gate, up interleaved on the last axis) and
    `down_proj` [E, F, D], or their MXFP4 `_blocks` and `_scales`, dequantized here to `dtype` (None: the biases')."""
    gate_up_bias = get("gate_up_proj_bias", (E, 2 * F))
    dt = dtype or gate_up_bias.dtype
    if has("gate_up_proj_blocks"):
        if D % 32 or F % 32:
            raise GptOssError(f"{where}: MXFP4 experts need hidden_size and intermediate_size multiples of 32, "
                              f"not {D} and {F}")
        gate_up_E2FD = dequantize_mxfp4(get("gate_up_proj_blocks", (E, 2 * F, D // 32, 16)),
                                        get("gate_up_proj_scales", (E, 2 * F, D // 32)), dt)
        w2_EDF = dequantize_mxfp4(get("down_proj_blocks", (E, D, F // 32, 16)),
                                  get("down_proj_scales", (E, D, F // 32)), dt)
    else:
        gate_up_E2FD = get("gate_up_proj", (E, D, 2 * F)).transpose(1, 2)
        w2_EDF = get("down_proj", (E, F, D)).transpose(1, 2).to(dt).contiguous()
    w13_EFD = torch.empty(E, 2 * F, D, dtype=dt, device=gate_up_E2FD.device)  # gate rows, then up rows
    if not w13_EFD.is_meta:
        w13_EFD[:, :F], w13_EFD[:, F:] = gate_up_E2FD[:, 0::2], gate_up_E2FD[:, 1::2]
    gate_up_bias = gate_up_bias.to(dt)
    return {o + "w1": w13_EFD[:, :F], o + "w3": w13_EFD[:, F:], o + "w2": w2_EDF,
            o + "b1": gate_up_bias[:, 0::2].contiguous(), o + "b3": gate_up_bias[:, 1::2].contiguous(),
            o + "b2": get("down_proj_bias", (E, D)).to(dt)}


def from_gpt_oss(tensors: dict[str, torch.Tensor], config: MoEConfig, origin: dict[str, Path],
                 where: Path, dtype: torch.dtype | None = None, experts: bool = True) -> dict[str, torch.Tensor]:
    """Hugging Face gpt-oss tensors -> the Transformer's state_dict names. `tensors` is consumed. Every tensor is
    in `dtype` (None: as stored; MXFP4 experts in their biases' dtype). experts=False: the experts are left out (the
    dense part of an expert-parallel rank, whose own come from `gpt_oss_expert_slice`)."""
    src = {name: (name, t) for name, t in tensors.items()}
    tensors.clear()
    take = taker(src, origin, where, dtype, GptOssError, "gpt-oss")
    c = config
    D, F, E, H = c.d_model, c.d_ff, c.n_experts, c.n_heads
    q, kv = c.n_heads * c.head_dim, c.kv_heads * c.head_dim
    out = embedding_and_head(take, src, c)
    for i in range(c.n_layers):
        p, m, o = f"model.layers.{i}.", f"model.layers.{i}.mlp.", f"layers.{i}."
        out[o + "attention_norm.weight"] = take(p + "input_layernorm.weight", D)
        out[o + "ffn_norm.weight"] = take(p + "post_attention_layernorm.weight", D)
        for ours, theirs, rows, cols, bias in (("wq", "q_proj", q, D, c.qkv_bias), ("wk", "k_proj", kv, D, c.qkv_bias),
                                               ("wv", "v_proj", kv, D, c.qkv_bias), ("wo", "o_proj", D, q, c.o_bias)):
            out[f"{o}attention.{ours}.weight"] = take(f"{p}self_attn.{theirs}.weight", rows, cols)
            if bias:
                out[f"{o}attention.{ours}.bias"] = take(f"{p}self_attn.{theirs}.bias", rows)
        out[o + "attention.sinks"] = take(p + "self_attn.sinks", H)
        out[o + "ffn.router.gate.weight"] = take(m + "router.weight", E, D)
        out[o + "ffn.router.gate.bias"] = take(m + "router.bias", E)
        if not experts:
            for name in [k for k in src if k.startswith(m + "experts.")]:
                src.pop(name)
            continue
        out.update(_expert_tensors(lambda n, shape: take(m + "experts." + n, *shape, convert=False),
                                   lambda n: m + "experts." + n in src, o + "ffn.experts.", E, D, F, dtype, where))
    refuse_leftovers(list(src), where, GptOssError, "gpt-oss")
    return out


def gpt_oss_expert_slice(read: Callable[[str], Any], names: Iterable[str], config: MoEConfig, start: int, stop: int,
                         where: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Experts [start, stop) of every MoE layer of a gpt-oss directory, as the Transformer's stacked
    `layers.{i}.ffn.experts.*` [stop - start, ...]: each tensor read as a safetensors slice of its expert axis (MXFP4
    blocks and scales sliced, then dequantized), so no rank reads another's experts."""
    names = set(names)
    D, F = config.d_model, config.d_ff
    out: dict[str, torch.Tensor] = {}
    for i in config.moe_layer_ids:
        m = f"model.layers.{i}.mlp.experts."

        def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            full = (config.n_experts, *shape[1:])
            if m + name not in names:
                raise GptOssError(f"{where}: gpt-oss tensor {m + name!r} missing (expected shape {full})")
            sl = read(m + name)
            if tuple(sl.get_shape()) != full:
                raise GptOssError(f"{where}: tensor {m + name!r} has shape {tuple(sl.get_shape())}, config.json "
                                  f"implies {full}")
            return sl[start:stop]

        out.update(_expert_tensors(get, lambda n: m + n in names, f"layers.{i}.ffn.experts.", stop - start, D, F,
                                   dtype, where))
    return out

