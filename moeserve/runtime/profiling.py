"""A profile of a serving process's steps: labels on a step's phases, and torch's profiler around them.

Once decode replays a graph, a GPU server's req/s is set by the host work of each step (the plan, the inputs, the
host sync that reads the tokens back, detokenising and streaming) as much as by the device, and only a trace says
which. torch's profiler records the ops of the thread that started it (and, through CUPTI, every CUDA kernel), so
the server starts and stops it on the thread that owns the model, between two steps (serve/batcher.py `call`).
The labels are `record_function` ranges, which cost ~6 us each even with no profiler running: `phase` reads one
flag instead while none runs.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from moeserve.errors import UserError

log = logging.getLogger("moeserve.serve")

# the labels, outermost first: a turn of the model thread (what it does between waits for work) holds the others
TURN, PLAN, PREFILL, DECODE, SAMPLE, OUTPUT = (f"moeserve.{p}" for p in
                                               ("turn", "plan", "prefill", "decode", "sample", "output"))
PHASES = (TURN, PLAN, PREFILL, DECODE, SAMPLE, OUTPUT)

_running = False  # set while a StepProfiler records: `phase` is then a record_function
_NONE = contextlib.nullcontext()


def phase(name: str) -> contextlib.AbstractContextManager:
    """A labelled range of the trace while a profile runs; else nothing (the same nullcontext each time)."""
    return record_function(name) if _running else _NONE


def prepare() -> None:
    """Start and stop an empty profile here, on the thread that imported torch (~1 s), before any other thread
    profiles. Kineto, torch's profiler, initialises its client on the first profile, and only on the thread that
    registered it (at import): a first profile started elsewhere skips that, prints "ERROR: External init callback
    must run in same thread as registerClient", and starts kineto's own thread from the profiling thread, under
    its name (the model thread's, in the server's CPU by thread)."""
    with profile(activities=[ProfilerActivity.CPU]):
        pass


class ProfileStateError(UserError):
    """A profile started while one runs, or stopped while none does."""


@dataclass
class ProfileReport:
    """What a stopped profile wrote, and its summary: the model thread's time in each phase, per turn, and how busy
    the thread and the device were from its first turn to its last (the span: a profile started before the load
    and stopped after it is not diluted by the idle time around it)."""

    trace: Path  # Chrome trace (chrome://tracing, Perfetto), gzipped; beside it, this report as .summary.json
    table: Path  # the host's ops and labels by self time; on a GPU, the device's work by time
    wall_s: float  # start to stop
    span_s: float  # the first turn's start to the last one's end
    turns: int
    phases: dict[str, dict[str, float]]  # label -> calls, total_ms, ms_per_turn
    # turns' time over the span; the thread's CPU time over it; its time runnable but waiting for a core (Linux's
    # schedstat; None elsewhere). Busy and on a core near 1: its host work is the bound; busy less the other two:
    # it waits, blocked, inside its turns (for the device at a host sync, or for the GIL)
    model_thread_busy: float
    model_thread_cpu: float
    model_thread_runnable: float | None
    device_busy: float | None  # CUDA kernels' time over the span (None without a GPU)
    stopped: str  # "asked", "limit" (ran max_s), "shutdown"

    def to_dict(self) -> dict:
        return {"trace": str(self.trace), "table": str(self.table), "wall_s": round(self.wall_s, 3),
                "span_s": round(self.span_s, 3), "turns": self.turns, "phases": self.phases,
                "model_thread_busy": round(self.model_thread_busy, 3),
                "model_thread_cpu": round(self.model_thread_cpu, 3),
                "model_thread_runnable": None if self.model_thread_runnable is None else
                round(self.model_thread_runnable, 3),
                "device_busy": None if self.device_busy is None else round(self.device_busy, 3),
                "stopped": self.stopped}


class StepProfiler:
    """torch's profiler over the model thread's turns. Every method is called on the model thread, which only starts
    and stops the profiler: what a stopped profile writes (`Halted.write`: seconds for a long GPU trace) runs on
    another thread, so no request holds the model thread for it. The stop itself cannot move: torch builds its
    results on the thread that recorded them, ~1 s a second profiled on a CPU (docs/bench/profile-write.py). `max_s`
    bounds a profile that nobody stops (it holds every op in memory until then): the first turn past it stops it, a
    thread of its own writes it, and the report waits for the next `stop`."""

    def __init__(self, out_dir: Path, device: torch.device, max_s: float = 10.0):
        self.out_dir, self.device, self.max_s = Path(out_dir), device, max_s
        self._prof: profile | None = None
        self._t0 = self._cpu0 = 0.0
        self._queued0: float | None = None
        self._done: Halted | None = None  # stopped at the limit, not yet asked for
        self._written = 0

    @property
    def running(self) -> bool:
        return self._prof is not None

    def start(self) -> dict:
        global _running
        if self._prof is not None:
            raise ProfileStateError("a profile is already running; stop it first (POST /stop_profile)")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        prof = profile(activities=activities)
        prof.start()  # first: a profiler that fails to start leaves none running
        self._prof, self._done = prof, None
        # this thread's: the model thread's
        self._t0, self._cpu0, self._queued0 = time.perf_counter(), time.thread_time(), runqueue_s()
        _running = True
        return {"profiling": True, "dir": str(self.out_dir), "max_s": self.max_s}

    def tick(self) -> None:
        """At each turn: a profile past `max_s` stops here, and is written on a thread of its own (a trace that
        cannot be written, a full disk, is logged there)."""
        if self._prof is not None and time.perf_counter() - self._t0 > self.max_s:
            try:
                self._done = self._halt("limit")
            except Exception:  # noqa: BLE001 - the model thread's loop goes on without its diagnostics
                log.exception("moeserve: the profile that reached its %g s limit could not be stopped", self.max_s)
                return
            threading.Thread(target=self._done.write_logged, name="moeserve-profile-writer", daemon=True).start()

    def stop(self, why: str = "asked") -> Halted:
        """The running profile stopped (or the one stopped at the limit), for the caller to `write` elsewhere."""
        if self._prof is None:
            if self._done is not None:
                done, self._done = self._done, None
                return done
            raise ProfileStateError("no profile is running; start one first (POST /start_profile)")
        return self._halt(why)

    def close(self) -> None:
        """At shutdown: a running profile, or one stopped at the limit and not asked for, written here (nothing
        profiled is lost; the model thread has nothing left to do)."""
        halted = self._halt("shutdown") if self._prof is not None else self._done
        if halted is not None:
            halted.write_logged()

    def _halt(self, why: str) -> Halted:
        global _running
        prof, self._prof = self._prof, None
        _running = False
        wall, cpu, queued = time.perf_counter() - self._t0, time.thread_time() - self._cpu0, runqueue_s()
        queued = None if queued is None or self._queued0 is None else queued - self._queued0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the kernels launched so far, in the trace
        prof.stop()
        self._written += 1  # two profiles in one second do not overwrite each other
        name = f"moeserve-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{self._written}"
        return Halted(prof, self.out_dir, name, wall, cpu, queued, self.device.type == "cuda", why)


@dataclass(eq=False)
class Halted:
    """A profile stopped on the model thread, and what `write` needs to write it from any other thread: once, the
    first caller writing and any other waiting for its report."""

    prof: profile | None  # None once written
    out_dir: Path
    name: str  # of its files, less their suffixes
    wall_s: float
    cpu_s: float
    queued_s: float | None
    cuda: bool
    why: str
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _report: ProfileReport | None = None

    def write(self) -> ProfileReport:
        """The trace, the table of its ops and the summary, written (once); the summary."""
        with self._lock:
            if self._report is None:
                self._report = self._write()
                # kineto's results (~0.5 GB a second of profile) need not outlive the files: a profile stopped at
                # its limit is held by the profiler until someone asks for it
                self.prof = None
            return self._report

    def write_logged(self) -> None:
        """`write`, where no caller waits for it: where it went, or why it could not be written, in the log."""
        try:
            log.info("moeserve: the profile stopped (%s) is in %s", self.why, self.write().trace)
        except Exception:  # noqa: BLE001 - the server outlives its diagnostics
            log.exception("moeserve: the profile stopped (%s) could not be written", self.why)

    def _write(self) -> ProfileReport:
        """kineto's JSON (its C++ writer), read back once for the summary and the table, then gzipped at level 1.
        torch's own ways cost ~10x more time and memory: a ".gz" path compresses at level 9 in Python, and
        `key_averages` builds a Python object an event (a 2 s profile of a small model's step loop on a CPU, ~700k
        events: 46 s and 2 GB beyond the stopped profile's own, against 4-5 s and 0.2 GB)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        raw = self.out_dir / f"{self.name}.pt.trace.json"
        trace, table = raw.with_name(raw.name + ".gz"), self.out_dir / f"{self.name}.ops.txt"
        try:
            self.prof.export_chrome_trace(str(raw))
            times = Times.of(trace_events(raw))
            with open(raw, "rb") as f, gzip.open(trace, "wb", compresslevel=1) as out:
                shutil.copyfileobj(f, out, 1 << 20)
        finally:
            raw.unlink(missing_ok=True)
        table.write_text(times.table())
        report = summarize(times, self.wall_s, self.cpu_s, self.queued_s, trace, table, self.cuda, self.why)
        (self.out_dir / f"{self.name}.summary.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        return report


# kineto's trace: the host's ranges (torch's ops, our labels, and on a GPU the CUDA API calls: the launches, the
# waits at a host sync), and the device's own work
HOST_RANGES = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class Times:
    """A trace's time by name, in us: the host's ranges (torch's ops, our labels, CUDA API calls: calls, time
    inclusive of what they hold, self time without it) and the device's work (calls, time), and the turns' (start,
    end)."""

    host: dict[str, list[float]]  # name -> [calls, total, self]
    device: dict[str, list[float]]  # name -> [calls, total]
    turns: list[tuple[float, float]]

    @classmethod
    def of(cls, events: Iterable[dict]) -> Times:
        """Each thread's ranges nest (a label holds ops, an op the ops it calls): a range's self time is its own less
        its children's, found with a stack over the thread's ranges in order of start. As torch's tables do, an op
        whose only child has its name (a redispatch: `aten::div_` calling `aten::div_`) counts once, the child's
        children its own."""
        host: dict[str, list[float]] = {}
        device: dict[str, list[float]] = {}
        threads: dict[tuple, list[tuple[float, float, str]]] = {}  # (start, -duration, name): the outer first
        names: dict[str, str] = {}  # one string a name, not one an event
        for e in events:
            if e.get("ph") != "X":
                continue
            if e.get("cat") in HOST_RANGES:
                name = names.setdefault(e["name"], e["name"])
                threads.setdefault((e["pid"], e["tid"]), []).append((e["ts"], -e["dur"], name))
            elif e.get("cat") in DEVICE_WORK:
                row = device.setdefault(e["name"], [0, 0.0])
                row[0] += 1
                row[1] += e["dur"]
        turns = []
        for ranges in threads.values():
            ranges.sort()
            parent, children, open_ = [-1] * len(ranges), [0] * len(ranges), []  # open_: (end, index) holding this
            for i, (ts, neg_dur, _) in enumerate(ranges):
                while open_ and open_[-1][0] <= ts:
                    open_.pop()
                if open_:
                    parent[i] = open_[-1][1]
                    children[parent[i]] += 1
                open_.append((ts - neg_dur, i))
            kept_parent = [-1] * len(ranges)  # the nearest range above that counts
            rows: list[list[float] | None] = [None] * len(ranges)
            for i, (ts, neg_dur, name) in enumerate(ranges):
                q = parent[i]
                if q >= 0 and children[q] == 1 and ranges[q][2] == name:  # the same op, redispatched
                    kept_parent[i] = kept_parent[q] if rows[q] is None else q
                    continue
                kept_parent[i] = q if q < 0 or rows[q] is not None else kept_parent[q]
                dur = -neg_dur
                row = rows[i] = host.setdefault(name, [0, 0.0, 0.0])
                row[0] += 1
                row[1] += dur
                row[2] += dur
                if kept_parent[i] >= 0:
                    rows[kept_parent[i]][2] -= dur
                if name == TURN:
                    turns.append((ts, ts + dur))
        return cls(host, device, turns)

    def table(self, rows: int = 60) -> str:
        """The host's ranges by self time, then (on a GPU) the device's work by time: the `rows` largest of each."""
        host_us = sum(r[2] for r in self.host.values()) or 1.0
        out = [f"{'Name':<60} {'Self CPU ms':>12} {'Self CPU %':>10} {'CPU total ms':>13} {'Calls':>8}"]
        for name, (calls, total, own) in sorted(self.host.items(), key=lambda kv: -kv[1][2])[:rows]:
            out.append(f"{name[:60]:<60} {own / 1e3:>12.3f} {own / host_us:>10.1%} {total / 1e3:>13.3f} {calls:>8}")
        if self.device:
            device_us = sum(r[1] for r in self.device.values()) or 1.0
            out += ["", f"{'Device: kernels, copies, fills':<60} {'Device ms':>12} {'Device %':>10} {'Calls':>8}"]
            for name, (calls, total) in sorted(self.device.items(), key=lambda kv: -kv[1][1])[:rows]:
                out.append(f"{name[:60]:<60} {total / 1e3:>12.3f} {total / device_us:>10.1%} {calls:>8}")
        return "\n".join(out) + "\n"


def trace_events(path: Path, chunk: int = 1 << 24) -> Iterator[dict]:
    """The events of a Chrome trace file, one at a time, read `chunk` characters at a time: never the whole file (a
    profile writes ~80 MB of JSON a second of a busy step loop) nor every event (a dict each) in memory at once."""
    decoder, head = json.JSONDecoder(), re.compile(r'"traceEvents"\s*:\s*\[')
    with open(path, encoding="utf-8") as f:
        buf = ""
        while (found := head.search(buf)) is None:  # the metadata before the events
            more = f.read(chunk)
            if not more:
                raise ValueError(f"{path} is not a Chrome trace: it has no traceEvents")
            buf += more
        i = found.end()
        while True:
            while i < len(buf) and buf[i] in " \t\r\n,":
                i += 1
            if i < len(buf) and buf[i] == "]":
                return
            try:  # an event is an object: one cut at the buffer's end does not decode
                event, i = decoder.raw_decode(buf, i)
            except json.JSONDecodeError:
                more = f.read(chunk)
                if not more:
                    raise ValueError(f"{path} ends inside its traceEvents") from None
                buf, i = buf[i:] + more, 0
                continue
            yield event


def summarize(times: Times, wall_s: float, cpu_s: float, queued_s: float | None, trace: Path, table: Path,
              cuda: bool, stopped: str) -> ProfileReport:
    """The phases' inclusive time and the turns' span from the trace's ranges; the device's busy time from its work
    (one stream: kernels do not overlap, so their sum is the time it computed)."""
    turns = times.turns
    phases = {}
    for name in PHASES:
        if name in times.host:
            calls, total, _ = times.host[name]
            phases[name.removeprefix("moeserve.")] = {"calls": calls, "total_ms": round(total / 1000, 3),
                                                      "ms_per_turn": round(total / 1000 / max(len(turns), 1), 4)}
    span_s = (max(end for _, end in turns) - min(start for start, _ in turns)) / 1e6 if turns else 0.0
    busy = sum(end - start for start, end in turns) / 1e6 / span_s if span_s else 0.0
    device = None
    if cuda:
        device_s = sum(total for _, total in times.device.values()) / 1e6
        device = device_s / span_s if span_s else 0.0
    share = lambda s: min(s / span_s, 1.0) if span_s else 0.0  # noqa: E731 - start and stop are outside the span
    runnable = None if queued_s is None else share(queued_s)
    return ProfileReport(trace, table, wall_s, span_s, len(turns), phases, busy, share(cpu_s), runnable, device,
                         stopped)


def runqueue_s() -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a core (the second field of Linux's
    /proc/thread-self/schedstat); None where it cannot be read."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None
