"""Hardware capabilities that decide how to run: bf16 where the CPU has fast bf16 matrix units."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """AMX or AVX512-BF16: there a bf16 GEMM runs several times an fp32 one (about 5x measured here)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags
