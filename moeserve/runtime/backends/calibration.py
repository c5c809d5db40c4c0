"""How this machine runs a model: the weight layout and dispatch path of its DispatchPlan (plan.py), measured here
rather than assumed.

Three choices decide an MoE model's speed on a CPU, and their best answers differ from CPU to CPU:

  pack_dense, pack_experts   oneDNN-packed weights or plain ones (packing.py): faster on some CPUs, slower
                             at some shapes on others, and bf16 weights cannot be packed at all without
                             AVX512 (device.onednn_bf16_available).
  gather_max                 up to how many tokens the gather path beats the grouped one (experts.py)
  grouped_mm                 for many tokens, one grouped_mm call or a loop over the experts
  kernel_experts             plain expert weights run by a C GEMM written for decode's few rows
                             (cpu_kernel.py), where it builds: ahead of oneDNN at a few rows, behind it
                             at a prompt's hundreds (docs/design-notes.md has the figures)

`plan_for` times each candidate on random weights of the model's shapes (a GEMM's time does not depend on the
values; each call reads other weights than the last, STREAM_BYTES) the first time a shape is loaded on a machine,
and caches the plan as JSON under the cache directory, keyed by the CPU, torch's thread count and version, the
dtype and the shape: seconds, once. MOESERVE_CALIBRATION=off (or mode "off") uses `default_plan` without
measuring; "redo" measures again. On CUDA the defaults stand (grouped_mm for many tokens, and for a compiled bf16
decode step), but for the rows up to which that step's experts run as GEMVs instead, which decode_calibration.py
measures on the GPU (`gpu_decode_plan`, which the executor asks for a CUDA model instead of `plan_for`).

How a plan is chosen: each candidate configuration (plain weights with a loop, plain with grouped_mm,
packed with a loop, packed for the gather path with grouped_mm beyond) is timed at token counts 1, 2, 4,
..., 512 on the path it would take there (gather up to its own crossover, grouped beyond), and the
C kernel where it builds. The winner is the configuration with the least mean time per token over the
ladder, as if the same number of tokens went through the layer at every count: a server reads prompts in
chunks of tens to hundreds of tokens and generates as many tokens again one step at a time, at batch sizes
of 1 to tens. A sum of raw times would let the 512-token count decide alone; a geometric mean of time /
best weighs a decode step and a prefill a hundred times longer alike, and let the measurement's noise choose
between two layouts from one run to the next (docs/design-notes.md). Within 2% of the winner, the simpler
configuration (plain before the kernel before packed, a loop before grouped_mm; see CONFIGS) is kept: that is
noise.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from moeserve.cache import cache_root
from moeserve.config import MoEConfig
from moeserve.errors import UserError
from moeserve.files import atomic_write
from moeserve.runtime.backends import cpu_kernel
from moeserve.runtime.device import cpu_name
from moeserve.runtime.backends.experts import (InferenceWeights, fuse_expert_weights, moe_gather, moe_grouped,
                                              moe_sorted_fp32)
from moeserve.runtime.backends.packing import onednn_packing_available, pack_weight, packed_linear
from moeserve.runtime.backends.plan import DispatchPlan, default_plan

VERSION = 9  # bump when what is measured or how it is decided changes: older cache files are then ignored
MODES = ("auto", "off", "redo")
ENV = "MOESERVE_CALIBRATION"
# Up to a prefill-sized 512: a ranking at 128 tokens need not hold at 1024, so the ladder reaches the regime where
# the GEMMs dominate.
TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
DENSE_TOKENS = (1, 16, 128)
# Where the C kernel was chosen, it and torch's GEMMs on the same plain weights are timed again at a prompt's or a
# scoring batch's row counts: the kernel's lead at a few tokens turns at a few hundred, so past the crossover the
# kernel's layers run torch's GEMMs (DispatchPlan.kernel_max_tokens; figures in docs/design-notes.md).
LARGE_TOKENS = (1024, 2048)
LARGE_DENSE_TOKENS = (512, 2048)
COUNT_S = 0.1  # each count is timed for about this long, and at least MIN_ROUNDS rounds
# A model's decode step reads each weight once, from memory, not from a cache: consecutive calls of a
# measurement go to different weights (dense) and different experts (MoE), cycling through about this many
# bytes. One hot [D, D] weight stays in the last-level cache and times packed and plain alike, where a model's
# stream of weights does not.
STREAM_BYTES = 128 << 20
ROUTINGS = 8  # routings cycled through per token count: at one token, top_k of E experts each
MAX_S = 20.0  # a model so large that the ladder takes longer stops at the count it has reached
MIN_ROUNDS, MAX_ROUNDS = 3, 25
TIE = 1.02  # within 2% of the best score, the simpler configuration wins

# configuration -> (gather candidate, grouped candidate, pack_experts, grouped_mm), simplest first: what a tie
# goes to. The C kernel reads the weights where they lie (a checkpoint's mapped pages: no copy at load), so it
# comes before packing, which copies every expert at load (seconds, and the experts' memory again). The last
# holds the experts twice over (packed for the gather path, stacked plain for grouped_mm): a third more memory
# than "packed", so it is taken only where it beats every other by more than the tie margin.
CONFIGS: dict[str, tuple[str, str, bool, bool]] = {
    "plain": ("gather/plain", "grouped/plain", False, False),
    "kernel": ("gather/kernel", "grouped/kernel", False, False),
    "plain + grouped_mm": ("gather/plain", "grouped_mm/plain", False, True),
    "packed": ("gather/packed", "grouped/packed", True, False),
    "packed + grouped_mm": ("gather/packed", "grouped_mm/plain", True, True),
}

log = logging.getLogger("moeserve.runtime")


class CalibrationError(UserError):
    """A calibration mode other than auto, off or redo."""


@dataclass(frozen=True)
class ExpertShape:
    """What the time of an MoE layer depends on."""

    d_model: int
    d_ff: int
    n_experts: int
    top_k: int
    act: str

    @classmethod
    def of(cls, cfg: MoEConfig) -> "ExpertShape":
        discrete = cfg.router == "vq" and cfg.vq_mode == "discrete"  # one expert per token
        # gpt-oss's clamped SwiGLU times as the SwiGLU: the same three matrices, which is what the paths differ in
        act = "swiglu" if cfg.expert_act == "clamped_swiglu" else cfg.expert_act
        return cls(cfg.d_model, cfg.d_ff, cfg.n_experts, 1 if discrete else cfg.top_k, act)


def resolve_mode(mode: str | None = None) -> str:
    """`mode`, else $MOESERVE_CALIBRATION, else auto."""
    value = mode if mode is not None else os.environ.get(ENV, "auto")
    if value not in MODES:
        where = f"${ENV}" if mode is None else "calibration"
        raise CalibrationError(f"{where} = {value!r}: expected one of {', '.join(MODES)}")
    return value


def plan_for(shape: ExpertShape | None, device: torch.device | str, dtype: torch.dtype, mode: str | None = None,
             root: Path | None = None) -> DispatchPlan:
    """The plan for a model of `shape` (None: no MoE layer) on this machine: cached, measured now, or
    the default where calibration is off or does not apply."""
    mode = resolve_mode(mode)
    if mode == "off":
        return default_plan(device, dtype, "calibration off")
    if torch.device(device).type != "cpu":  # a GPU's: decode_calibration.gpu_decode_plan
        return default_plan(device, dtype, f"{torch.device(device).type}: defaults (no CPU calibration there)")
    if shape is None:
        return default_plan(device, dtype, "no MoE layer to calibrate")
    key = calibration_key(shape, dtype)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = (root or cache_root()) / "calibration" / f"{digest}.json"
    if mode == "auto":
        cached = _read(path, key)
        if cached is not None:
            return cached
    t0 = time.perf_counter()
    plan = calibrate(shape, dtype)
    seconds = time.perf_counter() - t0
    log.info("calibrated %s on this CPU in %.1f s: %s", _shape_text(shape, dtype), seconds, plan.describe())
    _write(path, key, plan, seconds)
    return plan


def calibration_key(shape: ExpertShape, dtype: torch.dtype) -> dict:
    return {"version": VERSION, "cpu": cpu_name(), "capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "dtype": _name(dtype),
            "kernel": cpu_kernel.identity(),  # a new kernel (source, compiler, flags) is measured again
            "shape": asdict(shape)}


# ---- measuring --------------------------------------------------------------------------------
def calibrate(shape: ExpertShape, dtype: torch.dtype, max_s: float = MAX_S) -> DispatchPlan:
    """Time every candidate on this CPU and choose (module docstring)."""
    g = torch.Generator().manual_seed(0)
    E, D, Fh = shape.n_experts, shape.d_model, shape.d_ff

    def weight(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=g) * dims[-1] ** -0.5).to(dtype)

    w1, w2 = weight(E, Fh, D), weight(E, D, Fh)
    w3 = weight(E, Fh, D) if shape.act == "swiglu" else None
    layouts = {"plain": fuse_expert_weights(w1, w2, w3, shape.act, pack=False)}
    skipped: dict[str, str] = {}
    if onednn_packing_available("cpu", dtype):
        layouts["packed"] = fuse_expert_weights(w1, w2, w3, shape.act, pack=True)
    else:
        skipped["packed"] = f"oneDNN cannot pack {_name(dtype)} weights on this CPU"
    why_no_kernel = cpu_kernel.unavailable_for(dtype)
    if why_no_kernel is None:
        layouts["kernel"] = fuse_expert_weights(w1, w2, w3, shape.act, pack=False, kernel=True)  # no copy
    else:
        skipped["kernel"] = why_no_kernel
    upcast = (w1, w2, w3) if dtype != torch.float32 else None  # float32 GEMMs past the crossover, timed below
    del w1, w3  # a layer's experts are held at most three times over while measuring (four for an upcast's timing)
    gmm = replace(layouts["plain"], grouped_mm=True)  # the same stacked tensors
    why_not_gmm = _fails(lambda: moe_grouped(*_routing(shape, 8, dtype, g), gmm))
    if why_not_gmm is None:
        layouts["grouped_mm"] = gmm
    else:
        skipped["plain + grouped_mm"] = f"grouped_mm does not run here ({why_not_gmm})"

    candidates: dict[str, tuple[Callable, InferenceWeights]] = {}
    for name, w in layouts.items():
        if name != "grouped_mm":
            candidates[f"gather/{name}"] = (moe_gather, w)
            candidates[f"grouped/{name}"] = (moe_grouped, w)
    if "grouped_mm" in layouts:
        candidates["grouped_mm/plain"] = (moe_grouped, layouts["grouped_mm"])

    timings: dict[str, dict[int, float]] = {name: {} for name in candidates}
    start = time.perf_counter()
    with torch.inference_mode():
        for i, T in enumerate(TOKEN_COUNTS):
            if i >= 2 and time.perf_counter() - start > max_s:
                break
            routings = [_routing(shape, T, dtype, g) for _ in range(ROUTINGS)]
            ms = _median_ms({n: (lambda fn=fn, w=w, r=itertools.cycle(routings): fn(*next(r), w))
                             for n, (fn, w) in candidates.items()}, COUNT_S)
            for n, t in ms.items():
                timings[n][T] = t
        timings.update(_dense_timings(D, dtype, g, COUNT_S))
        if "kernel" in layouts:  # the kernel against torch's GEMMs where a prompt or a scoring batch runs
            for T in LARGE_TOKENS:
                r = _routing(shape, T, dtype, g)
                fns = {n: (lambda w=w: moe_grouped(*r, w))
                       for n, w in (("large/kernel", layouts["kernel"]), ("large/plain", layouts["plain"]))}
                if upcast is not None:
                    fns["large/upcast"] = lambda: moe_sorted_fp32(*r, *upcast)
                ms = _median_ms(fns, 0.0)
                for n, t in ms.items():
                    timings.setdefault(n, {})[T] = t
    return choose(timings, skipped)


def _routing(shape: ExpertShape, T: int, dtype: torch.dtype, g: torch.Generator):
    """x [T, D], K distinct experts per token drawn uniformly, positive gates: a balanced router."""
    x = torch.randn(T, shape.d_model, generator=g).to(dtype)
    ids = torch.rand(T, shape.n_experts, generator=g).argsort(dim=-1)[:, : shape.top_k]
    gates = torch.rand(T, shape.top_k, generator=g).to(dtype)
    return x, ids, gates


def _dense_timings(D: int, dtype: torch.dtype, g: torch.Generator, min_time: float) -> dict[str, dict[int, float]]:
    """A [D, D] projection (attention's shape) plain, packed and on the C kernel (where each can run),
    each call on the next of enough copies to stream STREAM_BYTES from memory (the values do not change
    a GEMM's time)."""
    w = (torch.randn(D, D, generator=g) * D**-0.5).to(dtype)
    plain = [w.clone() for _ in range(max(1, min(256, STREAM_BYTES // (w.numel() * w.element_size()))))]
    layouts: dict[str, tuple[Callable, list[torch.Tensor]]] = {"linear/plain": (F.linear, plain)}
    if onednn_packing_available("cpu", dtype):
        layouts["linear/packed"] = (packed_linear, [pack_weight(c) for c in plain])
    if cpu_kernel.unavailable_for(dtype) is None:
        layouts["linear/kernel"] = (cpu_kernel.linear, plain)
    if len(layouts) == 1:
        return {}
    out: dict[str, dict[int, float]] = {n: {} for n in layouts}
    for T in DENSE_TOKENS:
        x = torch.randn(T, D, generator=g).to(dtype)
        ms = _median_ms({n: lambda fn=fn, ws=itertools.cycle(ws): fn(x, next(ws)) for n, (fn, ws) in layouts.items()},
                        min_time)
        for n, t in ms.items():
            out[n][T] = t
    if "linear/kernel" in layouts:  # at a prompt's row counts, the kernel against torch's GEMM only
        for T in LARGE_DENSE_TOKENS:
            x = torch.randn(T, D, generator=g).to(dtype)
            fns = {f"large-{n}": lambda fn=fn, ws=itertools.cycle(ws): fn(x, next(ws))
                   for n, (fn, ws) in layouts.items() if n in ("linear/kernel", "linear/plain")}
            if dtype != torch.float32:
                fns["large-linear/upcast"] = lambda ws=itertools.cycle(plain): F.linear(x.float(), next(ws).float()).to(dtype)
            ms = _median_ms(fns, min_time)
            for n, t in ms.items():
                out.setdefault(n, {})[T] = t
    return out


def interleaved_ms(fns: dict[str, Callable[[], object]], min_time: float, min_rounds: int = MIN_ROUNDS,
                   max_rounds: int = MAX_ROUNDS, *, warmup: int = 1, per_turn: int = 1, turn_warmup: int = 0,
                   after_round: Callable[[int], object] | None = None) -> dict[str, list[float]]:
    """Wall times (ms) of each function, the functions taking turns (after `warmup` calls each) for at least
    `min_rounds` rounds and `min_time` seconds in all: a shared machine's speed drifts (a 2-core VM's by 15% and
    more within a minute), and taking turns makes the drift hit every one alike instead of whichever happened
    to run during a slow spell. A turn is `turn_warmup` untimed calls then `per_turn` timed ones (ONNX Runtime
    and torch slow each other when they alternate call by call: their idle threads still spin); `after_round(r)`
    runs between rounds, untimed. The one timing loop of the calibration and of the benches."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {n: [] for n in fns}
    start, rounds = time.perf_counter(), 0
    while rounds < max_rounds and (rounds < min_rounds or time.perf_counter() - start < min_time):
        for n, fn in fns.items():
            for _ in range(turn_warmup):
                fn()
            for _ in range(per_turn):
                t0 = time.perf_counter()
                fn()
                times[n].append((time.perf_counter() - t0) * 1e3)
        if after_round is not None:
            after_round(rounds)
        rounds += 1
    return times


def _median_ms(fns: dict[str, Callable[[], object]], min_time: float) -> dict[str, float]:
    return {n: round(statistics.median(ts), 4) for n, ts in interleaved_ms(fns, min_time).items()}


def _fails(fn: Callable[[], object]) -> str | None:
    try:
        with torch.inference_mode():
            fn()
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        return str(e).splitlines()[0][:160]
    return None


# ---- choosing ---------------------------------------------------------------------------------
def choose(timings: dict[str, dict[int, float]], skipped: dict[str, str] | None = None) -> DispatchPlan:
    """The plan from measured times (module docstring): pure, so that tests can hand it any timings."""
    counts = sorted(timings["gather/plain"])
    expert = [n for n in timings if not n.startswith(("linear/", "large"))]
    best = {T: min(timings[n][T] for n in expert) for T in counts}
    scores: dict[str, tuple[float, int]] = {}
    for name, (gather, grouped, _, _) in CONFIGS.items():
        if gather not in timings or grouped not in timings:
            continue
        g, m = timings[gather], timings[grouped]
        gather_max = 0
        for T in counts:
            if g[T] > m[T]:
                break
            gather_max = T
        scores[name] = (per_token_ratio({T: g[T] if T <= gather_max else m[T] for T in counts}, best), gather_max)
    top = min(s for s, _ in scores.values())
    name = next(n for n, (s, _) in scores.items() if s <= top * TIE)
    _, _, pack_experts, grouped_mm = CONFIGS[name]
    kernel_experts = name == "kernel"
    gather_max = scores[name][1]

    dense, dense_text = "plain", "dense layers plain (neither packing nor the C kernel runs this dtype here)"
    ratios = {n: per_token_ratio(timings[f"linear/{n}"], timings["linear/plain"])
              for n in ("packed", "kernel") if f"linear/{n}" in timings}
    if ratios:
        best = min(ratios.values())
        dense = next((n for n, r in ratios.items() if r <= best * TIE and r * TIE < 1), "plain")  # packed first
        dense_text = f"dense layers {dense} ({', '.join(f'{n}/plain time {r:.2f}x' for n, r in ratios.items())})"
    others = "; ".join(f"{n} {s:.2f}x" for n, (s, _) in scores.items() if n != name)
    crossover = _crossover_text(timings[CONFIGS[name][0]], timings[CONFIGS[name][1]], gather_max, counts)
    reason = (f"experts {name}: {scores[name][0]:.2f}x the best time per token ({others or 'no other candidate'})"
              f"; {crossover}; {dense_text}")
    # Norms and decode attention are not timed: one call against torch's six (RMSNorm) or SDPA plus a gather,
    # faster at every size measured (docs/benchmarks.md), so they go on the kernel wherever it ran here.
    kernel_norms = any(n.endswith("/kernel") for n in timings)
    if kernel_norms:
        reason += "; norms and decode attention on the C kernel"
    if skipped:
        reason += "; not candidates: " + "; ".join(f"{n}: {why}" for n, why in skipped.items())
    limit = dense_limit = None
    upcast_experts = upcast_dense = False
    if kernel_experts:
        large, upcast_experts = _torch_large(timings, "large/plain", "large/upcast")
        limit = kernel_limit({**timings["grouped/kernel"], **timings.get("large/kernel", {})},
                             {**timings["grouped/plain"], **large})
        upcast_experts = upcast_experts and limit is not None
        if limit is not None:
            reason += (f"; experts on torch's GEMMs past {limit} tokens (faster at every count above"
                       f"{', in float32 on upcast weights' if upcast_experts else ''})")
    if dense == "kernel":
        large, upcast_dense = _torch_large(timings, "large-linear/plain", "large-linear/upcast")
        dense_limit = kernel_limit({**timings["linear/kernel"], **timings.get("large-linear/kernel", {})},
                                   {**timings["linear/plain"], **large})
        upcast_dense = upcast_dense and dense_limit is not None
        if dense_limit is not None:
            reason += (f"; dense layers on torch's GEMM past {dense_limit} rows"
                       f"{' (float32 on upcast weights)' if upcast_dense else ''}")
    return DispatchPlan(dense == "packed", pack_experts, grouped_mm, gather_max, "measured", reason, timings,
                        kernel_experts=kernel_experts, kernel_dense=dense == "kernel", kernel_norms=kernel_norms,
                        kernel_max_tokens=limit, dense_kernel_max_tokens=dense_limit, upcast_experts=upcast_experts,
                        upcast_dense=upcast_dense)


def _torch_large(timings: dict[str, dict[int, float]], plain: str, upcast: str) -> tuple[dict[int, float], bool]:
    """torch's side at the large counts: its GEMMs in the model's dtype, or in float32 on upcast weights where
    those beat them by more than the tie margin (a bf16 model on a CPU without bf16 arithmetic); and which."""
    same, up = timings.get(plain, {}), timings.get(upcast)
    if up and same and per_token_ratio(up, same) * TIE < 1:
        return up, True
    return same, False


def kernel_limit(kernel: dict[int, float], plain: dict[int, float]) -> int | None:
    """The most tokens at which the C kernel still runs: the count below the smallest one from which torch's GEMMs
    are faster at every larger count measured (0: at every count); None where the kernel wins at the largest."""
    counts = sorted(set(kernel) & set(plain))
    first = None
    for T in reversed(counts):
        if plain[T] >= kernel[T]:
            break
        first = T
    if first is None:
        return None
    i = counts.index(first)
    return counts[i - 1] if i > 0 else 0


def per_token_ratio(a: dict[int, float], b: dict[int, float]) -> float:
    """Mean time per token of `a` over the counts it was timed at, against `b`'s over the same counts: the
    time each takes for the same number of tokens at every count (module docstring)."""
    return sum(a[T] / T for T in a) / sum(b[T] / T for T in a)


def _crossover_text(gather: dict[int, float], grouped: dict[int, float], gather_max: int, counts: list[int]) -> str:
    after = next((T for T in counts if T > gather_max), None)
    if after is None:
        return f"gather faster at every count up to {gather_max}"
    at = [f"gather {gather[T]:.3g} vs grouped {grouped[T]:.3g} ms at {T}" for T in (gather_max, after) if T]
    return f"gather path up to {gather_max} token{'s' if gather_max != 1 else ''} ({', '.join(at)})"


# ---- the cache file ---------------------------------------------------------------------------
def _read(path: Path, key: dict) -> DispatchPlan | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data["key"] != key:  # a hash collision or a hand-edited file: measure rather than trust it
            raise ValueError("its key is for another machine, torch, dtype or shape")
        plan = DispatchPlan(**{**data["plan"], "source": "cached"})
        plan.timings = {n: {int(T): float(ms) for T, ms in row.items()} for n, row in plan.timings.items()}
        return plan
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("calibration file %s is unusable (%s); measuring again", path, e)
        return None


def _write(path: Path, key: dict, plan: DispatchPlan, seconds: float) -> None:
    record = {"key": key, "plan": asdict(plan), "seconds": round(seconds, 2),
              "measured": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(record, indent=1))
    except OSError as e:  # a read-only cache costs a re-measure next time, nothing else
        log.warning("could not save the calibration to %s (%s); it will be measured again next time", path, e)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shape_text(shape: ExpertShape, dtype: torch.dtype) -> str:
    return (f"MoE dispatch (D {shape.d_model}, F {shape.d_ff}, E {shape.n_experts}, k {shape.top_k}, "
            f"{shape.act}, {_name(dtype)})")
