"""oneDNN weight prepacking for CPU inference.

A weight reordered once into oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the
op inductor's freezing pass uses) skips the per-call reorder of a plain `F.linear`. Whether that pays
depends on the CPU: on an AVX512-BF16 EPYC, decode-sized bf16 GEMMs ran about 2x faster and fp32 GEMMs
about 2.4x (MKL's sgemm took a slow path there); on an AVX2-only EPYC, packed fp32 GEMMs ran slower
than plain ones, and bf16 cannot be packed at all (device.onednn_bf16_available). So packing is
*available* where torch can do it, and *used* where calibration.py measured it faster on this machine.
Packed tensors are opaque (no autograd, no views), so packing is for inference only and every packed
module keeps its plain weight for training, state_dict and export.
"""

from __future__ import annotations

import platform

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moeserve.errors import UserError
from moeserve.runtime import device as device_caps
from moeserve.runtime.cpu_kernel import KernelLinear


class PackingError(UserError):
    """Packing asked for where this CPU or build of torch cannot do it."""


def onednn_packing_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """x86 CPU builds of torch with mkldnn: fp32 always, bf16 only where oneDNN accepts bf16 weights
    (AVX512 BW/VL/DQ, AVX-NE-CONVERT or AMX)."""
    if not (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype == torch.float32 or device_caps.onednn_bf16_available()


def pack_weight(w_OI: Tensor) -> Tensor:
    if not onednn_packing_available(w_OI.device, w_OI.dtype):
        raise PackingError(f"oneDNN cannot pack {str(w_OI.dtype).removeprefix('torch.')} weights on this "
                           f"{w_OI.device.type} ({device_caps.cpu_name()}, {torch.backends.cpu.get_cpu_capability()}); "
                           f"run them unpacked (pack=False)")
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


def unpack_linears_(module: nn.Module) -> int:
    """Put back a plain bias-free nn.Linear (the same weight Parameter) for every PackedLinear or
    KernelLinear under `module`; returns how many."""
    n = 0
    for name, child in list(module.named_children()):
        if isinstance(child, (PackedLinear, KernelLinear)):
            linear = nn.Linear(child.weight.shape[1], child.weight.shape[0], bias=False, device="meta")
            linear.weight = child.weight
            setattr(module, name, linear)
            n += 1
        else:
            n += unpack_linears_(child)
    return n


def wrap_linears_(module: nn.Module, wrap: type[PackedLinear] | type[KernelLinear]) -> int:
    """Replace every plain bias-free nn.Linear under `module` by wrap(linear) (a PackedLinear or a KernelLinear,
    which keep its weight Parameter); returns how many. Call unpack_linears_ first to change a layout."""
    n = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear and child.bias is None:
            setattr(module, name, wrap(child))
            n += 1
        else:
            n += wrap_linears_(child, wrap)
    return n
