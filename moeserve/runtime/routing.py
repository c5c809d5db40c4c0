"""Routers: each token's hidden vector in, K experts and their gates out.

Pipeline of an MoE layer: router (this file) -> dispatch + experts (experts.py) -> combine.

Shape legend: T tokens (batch and sequence flattened), D model dim, E experts, K experts per token,
R the X-MoE routing dim d_e, C the VQ code dim d_c.

  softmax  s = W_g h; gate = softmax(s); top-k; optional renormalisation (Switch, Mixtral)
  sigmoid  s = W_g h; top-k of s; gate = sigmoid(s_k)
  xmoe     s_i = cos(W h, e_i); gate = softmax(s / tau) or sigmoid(s / tau)     (X-MoE eq. 6-7)
  vq       k(x) = argmin_j dist(z(x), v_j), one code per expert                  (VQMoE eq. 3-5)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moeserve.config import MoEConfig


@dataclass
class Routing:
    expert_ids: Tensor  # [T, K] long
    gates: Tensor  # [T, K] weight of each chosen expert's output
    scores: Tensor | None = None  # [T, E] s before gating; the balance loss reads it
    keep: Tensor | None = None  # [T, K] bool; False = dropped by the capacity limit; None = all kept


class SoftmaxRouter(nn.Module):
    """Switch / Mixtral routing: softmax over all E scores, then the top K.

    bias: s = W_g h + b (gpt-oss). gpt-oss takes the top K of s and a softmax over those K (OpenAI, gpt-oss model
    card, 2025, sec. 2.1); with renormalize that is this router exactly: softmax is monotone, so the K largest
    probabilities are the K largest scores, and p_k / sum_K p_j = exp(s_k) / sum_K exp(s_j). The two roundings
    differ by under 1e-6 in float32 (tests/test_hf_gpt_oss.py)."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, renormalize: bool = False, bias: bool = False):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = nn.Linear(d_model, n_experts, bias=bias)

    def forward(self, x_TD: Tensor) -> Routing:
        scores_TE = self.gate(x_TD)
        probs_TE = scores_TE.float().softmax(dim=-1)
        gates_TK, ids_TK = probs_TE.topk(self.top_k, dim=-1)
        if self.renormalize:
            gates_TK = gates_TK / gates_TK.sum(dim=-1, keepdim=True)
        return Routing(ids_TK, gates_TK.to(x_TD.dtype), scores_TE)


class SigmoidRouter(nn.Module):
    """Sigmoid gating (BASE layers, StableMoE): experts are ranked by s, each gate is sigma(s_k)."""

    def __init__(self, d_model: int, n_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(d_model, n_experts, bias=False)

    def forward(self, x_TD: Tensor) -> Routing:
        scores_TE = self.gate(x_TD)
        top_TK, ids_TK = scores_TE.float().topk(self.top_k, dim=-1)
        return Routing(ids_TK, torch.sigmoid(top_TK).to(x_TD.dtype), scores_TE)


class XMoERouter(nn.Module):
    """X-MoE (Chi et al. 2022, eq. 6-7): cosine routing on a low-dimensional hypersphere.

    The token is projected to R = d_e dimensions (W in R^{R x D}) and compared by cosine with expert
    embeddings e_i in R^R; a learnable temperature tau sharpens the [-1, 1] scores. The paper keeps
    ||e_i|| at 0.1: the forward pass is invariant to that norm, but it sets the gradient scale of
    the embeddings (d cos / d e ~ 1 / ||e||), so `constrain_()` restores it after each step.
    """

    def __init__(self, d_model: int, n_experts: int, top_k: int, routing_dim: int, gate: str, tau_init: float,
                 expert_norm: float):
        super().__init__()
        self.top_k, self.gate_kind, self.expert_norm = top_k, gate, expert_norm
        self.proj = nn.Linear(d_model, routing_dim, bias=False)
        self.expert_embeddings = nn.Parameter(torch.empty(n_experts, routing_dim))
        self.tau = nn.Parameter(torch.tensor(float(tau_init)))
        self.reset_embeddings()

    def reset_embeddings(self) -> None:
        nn.init.normal_(self.expert_embeddings)
        self.constrain_()

    @torch.no_grad()
    def constrain_(self) -> None:
        self.expert_embeddings.copy_(F.normalize(self.expert_embeddings, dim=-1) * self.expert_norm)

    def scores(self, x_TD: Tensor) -> Tensor:
        """s_i = (W h) . e_i / (||W h|| ||e_i||), eq. 6."""
        h_TR = F.normalize(self.proj(x_TD).float(), dim=-1)
        e_ER = F.normalize(self.expert_embeddings.float(), dim=-1)
        return h_TR @ e_ER.T

    def forward(self, x_TD: Tensor) -> Routing:
        scores_TE = self.scores(x_TD)
        # A tau that training pushed to or below zero would flip or blow up every gate.
        tau = self.tau.float().clamp(min=1e-3)
        if self.gate_kind == "softmax":
            gates_TK, ids_TK = (scores_TE / tau).softmax(dim=-1).topk(self.top_k, dim=-1)
        else:
            top_TK, ids_TK = scores_TE.topk(self.top_k, dim=-1)
            gates_TK = torch.sigmoid(top_TK / tau)
        return Routing(ids_TK, gates_TK.to(x_TD.dtype), scores_TE)


class VectorQuantizer(nn.Module):
    """VQMoE's expert selection (Do et al., eq. 3): the nearest code of z(x) names the expert.

    Code j belongs to expert j, so K = E. z(x) = x when C = D, else a learned projection D -> C,
    and the chosen code is mapped back to D by a second projection.
    """

    def __init__(self, d_model: int, n_codes: int, code_dim: int, distance: str, vq_input: str, blend_rate: float):
        super().__init__()
        self.distance, self.vq_input, self.blend_rate = distance, vq_input, blend_rate
        self.codebook = nn.Parameter(torch.randn(n_codes, code_dim))
        self.down = nn.Linear(d_model, code_dim, bias=False) if code_dim != d_model else None
        self.up = nn.Linear(code_dim, d_model, bias=False) if code_dim != d_model else None
        # Codes start at random inputs of the first training batch (as VQ libraries do), so that no
        # code starts out of reach of every token and its expert is never trained.
        self.register_buffer("initialized", torch.tensor(False))

    def encode(self, x_TD: Tensor) -> Tensor:
        z_TC = self.down(x_TD) if self.down is not None else x_TD
        return F.normalize(z_TC, dim=-1) if self.distance == "cosine" else z_TC

    def vectors(self) -> Tensor:
        """The codebook as compared with z: unit rows for cosine distance."""
        return F.normalize(self.codebook, dim=-1) if self.distance == "cosine" else self.codebook

    def nearest(self, z_TC: Tensor) -> Tensor:
        """k(x) = argmin_j ||z - v_j||^2 = argmin_j (||v_j||^2 - 2 z.v_j); for unit vectors, max cosine."""
        v_KC = self.vectors().float()
        dist_TK = v_KC.pow(2).sum(-1) - 2 * z_TC.float() @ v_KC.T
        return dist_TK.argmin(dim=-1)

    @torch.no_grad()
    def init_from_data_(self, z_TC: Tensor) -> None:
        idx = torch.randperm(z_TC.shape[0], device=z_TC.device)[: self.codebook.shape[0]]
        picked = z_TC[idx].float()
        if picked.shape[0] < self.codebook.shape[0]:  # fewer tokens than codes: jitter repeats
            reps = math.ceil(self.codebook.shape[0] / picked.shape[0])
            picked = picked.repeat(reps, 1)[: self.codebook.shape[0]]
            picked = picked + 0.01 * torch.randn_like(picked)
        self.codebook.copy_(picked)
        self.initialized.fill_(True)

    def forward(self, x_TD: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Returns (codes [T], x~ [T, D], z [T, C], v_k [T, C]); the VQ losses are built from z and v_k.

        x~ = v_k (vq_input='code', paper eq. 4-5) with a straight-through gradient to z:
        v_k.detach() + (z - z.detach()) equals v_k exactly in the forward pass, so the layer's
        output depends on x only through k(x) and can be folded into a table.
        x~ = (1 - 2c) x + c v_k (vq_input='blend', the authors' released code).
        """
        z_TC = self.encode(x_TD)
        if self.training and not bool(self.initialized):
            self.init_from_data_(z_TC.detach())
        codes_T = self.nearest(z_TC)
        v_TC = self.vectors()[codes_T].to(z_TC.dtype)
        if self.vq_input == "code":
            q_TC = v_TC.detach() + (z_TC - z_TC.detach())
            x_tilde = self.up(q_TC) if self.up is not None else q_TC
        else:
            v_TD = self.up(v_TC) if self.up is not None else v_TC
            x_tilde = (1 - 2 * self.blend_rate) * x_TD + self.blend_rate * v_TD
        return codes_T, x_tilde, z_TC, v_TC


def capacity_keep(expert_ids_TK: Tensor, n_experts: int, capacity: int) -> Tensor:
    """Which (token, slot) assignments fit in `capacity` per expert: first choices of all tokens
    take priority over second choices (GShard), and earlier tokens over later ones."""
    T, K = expert_ids_TK.shape
    flat = expert_ids_TK.T.reshape(-1)  # slot-major order
    onehot = F.one_hot(flat, n_experts)
    rank = (onehot.cumsum(0) * onehot).sum(-1) - 1
    return (rank < capacity).reshape(K, T).T


def make_router(cfg: MoEConfig) -> nn.Module:
    """The continuous router a config names (VQ's mixed layer uses a softmax one for its SMoE path)."""
    if cfg.router == "sigmoid":
        return SigmoidRouter(cfg.d_model, cfg.n_experts, cfg.top_k)
    if cfg.router == "xmoe":
        return XMoERouter(cfg.d_model, cfg.n_experts, cfg.top_k, cfg.router_dim, cfg.xmoe_gate, cfg.tau_init,
                          cfg.xmoe_expert_norm)
    if cfg.router_bias and cfg.router != "softmax":
        raise ValueError(f"router_bias with router {cfg.router!r}: only the softmax router has a bias")
    return SoftmaxRouter(cfg.d_model, cfg.n_experts, cfg.top_k, cfg.renormalize, cfg.router_bias)
