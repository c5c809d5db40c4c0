"""Expert weights, stacked [E, out, in], and the dispatch that runs tokens through them.

Shape legend: T tokens, D model dim, F expert hidden dim, E experts, K experts per token.

  gelu            y = gelu(x W1^T) W2^T
  swiglu          y = (silu(x W1^T) * (x W3^T)) W2^T        (Mixtral: w1 gate, w3 up, w2 down)
  clamped_swiglu  g = min(x W1^T + b1, l), u = clip(x W3^T + b3, -l, l),
                  y = ((u + 1) * g * sigmoid(a g)) W2^T + b2   (gpt-oss: BiasedExperts)

`moe_reference` is the plain per-expert loop: readable, differentiable, and the reference every faster dispatch
path is tested against. `moe_sorted` is the training path, in three steps that are also the seam for experts that
live elsewhere (expert_parallel.py): `dispatch` (one gather of the tokens sorted by expert), `compute` (one
contiguous block per expert), `combine` (one scatter back). Indexing a stacked [E, F, D] parameter once per expert
would make autograd allocate a full-size zero gradient for each index (E^2 F D memory traffic); unbinding it once
gives each expert a view whose gradients are stacked once.

`BiasedExperts` (experts with biases, or the clamped SwiGLU) is a module of its own, not an `Experts`: the backends
lay out `type(m) is Experts` only, so they leave it as the plain math here rather than run it without its biases.

Faster inference paths over the same weights (fused gate-up, oneDNN packing, gather by token count, the C
kernel, the compiled step's sync-free paths) are the backends' (runtime/backends/experts.py): a backend lays
an `Experts` out once, and this module stays the math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


# Called as observer(expert, linear_map_name, inputs_NI) with the rows one linear map of one expert
# received; the OMoE optimizer uses it to record each expert's mean inputs (paper 003, R step).
InputObserver = Callable[[int, str, Tensor], None]


def expert_hidden(x_ND: Tensor, w1_FD: Tensor, w3_FD: Tensor | None) -> Tensor:
    if w3_FD is None:
        return F.gelu(x_ND @ w1_FD.T)
    return F.silu(x_ND @ w1_FD.T) * (x_ND @ w3_FD.T)


def expert_forward(e: int, x_ND: Tensor, w1_FD: Tensor, w2_DF: Tensor, w3_FD: Tensor | None,
                   observer: InputObserver | None) -> Tensor:
    """Expert e on the rows routed to it; the observer sees each linear map's input rows."""
    h_NF = expert_hidden(x_ND, w1_FD, w3_FD)
    if observer is not None:
        observer(e, "w1", x_ND)
        if w3_FD is not None:
            observer(e, "w3", x_ND)
        observer(e, "w2", h_NF)
    return h_NF @ w2_DF.T


def moe_reference(x_TD: Tensor, expert_ids_TK: Tensor, gates_TK: Tensor, w1_EFD: Tensor, w2_EDF: Tensor,
                  w3_EFD: Tensor | None = None, keep_TK: Tensor | None = None,
                  observer: InputObserver | None = None) -> Tensor:
    """y_t = sum_k gate_tk * f_{e_tk}(x_t), one expert at a time."""
    out_TD = torch.zeros_like(x_TD)
    selected_TK = torch.ones_like(expert_ids_TK, dtype=torch.bool) if keep_TK is None else keep_TK
    for e in range(w1_EFD.shape[0]):
        tok_N, slot_N = torch.where((expert_ids_TK == e) & selected_TK)
        if tok_N.numel() == 0:
            continue
        y_ND = expert_forward(e, x_TD[tok_N], w1_EFD[e], w2_EDF[e], None if w3_EFD is None else w3_EFD[e], observer)
        out_TD.index_add_(0, tok_N, (y_ND * gates_TK[tok_N, slot_N, None].to(y_ND.dtype)).to(out_TD.dtype))
    return out_TD


@dataclass
class Dispatch:
    """A layer's routed assignments grouped by expert: expert e's rows are the e-th contiguous block of
    x_ND. The seam where experts can live elsewhere: `dispatch` here, the experts compute on their
    blocks (locally, or a rank on only its own experts' blocks: expert_parallel.py), `combine` here."""

    x_ND: Tensor  # the routed rows, sorted by expert (N kept assignments)
    counts: list[int]  # [E] rows per expert, in expert order
    tok_N: Tensor  # the token each row came from
    gates_N: Tensor  # each row's gate

    def blocks(self) -> list[Tensor]:
        """Per expert, its rows [n_e, D] (views; empty for an expert no token chose)."""
        return list(self.x_ND.split(self.counts))


def dispatch(x_TD: Tensor, expert_ids_TK: Tensor, gates_TK: Tensor, n_experts: int,
             keep_TK: Tensor | None = None) -> Dispatch:
    """Sort the kept (token, expert) assignments by expert and gather their rows (one host sync: the counts)."""
    T, K = expert_ids_TK.shape
    ids_N = expert_ids_TK.reshape(-1)
    gates_N = gates_TK.reshape(-1)
    tok_N = torch.arange(T, device=x_TD.device).repeat_interleave(K)
    if keep_TK is not None:
        kept = keep_TK.reshape(-1)
        ids_N, gates_N, tok_N = ids_N[kept], gates_N[kept], tok_N[kept]
    order = ids_N.argsort(stable=True)
    tok_N, gates_N = tok_N[order], gates_N[order]
    return Dispatch(x_TD[tok_N], torch.bincount(ids_N, minlength=n_experts).tolist(), tok_N, gates_N)


def combine(d: Dispatch, y_ND: Tensor, like_TD: Tensor) -> Tensor:
    """y_t = sum over t's rows of gate * expert output: one scatter-add back to the tokens."""
    out_TD = torch.zeros_like(like_TD)
    if y_ND.shape[0]:
        out_TD.index_add_(0, d.tok_N, (y_ND * d.gates_N[:, None].to(y_ND.dtype)).to(out_TD.dtype))
    return out_TD


def compute(d: Dispatch, w1_EFD: Tensor, w2_EDF: Tensor, w3_EFD: Tensor | None = None,
            observer: InputObserver | None = None, expert_ids: list[int] | None = None) -> Tensor:
    """Each expert on its own block: y_ND in the dispatch's row order. `expert_ids`: the global id of
    each stacked expert here (a shard's), for the observer; default 0..E-1."""
    E = w1_EFD.shape[0]
    w1s, w2s = w1_EFD.unbind(0), w2_EDF.unbind(0)
    w3s = w3_EFD.unbind(0) if w3_EFD is not None else (None,) * E
    ids = range(E) if expert_ids is None else expert_ids
    ys = [expert_forward(g, x_ND, w1s[e], w2s[e], w3s[e], observer)
          for e, (g, x_ND) in enumerate(zip(ids, d.blocks())) if x_ND.shape[0]]
    return torch.cat(ys) if ys else d.x_ND.new_zeros(0, w2_EDF.shape[1])


def expert_rows(x_ND: Tensor, ids_N: Tensor, w1_EFD: Tensor, w2_EDF: Tensor, w3_EFD: Tensor | None = None) -> Tensor:
    """Row n through expert ids_N[n] of the stack, zero where ids_N[n] is no expert (>= E: a padding row), in
    fixed shapes and with no host sync, so a compiled or captured step can hold it (expert_parallel.py's fixed
    exchange). Each expert runs on every row and keeps its own: E times the FLOPs of the rows, but each expert's
    weights are read once, which is what a decode-sized buffer is bound by; a grouped GEMM over rows sorted by
    expert is the drop-in where the wasted FLOPs matter."""
    y_ND = x_ND.new_zeros(x_ND.shape[0], w2_EDF.shape[1])
    for e in range(w1_EFD.shape[0]):  # E is the stack's: a constant of the graph
        y_e = expert_hidden(x_ND, w1_EFD[e], None if w3_EFD is None else w3_EFD[e]) @ w2_EDF[e].T
        y_ND = torch.where((ids_N == e)[:, None], y_e, y_ND)
    return y_ND


def moe_sorted(x_TD: Tensor, expert_ids_TK: Tensor, gates_TK: Tensor, w1_EFD: Tensor, w2_EDF: Tensor,
               w3_EFD: Tensor | None = None, keep_TK: Tensor | None = None,
               observer: InputObserver | None = None) -> Tensor:
    """Same result as moe_reference: dispatch -> compute -> combine, so each expert reads one contiguous block."""
    d = dispatch(x_TD, expert_ids_TK, gates_TK, w1_EFD.shape[0], keep_TK)
    return combine(d, compute(d, w1_EFD, w2_EDF, w3_EFD, observer), x_TD)


class Experts(nn.Module):
    """E FFN experts of one layer, each weight one stacked parameter so that no expert is a module
    of its own and a kernel can index all of them at once."""

    def __init__(self, n_experts: int, d_model: int, d_ff: int, act: str):
        super().__init__()
        self.act = act
        self.w1 = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_model, d_ff))
        self.w3 = nn.Parameter(torch.empty(n_experts, d_ff, d_model)) if act == "swiglu" else None
        for w in (self.w1, self.w2, self.w3):  # usable alone; Transformer.reset_parameters re-inits by depth
            if w is not None:
                nn.init.normal_(w, std=0.02)
        self.observer: InputObserver | None = None

    @property
    def n_experts(self) -> int:
        return self.w1.shape[0]

    def forward(self, x_TD: Tensor, expert_ids_TK: Tensor, gates_TK: Tensor, keep_TK: Tensor | None = None) -> Tensor:
        return moe_sorted(x_TD, expert_ids_TK, gates_TK, self.w1, self.w2, self.w3, keep_TK, self.observer)


def clamped_swiglu(gate: Tensor, up: Tensor, limit: float, alpha: float) -> Tensor:
    """gpt-oss's expert activation (OpenAI, gpt-oss-120b & gpt-oss-20b model card, 2025, sec. 2.1: "a gated SwiGLU
    activation with clamping and a residual connection"; transformers' GptOssExperts._apply_gate): the gate clamped
    from above and the up projection on both sides at `limit`, swish with slope `alpha`, and up + 1."""
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class BiasedExperts(nn.Module):
    """E experts whose linear maps have biases and whose activation may be the clamped SwiGLU (gpt-oss): the math
    of `Experts` plus b1, b3 [E, F] and b2 [E, D]. A gate multiplies its expert's whole output, bias included
    (y_t = sum_k g_tk (h W2^T + b2)), as gpt-oss computes it.

    Its own type, so that no backend lays it out as an `Experts` (which would drop the biases): the eager and CPU
    kernel backends run this forward (moe_sorted's dispatch, one host sync for the counts); the compiled backend
    lays it out as backends/experts.GraphBiasedExperts, whose traced decode step indexes each token's experts."""

    def __init__(self, n_experts: int, d_model: int, d_ff: int, act: str, bias: bool = True,
                 limit: float = 7.0, alpha: float = 1.702):
        super().__init__()
        if act not in ("gelu", "swiglu", "clamped_swiglu"):
            raise ValueError(f"expert activation {act!r}: expected 'gelu', 'swiglu' or 'clamped_swiglu'")
        self.act, self.limit, self.alpha = act, limit, alpha
        self.w1 = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_model, d_ff))
        self.w3 = nn.Parameter(torch.empty(n_experts, d_ff, d_model)) if act != "gelu" else None
        self.b1 = nn.Parameter(torch.zeros(n_experts, d_ff)) if bias else None
        self.b2 = nn.Parameter(torch.zeros(n_experts, d_model)) if bias else None
        self.b3 = nn.Parameter(torch.zeros(n_experts, d_ff)) if bias and act != "gelu" else None
        for w in (self.w1, self.w2, self.w3):
            if w is not None:
                nn.init.normal_(w, std=0.02)

    @property
    def n_experts(self) -> int:
        return self.w1.shape[0]

    def hidden(self, gate: Tensor, up: Tensor | None) -> Tensor:
        if self.act == "clamped_swiglu":
            return clamped_swiglu(gate, up, self.limit, self.alpha)
        return F.gelu(gate) if up is None else F.silu(gate) * up

    def linear(self, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        """One map of one expert, x w^T + b (the CPU kernel's form runs it on the kernel's GEMM)."""
        return F.linear(x, w, b)

    def ffn(self, e: int, x_ND: Tensor) -> Tensor:
        """Expert e on its rows: (act(x W1^T + b1, x W3^T + b3)) W2^T + b2."""
        gate = self.linear(x_ND, self.w1[e], None if self.b1 is None else self.b1[e])
        up = None if self.w3 is None else self.linear(x_ND, self.w3[e], None if self.b3 is None else self.b3[e])
        return self.linear(self.hidden(gate, up), self.w2[e], None if self.b2 is None else self.b2[e])

    def compute(self, x_ND: Tensor, counts: list[int]) -> Tensor:
        """Each expert through `ffn` on its block of rows (sorted by expert, counts[e] of expert e): the experts'
        outputs, bias included and no gate yet, in the same order. An expert-parallel rank's shard of these experts
        (backends/expert_shards.BiasedExpertShard) computes through it too."""
        ys = [self.ffn(e, x) for e, x in enumerate(x_ND.split(counts)) if x.shape[0]]
        return torch.cat(ys) if ys else x_ND.new_zeros(0, self.w2.shape[1])

    def forward(self, x_TD: Tensor, expert_ids_TK: Tensor, gates_TK: Tensor, keep_TK: Tensor | None = None) -> Tensor:
        """moe_sorted's dispatch -> compute -> combine, each expert through `ffn`."""
        d = dispatch(x_TD, expert_ids_TK, gates_TK, self.n_experts, keep_TK)
        return combine(d, self.compute(d.x_ND, d.counts), x_TD)


def biased_experts(cfg) -> bool:
    """Whether `cfg`'s experts are `BiasedExperts`: expert biases or the clamped SwiGLU (gpt-oss)."""
    return cfg.expert_bias or cfg.expert_act == "clamped_swiglu"


def make_experts(cfg) -> nn.Module:
    """A MoE layer's own experts as `cfg` describes them: `Experts`, or `BiasedExperts` (biased_experts)."""
    if biased_experts(cfg):
        return BiasedExperts(cfg.n_experts, cfg.d_model, cfg.d_ff, cfg.expert_act, cfg.expert_bias,
                             cfg.swiglu_limit, cfg.swiglu_alpha)
    return Experts(cfg.n_experts, cfg.d_model, cfg.d_ff, cfg.expert_act)


class FeedForward(nn.Module):
    """The dense FFN of layers that `moe_layers` leaves out: one expert, always on."""

    def __init__(self, d_model: int, d_ff: int, act: str):
        super().__init__()
        if act == "clamped_swiglu":  # gpt-oss has no dense FFN layers; refused rather than run as gelu
            raise ValueError("a dense FFN with the clamped SwiGLU is not implemented (gpt-oss's layers are all MoE)")
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False) if act == "swiglu" else None

    def forward(self, x: Tensor) -> Tensor:  # through the modules: a backend may lay them out (or quantize them)
        h = F.gelu(self.w1(x)) if self.w3 is None else F.silu(self.w1(x)) * self.w3(x)
        return self.w2(h)
