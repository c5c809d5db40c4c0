"""oneDNN weight prepacking for CPU inference.

A weight reordered once into oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the
op inductor's freezing pass uses) skips the per-call reorder of a plain `F.linear`. Whether that pays
depends on the CPU: faster on an AVX512-BF16 EPYC (MKL's sgemm took a slow path there), slower than plain
fp32 GEMMs on an AVX2-only one, where bf16 cannot be packed at all (device.onednn_bf16_available). So packing is
*available* where torch can do it, and *used* where calibration.py measured it faster on this machine.
Packed tensors are opaque (no autograd, no views), so packing is for inference only and every packed
module keeps its plain weight for state_dict and export (backends/layout.py).
"""

from __future__ import annotations

import platform

import torch
from torch import Tensor, nn

from moeserve.errors import UserError
from moeserve.runtime import device as device_caps
from moeserve.runtime.backends.layout import Laid


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


class PackedLinear(Laid, nn.Linear):
    """A bias-free linear map (an nn.Linear, or a TiedHead) run on a packed copy of its weight: `packed`, made by
    `PackedLinear.of(linear, packed=pack_weight(linear.weight))`. The weight Parameter stays where it was."""

    packed: Tensor

    def forward(self, x: Tensor) -> Tensor:
        return packed_linear(x, self.packed)
