"""An MoE layer's experts laid out for inference (`Experts` in runtime/experts.py is the math they compute).

Shape legend: T tokens, D model dim, F expert hidden dim, E experts, K experts per token.

`InferenceWeights`: gate and up of SwiGLU fused into one [2F, D] matrix per expert (one GEMM reads x once),
on x86 CPUs each matrix prepacked for oneDNN (packing.py) where the calibration measured it faster. Paths:

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
  moe_reduced   a compiled decode step of at most `decode_reduce_max` rows: each token's K experts as
                products summed over D, `(x * W[ids]).sum(-1)`, which inductor lowers to one reduction kernel
                per matrix that loads the indexed weights where they lie: a GEMV reading each (token, expert)
                pair's weights once, with no copy out of the stack and none of grouped_mm's sort and scatter.
                Eager it would materialize the products; it runs traced only.
  moe_fused     on the C kernel (cpu_kernel.py, where the calibration chose it): any token count, the
                layer's experts in one call (both GEMMs and the activation), one scatter back.

Which one a layer runs is the class a backend lays it out as: `TorchExperts` (gather or indexed up to
`gather_max` tokens, grouped beyond: the threshold is measured, `moeserve bench layer --sweep`),
`GraphExperts` (the compiled backend's: its traced decode step takes the fixed-shape path) and `FusedExperts`
(the C kernel up to `max_tokens`, torch's GEMMs on the same weights past it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from moeserve.runtime.backends import cpu_kernel
from moeserve.runtime.backends.layout import Laid
from moeserve.runtime.backends.packing import onednn_packing_available, pack_weight, packed_linear
from moeserve.runtime.experts import BiasedExperts, Experts, combine, dispatch, expert_forward, moe_sorted


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
    decode_reduce_max: int = 0  # a compiled decode step of at most this many rows: moe_reduced (0: never)
    fused: cpu_kernel.KernelExperts | None = field(default=None, repr=False)  # w1 / w3 / w2 as they lie, on the C kernel
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


def moe_reduced(x_TD: Tensor, expert_ids_TK: Tensor, gates_TK: Tensor, w: InferenceWeights) -> Tensor:
    """moe_indexed's sum with each matrix product written as a product summed over its inner dimension, in float32:
    traced, inductor fuses the weights' indexing into the reduction (module docstring), so a decode step of one or
    two rows reads each of its experts' weights once, at the speed of a GEMV."""
    T, K = expert_ids_TK.shape
    h_TKF = (x_TD.float()[:, None, None, :] * w.w13_EFD[expert_ids_TK].float()).sum(-1)
    a_TKF = w.activation(h_TKF.reshape(T * K, -1)).view(T, K, -1)
    y_TKD = (a_TKF[:, :, None, :] * w.w2_EFD[expert_ids_TK].float()).sum(-1)
    return (y_TKD * gates_TK[..., None].float()).sum(dim=1).to(x_TD.dtype)


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


class TorchExperts(Laid, Experts):
    """An `Experts` on torch's GEMMs over `InferenceWeights`: gather (or, sync-free, indexed) up to `w.gather_max`
    tokens, grouped beyond. A capacity limit's mask (keep_TK) takes the sorted path, which applies it."""

    w: InferenceWeights

    def forward(self, x_TD: Tensor, expert_ids_TK: Tensor, gates_TK: Tensor, keep_TK: Tensor | None = None) -> Tensor:
        w = self.w
        if keep_TK is not None:
            return moe_sorted(x_TD, expert_ids_TK, gates_TK, self.w1, self.w2, self.w3, keep_TK)
        if x_TD.shape[0] <= w.gather_max:
            return (moe_indexed if w.sync_free else moe_gather)(x_TD, expert_ids_TK, gates_TK, w)
        return moe_grouped(x_TD, expert_ids_TK, gates_TK, w)


class GraphExperts(TorchExperts):
    """The compiled backend's experts: eager calls (a prompt) as TorchExperts; the traced decode step takes the
    path with fixed shapes and no host sync, one grouped_mm call (`decode_grouped`) or each token's experts
    indexed out of the stack. The same module serves both, since the step is traced from the eager model."""

    def forward(self, x_TD: Tensor, expert_ids_TK: Tensor, gates_TK: Tensor, keep_TK: Tensor | None = None) -> Tensor:
        if torch.compiler.is_compiling():  # a step's row count is static in its graph: one path per bucket
            w = self.w
            path = (moe_reduced if x_TD.shape[0] <= w.decode_reduce_max else
                    moe_grouped if w.decode_grouped else moe_indexed)
            return path(x_TD, expert_ids_TK, gates_TK, w)
        return super().forward(x_TD, expert_ids_TK, gates_TK, keep_TK)


def moe_indexed_biased(x_TD: Tensor, expert_ids_TK: Tensor, gates_TK: Tensor, e: BiasedExperts) -> Tensor:
    """moe_indexed for BiasedExperts: y_t = sum_k g_tk (act(x W1^T + b1, x W3^T + b3) W2^T + b2), each token's K
    experts' weights and biases gathered from the stacks, with no host sync and fixed shapes."""
    def bias(b: Tensor | None) -> Tensor | float:
        return 0.0 if b is None else b[expert_ids_TK]

    gate = torch.einsum("td,tkfd->tkf", x_TD, e.w1[expert_ids_TK]) + bias(e.b1)
    up = None if e.w3 is None else torch.einsum("td,tkfd->tkf", x_TD, e.w3[expert_ids_TK]) + bias(e.b3)
    y_TKD = torch.einsum("tkf,tkdf->tkd", e.hidden(gate, up), e.w2[expert_ids_TK]) + bias(e.b2)
    return (y_TKD * gates_TK[..., None].to(y_TKD.dtype)).sum(dim=1)


class GraphBiasedExperts(Laid, BiasedExperts):
    """The compiled backend's BiasedExperts (gpt-oss): eager calls (a prompt) as the module's own sorted dispatch;
    the traced decode step indexes each token's experts (moe_indexed_biased), as GraphExperts does for `Experts`."""

    def forward(self, x_TD: Tensor, expert_ids_TK: Tensor, gates_TK: Tensor, keep_TK: Tensor | None = None) -> Tensor:
        if keep_TK is None and torch.compiler.is_compiling():
            return moe_indexed_biased(x_TD, expert_ids_TK, gates_TK, self)
        return super().forward(x_TD, expert_ids_TK, gates_TK, keep_TK)


class FusedExperts(Laid, Experts):
    """An `Experts` on the C kernel, its weights used where they lie: up to `max_tokens` tokens the layer's experts
    in one call (moe_fused); past it, torch's GEMMs on the same plain weights (moe_sorted), faster there
    (DispatchPlan.kernel_max_tokens), in float32 on upcast copies where `upcast` (moe_sorted_fp32)."""

    w: InferenceWeights
    max_tokens: int | None
    upcast: bool = False

    def forward(self, x_TD: Tensor, expert_ids_TK: Tensor, gates_TK: Tensor, keep_TK: Tensor | None = None) -> Tensor:
        if keep_TK is not None or (self.max_tokens is not None and x_TD.shape[0] > self.max_tokens):
            sorted_ = moe_sorted_fp32 if self.upcast else moe_sorted
            return sorted_(x_TD, expert_ids_TK, gates_TK, self.w1, self.w2, self.w3, keep_TK)
        return moe_fused(x_TD, expert_ids_TK, gates_TK, self.w)


def moe_sorted_fp32(x_TD: Tensor, expert_ids_TK: Tensor, gates_TK: Tensor, w1_EFD: Tensor, w2_EDF: Tensor,
                    w3_EFD: Tensor | None = None, keep_TK: Tensor | None = None) -> Tensor:
    """moe_sorted with float32 GEMMs: each expert's rows and weights upcast as it runs, the output cast back. On a
    CPU without bf16 arithmetic (AVX2) a bf16 GEMM converts inside its inner loop and runs at a fraction of float32
    speed; the upcast is one pass over an expert's weights per call, which a scoring batch's hundreds of rows per
    expert repay many times (the calibration measures whether they do: DispatchPlan.upcast_experts). One expert's
    copy lives at a time."""
    d = dispatch(x_TD, expert_ids_TK, gates_TK, w1_EFD.shape[0], keep_TK)
    ys = [expert_forward(e, x_ND.float(), w1_EFD[e].float(), w2_EDF[e].float(),
                         None if w3_EFD is None else w3_EFD[e].float(), None).to(x_TD.dtype)
          for e, x_ND in enumerate(d.blocks()) if x_ND.shape[0]]
    return combine(d, torch.cat(ys) if ys else d.x_ND.new_zeros(0, w2_EDF.shape[1]), x_TD)


@torch.no_grad()
def lay_out_experts(experts: Experts, pack: bool | None = None, grouped_mm: bool | None = None,
                    gather_max: int | None = None, sync_free: bool | None = None, kernel: bool = False,
                    decode_grouped: bool = False, kernel_max_tokens: int | None = None,
                    graph: bool = False, upcast: bool = False, decode_reduce_max: int = 0,
                    ) -> TorchExperts | FusedExperts:
    """`experts` laid out for inference from its current weights (again after any weight change).
    pack=None: oneDNN packing where available; grouped_mm=None and sync_free=None: on CUDA only;
    kernel: plain weights run by the C kernel (cpu_kernel.py), where the calibration measured it faster;
    graph: the compiled step's form (GraphExperts), decode_grouped: its experts as one grouped_mm call (which torch
    compiles for bfloat16 only) rather than indexing each token's experts out of the stack, and up to
    decode_reduce_max rows as moe_reduced's GEMVs."""
    dev, dtype = experts.w1.device, experts.w1.dtype
    pack = (onednn_packing_available(dev, dtype) and not kernel) if pack is None else pack
    grouped_mm = (dev.type == "cuda") if grouped_mm is None else grouped_mm
    sync_free = (dev.type == "cuda") if sync_free is None else sync_free
    if decode_grouped and (not grouped_mm or kernel or dtype != torch.bfloat16):
        raise ValueError(f"decode_grouped runs torch's grouped_mm on plain bfloat16 weights: not with "
                         f"grouped_mm={grouped_mm}, kernel={kernel} and {str(dtype).removeprefix('torch.')}")
    w = fuse_expert_weights(experts.w1, experts.w2, experts.w3, experts.act, pack, grouped_mm, sync_free, kernel)
    w.decode_grouped, w.decode_reduce_max = decode_grouped, decode_reduce_max
    if gather_max is not None:
        w.gather_max = gather_max
    if kernel:
        return FusedExperts.of(experts, w=w, max_tokens=kernel_max_tokens, upcast=upcast)
    return (GraphExperts if graph else TorchExperts).of(experts, w=w)
