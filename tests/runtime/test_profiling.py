"""runtime/profiling.py: a profile's summary counts the step engine's model calls exactly, on a CPU and, marked
cuda, on a GPU, where the trace also holds the device's kernels and their time; with no profile running the labels
are one shared nullcontext. The server's endpoints over it: tests/serve/test_profiling.py."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from moeserve.runtime.engine import SamplingParams
from moeserve.runtime.profiling import PLAN, TURN, ProfileStateError, StepProfiler, phase

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
    else:
        assert not kernels and report.device_busy is None
    assert phase(TURN) is phase(PLAN)  # stopped: the labels are free again
    with pytest.raises(ProfileStateError, match="no profile is running"):
        profiler.stop()


def test_a_profile_past_its_limit_stops_at_the_next_tick_and_waits_to_be_asked(tmp_path):
    profiler = StepProfiler(tmp_path, torch.device("cpu"), max_s=0.0)
    profiler.tick()  # nothing running: nothing to do
    profiler.start()
    profiler.tick()
    assert not profiler.running and phase(TURN) is phase(PLAN)
    report = profiler.stop().write()
    assert report.stopped == "limit" and report.turns == 0 and report.trace.exists()
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
