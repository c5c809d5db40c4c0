"""The Transformer: pre-norm blocks of attention and an FFN that is an MoE layer where the config says.

Shape legend: B batch, S sequence (queries), L key/value length, D model dim, H heads, G kv heads,
Dh head dim, V vocabulary, C classes.

Causal (language model) or bidirectional (classifier); RoPE in the Hugging Face "rotate half"
layout, so Mixtral weights load without permutation; multi-head or grouped-query attention; an
optional KV cache for decoding (kv_cache.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from moeserve.config import MoEConfig
from moeserve.runtime.experts import Experts, FeedForward
from moeserve.runtime.kv_cache import CacheRows, StepRows
from moeserve.runtime.moe import MoEAux, MoELayer
from moeserve.runtime.quant import QuantExperts, QuantSpec, quantize_
from moeserve.runtime.quant_fp8 import is_fp8_config, quantize_fp8_

ExpertsFactory = Callable[[int], nn.Module]  # layer id -> that MoE layer's experts (MoELayer's `experts`)
HEAD_ROWS = 128  # rows of logits a scoring call holds at once (Transformer._target_logprobs)
SINK_QUERY_BLOCK = 256  # queries whose attention logits attend_with_sinks holds at once


def yarn_inv_freq(head_dim: int, theta: float, scaling: dict) -> tuple[Tensor, float]:
    """YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models", sec. 3.2-3.4;
    gpt-oss extends its 4k-token training context to 128k with it, model card sec. 2.1): (inv_freq [head_dim / 2]
    in float64, the attention factor). Each frequency is a blend of the original one (extrapolation, for the
    high-frequency dimensions that turn many times within the original context) and the original over `factor`
    (interpolation, for the slow ones), by a linear ramp between the dimensions that turn beta_fast and beta_slow
    times in original_max_position_embeddings tokens. The attention factor, 0.1 ln(factor) + 1 unless given, scales
    cos and sin, so q.k by its square: the paper's temperature sqrt(1/t). transformers' _compute_yarn_parameters,
    term for term (its `truncate`, default true, rounds the ramp's ends outwards; gpt-oss sets it false), in float64."""
    dim, factor = head_dim, float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times in `original` tokens
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extrapolation = 1 - ramp  # 1: the original frequency, 0: interpolated
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def rope_tables(head_dim: int, max_len: int, theta: float, scaling: dict | None = None) -> tuple[Tensor, Tensor]:
    """cos and sin [max_len, head_dim], computed on the host in float64 whatever device the model is
    built on (Transformer.empty builds it on the meta device). scaling: MoEConfig.rope_scaling, None or
    {"rope_type": "yarn", ...} (yarn_inv_freq: the frequencies, and cos and sin times the attention factor)."""
    with torch.device("cpu"):
        if scaling is None:
            inv_freq, attention = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)), 1.0
        elif scaling.get("rope_type") == "yarn":
            inv_freq, attention = yarn_inv_freq(head_dim, theta, scaling)
        else:
            raise ValueError(f"rope_scaling {scaling!r}: only rope_type 'yarn' is implemented")
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * attention).float(), (emb.sin() * attention).float()


def apply_rope(x_BHSDh: Tensor, cos_SDh: Tensor, sin_SDh: Tensor) -> Tensor:
    """Rotate-half RoPE, computed in the tables' dtype: the model's own dtype (as transformers does), which
    is fp32 under training's autocast, where q and k arrive in bf16."""
    x1, x2 = x_BHSDh.chunk(2, dim=-1)
    return (x_BHSDh * cos_SDh + torch.cat([-x2, x1], dim=-1) * sin_SDh).to(x_BHSDh.dtype)


def attend_with_sinks(q_BHSDh: Tensor, k_BGLDh: Tensor, v_BGLDh: Tensor, sinks_H: Tensor, mask: Tensor | None,
                      is_causal: bool, block: int = SINK_QUERY_BLOCK) -> Tensor:
    """Softmax attention with a learned sink logit per head (gpt-oss; OpenAI, gpt-oss model card, 2025, sec. 2.1:
    "each attention head has a learned bias in the denominator of the softmax", after Xiao et al. 2023's attention
    sinks): p_ij = exp(s_ij) / (exp(sink_h) + sum_j' exp(s_ij')), y_i = sum_j p_ij v_j. The sink takes a share of
    the probability and gives no value, so a head may attend to nothing. -> [B, H, S, Dh].

    Computed as the equation, not by SDPA: SDPA does not return its normaliser, and the exact SDPA form (an extra
    key and value of zeros whose additive float mask entry is the sink) copies the whole cache per layer and step
    to append that column and builds a float [B, H, S, L + 1] mask. Measured on one CPU thread at gpt-oss-20b's
    heads (H 64, G 8, Dh 64), fp32: a decode step over 512 keys at batch 8, 5.5 ms here against 10.2 ms; over
    2,048 keys at batch 1, 1.7 against 6.7 ms; a 256-token prompt, 46 against 37 ms (tests/test_hf_gpt_oss.py holds
    the two equal). mask: bool [B|1, 1, S, L] (True = visible) or None (is_causal: the last S of L positions, causal).
    Queries go `block` at a time: the float32 logits of a block are [B, H, block, L], not [B, H, S, L] (64 heads of an
    8k-token prompt would hold 17 GB at once)."""
    B, H, S, Dh = q_BHSDh.shape
    G, L = k_BGLDh.shape[1], k_BGLDh.shape[2]
    if S > block:
        if mask is None and is_causal:  # query i (position L - S + i) sees keys up to its own position
            mask = torch.arange(L, device=q_BHSDh.device)[None, :] <= \
                torch.arange(L - S, L, device=q_BHSDh.device)[:, None]
        return torch.cat([attend_with_sinks(q_BHSDh[:, :, a:a + block], k_BGLDh, v_BGLDh, sinks_H,
                                            None if mask is None else mask[..., a:a + block, :], False, block)
                          for a in range(0, S, block)], dim=2)
    q_BGNDh = q_BHSDh.reshape(B, G, H // G * S, Dh)  # head h reads kv head h // (H / G), as SDPA's enable_gqa
    s_BHSL = (q_BGNDh @ k_BGLDh.transpose(-1, -2)).view(B, H, S, L).float() * Dh**-0.5
    if mask is None and is_causal:
        mask = torch.ones(S, L, dtype=torch.bool, device=s_BHSL.device).tril(L - S)
    if mask is not None:
        s_BHSL = s_BHSL.masked_fill(~mask, float("-inf"))
    sink_BHS1 = sinks_H.float().view(1, H, 1, 1).expand(B, H, S, 1)
    p_BHSL = torch.cat([s_BHSL, sink_BHS1], dim=-1).softmax(dim=-1)[..., :L]
    y_BGNDh = p_BHSL.to(v_BGLDh.dtype).reshape(B, G, H // G * S, L) @ v_BGLDh
    return y_BGNDh.view(B, H, S, Dh)


class Attention(nn.Module):
    """Multi-head or grouped-query attention with RoPE. What the Hugging Face families add is off unless the config
    turns it on: biases (Qwen2-MoE's q, k, v; gpt-oss's all four maps), a head width of its own (d_head), RMSNorm
    of q and k before RoPE (QK-norm: per head as Qwen3 does, or over the whole projection as OLMoE does), a
    sliding window per layer (gpt-oss alternates windowed and full layers) and a sink logit per head (gpt-oss)."""

    def __init__(self, cfg: MoEConfig, layer_id: int = 0):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.causal, self.window = cfg.causal, cfg.window_of(layer_id)
        q, kv = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, q, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.d_model, kv, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.d_model, kv, bias=cfg.qkv_bias)
        self.wo = nn.Linear(q, cfg.d_model, bias=cfg.o_bias)
        # gpt-oss: a learned logit per head in each softmax's denominator (attend_with_sinks); zero-initialised
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads)) if cfg.attention_sinks else None
        # QK-norm keeps the attention logits from growing with the weights' norms (OLMoE, Qwen3): "head" normalises
        # each head's Dh values, "all" a token's whole q (and k) projection before it is split into heads.
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm is not None:
            width_q, width_k = (cfg.head_dim, cfg.head_dim) if cfg.qk_norm == "head" else (q, kv)
            self.q_norm = nn.RMSNorm(width_q, eps=cfg.norm_eps)
            self.k_norm = nn.RMSNorm(width_k, eps=cfg.norm_eps)

    def _project(self, x_BSD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, S, H, Dh], k and v [B, S, G, Dh], QK-normed where the config says, before RoPE."""
        B, S, _ = x_BSD.shape
        q, k, v = self.wq(x_BSD), self.wk(x_BSD), self.wv(x_BSD)
        if self.qk_norm == "all":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, S, self.n_heads, self.head_dim)
        k = k.view(B, S, self.n_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v.view(B, S, self.n_kv_heads, self.head_dim)

    def forward(self, x_BSD: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, is_causal: bool,
                cache: CacheRows | StepRows | None = None) -> Tensor:
        B, S, _ = x_BSD.shape
        q, k, v = self._project(x_BSD)
        if isinstance(cache, StepRows):  # [1, T] tokens of rows of any lengths: each part attends as it would alone
            ys = []
            for p in cache.parts:
                n, R = p.tokens.stop - p.tokens.start, p.rows.positions.shape[0]
                qp, kp, vp = (t[0, p.tokens].view(R, n // R, *t.shape[2:]) for t in (q, k, v))
                ys.append(self._attend(qp, kp, vp, p.cos, p.sin, p.masks[self.window], False, p.rows)
                          .reshape(1, n, -1))
            return self.wo(torch.cat(ys, dim=1) if len(ys) > 1 else ys[0])
        return self.wo(self._attend(q, k, v, cos, sin, mask, is_causal, cache).reshape(B, S, -1))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                is_causal: bool, cache: CacheRows | None) -> Tensor:
        """q [B, S, H, Dh], k and v [B, S, G, Dh], before RoPE -> the heads' outputs [B, S, H * Dh]."""
        B, S = q.shape[:2]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_id, k, v)
        if self.sinks is not None:  # gpt-oss: not SDPA's softmax
            return attend_with_sinks(q, k, v, self.sinks, mask, is_causal).transpose(1, 2).reshape(B, S, -1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal and mask is None,
                                           enable_gqa=self.n_kv_heads != self.n_heads)
        return y.transpose(1, 2).reshape(B, S, -1)


def make_norm(cfg: MoEConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig, layer_id: int, experts_factory: ExpertsFactory | None = None):
        super().__init__()
        self.attention_norm = make_norm(cfg)
        self.attention = Attention(cfg, layer_id)
        self.ffn_norm = make_norm(cfg)
        is_moe = layer_id in cfg.moe_layer_ids
        if is_moe:
            self.ffn: nn.Module = MoELayer(cfg, experts_factory(layer_id) if experts_factory is not None else None)
        else:  # Qwen's dense layers are wider than its experts (intermediate_size vs moe_intermediate_size)
            self.ffn = FeedForward(cfg.d_model, cfg.dense_d_ff if cfg.dense_d_ff is not None else cfg.d_ff,
                                   cfg.expert_act)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, is_causal: bool,
                token_mask: Tensor | None = None,
                cache: CacheRows | StepRows | None = None) -> tuple[Tensor, MoEAux | None]:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, is_causal, cache)
        hn = self.ffn_norm(h)
        if isinstance(self.ffn, MoELayer):
            y, aux = self.ffn(hn, token_mask)
            return h + y, aux
        return h + self.ffn(hn), None


class TiedHead(nn.Module):
    """The LM head of a model whose head is its embedding's transpose: logits = x E^T. It holds no parameter of
    its own (the state_dict has none: the embedding's is the one), only the embedding module it reads, so a
    backend lays it out as it lays out an nn.Linear (`weight` is the embedding's)."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.__dict__["embedding"] = embedding  # not a child: its parameter is registered once, by the model

    @property
    def weight(self) -> Tensor:
        return self.embedding.weight

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


@dataclass
class ModelOutput:
    logits: Tensor  # [B, S, V] for language models, [B, C] for classifiers
    aux: list[MoEAux] = field(default_factory=list)  # one per MoE layer, in layer order
    graph: bool = False  # a compiled step's replay (backends/compiled.py): moeserve_decode_tokens_total{path="graph"}


class _SkipInit(TorchFunctionMode):
    """torch.nn.init's functions return their tensor untouched. On the meta device they would compute
    nothing anyway, but their decompositions import torch._dynamo, seconds of a start-up."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


class Transformer(nn.Module):
    def __init__(self, cfg: MoEConfig, experts_factory: ExpertsFactory | None = None):
        """experts_factory(layer_id): the experts module of each MoE layer, where they are not the layer's
        own (MoELayer); its weights are then the factory's to load."""
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i, experts_factory) for i in range(cfg.n_layers))
        # the layers' distinct sliding windows (None: the whole context): a call builds one mask for each
        self.windows = list(dict.fromkeys(cfg.window_of(i) for i in range(cfg.n_layers)))
        self.norm = make_norm(cfg)
        if cfg.task == "classify":
            self.classifier = nn.Linear(cfg.d_model, cfg.n_classes, bias=True)
        elif cfg.tie_embeddings:
            self.output: nn.Module = TiedHead(self.tok_embeddings)
        else:
            self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()
        if is_fp8_config(cfg.quantization):  # a quantized model's config: its tensors are assigned by the loader
            quantize_fp8_(self, weights=False)
        elif cfg.quantization is not None:
            quantize_(self, QuantSpec.from_dict(cfg.quantization), weights=False)

    @classmethod
    def empty(cls, cfg: MoEConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
              experts_factory: ExpertsFactory | None = None) -> "Transformer":
        """A model whose weights a checkpoint will assign (loading.py): they are neither allocated nor
        initialised here (a random initialisation the checkpoint then overwrites would be most of a large model's
        load); only the RoPE tables, which no checkpoint holds, are computed."""
        with torch.device("meta"), _SkipInit():
            model = cls(cfg, experts_factory)
        model.rope_cos, model.rope_sin = model.rope_cos.to(device, dtype), model.rope_sin.to(device, dtype)
        return model

    # ---- parameters -----------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 style: N(0, init_std), with the projections into the residual stream scaled by
        1/sqrt(2 n_layers) so the residual's variance does not grow with depth."""
        std, out_std = self.cfg.init_std, self.cfg.init_std / (2 * self.cfg.n_layers) ** 0.5
        foreign = {id(p) for layer in self.moe_layers if not isinstance(layer.experts, Experts)
                   for p in layer.experts.parameters()}  # an experts_factory's weights are the factory's
        for name, p in self.named_parameters():
            if p.dim() < 2 or "router.expert_embeddings" in name or "quantizer.codebook" in name or id(p) in foreign:
                continue
            is_out = name.endswith(("wo.weight", "w2.weight", "experts.w2"))
            nn.init.normal_(p, mean=0.0, std=out_std if is_out else std)
        if self.cfg.task == "classify":
            nn.init.zeros_(self.classifier.bias)

    def quantizable(self) -> list[tuple[nn.Module, str]]:
        """(parent, attribute) of every module a weight-only quantization replaces (runtime/quant.py): attention's and
        the dense FFNs' linear maps (a shared expert's too), each MoE layer's own experts and the LM head. The
        embedding, norms, routers (a shared expert's gate, [1, D], is one), VQ codebooks, a classifier and any map with
        a bias stay in full precision."""
        out: list[tuple[nn.Module, str]] = []

        def dense(ffn: FeedForward) -> list[tuple[nn.Module, str]]:
            return [(ffn, n) for n in ("w1", "w2", "w3") if getattr(ffn, n) is not None]

        for block in self.layers:  # a map with a bias stays in float: the quantized forms have none
            out += [(block.attention, n) for n in ("wq", "wk", "wv", "wo")
                    if getattr(getattr(block.attention, n), "bias", None) is None]
            if isinstance(block.ffn, FeedForward):
                out += dense(block.ffn)
                continue
            if type(block.ffn.experts) in (Experts, QuantExperts):  # its own, not an experts_factory's
                out.append((block.ffn, "experts"))
            if block.ffn.shared is not None:
                out += dense(block.ffn.shared)
        if self.cfg.task == "lm":
            out.append((self, "output"))
        return out

    @property
    def moe_layers(self) -> list[MoELayer]:
        return [b.ffn for b in self.layers if isinstance(b.ffn, MoELayer)]

    @torch.no_grad()
    def constrain_(self) -> None:
        """Re-impose the constraints the papers keep through training (X-MoE: ||e_i|| = 0.1)."""
        for layer in self.moe_layers:
            if hasattr(layer.router, "constrain_"):
                layer.router.constrain_()

    # ---- forward --------------------------------------------------------------------------
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                cache: CacheRows | StepRows | None = None, last_only: bool = False,
                targets: Tensor | None = None) -> ModelOutput:
        """input_ids [B, S]. Without a cache: positions 0..S-1, and attention_mask [B, S] (1 real, 0 padding;
        padding is never attended to and never routed to an expert). With one: the tokens sit at
        `cache.positions` of their slots and attend to everything their sequence wrote before them.
        Pure: the logits and each MoE layer's aux come back; nothing is left in the modules, and
        nothing here waits for the device (with a cache the host has said where every row is).
        last_only: logits of each row's last token only, [B, 1, V] (a prefill needs no more).
        With StepRows (rows of any lengths, KVCache.step_rows): input_ids [1, T], the rows' tokens end to end in
        `cache.order`, and the logits of each row's last token come back, [R, 1, V] in the rows' order.
        targets [B, T], T <= S (a language model, no cache; nanoGPT's way): `logits` is then log p(targets[b, t] |
        input_ids[b, :t + 1]), [B, T] float32, from the head run a few rows at a time (_target_logprobs)."""
        B, S = input_ids.shape
        x = self.tok_embeddings(input_ids)
        token_mask = None
        cos = sin = None
        masks: dict[int | None, Tensor | None] = dict.fromkeys(self.windows)
        if isinstance(cache, StepRows):
            if attention_mask is not None or (B, S) != (1, cache.n_tokens):
                raise ValueError(f"these rows take their {cache.n_tokens} tokens as one row [1, {cache.n_tokens}] and "
                                 f"no attention mask, not {list(input_ids.shape)}")
            for p in cache.parts:
                p.cos, p.sin, p.masks = self._rope_and_masks(p.rows, x.dtype)
        elif cache is None:
            if S > self.cfg.max_seq_len:
                raise ValueError(f"{S} tokens are past max_seq_len={self.cfg.max_seq_len}")
            masks = {w: self._mask(S, attention_mask, w) for w in self.windows}
            if attention_mask is not None:
                token_mask = attention_mask.bool()
                token_mask = None if bool(token_mask.all()) else token_mask  # one check here, not one per layer
            cos, sin = self.rope_cos[:S].to(x.dtype), self.rope_sin[:S].to(x.dtype)  # [S, Dh]
        else:
            if attention_mask is not None:
                raise ValueError("a cached call takes no attention mask: its rows have no padding")
            cos, sin, masks = self._rope_and_masks(cache, x.dtype)
        is_causal = self.cfg.causal and cache is None
        aux = []
        for block in self.layers:
            x, a = block(x, cos, sin, masks[block.attention.window], is_causal, token_mask, cache)
            if a is not None:
                aux.append(a)
        if isinstance(cache, StepRows):
            x = x[0, cache.last][:, None]
        elif last_only:
            x = x[:, -1:]
        x = self.norm(x)
        if self.cfg.task == "classify":
            return ModelOutput(self.classifier(self._pool(x, attention_mask)), aux)
        if targets is not None:
            return ModelOutput(self._target_logprobs(x[:, :targets.shape[1]], targets), aux)
        return ModelOutput(self.output(x), aux)

    def _target_logprobs(self, x_BTD: Tensor, targets_BT: Tensor) -> Tensor:
        """log p(targets) [B, T] float32: the head and log-softmax over HEAD_ROWS rows at a time. Whole, a batch of
        16,384 tokens of a 32,000-token vocabulary holds 2.1 GB of logits and as much again of their log-softmax,
        allocated afresh (and page-faulted in) by every batch; a chunk's 16 MB stays in the allocator's reach.
        Each row's numbers are those of the whole batch's log_softmax: the chunks only split the rows."""
        B, T, D = x_BTD.shape
        x_ND, t_N = x_BTD.reshape(-1, D), targets_BT.reshape(-1, 1)
        out = torch.empty(B * T, dtype=torch.float32, device=x_BTD.device)
        for a in range(0, B * T, HEAD_ROWS):
            logp = torch.log_softmax(self.output(x_ND[a:a + HEAD_ROWS]).float(), dim=-1)
            out[a:a + HEAD_ROWS] = logp.gather(-1, t_N[a:a + HEAD_ROWS])[:, 0]
        return out.view(B, T)

    def _mask(self, S: int, attention_mask_BS: Tensor | None, window: int | None) -> Tensor | None:
        """Boolean [B|1, 1, S, S] mask of an uncached call through layers of sliding window `window`, or None when
        SDPA's causal flag (or nothing) suffices."""
        window = window if self.cfg.causal else None
        windowed = window is not None and S > window  # some query cannot see all before it
        if attention_mask_BS is None and not windowed:
            return None
        pos = torch.arange(S, device=self.rope_cos.device)
        allowed = torch.ones(S, S, dtype=torch.bool, device=pos.device)
        if self.cfg.causal:
            allowed = pos[None, :] <= pos[:, None]
            if windowed:  # Mistral / Mixtral: key j is visible from query i when i - window < j <= i
                allowed = allowed & (pos[None, :] > pos[:, None] - window)
        allowed = allowed[None, None]
        if attention_mask_BS is not None:
            if attention_mask_BS.shape[-1] != S:
                raise ValueError(f"attention_mask has length {attention_mask_BS.shape[-1]}, expected {S}")
            allowed = allowed & attention_mask_BS.bool()[:, None, None, :]
            # A padding query that may see nothing would make softmax NaN; let it see itself.
            allowed = allowed | torch.eye(S, dtype=torch.bool, device=pos.device)[None, None]
        return allowed

    def _rope_and_masks(self, cache: CacheRows, dtype: torch.dtype) -> tuple[Tensor, Tensor, dict[int | None, Tensor]]:
        """cos and sin [B, 1, S, Dh] at the rows' positions, and their mask for each of the layers' windows."""
        pos = cache.positions
        return (self.rope_cos[pos][:, None].to(dtype), self.rope_sin[pos][:, None].to(dtype),
                {w: self._cache_mask(cache, w) for w in self.windows})

    def _cache_mask(self, cache: CacheRows, window: int | None) -> Tensor:
        """[B, 1, S, L]: a query sees its sequence's keys up to its own position (causal, within the sliding
        window `window`), or every key its sequence wrote (bidirectional); never a key of an earlier owner of the
        slot."""
        q_BS1 = cache.positions[:, :, None]
        k_1L = torch.arange(cache.length, device=q_BS1.device)[None, None, :]
        if self.cfg.causal:
            allowed = k_1L <= q_BS1
            if window is not None:
                allowed = allowed & (k_1L > q_BS1 - window)
        else:
            last_B11 = cache.positions.amax(dim=1)[:, None, None]
            allowed = (k_1L <= last_B11).expand(-1, q_BS1.shape[1], -1)
        return allowed[:, None]

    def _pool(self, x_BSD: Tensor, attention_mask_BS: Tensor | None) -> Tensor:
        if attention_mask_BS is None:
            return x_BSD.mean(dim=1)
        m = attention_mask_BS.to(x_BSD.dtype)[..., None]
        return (x_BSD * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)
