"""The MoE layer: router -> dispatch -> experts -> combine, for every router kind.

  softmax / sigmoid / xmoe   y = sum_k g_k(x) f_{e_k}(x)
  vq, mixed (pre-training)   y = g_c(x) SMoE(x) + g_d(x) f_{k(x)}(x~),  [g_c, g_d] = softmax(W_g x)   (eq. 4)
  vq, discrete (serving)     y = f_{k(x)}(x~): no router, no gate, one expert per token            (eq. 5)
  with a shared expert       y + sigmoid(w_s . x) f_s(x)  (Qwen1.5 / Qwen2-MoE; the gate only where shared_gate)

Each forward returns its output and an `MoEAux`: what the balance and VQ losses (training/losses.py)
and the expert-load accounting need, at the cost of one bincount. Nothing is left in the module, so
one layer can serve concurrent callers and a captured decode step has no side effects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moeserve.config import MoEConfig
from moeserve.runtime.experts import FeedForward, make_experts
from moeserve.runtime.routing import Routing, VectorQuantizer, capacity_keep, make_router


@dataclass
class MoEAux:
    counts: Tensor | None  # [E] tokens routed to each expert in this forward (kept assignments only)
    routing: Routing | None  # the continuous router's decision; None for the discrete VQ layer
    codes: Tensor | None = None  # [T] VQ code = expert of each token
    z: Tensor | None = None  # [T, C] VQ encoder output
    v: Tensor | None = None  # [T, C] chosen code vectors


class MoELayer(nn.Module):
    def __init__(self, cfg: MoEConfig, experts: nn.Module | None = None):
        """experts: called as `experts(x_TD, expert_ids_TK, gates_TK, keep_TK) -> y_TD` (default: this
        layer's own `make_experts(cfg)`: stacked `Experts`, or gpt-oss's `BiasedExperts`; expert_parallel.py for experts split across ranks)."""
        super().__init__()
        self.cfg = cfg
        self.n_experts = cfg.n_experts
        self.experts = experts if experts is not None else make_experts(cfg)
        is_vq = cfg.router == "vq"
        self.router = make_router(cfg) if not (is_vq and cfg.vq_mode == "discrete") else None
        self.quantizer = (
            VectorQuantizer(cfg.d_model, cfg.n_experts, cfg.code_dim, cfg.vq_distance, cfg.vq_input, cfg.vq_blend_rate)
            if is_vq else None
        )
        self.mix = nn.Linear(cfg.d_model, 2, bias=False) if is_vq and cfg.vq_mode == "mixed" else None
        # Qwen2-MoE's shared expert: a dense FFN every token goes through beside the routed ones. Its weights are
        # dense (not `.ffn.experts.`), so each expert-parallel rank holds all of them, as it holds attention's.
        self.shared = FeedForward(cfg.d_model, cfg.shared_d_ff, cfg.expert_act) if cfg.shared_d_ff is not None else None
        self.shared_gate = nn.Linear(cfg.d_model, 1, bias=False) if cfg.shared_gate else None
        self.count_load = True  # the bincount of MoEAux.counts; off only to measure what it costs

    def _discrete(self, x_TD: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """VQ's discrete path: (f_k(x~) [T, D], codes, z, v)."""
        codes_T, x_tilde_TD, z, v = self.quantizer(x_TD)
        ones_T1 = torch.ones(x_TD.shape[0], 1, dtype=x_TD.dtype, device=x_TD.device)
        return self.experts(x_tilde_TD, codes_T[:, None], ones_T1), codes_T, z, v

    def _route(self, x_TD: Tensor) -> Routing:
        routing = self.router(x_TD)
        if self.cfg.capacity_factor is not None:
            capacity = math.ceil(self.cfg.capacity_factor * x_TD.shape[0] * routing.expert_ids.shape[1] / self.n_experts)
            routing.keep = capacity_keep(routing.expert_ids, self.n_experts, capacity)
        return routing

    def forward(self, x_BSD: Tensor, token_mask_BS: Tensor | None = None) -> tuple[Tensor, MoEAux]:
        """(y [B, S, D], aux). token_mask_BS: False for padding, which is neither routed nor counted and comes
        out as zeros (the caller passes None when every token is real, so a decode step has no mask)."""
        if token_mask_BS is not None:
            keep_T = token_mask_BS.reshape(-1)
            y_TD = x_BSD.new_zeros(keep_T.shape[0], x_BSD.shape[-1])
            y_1ND, aux = self.forward(x_BSD.reshape(-1, x_BSD.shape[-1])[keep_T][None])
            y_TD[keep_T] = y_1ND[0]
            return y_TD.reshape(x_BSD.shape), aux
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        routing = codes_T = z = v = None
        if self.quantizer is None:
            routing = self._route(x_TD)
            y_TD = self.experts(x_TD, routing.expert_ids, routing.gates, routing.keep)
        else:
            discrete_TD, codes_T, z, v = self._discrete(x_TD)
            if self.mix is None:
                y_TD = discrete_TD
            else:
                routing = self._route(x_TD)
                continuous_TD = self.experts(x_TD, routing.expert_ids, routing.gates, routing.keep)
                g_T2 = self.mix(x_TD).float().softmax(dim=-1).to(x_TD.dtype)
                y_TD = g_T2[:, :1] * continuous_TD + g_T2[:, 1:] * discrete_TD
        if self.shared is not None:
            y_TD = y_TD + self._shared(x_TD)
        counts = self._counts(routing, codes_T) if self.count_load else None
        return y_TD.reshape(x_BSD.shape), MoEAux(counts, routing, codes_T, z, v)

    def _shared(self, x_TD: Tensor) -> Tensor:
        """The shared expert's output f_s(x) [T, D], scaled by its gate sigmoid(w_s . x) [T, 1] where it has one
        (transformers' Qwen2MoeSparseMoeBlock: sigmoid in the model's dtype, then the product)."""
        y_TD = self.shared(x_TD)
        return y_TD if self.shared_gate is None else torch.sigmoid(self.shared_gate(x_TD)) * y_TD

    def _counts(self, routing: Routing | None, codes_T: Tensor | None) -> Tensor:
        """Tokens per expert: the continuous router's kept assignments, else the VQ codes."""
        if routing is not None:
            ids = routing.expert_ids if routing.keep is None else routing.expert_ids[routing.keep]
        else:
            ids = codes_T
        ids = ids.reshape(-1)  # a fixed-size sum rather than bincount, whose size depends on the values: compilable
        return torch.zeros(self.n_experts, dtype=torch.long, device=ids.device).index_add_(0, ids, torch.ones_like(ids))
