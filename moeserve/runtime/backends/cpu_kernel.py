"""C kernels for CPU inference (kernels/, one C file an op): a GEMM written for the few rows of decode, used by
the experts and the dense layers (gemm.c), a MoE layer's experts in one call (experts.c: KernelExperts), RMSNorm
(norm.c: rms_norm) and a decode step's attention over the KV cache (attention.c: attend_decode); float32 and
bfloat16. kernel_decode.py builds on them: the router (router.c) and a whole decode step in one call (step.c).

At one row, oneDNN's packed GEMV streams a weight near memory speed; at two to eight rows (an expert's
share of a decode step that batches several sequences) oneDNN and MKL fall to half of that, because
their small-M paths read the weight in a way that does not reuse it across rows. The kernel reads each
weight row once for all rows, so a serving step of 8 sequences, where each expert gets about 2 rows,
reads its experts at about the speed of one row. Past 8 rows it blocks for the L2 cache, level with
oneDNN's packed GEMM at an expert's share of a short prompt and behind it past that (docs/benchmarks.md).
One plain copy of the weights serves both; the calibration weighs the two ends.

In bfloat16 a decode step streams half the bytes. torch's own bf16 GEMMs at one row stream well below memory
speed (oneDNN's packed ones faster, the calibration times both); the kernel's bf16 path streams as fast as its
float32 one, so takes half the time. It uses AVX512-BF16's pairwise dot products where the CPU
has them and widens bf16 to float32 elsewhere (`bf16_native()` says which was built; $MOESERVE_KERNEL_CFLAGS
adds compiler flags, so that `-mno-avx512bf16` builds the other side on a CPU that has it).

The source ships with the package and is compiled on first use by the machine's C compiler ($CC, else
`cc`) with -march=native, like inductor's CPU code: it fits whatever vector units this CPU has, so the
built library is cached per CPU (model name and flags) and compiler. It links OpenMP, which resolves to
the libgomp torch has already loaded (one thread pool, not two fighting for the cores), and it is called
through ctypes, which lets go of the GIL for the call. `available()` is the capability probe: no
compiler, no OpenMP, a non-CPU tensor or a dtype other than float32 and bfloat16, or `MOESERVE_CPU_KERNEL=off`, and
the callers keep torch's kernels.

kernels/moeserve_kernels.h is the one declaration of the library's interface, which both sides follow: the C
files include it (a definition that disagrees with it does not compile), and the ctypes bindings here are derived
from its prototypes, the Structures checked against its structs and the library's moeserve_kernel_abi() against
ABI when the library loads (kernel_abi.py). A mistake there would not fail loudly: ctypes passes whatever it is
told, and a wrong argument reads or writes the wrong memory. Nor would a wrong op: every op is checked against its
torch reference on a small problem at load (kernel_checks.py), and a library that is off in any of them is not
used, unavailable_reason() naming the op. Whether it is used where available is the calibration's call
(calibration.py), made by timing it against the other layouts on this machine.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch
from torch import Tensor

from moeserve.cache import cache_root
from moeserve.runtime.backends import kernel_checks
from moeserve.runtime.backends.kernel_abi import DTYPES, KernelError, check_abi, check_structures, parse_header
from moeserve.files import publish, temporary_beside
from moeserve.runtime.device import cpu_name

log = logging.getLogger(__name__)

KERNELS = Path(__file__).with_name("kernels")  # every *.c there is built into the one library
HEADER = KERNELS / "moeserve_kernels.h"
ENV = "MOESERVE_CPU_KERNEL"  # "off": never build or use it
CFLAGS_ENV = "MOESERVE_KERNEL_CFLAGS"  # extra compiler flags, e.g. -mno-avx512bf16 (part of the cache key)
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")


def available() -> bool:
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here, or None where it can."""
    if os.environ.get(ENV, "").lower() == "off":
        return f"${ENV}=off"
    lib = _library()
    return lib if isinstance(lib, str) else None


def unavailable_for(dtype: torch.dtype) -> str | None:
    """Why the kernel cannot run `dtype` here, or None where it can."""
    if dtype not in DTYPES:
        return f"float32 and bfloat16 only, not {str(dtype).removeprefix('torch.')}"
    return unavailable_reason()


def identity() -> str | None:
    """The built library's name (a hash of the source, compiler, flags and CPU), or None where there is none:
    what a measurement of the kernel (calibration.py's cache) was taken with."""
    lib = None if os.environ.get(ENV, "").lower() == "off" else _library()
    return None if lib is None or isinstance(lib, str) else Path(lib._name).name


def bf16_native() -> bool:
    """Whether the built kernel multiplies bf16 with AVX512-BF16's dot products (else: widened to float32)."""
    lib = _library()
    if isinstance(lib, str):
        raise KernelError(f"the CPU kernel is not available: {lib}")
    return bool(lib.bf16_native())


def linear(x_NI: Tensor, w_OI: Tensor) -> Tensor:
    """x @ w^T, float32 or bfloat16 (both the same) on the CPU, rows contiguous; the same numbers whatever rows
    share the call. A decode step makes ~20 of these on weights of 1-8 MB, so the checks are the cheap ones a
    tensor answers without building objects (docs/design-notes.md)."""
    lib = _library()
    if isinstance(lib, str):
        raise KernelError(f"the CPU kernel is not available: {lib}")
    dtype = w_OI.dtype
    if x_NI.dtype != dtype or dtype not in DTYPES or not (x_NI.is_cpu and w_OI.is_cpu):
        raise KernelError(f"the CPU kernel takes float32 or bfloat16 CPU tensors of one dtype, not "
                          f"{x_NI.dtype} x {w_OI.dtype} on {x_NI.device.type}")
    if w_OI.stride(-1) != 1:
        raise KernelError("the CPU kernel needs a weight with contiguous rows")
    (O, I), *lead = w_OI.shape, *x_NI.shape[:-1]
    if x_NI.shape[-1] != I:
        raise KernelError(f"shapes do not match: x {list(x_NI.shape)} and w {[O, I]}")
    row = I  # the distance between x's rows: I when contiguous
    if not x_NI.is_contiguous():  # rows at one stride: a view where the leading dims allow it, else a copy
        x_NI = (x_NI if x_NI.stride(-1) == 1 else x_NI.contiguous()).reshape(-1, I)
        row = x_NI.stride(0)
    n = math.prod(lead)
    y = torch.empty(*lead, O, dtype=dtype)
    if n and O:
        fn = lib.linear_nt if dtype == torch.float32 else lib.linear_nt_bf16
        fn(x_NI.data_ptr(), row, w_OI.data_ptr(), w_OI.stride(0), y.data_ptr(), O, n, O, I, torch.get_num_threads())
    return y


def rms_norm(x: Tensor, w_D: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension (float32 or bfloat16, x and w of one dtype, on the CPU): what torch's
    rms_norm computes, in float32 and rounded once, in one call instead of half a dozen operations."""
    lib = _library()
    if isinstance(lib, str):
        raise KernelError(f"the CPU kernel is not available: {lib}")
    D = x.shape[-1]
    if x.dtype != w_D.dtype or x.dtype not in DTYPES or not (x.is_cpu and w_D.is_cpu) or w_D.shape != (D,):
        raise KernelError(f"rms_norm takes float32 or bfloat16 CPU rows and a weight of their width, not "
                          f"{x.dtype} {list(x.shape)} and {w_D.dtype} {list(w_D.shape)}")
    x, w_D = x.contiguous(), w_D.contiguous()
    y = torch.empty_like(x)
    fn = lib.rms_norm if x.dtype == torch.float32 else lib.rms_norm_bf16
    fn(x.data_ptr(), w_D.data_ptr(), y.data_ptr(), x.numel() // D if D else 0, D, eps)
    return y


def _check_rows(what: str, B: int, *rows: Tensor, names: str = "slots and bounds") -> None:
    """A decode call's numbers per row (slots and causal bounds, or tokens, slots and positions): B contiguous
    int64s each, which the C code reads as they are."""
    for t in rows:
        if t.dtype != torch.int64 or t.shape != (B,) or not t.is_contiguous() or not t.is_cpu:
            raise KernelError(f"{what}: {names} are {B} contiguous int64s, not {t.dtype} {list(t.shape)}")


def attend_decode(q_BHD: Tensor, k_cache: Tensor, v_cache: Tensor, slots_B: Tensor, lo_B: Tensor, hi_B: Tensor,
                  scale: float, new_kv: tuple[Tensor, Tensor] | None = None,
                  rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Attention of one query per row (a decode step) over the KV cache where it lies: row b's heads q [B, H, Dh]
    against keys and values [slots, G, max_len, Dh] of slot slots_B[b] at positions lo_B[b] .. hi_B[b] - 1
    (int64), query head h reading kv head h // (H // G); -> [B, H, Dh]. The positions are the caller's to have
    checked against the cache (CacheRows.decode_bounds does, once a step): this reads what it is told to.

    new_kv = (k, v) [B, G, Dh]: this step's keys and values, written first at position hi_B[b] - 1 of each row's
    slot (CacheRows.write's job). rope = (cos, sin) [B, Dh]: q and the new keys rotated first, as apply_rope
    rotates them (the same roundings, in the queries' dtype). A layer's decode attention in one call."""
    lib = _library()
    if isinstance(lib, str):
        raise KernelError(f"the CPU kernel is not available: {lib}")
    (B, H, Dh), (_, G, L, Dk) = q_BHD.shape, k_cache.shape
    dtype = q_BHD.dtype
    if (dtype not in DTYPES or k_cache.dtype != dtype or v_cache.dtype != dtype or v_cache.shape != k_cache.shape
            or Dk != Dh or H % G or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        raise KernelError(f"attend_decode: queries {dtype} {list(q_BHD.shape)} against a cache of {k_cache.dtype} "
                          f"{list(k_cache.shape)} (contiguous float32 or bfloat16, one dtype, heads dividing)")
    _check_rows("attend_decode", B, slots_B, lo_B, hi_B)
    extra = []
    for name, pair, shape in (("new_kv", new_kv, (B, G, Dh)), ("rope", rope, (B, Dh))):
        for t in pair or ():
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise KernelError(f"attend_decode: {name} takes {dtype} {list(shape)}, not {t.dtype} {list(t.shape)}")
        extra.append(None if pair is None else [t.contiguous() for t in pair])
    (kv, cs) = extra
    if cs is not None and Dh % 2:
        raise KernelError(f"attend_decode: rotate-half RoPE needs an even head dim, not {Dh}")
    q_BHD = q_BHD.contiguous()
    y = torch.empty_like(q_BHD)
    fn = lib.attend_decode if dtype == torch.float32 else lib.attend_decode_bf16
    fn(q_BHD.data_ptr(), *(None, None) if kv is None else (kv[0].data_ptr(), kv[1].data_ptr()),
       *(None, None) if cs is None else (cs[0].data_ptr(), cs[1].data_ptr()), k_cache.data_ptr(), v_cache.data_ptr(),
       y.data_ptr(), slots_B.data_ptr(), lo_B.data_ptr(), hi_B.data_ptr(), B, H, G, Dh, L, scale,
       torch.get_num_threads())
    return y


class KernelExperts:
    """One MoE layer's stacked expert weights as `experts_ffn` takes them: w1 and w3 [E, F, D], w2 [E, D, F],
    each expert's matrix with contiguous rows and the experts at any fixed stride, so that the parameters
    are used where they lie (a checkpoint's memory-mapped pages, or the two halves of a Mixtral import's
    gate-up tensor): no [w1; w3] copy at load. A call runs the whole layer:
    both GEMMs and the activation of every expert hit, two barriers apart, in place of a dozen torch
    operations per expert. w3=None: a gelu FFN. float32 or bfloat16 (in bf16 the activation is computed in
    float32 and rounded once)."""

    def __init__(self, w1_EFD: Tensor, w2_EDF: Tensor, w3_EFD: Tensor | None = None):
        why = unavailable_reason()  # $MOESERVE_CPU_KERNEL=off included
        if why is not None:
            raise KernelError(f"the CPU kernel is not available: {why}")
        E, F_, D = w1_EFD.shape
        dtype = w1_EFD.dtype
        want = {"w1": (E, F_, D), "w2": (E, D, F_), "w3": (E, F_, D)}
        given = {"w1": w1_EFD, "w2": w2_EDF} | ({} if w3_EFD is None else {"w3": w3_EFD})
        for name, w in given.items():
            if (w.dtype != dtype or dtype not in DTYPES or w.device.type != "cpu" or w.dim() != 3
                    or w.stride()[1:] != (w.shape[2], 1)):
                raise KernelError(f"the CPU kernel takes float32 or bfloat16 CPU expert weights (one dtype) with "
                                  f"contiguous rows, not "
                                  f"{w.dtype} on {w.device.type} with strides {tuple(w.stride())}")
            if tuple(w.shape) != want[name]:
                raise KernelError(f"expert {name} of shape {tuple(w.shape)}: expected {want[name]}")
        self.lib, self.w1, self.w2, self.w3 = _library(), w1_EFD, w2_EDF, w3_EFD
        # what every call passes (and KernelDecodeStep's layers), read once: the tensors are held here, so their
        # storage does not move
        self.pointers = (w1_EFD.data_ptr(), None if w3_EFD is None else w3_EFD.data_ptr(), w2_EDF.data_ptr(),
                         w1_EFD.stride(0), 0 if w3_EFD is None else w3_EFD.stride(0), w2_EDF.stride(0))
        self.E, self.D, self.F, self._h = E, D, F_, (1 if w3_EFD is None else 2) * F_
        self.dtype = dtype

    def __call__(self, x_ND: Tensor, counts_E: Tensor) -> Tensor:
        """x_ND: the routed rows sorted by expert, counts_E[e] (int64) of them for expert e; their outputs [N, D]."""
        if not x_ND.is_contiguous():
            x_ND = x_ND.contiguous()
        if counts_E.dtype != torch.int64 or not counts_E.is_contiguous():
            counts_E = counts_E.to(torch.int64).contiguous()
        N, D = x_ND.shape
        if x_ND.dtype != self.dtype or D != self.D:
            raise KernelError(f"expert inputs: {self.dtype} rows of {self.D}, not {x_ND.dtype} rows of {D}")
        if counts_E.shape != (self.E,) or sum(counts_E.tolist()) != N:  # else it reads out of bounds
            raise KernelError(f"{N} rows and expert counts {counts_E.tolist()} do not match")
        h = torch.empty(N, self._h, dtype=torch.float32)
        y = torch.empty(N, self.D, dtype=self.dtype)
        if self.dtype == torch.float32:
            self.lib.experts_ffn(x_ND.data_ptr(), counts_E.data_ptr(), *self.pointers, h.data_ptr(), y.data_ptr(),
                                 self.E, self.D, self.F, torch.get_num_threads())
        else:
            hb = torch.empty(N, self.F, dtype=torch.bfloat16)  # the activation, the second GEMM's input
            self.lib.experts_ffn_bf16(x_ND.data_ptr(), counts_E.data_ptr(), *self.pointers, h.data_ptr(),
                                      hb.data_ptr(), y.data_ptr(), self.E, self.D, self.F, torch.get_num_threads())
        return y

    def moe(self, x_TD: Tensor, ids_TK: Tensor, gates_TK: Tensor) -> Tensor:
        """The layer's output for routed tokens: y_t = sum_k gates[t, k] * expert_{ids[t, k]}(x_t), the sorting by
        expert, the gather and the gated sum back in the same call, in place of the dozen torch operations around
        __call__ that were there before (the tests hold them: the same roundings in the same order). ids int64
        [T, K] (other integer dtypes are widened); gates in x's dtype."""
        T, D = x_TD.shape
        if x_TD.dtype != self.dtype or D != self.D or ids_TK.dim() != 2 or ids_TK.shape[0] != T:
            raise KernelError(f"routed experts: {self.dtype} rows of {self.D} and [T, K] ids, not {x_TD.dtype} "
                              f"{list(x_TD.shape)} and {list(ids_TK.shape)}")
        if gates_TK.shape != ids_TK.shape:
            raise KernelError(f"gates {list(gates_TK.shape)} for ids {list(ids_TK.shape)}")
        x_TD, gates_TK = x_TD.contiguous(), gates_TK.to(self.dtype).contiguous()
        ids_TK = ids_TK.to(torch.int64).contiguous()
        out = torch.empty_like(x_TD)
        fn = self.lib.moe_ffn if self.dtype == torch.float32 else self.lib.moe_ffn_bf16
        status = fn(x_TD.data_ptr(), ids_TK.data_ptr(), gates_TK.data_ptr(), T, ids_TK.shape[1], *self.pointers,
                    out.data_ptr(), self.E, self.D, self.F, torch.get_num_threads())
        if status == -1:
            raise KernelError(f"expert ids outside [0, {self.E}): {sorted(set(ids_TK.flatten().tolist()))}")
        if status != 0:
            raise MemoryError(f"routed experts: no memory for the scratch of {T} x {ids_TK.shape[1]} rows")
        return out


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The built, bound and checked library, or why there is none (once per process)."""
    if platform.system() == "Windows":
        return "not built on Windows"
    try:
        path = _build()
        lib = ctypes.CDLL(str(path))  # CDLL (not PyDLL): the GIL is released during each call
        check_abi(lib)
        header = parse_header(HEADER.read_text())
        for name, (restype, argtypes) in header.functions.items():
            fn = getattr(lib, name)  # AttributeError: a declared function the library lacks
            fn.restype, fn.argtypes = restype, argtypes
        check_structures(header)
    except (OSError, AttributeError, subprocess.SubprocessError, KernelError) as e:
        log.info("CPU kernel not used: %s", e)
        return str(e)
    why = kernel_checks.self_check(lib)
    if why is not None:
        log.warning("CPU kernel not used: %s", why)
        return why
    return lib


def _build() -> Path:
    """Compile every kernels/*.c once per (sources, headers, compiler, flags, CPU) into one library; later
    processes load the cached one."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise KernelError(f"no C compiler ({cc!r} not found; set $CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    flags = (*FLAGS, *os.environ.get(CFLAGS_ENV, "").split())
    sources = sorted(KERNELS.glob("*.c"))
    texts = [f"{p.name}\n{p.read_text()}" for p in sorted([*sources, *KERNELS.glob("*.h")])]
    key = "\n".join([*texts, version, " ".join(flags), cpu_name(), _cpu_flags()])
    out = cache_root() / "kernels" / f"kernels-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    built = temporary_beside(out)  # published whole: a concurrent process sees no half-written library
    try:
        r = subprocess.run([cc, *flags, *map(str, sources), "-o", str(built), "-lm"], capture_output=True,
                           text=True, timeout=300)
        if r.returncode != 0:
            raise KernelError(f"{cc} could not build it: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
        publish(built, out)
    finally:
        built.unlink(missing_ok=True)
    log.info("built the CPU kernel: %s", out)
    return out


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), so that a cache shared between machines never loads a library
    built for another CPU's instructions."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()
