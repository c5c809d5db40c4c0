"""MoEConfig: the one description of a model's architecture and routing.

Every field is validated once, on construction, and a bad value raises `ConfigError` naming the
field, the value and what is allowed, so a typo in a checkpoint's config.json or a command-line
flag never surfaces later as a shape error deep inside a forward pass.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from moeserve.errors import UserError

FORMAT = "moeserve/1"
MANIFEST_FILE = "moeserve.json"  # a checkpoint directory's file list, hashes and training metrics

ROUTERS = ("softmax", "sigmoid", "xmoe", "vq")
GATES = ("softmax", "sigmoid")
EXPERT_ACTS = ("gelu", "swiglu", "clamped_swiglu")
NORMS = ("rmsnorm", "layernorm")
TASKS = ("lm", "classify")
VQ_MODES = ("mixed", "discrete")
VQ_INPUTS = ("code", "blend")
VQ_DISTANCES = ("l2", "cosine")
TOKENIZERS = ("byte", "hf", "none")


def _quantization_ok(q: Any) -> bool:
    """int8 per output channel (no group), or int4 in groups of a multiple of 32, optionally with lists of weights
    kept at int8 and int6 (runtime/quant.QuantSpec, which checks the names); or fp8 (runtime/quant_fp8.py), a GPU
    format quantized at load."""
    if q == {"format": "fp8"}:
        return True
    if not isinstance(q, dict) or not {"bits", "group"} <= set(q) <= {"bits", "group", "int8", "int6"} \
            or isinstance(q["bits"], bool):
        return False
    group, kept = q["group"], [q.get("int8"), q.get("int6")]
    if q["bits"] == 8:
        return group is None and kept == [None, None]
    return (q["bits"] == 4 and not isinstance(group, bool) and isinstance(group, int) and group >= 32
            and group % 32 == 0
            and all(k is None or isinstance(k, list) and all(isinstance(n, str) for n in k) for k in kept))


def describe_quantization(q: dict | None) -> str:
    """A config's `quantization` in words: float, fp8, int8, int4 (group 32), or int4 (group 32; wk, wv at int8;
    output at int6). Here rather than in runtime/quant.py so that `moeserve inspect` (checkpoint.py) can say it
    without importing the runtime."""
    if q is None:
        return "float"
    if q == {"format": "fp8"}:
        return "fp8"
    inner = [f"group {q['group']}"] if q.get("group") else []
    inner += [f"{', '.join(q[kept])} at {kept}" for kept in ("int8", "int6") if q.get(kept)]
    return f"int{q['bits']}" + (f" ({'; '.join(inner)})" if inner else "")


class ConfigError(UserError):
    """A config field holds a value outside what the model family allows."""


@dataclass
class MoEConfig:
    # --- Transformer trunk ---
    vocab_size: int = 259  # 256 bytes + <bos>, <eos>, <pad> for the byte tokenizer
    d_model: int = 256  # residual width D; cost grows with D^2 per token
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None  # None = n_heads (multi-head); fewer = grouped-query, smaller KV cache
    max_seq_len: int = 256  # longest context; sizes the RoPE table and the KV cache
    rope_theta: float = 10000.0
    sliding_window: int | None = None  # attend to at most this many latest positions (Mixtral); None = all
    norm: str = "rmsnorm"  # rmsnorm (Mixtral) or layernorm (BERT-style encoders of the X-MoE paper)
    norm_eps: float = 1e-5
    causal: bool = True  # False: bidirectional attention, for classifiers
    tie_embeddings: bool = True  # share input embedding and LM head: fewer parameters, small models train faster
    init_std: float = 0.02
    task: str = "lm"  # lm: next-token head; classify: mean-pooled class head
    n_classes: int = 0  # classify only
    labels: list[str] | None = None  # classify: each class's name, by id (moeserve finetune writes them)
    tokenizer: str = "byte"  # byte (built in), hf (tokenizer.json in the checkpoint), none (token ids only)

    # --- MoE layers ---
    moe_layers: list[int] | None = None  # indices of layers whose FFN is an MoE; None = every layer
    n_experts: int = 8  # E: more experts = more parameters at the same per-token compute
    top_k: int = 2  # K experts per token; per-token FFN compute grows linearly in K
    d_ff: int = 512  # F: hidden width of each expert (and of the dense FFN of non-MoE layers)
    expert_act: str = "swiglu"  # gelu: two matrices; swiglu: three (gate, up, down) as Mixtral
    router: str = "softmax"  # softmax | sigmoid | xmoe | vq
    renormalize: bool = False  # softmax: rescale the K chosen gates to sum to 1 (Mixtral does)
    capacity_factor: float | None = None  # None = dropless; else each expert takes ceil(cf*T*K/E) tokens

    # --- X-MoE (paper 000/001, section 3.1) ---
    xmoe_dim: int | None = None  # d_e; None = max(2, E // 2) as in the paper
    xmoe_gate: str = "softmax"  # gate of eq. 7
    xmoe_tau_init: float | None = None  # None = 0.3 (softmax) / 0.07 (sigmoid), the paper's values
    xmoe_expert_norm: float = 0.1  # L2 norm the expert embeddings are initialised with and kept at

    # --- Balance loss (X-MoE eq. 8-9, Switch) ---
    balance_alpha: float = 1e-2  # weight of L_bal in the training loss
    balance_tau: float | None = None  # tau_0; None = the router's initial tau (1.0 for plain routers)

    # --- VQMoE (paper 002, section 3.2-3.3) ---
    vq_mode: str = "mixed"  # mixed (pre-training, eq. 4) or discrete (fine-tuning/serving, eq. 5)
    vq_input: str = "code"  # code: x~ = v_k (foldable to a table); blend: authors' code, not foldable
    vq_blend_rate: float = 0.05  # c in x~ = (1 - 2c) x + c v_k
    vq_dim: int | None = None  # d_c; None = d_model (no projection)
    vq_distance: str = "l2"  # l2 or cosine nearest-code search
    vq_beta: float = 0.25  # commitment weight (VQ-VAE)
    vq_alpha: float = 0.1  # weight of the VQ loss; the paper sweeps (0.05, 0.15)

    # --- Weight-only quantization (runtime/quant.py) ---
    # {"bits": 8, "group": null}, {"bits": 4, "group": 32[, "int8": ["wk", "wv"], "int6": ["output"]]} or
    # {"format": "fp8"};
    # null = float
    quantization: dict[str, Any] | None = None

    # --- What the Hugging Face MoE families add (hf_*.py); all off for moeserve's own models ---
    d_head: int | None = None  # width of a head; None = d_model / n_heads (Qwen3-MoE and gpt-oss set their own)
    qkv_bias: bool = False  # biases on q, k and v (Qwen2-MoE, gpt-oss)
    o_bias: bool = False  # a bias on attention's output map (gpt-oss)
    qk_norm: str | None = None  # RMSNorm of q and k before RoPE: "head" (per head, Qwen3-MoE) or "all" (OLMoE)
    attention_sinks: bool = False  # a learned logit per head joins each softmax's denominator (gpt-oss)
    layer_windows: list[int | None] | None = None  # a sliding window per layer (gpt-oss); None = sliding_window
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "yarn", ...} (gpt-oss); None = plain RoPE
    dense_d_ff: int | None = None  # hidden width of the dense (non-MoE) FFN layers; None = d_ff (Qwen2/3-MoE differ)
    shared_d_ff: int | None = None  # a shared expert of this hidden width beside the routed ones (Qwen2-MoE)
    shared_gate: bool = False  # the shared expert's output scaled by sigmoid(w . x) (Qwen2-MoE)
    router_bias: bool = False  # a bias on the router's logits (gpt-oss)
    expert_bias: bool = False  # biases in the experts' linear maps (gpt-oss)
    swiglu_limit: float = 7.0  # clamped_swiglu (gpt-oss): gate clamped to <= limit, up to [-limit, limit]
    swiglu_alpha: float = 1.702  # clamped_swiglu: gate * sigmoid(alpha * gate)

    extra: dict[str, Any] = field(default_factory=dict)  # free-form provenance (e.g. HF model_type)

    def __post_init__(self) -> None:
        self.validate()

    # ---- derived values -------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.d_head if self.d_head is not None else self.d_model // self.n_heads

    @property
    def extensions(self) -> list[str]:
        """The fields of the Hugging Face families' additions that this config turns on, by name: what a backend,
        an export or a quantizer that lacks one of them names when it refuses the model (and [] for every model
        moeserve trains)."""
        defaults = MoEConfig.__dataclass_fields__
        names = ("d_head", "qkv_bias", "o_bias", "qk_norm", "attention_sinks", "layer_windows", "rope_scaling",
                 "dense_d_ff", "shared_d_ff", "shared_gate", "router_bias", "expert_bias")
        on = [n for n in names if getattr(self, n) != defaults[n].default
              and not (n == "d_head" and self.d_head * self.n_heads == self.d_model)]
        return on + ["clamped_swiglu"] * (self.expert_act == "clamped_swiglu")

    def window_of(self, layer_id: int) -> int | None:
        """Layer `layer_id`'s sliding window (None: it attends to the whole context)."""
        return self.layer_windows[layer_id] if self.layer_windows is not None else self.sliding_window

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def moe_layer_ids(self) -> list[int]:
        return list(range(self.n_layers)) if self.moe_layers is None else sorted(self.moe_layers)

    @property
    def router_dim(self) -> int:
        """d_e of X-MoE: the paper's N/2, never below 2 so cosines are not all +-1."""
        return self.xmoe_dim if self.xmoe_dim is not None else max(2, self.n_experts // 2)

    @property
    def tau_init(self) -> float:
        """Initial gating temperature: the paper's 0.3 (softmax) / 0.07 (sigmoid) for X-MoE."""
        if self.router != "xmoe":
            return 1.0
        if self.xmoe_tau_init is not None:
            return self.xmoe_tau_init
        return 0.3 if self.xmoe_gate == "softmax" else 0.07

    @property
    def tau0(self) -> float:
        return self.balance_tau if self.balance_tau is not None else self.tau_init

    @property
    def code_dim(self) -> int:
        return self.vq_dim if self.vq_dim is not None else self.d_model

    @property
    def experts_per_token(self) -> int:
        """Experts that run for one token: K, or 1 for the discrete VQ layer."""
        return 1 if (self.router == "vq" and self.vq_mode == "discrete") else self.top_k

    # ---- validation -----------------------------------------------------------------------
    def validate(self) -> None:
        def fail(name: str, value: Any, expected: str) -> None:
            raise ConfigError(f"config field '{name}' = {value!r}: expected {expected}")

        def positive_int(name: str) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                fail(name, v, "a positive integer")

        def positive_float(name: str, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                fail(name, v, "a positive finite number" + (" or null" if allow_none else ""))

        def choice(name: str, options: tuple[str, ...]) -> None:
            v = getattr(self, name)
            if v not in options:
                fail(name, v, "one of " + ", ".join(repr(o) for o in options))

        def boolean(name: str) -> None:
            if not isinstance(getattr(self, name), bool):
                fail(name, getattr(self, name), "true or false")

        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "n_experts", "top_k", "d_ff"):
            positive_int(name)
        for name in ("rope_theta", "norm_eps", "init_std", "xmoe_expert_norm", "vq_beta"):
            positive_float(name)
        if self.sliding_window is not None:
            positive_int("sliding_window")
        for name in ("capacity_factor", "xmoe_tau_init", "balance_tau"):
            positive_float(name, allow_none=True)
        for name in ("balance_alpha", "vq_alpha"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                fail(name, v, "a finite number >= 0")
        for name, options in (
            ("router", ROUTERS), ("xmoe_gate", GATES), ("expert_act", EXPERT_ACTS), ("norm", NORMS),
            ("task", TASKS), ("vq_mode", VQ_MODES), ("vq_input", VQ_INPUTS),
            ("vq_distance", VQ_DISTANCES), ("tokenizer", TOKENIZERS),
        ):
            choice(name, options)
        for name in ("causal", "tie_embeddings", "renormalize", "qkv_bias", "o_bias", "attention_sinks", "shared_gate",
                     "router_bias", "expert_bias"):
            boolean(name)
        for name in ("d_head", "dense_d_ff", "shared_d_ff"):
            if getattr(self, name) is not None:
                positive_int(name)
        for name in ("swiglu_limit", "swiglu_alpha"):
            positive_float(name)
        if self.qk_norm not in (None, "head", "all"):
            fail("qk_norm", self.qk_norm, "'head', 'all' or null")
        if self.shared_gate and self.shared_d_ff is None:
            fail("shared_gate", self.shared_gate, "false where there is no shared expert (shared_d_ff null)")
        if self.layer_windows is not None and (
                not isinstance(self.layer_windows, list) or len(self.layer_windows) != self.n_layers
                or any(w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0)
                       for w in self.layer_windows)):
            fail("layer_windows", self.layer_windows, f"a list of n_layers={self.n_layers} windows (positive "
                 f"integers, or null for a layer that sees the whole context)")
        rs = self.rope_scaling
        if rs is not None and not (  # what runtime/model.yarn_inv_freq reads
                isinstance(rs, dict) and rs.get("rope_type") == "yarn"
                and not isinstance(rs.get("factor"), bool) and isinstance(rs.get("factor"), (int, float))
                and rs["factor"] > 0 and not isinstance(rs.get("original_max_position_embeddings"), bool)
                and isinstance(rs.get("original_max_position_embeddings"), int)
                and rs["original_max_position_embeddings"] > 0):
            fail("rope_scaling", rs, 'null or {"rope_type": "yarn", "factor": a positive number, '
                 '"original_max_position_embeddings": a positive integer, ...} (YaRN, the one scaling implemented)')

        if self.d_head is None and self.d_model % self.n_heads:
            fail("n_heads", self.n_heads, f"a divisor of d_model={self.d_model} (or a d_head of its own)")
        if self.head_dim % 2:
            fail("n_heads" if self.d_head is None else "d_head", self.n_heads if self.d_head is None else self.d_head,
                 f"a head size that is even (RoPE), got {self.head_dim}")
        if self.n_kv_heads is not None:
            positive_int("n_kv_heads")
            if self.n_heads % self.n_kv_heads:
                fail("n_kv_heads", self.n_kv_heads, f"a divisor of n_heads={self.n_heads}")
        if self.top_k > self.n_experts:
            fail("top_k", self.top_k, f"at most n_experts={self.n_experts}")
        if self.moe_layers is not None:
            if not isinstance(self.moe_layers, list) or any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_layers for i in self.moe_layers
            ):
                fail("moe_layers", self.moe_layers, f"a list of layer indices in [0, {self.n_layers})")
            if len(set(self.moe_layers)) != len(self.moe_layers):
                fail("moe_layers", self.moe_layers, "distinct layer indices")
        if self.xmoe_dim is not None:
            positive_int("xmoe_dim")
        if self.vq_dim is not None:
            positive_int("vq_dim")
        if isinstance(self.vq_blend_rate, bool) or not isinstance(self.vq_blend_rate, (int, float)) \
                or not 0 <= self.vq_blend_rate <= 0.5:
            fail("vq_blend_rate", self.vq_blend_rate, "a number in [0, 0.5]")
        if self.task == "classify":
            if isinstance(self.n_classes, bool) or not isinstance(self.n_classes, int) or self.n_classes < 2:
                fail("n_classes", self.n_classes, "an integer >= 2 when task is 'classify'")
        if self.labels is not None:
            if (self.task != "classify" or not isinstance(self.labels, list) or len(self.labels) != self.n_classes
                    or not all(isinstance(x, str) for x in self.labels) or len(set(self.labels)) != len(self.labels)):
                fail("labels", self.labels, f"n_classes={self.n_classes} distinct names of a classify model's classes")
        if self.vocab_size < 259 and self.tokenizer == "byte":
            fail("vocab_size", self.vocab_size, "at least 259 for the byte tokenizer (256 bytes + 3 specials)")
        if not isinstance(self.extra, dict):
            fail("extra", self.extra, "a JSON object")
        if self.quantization is not None and not _quantization_ok(self.quantization):
            fail("quantization", self.quantization,
                 '{"bits": 8, "group": null}, {"bits": 4, "group": a multiple of 32[, "int8": [names], "int6": [names]]}, '
                 '{"format": "fp8"}, or null')

    # ---- JSON -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **self.to_dict()}, indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MoEConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"config must be a JSON object, got {type(data).__name__}")
        data = dict(data)
        fmt = data.pop("format", FORMAT)
        if fmt != FORMAT:
            raise ConfigError(f"config field 'format' = {fmt!r}: expected {FORMAT!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> MoEConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config is not valid JSON: {e}") from e
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> MoEConfig:
        return dataclasses.replace(self, **changes)


# Named presets. `tiny` trains in seconds for tests; `small` is the built-in default model, sized so
# that it trains in under five minutes on two CPU cores (see docs/benchmarks.md).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, max_seq_len=64, n_experts=4, top_k=2, d_ff=128),
    "small": dict(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=256, n_experts=8, top_k=2, d_ff=512),
}


def preset(name: str, **overrides: Any) -> MoEConfig:
    """A preset's config with `overrides` applied (e.g. router="xmoe")."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return MoEConfig.from_dict({**PRESETS[name], **overrides})
