"""What this machine can run, asked of torch rather than assumed from the machine the code was written on.

Two CPU questions decide how a model runs, and they have different answers on common x86 CPUs:
- is bf16 *fast* here (AMX or AVX512-BF16: native bf16 dot products, several times fp32)? That picks
  the default dtype.
- can oneDNN *pack* bf16 weights here? torch's `_reorder_linear_weight` needs AVX512 BW/VL/DQ,
  AVX-NE-CONVERT or AMX (ideep's `has_bf16_type_support`) and raises on anything less, e.g. an
  AVX2-only AMD EPYC. bf16 still runs there, through plain (unpacked) kernels: slow but correct.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

import torch


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """AMX or AVX512-BF16: there a bf16 GEMM runs several times as fast as an fp32 one."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # a torch without the probes: read the flags the kernel reports
        try:
            flags = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
        return "amx_bf16" in flags or "avx512_bf16" in flags


@functools.cache
def onednn_bf16_available() -> bool:
    """Whether oneDNN accepts bf16 weights on this CPU: torch's own check, the one that makes
    `mkldnn._reorder_linear_weight` raise where it fails."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # an op this build of torch lacks: nothing to pack with
        return False


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), for reports and calibration keys."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# CPU flags that decide which kernels run (the vector width, bf16 and int8 dot products, AMX tiles)
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_flags() -> list[str]:
    """Which of REPORTED_FLAGS the kernel reports for this CPU ([] where there is no /proc/cpuinfo)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in REPORTED_FLAGS if f in have]
    except OSError:
        pass
    return []


def machine() -> dict:
    """The machine a measurement ran on, written beside every benchmark and calibration."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_flags": cpu_flags(),
            "fast_bf16": cpu_has_fast_bf16(), "onednn_bf16": onednn_bf16_available(), "cores": os.cpu_count(),
            "gpu": gpu, "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version()}


@functools.cache
def dtype_unsupported(device: str, dtype: torch.dtype) -> str | None:
    """Why torch cannot run a model in `dtype` on `device` here (None: it can), found by running the
    kinds of operation a forward pass uses on tiny inputs: matmul, softmax, attention, embedding."""
    try:
        x = torch.randn(2, 4, 8, device=device).to(dtype)
        w = torch.randn(8, 8, device=device).to(dtype)
        y = torch.nn.functional.linear(x, w).softmax(-1)
        q = y[:, None]
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        torch.nn.functional.embedding(torch.tensor([[0, 1]], device=device), w)
    except (RuntimeError, NotImplementedError) as e:
        return str(e).splitlines()[0]
    return None
