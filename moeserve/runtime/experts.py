"""Expert weights, stacked [E, out, in], and the dispatch that runs tokens through them.

Shape legend: T tokens, D model dim, F expert hidden dim, E experts, K experts per token.

  gelu    y = gelu(x W1^T) W2^T
  swiglu  y = (silu(x W1^T) * (x W3^T)) W2^T        (Mixtral: w1 gate, w3 up, w2 down)

`moe_reference` is the plain per-expert loop: readable, differentiable, and the reference every
faster dispatch path is tested against. `moe_sorted` is the training path, in three steps that are
also the seam for experts that live elsewhere (expert_shards.py): `dispatch` (one gather of the
tokens sorted by expert), `compute` (one contiguous block per expert), `combine` (one scatter back). Indexing a stacked [E, F, D]
parameter once per expert would make autograd allocate a full-size zero gradient for each index
(E^2 F D memory traffic); unbinding it once gives each expert a view whose gradients are stacked once.

Inference (no autograd) runs on `InferenceWeights`: gate and up of SwiGLU fused into one [2F, D]
matrix per expert (one GEMM reads x once), on x86 CPUs each matrix prepacked for oneDNN (packing.py).
Three paths:

  moe_gather    few tokens (decode): for each expert that was hit, gather its rows and run it.
                No sort, no split; the cost is reading the hit experts' weights.
  moe_indexed   few tokens, without a host sync (CUDA decode, captured as a graph): each token's K
                experts' weights are indexed out of the stacked [E, ...] tensors (gpt-fast's way),
                so shapes are fixed and nothing waits for the ids to reach the host.
  moe_grouped   many tokens (prefill): sort assignments by expert, gather x once, one GEMM per
                expert over a contiguous block (or one torch grouped_mm call where that is faster,
                i.e. on CUDA), one scatter-add back. With grouped_mm it has fixed shapes and no
                host sync too, so a compiled decode step may take it instead of moe_indexed
                (`decode_grouped`): it reads each hit expert's weights once, where indexing copies
                them out of the stack per token first.
  fused         on the C kernel (cpu_kernel.py, where the calibration chose it): any token count, the
                layer's experts in one call (both GEMMs and the activation), one scatter back.
  table         discrete VQ with vq_input='code': f_k(x~) depends on x only through the code k,
                so the layer is a gather from a precomputed [E, D] table (moe.py).

The engine picks gather or grouped by token count; the threshold is measured (`moeserve bench layer
--sweep`: on this CPU gather wins at 1 token in bf16 and fp32 and ties at 2), not guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moeserve.runtime import cpu_kernel
from moeserve.runtime.backends.packing import onednn_packing_available, pack_weight, packed_linear

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
    blocks (locally, or a shard on only its own experts' blocks: expert_shards.py), `combine` here."""

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


def moe_sorted(x_TD: Tensor, expert_ids_TK: Tensor, gates_TK: Tensor, w1_EFD: Tensor, w2_EDF: Tensor,
               w3_EFD: Tensor | None = None, keep_TK: Tensor | None = None,
               observer: InputObserver | None = None) -> Tensor:
    """Same result as moe_reference: dispatch -> compute -> combine, so each expert reads one contiguous block."""
    d = dispatch(x_TD, expert_ids_TK, gates_TK, w1_EFD.shape[0], keep_TK)
    return combine(d, compute(d, w1_EFD, w2_EDF, w3_EFD, observer), x_TD)


@dataclass
class InferenceWeights:
    """One MoE layer's experts laid out for inference (see the module docstring)."""

    act: str  # gelu | swiglu
    d_ff: int
    w13: list[Tensor]  # per expert [F, D] (gelu) or [2F, D] (swiglu: gate rows, then up rows); [] under the kernel
    w2: list[Tensor]  # per expert [D, F]
    packed: bool = False  # w13 / w2 hold oneDNN-packed tensors
    grouped_mm: bool = False  # many-token path: one torch grouped_mm call instead of a loop over experts
    gather_max: int = 1  # at most this many tokens: gather path; more: grouped (measured: bench layer --sweep)
    sync_free: bool = False  # the few-token path is moe_indexed (no host sync), not moe_gather: on CUDA
    decode_grouped: bool = False  # a compiled decode step's experts: moe_grouped's grouped_mm, not moe_indexed
    fused: cpu_kernel.KernelExperts | None = field(default=None, repr=False)  # w1 / w3 / w2 as they lie, on the C kernel
    kernel_max_tokens: int | None = None  # past this many tokens the kernel's layer runs torch's GEMMs (moe_sorted)
    w13_EFD: Tensor | None = field(default=None, repr=False)  # stacked, for grouped_mm
    w2_EFD: Tensor | None = field(default=None, repr=False)

    @property
    def n_experts(self) -> int:
        return len(self.w2)

    @property
    def kernel(self) -> bool:
        """The layer runs on the C kernel, all its experts in one call (moe_fused)."""
        return self.fused is not None

    def ffn(self, e: int, x_ND: Tensor) -> Tensor:
        linear = packed_linear if self.packed else F.linear
        return linear(self.activation(linear(x_ND, self.w13[e])), self.w2[e])

    def activation(self, h_NF: Tensor) -> Tensor:
        if self.act == "gelu":
            return F.gelu(h_NF)
        gate, up = h_NF[:, : self.d_ff], h_NF[:, self.d_ff:]
        return F.silu(gate) * up


def _halves_of_one(w1_EFD: Tensor, w3_EFD: Tensor) -> Tensor | None:
    """[w1; w3] as a view, where w3 starts right after w1 in one contiguous [E, 2F, D] storage; else None."""
    E, F, D = w1_EFD.shape
    if (w3_EFD.shape != w1_EFD.shape or w3_EFD.dtype != w1_EFD.dtype or w3_EFD.device != w1_EFD.device
            or w1_EFD.stride() != (2 * F * D, D, 1) or w3_EFD.stride() != w1_EFD.stride()
            or w1_EFD.untyped_storage().data_ptr() != w3_EFD.untyped_storage().data_ptr()
            or w3_EFD.data_ptr() != w1_EFD.data_ptr() + F * D * w1_EFD.element_size()):
        return None
    return w1_EFD.as_strided((E, 2 * F, D), (2 * F * D, D, 1))


def fuse_expert_weights(w1_EFD: Tensor, w2_EDF: Tensor, w3_EFD: Tensor | None, act: str, pack: bool,
                        grouped_mm: bool = False, sync_free: bool = False, kernel: bool = False) -> InferenceWeights:
    """The weights in inference layout: [w1; w3] stacked per expert, prepacked if `pack`, else plain. A
    copy, unless w1 and w3 already are the two halves of one [E, 2F, D] tensor (as a Mixtral import lays
    them out). `kernel`: the C kernel runs every token count on the weights as they lie, so no copy at all."""
    if kernel:
        return _kernel_weights(w1_EFD, w2_EDF, w3_EFD, act, pack or grouped_mm or sync_free)
    w13_EFD = w1_EFD if w3_EFD is None else _halves_of_one(w1_EFD.detach(), w3_EFD.detach())
    if w13_EFD is None:
        w13_EFD = torch.cat([w1_EFD, w3_EFD], dim=1)
    w13_EFD, w2_EDF = w13_EFD.detach().contiguous(), w2_EDF.detach().contiguous()
    if pack:
        w13, w2 = [pack_weight(w) for w in w13_EFD], [pack_weight(w) for w in w2_EDF]
    else:
        w13, w2 = list(w13_EFD.unbind(0)), list(w2_EDF.unbind(0))
    keep_stacked = grouped_mm or sync_free or not pack
    return InferenceWeights(act, w1_EFD.shape[1], w13, w2, pack, grouped_mm, sync_free=sync_free,
                            w13_EFD=w13_EFD if keep_stacked else None, w2_EFD=w2_EDF if keep_stacked else None)


def _kernel_weights(w1_EFD: Tensor, w2_EDF: Tensor, w3_EFD: Tensor | None, act: str,
                    other_layout: bool) -> InferenceWeights:
    """The layer on the C kernel: its one path for every token count (moe_fused), so nothing else is built
    (`w13` stays empty)."""
    if other_layout:
        raise ValueError("the CPU kernel runs the layer alone, on plain weights: not with pack, grouped_mm or sync_free")
    w1, w2, w3 = (None if w is None else _rows_contiguous(w.detach()) for w in (w1_EFD, w2_EDF, w3_EFD))
    return InferenceWeights(act, w1.shape[1], [], list(w2.unbind(0)), fused=cpu_kernel.KernelExperts(w1, w2, w3))


def _rows_contiguous(w_EIJ: Tensor) -> Tensor:
    """Each expert's matrix with contiguous rows, copied only if not: the experts themselves may lie at any
    stride (w1 and w3 of a Mixtral import are the halves of one [E, 2F, D] tensor)."""
    return w_EIJ if w_EIJ.stride()[1:] == (w_EIJ.shape[2], 1) else w_EIJ.contiguous()


def moe_fused(x_TD: Tensor, expert_ids_TK: Tensor, gates_TK: Tensor, w: InferenceWeights) -> Tensor:
    """Any token count on the C kernel: the layer's routed experts in one call (cpu_kernel.KernelExperts.moe:
    assignments sorted by expert, every expert hit, the gated sum back). No torch operation around it grows
    with the number of experts hit, which at a decode step of 8 sequences is most of them."""
    return w.fused.moe(x_TD, expert_ids_TK, gates_TK)


def moe_gather(x_TD: Tensor, expert_ids_TK: Tensor, gates_TK: Tensor, w: InferenceWeights) -> Tensor:
    """Decode path: each expert that any token chose runs on just the rows that chose it. The
    grouping is done in Python on the few ids (one device sync), which costs less than the
    sort / unique / where kernels it replaces when there are only a handful of assignments."""
    if w.fused is not None:
        return moe_fused(x_TD, expert_ids_TK, gates_TK, w)
    T, K = expert_ids_TK.shape
    rows: dict[int, list[int]] = {}
    for n, e in enumerate(expert_ids_TK.reshape(-1).tolist()):
        rows.setdefault(e, []).append(n)
    gates_N = gates_TK.reshape(-1).to(x_TD.dtype)
    if T == 1:  # one token: no gather and no scatter, just a gated sum of its K experts
        out_1D = None
        for e, (n,) in rows.items():
            y_1D = w.ffn(e, x_TD) * gates_N[n]
            out_1D = y_1D if out_1D is None else out_1D + y_1D
        return out_1D
    out_TD = torch.zeros_like(x_TD)
    for e, ns in rows.items():
        n_N = torch.tensor(ns, device=x_TD.device)
        tok_N = n_N // K
        out_TD.index_add_(0, tok_N, w.ffn(e, x_TD[tok_N]) * gates_N[n_N, None])
    return out_TD


def moe_indexed(x_TD: Tensor, expert_ids_TK: Tensor, gates_TK: Tensor, w: InferenceWeights) -> Tensor:
    """y_t = sum_k g_tk f_{e_tk}(x_t) with the K weight matrices of each token gathered from the stack:
    reads T*K experts' weights (a copy each), which for a decode step of a few rows is what any path reads."""
    T, K = expert_ids_TK.shape
    h_TKF = torch.einsum("td,tkfd->tkf", x_TD, w.w13_EFD[expert_ids_TK])
    a_TKF = w.activation(h_TKF.reshape(T * K, -1)).view(T, K, -1)
    y_TKD = torch.einsum("tkf,tkdf->tkd", a_TKF, w.w2_EFD[expert_ids_TK])
    return (y_TKD * gates_TK[..., None].to(y_TKD.dtype)).sum(dim=1)


def expert_counts(ids_N: Tensor, n_experts: int) -> Tensor:
    """Assignments per expert, [E] int32, computed where the ids are: torch.bincount would read the largest id
    back to the host to size its output (a sync on CUDA, and a shape a CUDA graph cannot hold)."""
    ones_N = torch.ones_like(ids_N, dtype=torch.int32)
    return torch.zeros(n_experts, dtype=torch.int32, device=ids_N.device).index_add_(0, ids_N, ones_N)


def moe_grouped(x_TD: Tensor, expert_ids_TK: Tensor, gates_TK: Tensor, w: InferenceWeights) -> Tensor:
    """Prefill path (and a compiled decode step's, with decode_grouped): assignments sorted by expert, one
    contiguous block per expert, one scatter back."""
    if w.fused is not None:
        return moe_fused(x_TD, expert_ids_TK, gates_TK, w)
    T, K = expert_ids_TK.shape
    ids_N = expert_ids_TK.reshape(-1)
    order = ids_N.argsort(stable=True)
    tok_N = order // K
    gates_N = gates_TK.reshape(-1)[order]
    x_ND = x_TD[tok_N]
    out_TD = torch.zeros_like(x_TD)
    if w.grouped_mm:  # the counts stay on the device: no host sync, fixed shapes (a compiled step may run this)
        offs = expert_counts(ids_N, w.n_experts).cumsum(0, dtype=torch.int32)
        h_NF = w.activation(F.grouped_mm(x_ND, w.w13_EFD.transpose(1, 2), offs=offs))
        y_ND = F.grouped_mm(h_NF, w.w2_EFD.transpose(1, 2), offs=offs)
        return out_TD.index_add_(0, tok_N, y_ND * gates_N[:, None].to(y_ND.dtype))
    # One scatter per expert straight from its output: no concatenated [N, D] copy.
    start = 0
    for e, n in enumerate(torch.bincount(ids_N, minlength=w.n_experts).tolist()):
        if n:
            sl = slice(start, start + n)
            out_TD.index_add_(0, tok_N[sl], w.ffn(e, x_ND[sl]) * gates_N[sl, None].to(x_TD.dtype))
            start += n
    return out_TD


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
        self.inference: InferenceWeights | None = None  # set by prepare_inference; used when autograd is off

    @property
    def n_experts(self) -> int:
        return self.w1.shape[0]

    @torch.no_grad()
    def prepare_inference(self, pack: bool | None = None, grouped_mm: bool | None = None,
                          gather_max: int | None = None, sync_free: bool | None = None,
                          kernel: bool = False, decode_grouped: bool = False,
                          kernel_max_tokens: int | None = None) -> InferenceWeights:
        """Build the inference layout from the current weights (again after any weight change).
        pack=None: oneDNN packing where available; grouped_mm=None and sync_free=None: on CUDA only;
        kernel: plain weights run by the C kernel (cpu_kernel.py), where the calibration measured it faster;
        decode_grouped: a compiled decode step runs the experts as one grouped_mm call (which torch compiles for
        bfloat16 only) rather than indexing each token's experts out of the stack."""
        dev, dtype = self.w1.device, self.w1.dtype
        pack = (onednn_packing_available(dev, dtype) and not kernel) if pack is None else pack
        grouped_mm = (dev.type == "cuda") if grouped_mm is None else grouped_mm
        sync_free = (dev.type == "cuda") if sync_free is None else sync_free
        if decode_grouped and (not grouped_mm or kernel or dtype != torch.bfloat16):
            raise ValueError(f"decode_grouped runs torch's grouped_mm on plain bfloat16 weights: not with "
                             f"grouped_mm={grouped_mm}, kernel={kernel} and {str(dtype).removeprefix('torch.')}")
        self.inference = fuse_expert_weights(self.w1, self.w2, self.w3, self.act, pack, grouped_mm, sync_free, kernel)
        self.inference.decode_grouped = decode_grouped
        self.inference.kernel_max_tokens = kernel_max_tokens if kernel else None
        if gather_max is not None:
            self.inference.gather_max = gather_max
        return self.inference

    def forward(self, x_TD: Tensor, expert_ids_TK: Tensor, gates_TK: Tensor, keep_TK: Tensor | None = None) -> Tensor:
        w = self.inference
        if w is None or keep_TK is not None or torch.is_grad_enabled():
            return moe_sorted(x_TD, expert_ids_TK, gates_TK, self.w1, self.w2, self.w3, keep_TK, self.observer)
        if torch.compiler.is_compiling():  # a compiled decode step (compiled.py): fixed shapes, no host sync
            return (moe_grouped if w.decode_grouped else moe_indexed)(x_TD, expert_ids_TK, gates_TK, w)
        if w.kernel_max_tokens is not None and x_TD.shape[0] > w.kernel_max_tokens:  # the kernel's weights, as they
            return moe_sorted(x_TD, expert_ids_TK, gates_TK, self.w1, self.w2, self.w3)  # lie, on torch's GEMMs
        if x_TD.shape[0] <= w.gather_max:
            return (moe_indexed if w.sync_free else moe_gather)(x_TD, expert_ids_TK, gates_TK, w)
        return moe_grouped(x_TD, expert_ids_TK, gates_TK, w)


class FeedForward(nn.Module):
    """The dense FFN of layers that `moe_layers` leaves out: one expert, always on."""

    def __init__(self, d_model: int, d_ff: int, act: str):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False) if act == "swiglu" else None

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(expert_hidden(x, self.w1.weight, None if self.w3 is None else self.w3.weight))
