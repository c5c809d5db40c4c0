"""oneDNN weight prepacking for CPU inference.

A weight reordered once into oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the
op inductor's freezing pass uses) skips the per-call reorder of a plain `F.linear`. Measured on this
project's 2-core AMD EPYC (docs/benchmarks.md): decode-sized bf16 GEMMs about 2x faster, and fp32
GEMMs of every size about 2.4x faster, because MKL's sgemm takes a slow code path on AMD CPUs while
oneDNN does not. Packed tensors are opaque (no autograd, no views), so packing is for inference only
and every packed module keeps its plain weight for training, state_dict and export.
"""

from __future__ import annotations

import platform

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def onednn_packing_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """x86 CPU builds of torch with mkldnn, for fp32 and bf16."""
    return (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_weight(w_OI: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w_OI.detach().contiguous(), 1)


def packed_linear(x_NI: Tensor, w_packed: Tensor) -> Tensor:
    """x @ w^T for a packed w; x may have any leading dims."""
    return torch.ops.mkldnn._linear_pointwise(x_NI, w_packed, None, "none", [], "")


class PackedLinear(nn.Module):
    """A bias-free nn.Linear whose no-grad forward runs on a packed copy of its weight. `weight` is the
    original Parameter, so state_dict keys and anything reading `.weight` are unchanged."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.packed = pack_weight(linear.weight)

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight)
        return packed_linear(x, self.packed)


def pack_linears_(module: nn.Module) -> int:
    """Replace every bias-free nn.Linear under `module` by a PackedLinear (re-pack existing ones, whose
    weights may have changed); returns how many."""
    n = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear and child.bias is None:
            setattr(module, name, PackedLinear(child))
            n += 1
        elif isinstance(child, PackedLinear):
            child.packed = pack_weight(child.weight)
            n += 1
        else:
            n += pack_linears_(child)
    return n
