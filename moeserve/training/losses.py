"""Auxiliary losses of the papers, computed from what each MoE layer's forward leaves behind (MoEAux).

Balance (X-MoE eq. 8-9, Switch):  L_bal = N * sum_i f_i * P_i
    f_i  fraction of the T*K routed assignments that went to expert i (no gradient)
    P_i  mean over tokens of softmax(s / tau_0)_i, tau_0 a fixed constant
    At perfect balance f_i = P_i = 1/N and L_bal = 1, whatever N and K.
VQ (VQMoE eq. 6, VQ-VAE):  L_vq = alpha_vq * (||sg[z] - v||^2 + beta ||z - sg[v]||^2)
    ||.||^2 is averaged over tokens and code dimensions (F.mse_loss), so the weight does not
    need retuning when the code dimension changes.
Each term is returned on its own so the trainer can log it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from moeserve.config import MoEConfig
from moeserve.runtime.moe import MoEAux
from moeserve.runtime.routing import Routing


def balance_loss(routing: Routing, n_experts: int, tau0: float) -> Tensor:
    ids = routing.expert_ids if routing.keep is None else routing.expert_ids[routing.keep]
    f_E = torch.bincount(ids.reshape(-1), minlength=n_experts).float() / routing.expert_ids.numel()
    P_E = (routing.scores.float() / tau0).softmax(dim=-1).mean(dim=0)
    return n_experts * (f_E * P_E).sum()


def vq_losses(z: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """(codebook loss ||sg[z] - v||^2, commitment loss ||z - sg[v]||^2)."""
    codebook = F.mse_loss(v.float(), z.detach().float())
    commitment = F.mse_loss(z.float(), v.detach().float())
    return codebook, commitment


@dataclass
class AuxLosses:
    balance: Tensor  # mean over MoE layers of L_bal (unweighted)
    vq_codebook: Tensor  # mean over VQ layers
    vq_commitment: Tensor

    def total(self, cfg: MoEConfig) -> Tensor:
        return cfg.balance_alpha * self.balance + cfg.vq_alpha * (self.vq_codebook + cfg.vq_beta * self.vq_commitment)


def aux_losses(aux: list[MoEAux], cfg: MoEConfig) -> AuxLosses:
    zero = torch.zeros(())
    bal, cb, cm = [], [], []
    for a in aux:
        if a.routing is not None and a.routing.scores is not None:
            bal.append(balance_loss(a.routing, cfg.n_experts, cfg.tau0))
        if a.z is not None:
            c, m = vq_losses(a.z, a.v)
            cb.append(c)
            cm.append(m)

    def mean(xs: list[Tensor]) -> Tensor:
        return torch.stack(xs).mean() if xs else zero

    return AuxLosses(mean(bal), mean(cb), mean(cm))


def load_entropy(counts_E: Tensor) -> float:
    """Entropy of an expert-load vector in bits: log2(E) is perfectly balanced, 0 is collapse."""
    p = counts_E.float() / counts_E.sum().clamp(min=1)
    return float(-(p[p > 0] * p[p > 0].log2()).sum())
