"""Which path a compiled decode step's experts take at its smallest batch buckets, measured on the GPU.

A compiled bf16 decode step on CUDA runs its experts as one grouped_mm call (`decode_grouped`, plan.py), which reads
each hit expert once. At one or two rows there is a cheaper way to read them: `moe_reduced`, each (token, expert)
pair's matrices as products summed over the model dimension, which inductor turns into GEMV-like reductions that
load the indexed weights in place, with none of grouped_mm's sort, scatter and tile padding. On an H200, one layer of
the 2.4B Mixtral's experts took 78 us that way against 374 us for grouped_mm at one token, 367 against 206 at eight
(docs/bench/log.md; launches included). Where the crossing lies depends on the GPU and the shapes, so it is measured:
for each of `ROWS`, one layer's experts of the model's shape are compiled both ways (fullgraph, as the step is),
captured in a CUDA graph as the step's are, and replayed; `decode_reduce_max` is the most rows up to which the
reduction wins at every count. Cached like the CPU's calibration (calibration.py), keyed by the GPU.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from moeserve.cache import cache_root
from moeserve.runtime.backends.calibration import (VERSION, ExpertShape, _name, _read, _routing, _shape_text,
                                                   _write, interleaved_ms, log, resolve_mode)
from moeserve.runtime.backends.experts import fuse_expert_weights, moe_grouped, moe_reduced
from moeserve.runtime.backends.plan import DispatchPlan, default_plan

ROWS = (1, 2, 4)  # the buckets a reduction may win: GEMVs are for few rows
REPLAYS = 20  # replays of each captured path, timed together
PATHS = {"decode/grouped": moe_grouped, "decode/reduced": moe_reduced}


def time_decode_paths(shape: ExpertShape, device: torch.device | str, dtype: torch.dtype,
                      rows: tuple[int, ...] = ROWS) -> dict[str, dict[int, float]]:
    """ms of one layer's experts at each row count, compiled both ways (random weights of `shape`: a kernel's time
    does not depend on the values), one CUDA graph replay each on a GPU, one call on a CPU."""
    device = torch.device(device)
    g = torch.Generator().manual_seed(0)

    def weight(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=g) * dims[-1] ** -0.5).to(device, dtype)

    E, D, Fh = shape.n_experts, shape.d_model, shape.d_ff
    w = fuse_expert_weights(weight(E, Fh, D), weight(E, D, Fh), weight(E, Fh, D) if shape.act == "swiglu" else None,
                            shape.act, pack=False, grouped_mm=True, sync_free=True)
    timings: dict[str, dict[int, float]] = {name: {} for name in PATHS}
    torch._dynamo.config.cache_size_limit += len(rows)  # a compile a row count, of each path's code object
    with torch.inference_mode():
        for T in rows:
            x, ids, gates = (t.to(device) for t in _routing(shape, T, dtype, g))
            for name, path in PATHS.items():  # the weights an argument, not a closure the compiled code would keep
                step = torch.compile(path, fullgraph=True, dynamic=False)
                timings[name][T] = round(_replay_ms(lambda: step(x, ids, gates, w), device), 4)
    return timings


def _replay_ms(fn, device: torch.device) -> float:
    """fn's ms once compiled: on CUDA a CUDA graph of it replayed REPLAYS times (launches cost a step's graph
    nothing), the median of 3 such rounds; on a CPU the median of REPLAYS calls."""
    fn()  # compile
    if device.type != "cuda":
        return statistics.median(interleaved_ms({"": fn}, 0.0, REPLAYS, REPLAYS, warmup=0)[""])
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()  # the warm-up a capture wants on a side stream
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    rounds = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) / REPLAYS)
    return sorted(rounds)[1]


def reduce_max_of(timings: dict[str, dict[int, float]]) -> int:
    """The most rows up to which the reduction beat grouped_mm at every count measured (0: at none)."""
    most = 0
    for T in sorted(timings["decode/reduced"]):
        if timings["decode/reduced"][T] >= timings["decode/grouped"][T]:
            break
        most = T
    return most


def gpu_decode_plan(shape: ExpertShape | None, device: torch.device | str, dtype: torch.dtype, mode: str | None = None,
                    root: Path | None = None) -> DispatchPlan:
    """A GPU's plan: the defaults, with `decode_reduce_max` measured here where the compiled step's experts are
    grouped_mm (bf16); cached per GPU, torch, dtype and shape. `mode` as calibration.plan_for's ('off': the defaults,
    'redo': measured again; None: $MOESERVE_CALIBRATION, else auto)."""
    mode = resolve_mode(mode)
    plan = default_plan(device, dtype, "GPU defaults" if mode != "off" else "calibration off")
    if shape is None or not plan.decode_grouped or mode == "off":
        return plan
    key = {"version": VERSION, "gpu": torch.cuda.get_device_name(torch.device(device)), "torch": torch.__version__,
           "dtype": _name(dtype), "shape": asdict(shape), "what": "compiled decode experts"}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = (root or cache_root()) / "calibration" / f"gpu-{digest}.json"
    if mode == "auto" and (cached := _read(path, key)) is not None:
        return cached
    t0 = time.perf_counter()
    try:
        timings = time_decode_paths(shape, device, dtype)
    except Exception as e:  # noqa: BLE001 - a measurement that cannot run leaves the defaults, not a failed load
        log.warning("could not time the compiled decode experts on this GPU (%s: %s); GEMVs off", type(e).__name__, e)
        return replace(plan, reason=f"GPU defaults: timing the decode experts failed ({type(e).__name__}: {e})"[:300])
    most = reduce_max_of(timings)
    text = ", ".join(f"{T} row{'s' * (T > 1)}: {timings['decode/reduced'][T]} against {timings['decode/grouped'][T]}"
                     for T in sorted(timings["decode/reduced"]))
    plan = replace(plan, decode_reduce_max=most, source="measured", timings=timings,
                   reason=f"compiled decode experts, GEMVs against grouped_mm, ms a layer: {text}")
    seconds = time.perf_counter() - t0
    log.info("calibrated %s on this GPU in %.1f s: GEMVs up to %d rows", _shape_text(shape, dtype), seconds, most)
    _write(path, key, plan, seconds)
    return plan
