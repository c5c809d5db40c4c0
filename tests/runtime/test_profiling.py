"""runtime/profiling.py: a profile's summary counts the step engine's model calls exactly, on a CPU and, marked
cuda, on a GPU, where the trace also holds the device's kernels and their time; with no profile running the labels
are one shared nullcontext. The server's endpoints over it: tests/serve/test_profiling.py."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from moeserve.runtime import profiling
from moeserve.runtime.engine import SamplingParams
from moeserve.runtime.profiling import (DECODE, PLAN, TURN, ProfileStateError, StepProfiler, Times, phase,
                                       trace_events)

from .test_engine import PROMPTS, make_engine

SCHEDSTAT = Path("/proc/thread-self/schedstat").exists()  # Linux: a thread's time waiting for a core


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_profile_counts_the_calls_it_saw(tmp_path, device):
    engine = make_engine("softmax", device=device)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    want = engine.complete(PROMPTS[:1], params)[0].token_ids  # also out of the profile: first calls' allocations
    profiler = StepProfiler(tmp_path, torch.device(device))
    profiler.start()
    with pytest.raises(ProfileStateError, match="already running"):
        profiler.start()
    with phase(TURN):  # the server's model thread labels its turns; here, one around the whole generation
        got = engine.complete(PROMPTS[:1], params)[0].token_ids
    report = profiler.stop().write()
    assert got == want
    p = report.phases
    assert p["prefill"]["calls"] == 1 and p["decode"]["calls"] == 5 and p["sample"]["calls"] == 6
    assert report.turns == 1 and "plan" not in p  # no scheduler turn here: only what ran is in the summary
    assert 0 < report.span_s <= report.wall_s and 0.99 <= report.model_thread_busy <= 1.0
    assert 0 < report.model_thread_cpu <= 1.0
    if SCHEDSTAT:
        assert 0 <= report.model_thread_runnable <= 1.0
    events = json.loads(gzip.decompress(report.trace.read_bytes()))["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if device == "cuda":  # the kernels the steps launched, and their time against the span
        assert kernels and 0 < report.device_busy < 1, report.device_busy
        assert "Device: kernels, copies, fills" in report.table.read_text()
    else:
        assert not kernels and report.device_busy is None
    assert phase(TURN) is phase(PLAN)  # stopped: the labels are free again
    with pytest.raises(ProfileStateError, match="no profile is running"):
        profiler.stop()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_times_from_the_trace_equal_torch_s_own_averages(tmp_path, device, monkeypatch):
    """The reference: torch's `key_averages` over the same profile. Each name's calls exactly, its inclusive and self
    time to kineto's rounding; on a GPU the device's whole time too (torch puts each kernel under its op, the table
    under its own name: only the sums compare)."""
    engine = make_engine("softmax", device=device)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    engine.complete(PROMPTS[:1], params)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    monkeypatch.setattr(profiling, "_running", True)  # the step engine's labels, as under a StepProfiler
    with profile(activities=activities) as prof, phase(TURN):
        engine.complete(PROMPTS[:2], params)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    times, torch_s = Times.of(trace_events(path)), {a.key: a for a in prof.key_averages()}
    assert set(times.host) == set(torch_s) and {TURN, DECODE} <= set(times.host) and len(times.host) > 20
    for name, (calls, total, own) in times.host.items():
        ref = torch_s[name]
        assert calls == ref.count, name
        assert total == pytest.approx(ref.cpu_time_total, rel=1e-3, abs=0.01), name
        assert own == pytest.approx(ref.self_cpu_time_total, rel=1e-3, abs=0.01), name
    if device == "cuda":
        device_us = sum(total for _, total in times.device.values())
        assert device_us == pytest.approx(sum(a.self_device_time_total for a in torch_s.values()), rel=0.05)


def test_a_profile_past_its_limit_stops_at_the_next_tick_and_waits_to_be_asked(tmp_path):
    profiler = StepProfiler(tmp_path, torch.device("cpu"), max_s=0.0)
    profiler.tick()  # nothing running: nothing to do
    profiler.start()
    profiler.tick()
    assert not profiler.running and phase(TURN) is phase(PLAN)
    halted = profiler.stop()
    report = halted.write()
    assert report.stopped == "limit" and report.turns == 0 and report.trace.exists()
    assert halted.prof is None and halted.write() is report  # written once, its results let go
    with pytest.raises(ProfileStateError):
        profiler.stop()


def test_a_profiler_that_fails_to_start_leaves_none_running(tmp_path, monkeypatch):
    """As where CUPTI cannot be loaded: the start fails with the profiler's error, and a later start can run."""
    import moeserve.runtime.profiling as profiling

    class Broken:
        def __init__(self, activities):
            pass

        def start(self):
            raise RuntimeError("CUPTI could not be loaded")

    profiler = StepProfiler(tmp_path, torch.device("cpu"))
    monkeypatch.setattr(profiling, "profile", Broken)
    with pytest.raises(RuntimeError, match="CUPTI"):
        profiler.start()
    assert not profiler.running and phase(TURN) is phase(PLAN)
    monkeypatch.undo()
    profiler.start()
    assert profiler.stop().write().stopped == "asked"


def _x(name: str, ts: float, dur: float, cat: str = "cpu_op", tid: int = 1) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur, "args": {"x": [1]}}


def test_times_by_name_with_self_time_less_what_each_range_holds():
    """Ranges nest on each thread: a turn holds a decode, which holds two ops, one of which holds a third; other
    threads' ops, the device's kernels and the trace's metadata are apart. Exact in us."""
    events = [{"ph": "M", "name": "thread_name", "pid": 7, "tid": 1, "args": {"name": "x"}},
              _x(TURN, 0, 100, "user_annotation"), _x(DECODE, 10, 60, "user_annotation"),
              _x("aten::mm", 20, 30), _x("aten::add", 55, 10), _x("aten::copy_", 56, 4),  # copy_ inside add
              _x("cudaLaunchKernel", 57, 2, "cuda_runtime"),  # the API call beneath copy_, on the same thread
              _x("aten::mm", 90, 5),  # after the decode, in the turn
              _x("aten::mm", 0, 1000, tid=2),  # another thread: not inside this one's turn
              _x("gemv", 30, 20, "kernel"), _x("gemv", 60, 5, "kernel"), _x("Memcpy HtoD", 12, 3, "gpu_memcpy"),
              _x("gpu range", 10, 60, "gpu_user_annotation"),  # the label as the device saw it: not host time
              # a redispatch, as torch's tables count it: an op whose only child has its name is one call, and the
              # child's children are its own; beside a sibling, the same name is a call of its own
              _x("aten::div_", 0, 8, tid=3), _x("aten::div_", 1, 6, tid=3), _x("aten::div_", 2, 5, tid=3),
              _x("aten::to", 3, 2, tid=3),
              _x("aten::mean", 20, 10, tid=3), _x("aten::mean", 21, 2, tid=3), _x("aten::sum", 24, 3, tid=3)]
    t = Times.of(events)
    assert t.host == {TURN: [1, 100, 35], DECODE: [1, 60, 20], "aten::mm": [3, 1035, 1035],
                      "aten::add": [1, 10, 6], "aten::copy_": [1, 4, 2], "cudaLaunchKernel": [1, 2, 2],
                      "aten::div_": [1, 8, 6], "aten::to": [1, 2, 2], "aten::mean": [2, 12, 7], "aten::sum": [1, 3, 3]}
    assert t.device == {"gemv": [2, 25], "Memcpy HtoD": [1, 3]}
    assert t.turns == [(0, 100)]
    table = t.table().splitlines()
    assert table[0].split()[:3] == ["Name", "Self", "CPU"] and table[1].split()[0] == "aten::mm"
    assert "Device: kernels, copies, fills" in table[12] and table[13].split()[:2] == ["gemv", "0.025"]


@pytest.mark.parametrize("chunk", [5, 64, 1 << 20])
def test_trace_events_read_a_chunk_at_a_time_are_the_file_s(tmp_path, chunk):
    events = [_x(f"op{i}", i * 1.25, 1.0) for i in range(500)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"schemaVersion": 1, "deviceProperties": [], "traceEvents": events, "after": 1},
                               indent=2))
    assert list(trace_events(path, chunk)) == events
    path.write_text(json.dumps({"traceEvents": events})[:-200])
    with pytest.raises(ValueError, match="ends inside its traceEvents"):
        list(trace_events(path, chunk))
    path.write_text('{"schemaVersion": 1}')
    with pytest.raises(ValueError, match="no traceEvents"):
        list(trace_events(path, chunk))
