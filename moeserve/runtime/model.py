"""The Transformer: pre-norm blocks of attention and an FFN that is an MoE layer where the config says.

Shape legend: B batch, S sequence (queries), L key/value length, D model dim, H heads, G kv heads,
Dh head dim, V vocabulary, C classes.

Causal (language model) or bidirectional (classifier); RoPE in the Hugging Face "rotate half"
layout, so Mixtral weights load without permutation; multi-head or grouped-query attention; an
optional KV cache for decoding (kv_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from moeserve.config import MoEConfig
from moeserve.runtime import cpu_kernel
from moeserve.runtime.backends.calibration import DispatchPlan, default_plan
from moeserve.runtime.cpu_kernel import KernelLinear, KernelRMSNorm
from moeserve.runtime.experts import Experts, FeedForward
from moeserve.runtime.kernel_decode import KernelDecodeBlock, KernelDecodeStep
from moeserve.runtime.kv_cache import CacheRows, KVCache, StepRows
from moeserve.runtime.moe import MoEAux, MoELayer
from moeserve.runtime.backends.packing import PackedLinear, pack_weight, packed_linear, unpack_linears_, wrap_linears_
from moeserve.runtime.routing import Routing

ExpertsFactory = Callable[[int], nn.Module]  # layer id -> that MoE layer's experts (MoELayer's `experts`)
HEAD_ROWS = 128  # rows of logits a scoring call holds at once (Transformer._target_logprobs)


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin [max_len, head_dim], computed on the host in float64 whatever device the model is
    built on (Transformer.empty builds it on the meta device)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float64, device="cpu"), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


def apply_rope(x_BHSDh: Tensor, cos_SDh: Tensor, sin_SDh: Tensor) -> Tensor:
    """Rotate-half RoPE, computed in the tables' dtype: the model's own dtype (as transformers does), which
    is fp32 under training's autocast, where q and k arrive in bf16."""
    x1, x2 = x_BHSDh.chunk(2, dim=-1)
    return (x_BHSDh * cos_SDh + torch.cat([-x2, x1], dim=-1) * sin_SDh).to(x_BHSDh.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: MoEConfig, layer_id: int = 0):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.causal, self.window = cfg.causal, cfg.sliding_window
        self.kernel_decode = False  # a decode step's attention on the C kernel (prepare_inference, plan.kernel_norms)
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x_BSD: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, is_causal: bool,
                cache: CacheRows | StepRows | None = None) -> Tensor:
        B, S, _ = x_BSD.shape
        q = self.wq(x_BSD).view(B, S, self.n_heads, self.head_dim)
        k = self.wk(x_BSD).view(B, S, self.n_kv_heads, self.head_dim)
        v = self.wv(x_BSD).view(B, S, self.n_kv_heads, self.head_dim)
        if isinstance(cache, StepRows):  # [1, T] tokens of rows of any lengths: each part attends as it would alone
            ys = []
            for p in cache.parts:
                n, R = p.tokens.stop - p.tokens.start, p.rows.positions.shape[0]
                qp, kp, vp = (t[0, p.tokens].view(R, n // R, *t.shape[2:]) for t in (q, k, v))
                ys.append(self._attend(qp, kp, vp, p.cos, p.sin, p.mask, False, p.rows).reshape(1, n, -1))
            return self.wo(torch.cat(ys, dim=1) if len(ys) > 1 else ys[0])
        return self.wo(self._attend(q, k, v, cos, sin, mask, is_causal, cache).reshape(B, S, -1))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                is_causal: bool, cache: CacheRows | None) -> Tensor:
        """q [B, S, H, Dh], k and v [B, S, G, Dh], before RoPE -> the heads' outputs [B, S, H * Dh]."""
        B, S = q.shape[:2]
        on_kernel = cache is not None and self.kernel_decode and self.causal and not torch.is_grad_enabled()
        if on_kernel and S == 1:
            # RoPE, the cache write and attention over the slots where they lie, in one call: no gather, no mask
            lo, hi = cache.decode_bounds(self.window)
            y = cpu_kernel.attend_decode(q.view(B, self.n_heads, self.head_dim), cache.cache.k[self.layer_id],
                                         cache.cache.v[self.layer_id], cache.slots, lo, hi, self.head_dim**-0.5,
                                         new_kv=(k.view(B, self.n_kv_heads, self.head_dim),
                                                 v.view(B, self.n_kv_heads, self.head_dim)),
                                         rope=(cos.reshape(B, self.head_dim), sin.reshape(B, self.head_dim)))
            return y.view(B, S, -1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if on_kernel:
            # A prompt's queries each as a decode step's: its tokens' keys written first, then every query over its
            # slot, the same sums as when it decodes, so a prompt's numbers do not depend on how it was chunked
            cache.write(self.layer_id, k, v)
            lo, hi = cache.decode_bounds(self.window)
            y = cpu_kernel.attend_decode(q.transpose(1, 2).reshape(B * S, self.n_heads, self.head_dim),
                                         cache.cache.k[self.layer_id], cache.cache.v[self.layer_id],
                                         cache.slots.repeat_interleave(S), lo, hi, self.head_dim**-0.5)
            return y.view(B, S, -1)
        if cache is not None:
            k, v = cache.update(self.layer_id, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal and mask is None,
                                           enable_gqa=self.n_kv_heads != self.n_heads)
        return y.transpose(1, 2).reshape(B, S, -1)


def make_norm(cfg: MoEConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return KernelRMSNorm(cfg.d_model, eps=cfg.norm_eps)  # nn.RMSNorm, on the C kernel where the plan says
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
        else:
            self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.expert_act)
        self.decode_kernel: KernelDecodeBlock | None = None  # a decode step's attention half in one C call

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, is_causal: bool,
                token_mask: Tensor | None = None,
                cache: CacheRows | StepRows | None = None) -> tuple[Tensor, MoEAux | None]:
        if (self.decode_kernel is not None and isinstance(cache, CacheRows) and x.shape[1] == 1
                and not torch.is_grad_enabled() and x.dtype == self.decode_kernel.dtype):
            h, hn = self._decode_attention(x, cos, sin, cache)
        else:
            h = x + self.attention(self.attention_norm(x), cos, sin, mask, is_causal, cache)
            hn = self.ffn_norm(h)
        if isinstance(self.ffn, MoELayer):
            y, aux = self.ffn(hn, token_mask)
            return h + y, aux
        return h + self.ffn(hn), None

    def _decode_attention(self, x_B1D: Tensor, cos: Tensor, sin: Tensor, cache: CacheRows) -> tuple[Tensor, Tensor]:
        """(h, ffn_norm(h)) of a decode step, h = x + attention(attention_norm(x)), in one call of the C kernel."""
        a, B = self.attention, x_B1D.shape[0]
        lo, hi = cache.decode_bounds(a.window)
        h, hn = self.decode_kernel(x_B1D.view(B, -1), (cos.reshape(B, a.head_dim), sin.reshape(B, a.head_dim)),
                                   cache.cache.k[a.layer_id], cache.cache.v[a.layer_id], cache.slots, lo, hi,
                                   a.head_dim**-0.5)
        return h.view_as(x_B1D), hn.view_as(x_B1D)


@dataclass
class ModelOutput:
    logits: Tensor  # [B, S, V] for language models, [B, C] for classifiers
    aux: list[MoEAux] = field(default_factory=list)  # one per MoE layer, in layer order
    graph: bool = False  # a compiled decode step's (runner.py): counted as moeserve_decode_tokens_total{path="graph"}


class _SkipInit(TorchFunctionMode):
    """torch.nn.init's functions return their tensor untouched. On the meta device they would compute
    nothing anyway, but their decompositions import torch._dynamo (1.5 s at start-up)."""

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
        self.norm = make_norm(cfg)
        if cfg.task == "classify":
            self.classifier = nn.Linear(cfg.d_model, cfg.n_classes, bias=True)
        elif not cfg.tie_embeddings:
            self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head_packed: Tensor | None = None  # tied LM head, packed by prepare_inference
        self.head_kernel = False  # tied LM head run by cpu_kernel.linear (prepare_inference)
        self.head_kernel_max_rows: int | None = None  # past this many rows, torch's GEMM instead
        self.step_kernel: KernelDecodeStep | None = None  # a whole decode step in one C call (prepare_inference)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @classmethod
    def empty(cls, cfg: MoEConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
              experts_factory: ExpertsFactory | None = None) -> "Transformer":
        """A model whose weights a checkpoint will assign (loading.py): they are neither allocated nor
        initialised here (for a 2.6 GB Mixtral the random initialisation alone took 8 s, all of it then
        overwritten); only the RoPE tables, which no checkpoint holds, are computed."""
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
            layer.prepare_inference(pack=plan.pack_experts, grouped_mm=plan.grouped_mm, gather_max=plan.gather_max,
                                    kernel=plan.kernel_experts, decode_grouped=plan.decode_grouped,
                                    kernel_max_tokens=plan.kernel_max_tokens)
        self.head_packed, self.head_kernel = None, False
        tied = self.cfg.task == "lm" and self.cfg.tie_embeddings
        unpack_linears_(self)
        if plan.pack_dense:
            wrap_linears_(self, PackedLinear)
            if tied:
                self.head_packed = pack_weight(w)
        elif plan.kernel_dense:
            if not cpu_kernel.available():
                raise cpu_kernel.KernelError(f"the plan runs dense layers on the CPU kernel, which is not available "
                                             f"here: {cpu_kernel.unavailable_reason()}")
            wrap_linears_(self, KernelLinear)
            for m in self.modules():
                if isinstance(m, KernelLinear):
                    m.max_rows = plan.dense_kernel_max_tokens
            self.head_kernel = tied
        self.head_kernel_max_rows = plan.dense_kernel_max_tokens
        if plan.kernel_norms and not cpu_kernel.available():
            raise cpu_kernel.KernelError(f"the plan runs norms and decode attention on the CPU kernel, which is not "
                                         f"available here: {cpu_kernel.unavailable_reason()}")
        for m in self.modules():
            if isinstance(m, KernelRMSNorm):
                m.use_kernel = plan.kernel_norms
            elif isinstance(m, Attention):
                m.kernel_decode = plan.kernel_norms
        for block in self.layers:  # the attention half of a decode layer in one call, where all of it is on the kernel
            block.decode_kernel = self._decode_kernel(block) if plan.kernel_dense and plan.kernel_norms else None
        self.step_kernel = self._step_kernel()
        return plan

    def _decode_kernel(self, block: Block) -> KernelDecodeBlock | None:
        a, norms = block.attention, (block.attention_norm, block.ffn_norm)
        if not a.causal or not all(isinstance(n, KernelRMSNorm) and n.weight is not None for n in norms):
            return None  # LayerNorm, or an encoder's attention: the calls one by one
        eps = [n.eps if n.eps is not None else torch.finfo(n.weight.dtype).eps for n in norms]
        return KernelDecodeBlock(((norms[0].weight, eps[0]), (norms[1].weight, eps[1])),
                                 (a.wq.weight, a.wk.weight, a.wv.weight, a.wo.weight), a.n_heads, a.n_kv_heads)

    def _step_kernel(self) -> KernelDecodeStep | None:
        """The whole decode step in one call, where every part of it is on the kernel: each layer's attention half,
        router and experts, the final norm and the LM head. Else None: the layers' calls one by one."""
        parts = []
        for block in self.layers:
            ffn = block.ffn
            if block.decode_kernel is None or not isinstance(ffn, MoELayer) or ffn.kernel_router is None:
                return None  # no kernel router: a VQ layer, a capacity limit, or experts off the kernel
            parts.append((block.decode_kernel, ffn.kernel_router, ffn.experts.inference.fused))
        norm, head = self.norm, None
        if self.cfg.task == "lm" and self.cfg.tie_embeddings and self.head_kernel:
            head = self.tok_embeddings.weight
        elif self.cfg.task == "lm" and not self.cfg.tie_embeddings and isinstance(self.output, KernelLinear):
            head = self.output.weight
        if head is None or not (isinstance(norm, KernelRMSNorm) and norm.use_kernel and norm.weight is not None):
            return None
        eps = norm.eps if norm.eps is not None else torch.finfo(norm.weight.dtype).eps
        return KernelDecodeStep(parts, (norm.weight, eps), head, self.tok_embeddings.weight,
                                (self.rope_cos, self.rope_sin), self.cfg.sliding_window)

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
        if (self.step_kernel is not None and isinstance(cache, CacheRows) and S == 1 and attention_mask is None
                and not torch.is_grad_enabled()):
            return self._decode_step(input_ids[:, 0].long().contiguous(), cache.slots, cache.positions.reshape(-1),
                                     cache.cache)
        x = self.tok_embeddings(input_ids)
        token_mask = None
        cos = sin = mask = None
        if isinstance(cache, StepRows):
            if attention_mask is not None or (B, S) != (1, cache.n_tokens):
                raise ValueError(f"these rows take their {cache.n_tokens} tokens as one row [1, {cache.n_tokens}] and "
                                 f"no attention mask, not {list(input_ids.shape)}")
            for p in cache.parts:
                p.cos, p.sin, p.mask = self._rope_and_mask(p.rows, x.dtype)
        elif cache is None:
            if S > self.cfg.max_seq_len:
                raise ValueError(f"{S} tokens are past max_seq_len={self.cfg.max_seq_len}")
            mask = self._mask(S, attention_mask)
            if attention_mask is not None:
                token_mask = attention_mask.bool()
                token_mask = None if bool(token_mask.all()) else token_mask  # one check here, not one per layer
            cos, sin = self.rope_cos[:S].to(x.dtype), self.rope_sin[:S].to(x.dtype)  # [S, Dh]
        else:
            if attention_mask is not None:
                raise ValueError("a cached call takes no attention mask: its rows have no padding")
            cos, sin, mask = self._rope_and_mask(cache, x.dtype)
        is_causal = self.cfg.causal and cache is None
        aux = []
        for block in self.layers:
            x, a = block(x, cos, sin, mask, is_causal, token_mask, cache)
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
        return ModelOutput(self._head(x), aux)

    def _head(self, x: Tensor) -> Tensor:
        """The LM head: normed hidden states [..., D] -> logits [..., V], packed or on the C kernel where laid out so."""
        if self.head_packed is not None and not torch.is_grad_enabled():
            return packed_linear(x, self.head_packed)
        if (self.head_kernel and not torch.is_grad_enabled() and x.dtype == self.tok_embeddings.weight.dtype
                and (self.head_kernel_max_rows is None or x.numel() <= self.head_kernel_max_rows * x.shape[-1])):
            return cpu_kernel.linear(x, self.tok_embeddings.weight)
        if self.cfg.tie_embeddings:
            return F.linear(x, self.tok_embeddings.weight)
        return self.output(x)

    def _target_logprobs(self, x_BTD: Tensor, targets_BT: Tensor) -> Tensor:
        """log p(targets) [B, T] float32: the head and log-softmax over HEAD_ROWS rows at a time. Whole, a batch of
        16,384 tokens of a 32,000-token vocabulary holds 2.1 GB of logits and as much again of their log-softmax,
        allocated afresh (and page-faulted in) by every batch; a chunk's 16 MB stays in the allocator's reach.
        Each row's numbers are those of the whole batch's log_softmax: the chunks only split the rows."""
        B, T, D = x_BTD.shape
        x_ND, t_N = x_BTD.reshape(-1, D), targets_BT.reshape(-1, 1)
        out = torch.empty(B * T, dtype=torch.float32, device=x_BTD.device)
        for a in range(0, B * T, HEAD_ROWS):
            logp = torch.log_softmax(self._head(x_ND[a:a + HEAD_ROWS]).float(), dim=-1)
            out[a:a + HEAD_ROWS] = logp.gather(-1, t_N[a:a + HEAD_ROWS])[:, 0]
        return out.view(B, T)

    def decode_step(self, cache: KVCache, slots: list[int], ids_B: Tensor, positions: list[int]) -> ModelOutput:
        """One token a row, row b's ids_B[b] at positions[b] of slot slots[b], on the kernel's whole-step call
        (step_kernel must be set): forward(ids_B[:, None], cache=cache.rows(slots, positions, 1)) from the host's
        numbers. A step that streams the weights leaves every cache cold, and there a small torch operation costs
        50-260 us: here the rows are checked on the host and the C call looks up the embedding, the RoPE rows and
        the bounds, which CacheRows and forward built in torch (on the 644M Mixtral, 0.82 -> 0.60 ms a token
        outside the C call)."""
        cache.claim(slots, positions, 1)
        rows = torch.tensor([*slots, *positions])
        return self._decode_step(ids_B, rows[:len(slots)], rows[len(slots):], cache)

    def _decode_step(self, ids_B: Tensor, slots_B: Tensor, positions_B: Tensor, cache: KVCache) -> ModelOutput:
        """A decode step on the kernel, every layer and the head in one call (KernelDecodeStep): the same numbers
        as the layers' calls one by one."""
        logits_BV, ids, gates, counts = self.step_kernel(ids_B, slots_B, positions_B, cache.k, cache.v,
                                                         self.cfg.head_dim**-0.5)
        aux = [MoEAux(c if block.ffn.count_load else None, Routing(i, g))
               for block, c, i, g in zip(self.layers, counts.unbind(0), ids.unbind(0), gates.unbind(0))]
        return ModelOutput(logits_BV[:, None], aux)

    def _mask(self, S: int, attention_mask_BS: Tensor | None) -> Tensor | None:
        """Boolean [B|1, 1, S, S] mask of an uncached call, or None when SDPA's causal flag (or nothing) suffices."""
        window = self.cfg.sliding_window if self.cfg.causal else None
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

    def _rope_and_mask(self, cache: CacheRows, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """cos and sin [B, 1, S, Dh] at the rows' positions, and their mask."""
        pos = cache.positions
        return self.rope_cos[pos][:, None].to(dtype), self.rope_sin[pos][:, None].to(dtype), self._cache_mask(cache)

    def _cache_mask(self, cache: CacheRows) -> Tensor:
        """[B, 1, S, L]: a query sees its sequence's keys up to its own position (causal, within the sliding
        window), or every key its sequence wrote (bidirectional); never a key of an earlier owner of the slot."""
        q_BS1 = cache.positions[:, :, None]
        k_1L = torch.arange(cache.length, device=q_BS1.device)[None, None, :]
        if self.cfg.causal:
            allowed = k_1L <= q_BS1
            if self.cfg.sliding_window is not None:
                allowed = allowed & (k_1L > q_BS1 - self.cfg.sliding_window)
        else:
            last_B11 = cache.positions.amax(dim=1)[:, None, None]
            allowed = (k_1L <= last_B11).expand(-1, q_BS1.shape[1], -1)
        return allowed[:, None]

    def _pool(self, x_BSD: Tensor, attention_mask_BS: Tensor | None) -> Tensor:
        if attention_mask_BS is None:
            return x_BSD.mean(dim=1)
        m = attention_mask_BS.to(x_BSD.dtype)[..., None]
        return (x_BSD * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)
