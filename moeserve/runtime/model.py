"""The Transformer: pre-norm blocks of attention and an FFN that is an MoE layer where the config says.

Shape legend: B batch, S sequence (queries), L key/value length, D model dim, H heads, G kv heads,
Dh head dim, V vocabulary, C classes.

Causal (language model) or bidirectional (classifier); RoPE in the Hugging Face "rotate half"
layout, so Mixtral weights load without permutation; multi-head or grouped-query attention; an
optional KV cache for decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moeserve.config import MoEConfig
from moeserve.runtime.calibration import DispatchPlan, default_plan
from moeserve.runtime.experts import FeedForward
from moeserve.runtime.moe import MoEAux, MoELayer
from moeserve.runtime.packing import pack_linears_, pack_weight, packed_linear, unpack_linears_


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


def apply_rope(x_BHSDh: Tensor, cos_SDh: Tensor, sin_SDh: Tensor) -> Tensor:
    """Rotate-half RoPE, computed in the tables' dtype: the model's own dtype (as transformers does), which
    is fp32 under training's autocast, where q and k arrive in bf16."""
    x1, x2 = x_BHSDh.chunk(2, dim=-1)
    return (x_BHSDh * cos_SDh + torch.cat([-x2, x1], dim=-1) * sin_SDh).to(x_BHSDh.dtype)


class KVCache(nn.Module):
    """Keys and values of every position so far, written in place at `input_pos` (gpt-fast style)."""

    def __init__(self, batch: int, max_len: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        super().__init__()
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos_S: Tensor, k_BGSDh: Tensor, v_BGSDh: Tensor) -> tuple[Tensor, Tensor]:
        self.k[:, :, input_pos_S] = k_BGSDh
        self.v[:, :, input_pos_S] = v_BGSDh
        return self.k, self.v


class Attention(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.cache: KVCache | None = None

    def forward(self, x_BSD: Tensor, cos: Tensor, sin: Tensor, input_pos_S: Tensor,
                mask: Tensor | None, is_causal: bool) -> Tensor:
        B, S, _ = x_BSD.shape
        q = self.wq(x_BSD).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x_BSD).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x_BSD).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.cache is not None:
            k, v = self.cache.update(input_pos_S, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal and mask is None,
                                           enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(y.transpose(1, 2).reshape(B, S, -1))


def make_norm(cfg: MoEConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig, layer_id: int):
        super().__init__()
        self.attention_norm = make_norm(cfg)
        self.attention = Attention(cfg)
        self.ffn_norm = make_norm(cfg)
        is_moe = layer_id in cfg.moe_layer_ids
        self.ffn: nn.Module = MoELayer(cfg) if is_moe else FeedForward(cfg.d_model, cfg.d_ff, cfg.expert_act)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor, mask: Tensor | None,
                is_causal: bool, token_mask: Tensor | None = None) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, input_pos, mask, is_causal)
        if isinstance(self.ffn, MoELayer):
            return h + self.ffn(self.ffn_norm(h), token_mask)
        return h + self.ffn(self.ffn_norm(h))


@dataclass
class ModelOutput:
    logits: Tensor  # [B, S, V] for language models, [B, C] for classifiers
    aux: list[MoEAux] = field(default_factory=list)  # one per MoE layer, in layer order


class Transformer(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = make_norm(cfg)
        if cfg.task == "classify":
            self.classifier = nn.Linear(cfg.d_model, cfg.n_classes, bias=True)
        elif not cfg.tie_embeddings:
            self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head_packed: Tensor | None = None  # tied LM head, packed by prepare_inference
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    # ---- parameters -----------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 style: N(0, init_std), with the projections into the residual stream scaled by
        1/sqrt(2 n_layers) so the residual's variance does not grow with depth."""
        std, out_std = self.cfg.init_std, self.cfg.init_std / (2 * self.cfg.n_layers) ** 0.5
        for name, p in self.named_parameters():
            if p.dim() < 2 or "router.expert_embeddings" in name or "quantizer.codebook" in name:
                continue
            is_out = name.endswith(("wo.weight", "w2.weight", "experts.w2"))
            nn.init.normal_(p, mean=0.0, std=out_std if is_out else std)
        if self.cfg.task == "classify":
            nn.init.zeros_(self.classifier.bias)

    @property
    def moe_layers(self) -> list[MoELayer]:
        return [b.ffn for b in self.layers if isinstance(b.ffn, MoELayer)]

    @torch.no_grad()
    def constrain_(self) -> None:
        """Re-impose the constraints the papers keep through training (X-MoE: ||e_i|| = 0.1)."""
        for layer in self.moe_layers:
            if hasattr(layer.router, "constrain_"):
                layer.router.constrain_()

    @torch.no_grad()
    def prepare_inference(self, plan: DispatchPlan | None = None) -> DispatchPlan:
        """Lay out the model for inference as `plan` says (calibration.py; None: the defaults for this
        device and dtype, unmeasured): fused experts and VQ tables in every MoE layer, packed or plain,
        with the plan's dispatch thresholds, and every other linear map packed or plain. Call again after
        changing weights, dtype or device."""
        w = self.tok_embeddings.weight
        plan = plan or default_plan(w.device, w.dtype)
        for layer in self.moe_layers:
            layer.prepare_inference(pack=plan.pack_experts, grouped_mm=plan.grouped_mm, gather_max=plan.gather_max)
        self.head_packed = None
        if plan.pack_dense:
            pack_linears_(self)
            if self.cfg.task == "lm" and self.cfg.tie_embeddings:
                self.head_packed = pack_weight(w)
        else:
            unpack_linears_(self)
        return plan

    # ---- KV cache -------------------------------------------------------------------------
    def setup_cache(self, batch: int, max_len: int | None = None) -> None:
        """A KV cache per layer in the model's dtype, for `batch` rows of up to `max_len` positions."""
        max_len = max_len or self.cfg.max_seq_len
        if max_len > self.cfg.max_seq_len:
            raise ValueError(f"cache length {max_len} exceeds max_seq_len={self.cfg.max_seq_len}")
        dtype, device = self.tok_embeddings.weight.dtype, self.tok_embeddings.weight.device
        for b in self.layers:
            b.attention.cache = KVCache(batch, max_len, self.cfg.kv_heads, self.cfg.head_dim, dtype, device)

    def clear_cache(self) -> None:
        for b in self.layers:
            b.attention.cache = None

    # ---- forward --------------------------------------------------------------------------
    def forward(self, input_ids: Tensor, input_pos: Tensor | None = None,
                attention_mask: Tensor | None = None, position_ids: Tensor | None = None) -> ModelOutput:
        """input_ids [B, S]; input_pos [S]: the positions of these tokens, and with a cache the slots they
        are written to (default 0..S-1); attention_mask [B, L]: 1 for real tokens, 0 for padding (L = S,
        or the cache length); padding is never attended to and never routed to an expert;
        position_ids [B, S]: RoPE positions where they differ per row (a left-padded batch), else input_pos."""
        B, S = input_ids.shape
        if input_pos is None:
            input_pos = torch.arange(S, device=input_ids.device)
        pos = input_pos[None] if position_ids is None else position_ids
        if int(pos.max()) >= self.cfg.max_seq_len or int(input_pos[-1]) >= self.cfg.max_seq_len:
            raise ValueError(f"position {int(max(pos.max(), input_pos[-1]))} is past max_seq_len={self.cfg.max_seq_len}")
        cache = self.layers[0].attention.cache
        L = cache.k.shape[2] if cache is not None else S
        mask = self._mask(input_pos, attention_mask, L, cached=cache is not None)
        token_mask = None
        if attention_mask is not None:
            token_mask = attention_mask.bool() if cache is None else attention_mask.bool()[:, input_pos]
            token_mask = None if bool(token_mask.all()) else token_mask  # one check here, not one per layer
        is_causal = self.cfg.causal and cache is None
        x = self.tok_embeddings(input_ids)
        cos, sin = self.rope_cos[pos][:, None].to(x.dtype), self.rope_sin[pos][:, None].to(x.dtype)  # [B|1, 1, S, Dh]
        for block in self.layers:
            x = block(x, cos, sin, input_pos, mask, is_causal, token_mask)
        x = self.norm(x)
        aux = []
        for layer in self.moe_layers:  # hand the aux over: a layer holding graph tensors would block deepcopy
            aux.append(layer.last_aux)
            layer.last_aux = None
        if self.cfg.task == "classify":
            return ModelOutput(self.classifier(self._pool(x, attention_mask)), aux)
        if self.head_packed is not None and not torch.is_grad_enabled():
            return ModelOutput(packed_linear(x, self.head_packed), aux)
        if self.cfg.tie_embeddings:
            return ModelOutput(F.linear(x, self.tok_embeddings.weight), aux)
        return ModelOutput(self.output(x), aux)

    def _mask(self, input_pos_S: Tensor, attention_mask_BL: Tensor | None, L: int, cached: bool) -> Tensor | None:
        """Boolean [B|1, 1, S, L] mask, or None when SDPA's own causal flag (or nothing) suffices."""
        window = self.cfg.sliding_window if self.cfg.causal else None
        windowed = window is not None and int(input_pos_S[-1]) >= window  # some query cannot see all before it
        if attention_mask_BL is None and not cached and not windowed:
            return None
        k_pos_L = torch.arange(L, device=input_pos_S.device)
        if self.cfg.causal:
            allowed = k_pos_L[None, :] <= input_pos_S[:, None]
            if windowed:  # Mistral / Mixtral: key j is visible from query i when i - window < j <= i
                allowed = allowed & (k_pos_L[None, :] > input_pos_S[:, None] - window)
        else:  # bidirectional: every written position, never the cache's unwritten tail
            allowed = (k_pos_L <= input_pos_S.max())[None, :].expand(input_pos_S.shape[0], L)
        allowed = allowed[None, None]
        if attention_mask_BL is not None:
            if attention_mask_BL.shape[-1] != L:
                raise ValueError(f"attention_mask has length {attention_mask_BL.shape[-1]}, expected {L}")
            allowed = allowed & attention_mask_BL.bool()[:, None, None, :]
            # A padding query that may see nothing would make softmax NaN; let it see itself.
            allowed = allowed | (k_pos_L[None, :] == input_pos_S[:, None])[None, None]
        return allowed

    def _pool(self, x_BSD: Tensor, attention_mask_BS: Tensor | None) -> Tensor:
        if attention_mask_BS is None:
            return x_BSD.mean(dim=1)
        m = attention_mask_BS.to(x_BSD.dtype)[..., None]
        return (x_BSD * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)
