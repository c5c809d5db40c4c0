"""What the Hugging Face MoE families read alike (hf_mixtral.py, hf_qwen_moe.py, hf_olmoe.py; hf_gpt_oss.py its small
helpers): the config.json fields every Llama-style MoE shares (sizes, RoPE, token ids), and the tensors of a pre-norm
decoder whose FFN is a routed MoE block (with, where the config says, attention biases, q/k norms, dense FFN layers
and a shared expert), renamed and stacked into the Transformer's layout. A family is a `Layout` (how it names its
tensors) and its own config mapping; like those modules, this one imports nothing of moeserve but the config and
errors.

Shape legend: D model dim, F expert hidden dim, E experts, V vocabulary, H heads, G kv heads, Dh head dim.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, NoReturn

import torch

from moeserve.config import ConfigError, MoEConfig
from moeserve.errors import HFError

Fail = Callable[[str], NoReturn]  # raises the family's error, the file and model_type in front of the problem

# MoEConfig field <- transformers field, for the fields every family copies as they are.
COMMON_FIELDS = {
    "vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads", "top_k": "num_experts_per_tok", "n_kv_heads": "num_key_value_heads",
    "max_seq_len": "max_position_embeddings", "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings",
}


@dataclass(frozen=True)
class Layout:
    """How one family names its tensors under `model.layers.{i}.`."""

    title: str  # the family in messages: "Mixtral", "Qwen2-MoE", ...
    error: type[HFError]
    moe: str  # the MoE block: "block_sparse_moe" (Mixtral) or "mlp"
    expert: dict[str, str]  # w1 (gate), w2 (down), w3 (up) -> a per-expert tensor's name under `{moe}.experts.{e}.`
    aliases: tuple[str, ...] = ()  # other names transformers reads the MoE block under (Mixtral: "mlp")

    def canonical(self, name: str) -> str:
        """One name for a tensor that transformers reads under either of the MoE block's names."""
        for alias in self.aliases:
            name = re.sub(rf"^(model\.layers\.\d+)\.{alias}\.", rf"\1.{self.moe}.", name)
        return name


GATE_UP_DOWN = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}  # Qwen's and OLMoE's per-expert names


# ---- small helpers every family uses ----------------------------------------------------------------------------
# take(key, *shape, convert=True) -> the tensor, popped from a reader's tensors, checked, in the asked dtype
Take = Callable[..., torch.Tensor]


def token_ids(raw: dict, fail: Fail) -> dict:
    """{"bos_token_id", "eos_token_id"} of a config.json for MoEConfig.extra: several eos ids give the first (the
    tokenizer's own eos); anything but a token id or null is refused by name."""
    eos = raw.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    for name, value in (("bos_token_id", raw.get("bos_token_id")), ("eos_token_id", eos)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            fail(f"field {name!r} = {raw.get(name)!r}: expected a token id (integer >= 0) or null")
    return {"bos_token_id": raw.get("bos_token_id"), "eos_token_id": eos}


def copied_fields(raw: dict, fields: dict[str, str], defaults: dict[str, Any], fail: Fail) -> dict:
    """MoEConfig's fields that config.json holds as they are (ours <- theirs), each the family's default where
    config.json leaves it out; a size with no default that is missing is refused by name."""
    values: dict = {}
    for ours, theirs in fields.items():
        if raw.get(theirs) is None and theirs not in defaults:
            fail(f"field {theirs!r} missing")
        values[ours] = raw[theirs] if raw.get(theirs) is not None else defaults[theirs]
    return values


def taker(src: dict[str, tuple[str, torch.Tensor]], origin: dict[str, Path], where: Path, dtype: torch.dtype | None,
          error: type[HFError], title: str) -> Take:
    """take(key, *shape, convert=True): the tensor `src` holds under `key` (src: key -> (its name in the files, it)),
    popped, its shape checked against what config.json implies, in `dtype` unless convert=False; errors name the
    tensor and its file."""

    def take(key: str, *shape: int, convert: bool = True) -> torch.Tensor:
        if key not in src:
            raise error(f"{where}: {title} tensor {key!r} missing (expected shape {shape})")
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
    out = {"tok_embeddings.weight": take("model.embed_tokens.weight", V, D),
           "norm.weight": take("model.norm.weight", D)}
    if not c.tie_embeddings:
        out["output.weight"] = take("lm_head.weight", V, D)
    elif "lm_head.weight" in src:
        take("lm_head.weight", V, D)
    return out


def refuse_leftovers(names: list[str], where: Path, error: type[HFError], title: str) -> None:
    """Tensors no weight of the model took (a RoPE table, recomputed, aside): refused by name, never ignored."""
    unexpected = sorted(name for name in names if not name.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise error(f"{where}: unexpected tensor(s) {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
                    f" for a {title} model as config.json describes it")


# ---- config.json ------------------------------------------------------------------------------------------------
def check_common(raw: dict, fail: Fail, architecture: str) -> float | None:
    """Refuse by name what no family here implements (another head, another activation, a quantized checkpoint, RoPE
    other than the default); the RoPE theta the config sets (None: the family's default)."""
    if (arch := raw.get("architectures")) is not None and arch != [architecture]:
        fail(f"field 'architectures' = {arch!r}: expected [{architecture!r}] (a language-model head)")
    if (act := raw.get("hidden_act", "silu")) != "silu":
        fail(f"field 'hidden_act' = {act!r}: expected 'silu' (SwiGLU experts)")
    for name in ("mlp_bias", "quantization_config"):
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
    return theta


def build_config(raw: dict, fail: Fail, fields: dict[str, str], defaults: dict[str, Any], model_type: str,
                 has_tokenizer: bool, theta: float | None, **math: Any) -> MoEConfig:
    """The MoEConfig of `fields` (ours <- theirs, `defaults` for those a config.json may leave out: theirs -> value,
    "rope_theta" among them) and the family's `math` (router, norms, ...); a value MoEConfig refuses is named by its
    transformers field."""
    values = copied_fields(raw, fields, defaults, fail)
    ids = token_ids(raw, fail)
    try:
        return MoEConfig(
            **values, rope_theta=float(theta if theta is not None else defaults["rope_theta"]),
            norm="rmsnorm", causal=True, task="lm", expert_act="swiglu", router="softmax",
            tokenizer="hf" if has_tokenizer else "none", **math,
            extra={"hf_model_type": model_type, **ids},
        )
    except (ConfigError, TypeError, ValueError) as e:
        msg = str(e)
        for ours, theirs in fields.items():
            msg = msg.replace(f"config field '{ours}'", f"field '{theirs}' (moeserve '{ours}')")
        fail(msg)


# ---- tensors ----------------------------------------------------------------------------------------------------
def import_tensors(layout: Layout, tensors: dict[str, torch.Tensor], config: MoEConfig, origin: dict[str, Path],
                   where: Path, dtype: torch.dtype | None = None, experts: bool = True) -> dict[str, torch.Tensor]:
    """A family's tensors -> the Transformer's state_dict names and [E, out, in] expert stacks.

    Two expert layouts are read: per expert `{moe}.experts.{e}.<w1|w2|w3 as the layout names them>.weight` (what
    save_pretrained writes by default), and fused `experts.gate_up_proj` [E, 2F, D] (gate rows first) +
    `experts.down_proj` [E, D, F] (transformers 5's modules, saved with save_original_format=False). `tensors` is
    consumed: each expert's matrices are freed once stacked. RoPE is rotate-half, so q and k need no permutation.

    w1 and w3 come back as the two halves of one [E, 2F, D] tensor, the layout inference runs on
    (backends/experts.fuse_expert_weights takes it without a copy); every tensor is in `dtype` (None: as stored),
    converted while it is copied into its stack rather than after. experts=False: the experts are left out
    (not stacked, not copied): the dense part of an expert-parallel rank, whose own experts come from `expert_slice`.
    A shared expert is dense: every rank holds it."""
    title = layout.title
    src: dict[str, tuple[str, torch.Tensor]] = {}
    for name in list(tensors):
        canon = layout.canonical(name)
        if canon in src:
            raise layout.error(f"{where}: tensors {src[canon][0]!r} and {name!r} are the same {title} weight")
        src[canon] = (name, tensors.pop(name))

    take = taker(src, origin, where, dtype, layout.error, title)

    def stack(m: str, *names: str) -> torch.Tensor:
        """[E, rows, cols]: expert e's matrices `names`, one under the other, copied and converted once."""
        shapes = {"w1": (F, D), "w2": (D, F), "w3": (F, D)}
        parts = [[take(f"{m}experts.{e}.{layout.expert[w]}.weight", *shapes[w], convert=False) for w in names]
                 for e in range(E)]
        first = parts[0][0]
        out = torch.empty(E, sum(shapes[w][0] for w in names), first.shape[1], dtype=dtype or first.dtype,
                          device=first.device)
        if first.is_meta:  # shapes only (describe): nothing to copy, and a meta copy would import torch._dynamo
            return out
        for e, mats in enumerate(parts):
            torch.cat(mats, out=out[e])
        return out

    def dense(theirs: str, ours: str, width: int) -> None:
        """A dense SwiGLU FFN (gate_proj, up_proj, down_proj) of hidden width `width` -> FeedForward's w1, w3, w2."""
        for w, shape in (("w1", (width, D)), ("w3", (width, D)), ("w2", (D, width))):
            out[f"{ours}{w}.weight"] = take(f"{theirs}{GATE_UP_DOWN[w]}.weight", *shape)

    c = config
    D, F, E, Dh = c.d_model, c.d_ff, c.n_experts, c.head_dim
    q, kv = c.n_heads * Dh, c.kv_heads * Dh
    norm_q, norm_k = {"head": (Dh, Dh), "all": (q, kv), None: (0, 0)}[c.qk_norm]
    out = embedding_and_head(take, src, c)
    for i in range(c.n_layers):
        p, m, o = f"model.layers.{i}.", f"model.layers.{i}.{layout.moe}.", f"layers.{i}."
        out[o + "attention_norm.weight"] = take(p + "input_layernorm.weight", D)
        out[o + "ffn_norm.weight"] = take(p + "post_attention_layernorm.weight", D)
        for ours, theirs, shape, bias in (("wq", "q_proj", (q, D), c.qkv_bias), ("wk", "k_proj", (kv, D), c.qkv_bias),
                                          ("wv", "v_proj", (kv, D), c.qkv_bias), ("wo", "o_proj", (D, q), c.o_bias)):
            out[f"{o}attention.{ours}.weight"] = take(f"{p}self_attn.{theirs}.weight", *shape)
            if bias:
                out[f"{o}attention.{ours}.bias"] = take(f"{p}self_attn.{theirs}.bias", shape[0])
        if c.qk_norm is not None:
            out[o + "attention.q_norm.weight"] = take(p + "self_attn.q_norm.weight", norm_q)
            out[o + "attention.k_norm.weight"] = take(p + "self_attn.k_norm.weight", norm_k)
        if i not in c.moe_layer_ids:
            dense(p + "mlp.", o + "ffn.", c.dense_d_ff if c.dense_d_ff is not None else F)
            continue
        out[o + "ffn.router.gate.weight"] = take(m + "gate.weight", E, D)
        if c.shared_d_ff is not None:
            dense(m + "shared_expert.", o + "ffn.shared.", c.shared_d_ff)
        if c.shared_gate:
            out[o + "ffn.shared_gate.weight"] = take(m + "shared_expert_gate.weight", 1, D)
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
    refuse_leftovers([name for name, _ in src.values()], where, layout.error, title)
    return out


def expert_slice(layout: Layout, read: Callable[[str], Any], names: Iterable[str], config: MoEConfig, start: int,
                 stop: int, where: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Experts [start, stop) of every MoE layer of a family's directory, as the Transformer's stacked
    `layers.{i}.ffn.experts.w1|w2|w3` [stop - start, out, in]; `read(name)` is a safetensors slice of a
    tensor in `names`. A fused layout is sliced on its expert axis; per-expert tensors outside the range
    are never read. What an expert-parallel rank holds (runtime/ep_rank.py), so no rank holds every expert."""
    D, F = config.d_model, config.d_ff
    names = {layout.canonical(k): k for k in names}

    def get(canon: str, shape: tuple[int, ...], rows: slice = slice(None)) -> torch.Tensor:
        if canon not in names:
            raise layout.error(f"{where}: {layout.title} tensor {canon!r} missing (expected shape {shape})")
        sl = read(names[canon])
        if tuple(sl.get_shape()) != shape:
            raise layout.error(f"{where}: tensor {names[canon]!r} has shape {tuple(sl.get_shape())}, config.json "
                               f"implies {shape}")
        t = sl[rows]
        return t if dtype is None else t.to(dtype)

    out: dict[str, torch.Tensor] = {}
    for i in config.moe_layer_ids:
        m, o = f"model.layers.{i}.{layout.moe}.experts.", f"layers.{i}.ffn.experts."
        if m + "gate_up_proj" in names:
            gate_up = get(m + "gate_up_proj", (config.n_experts, 2 * F, D), slice(start, stop))
            out[o + "w1"], out[o + "w3"] = gate_up[:, :F], gate_up[:, F:]
            out[o + "w2"] = get(m + "down_proj", (config.n_experts, D, F), slice(start, stop))
            continue
        shapes = {"w1": (F, D), "w2": (D, F), "w3": (F, D)}
        for w, shape in shapes.items():
            out[o + w] = torch.stack([get(f"{m}{e}.{layout.expert[w]}.weight", shape) for e in range(start, stop)])
    return out
