"""What a stopped profile costs to write: torch's own way (`export_chrome_trace` to a .gz path, `key_averages` and its
table) against the server's (runtime/profiling.py `Halted.write`: kineto's JSON read back one event at a time, a
table of our own, gzip at level 1), on the same kind of profile, alternated in one run. The profile is the server's:
`--seconds` of a step loop of a small random model with the phase labels, 2 sequences at a time (8-token prompts, 4
new tokens each: a busy model thread's many short turns). Each write runs in a process of its own, so that its peak
memory (ru_maxrss) is its own.

    PYTHONPATH=. python docs/bench/profile-write.py [--seconds 2] [--rounds 2] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def rss_mb() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 // 2**20


def profiled(seconds: float, device: str, out: Path):
    """A stopped StepProfiler over `seconds` of a step loop, the turns it saw, and how long the stop took (on the
    thread that profiled: a server's model thread, every stream paused meanwhile)."""
    from moeserve.config import preset
    from moeserve.runtime.executor import Executor
    from moeserve.runtime.model import Transformer
    from moeserve.runtime.profiling import TURN, StepProfiler, phase
    from moeserve.runtime.sampling import SamplingParams
    from moeserve.runtime.scheduler import Sequence

    torch.manual_seed(0)
    torch.set_num_threads(1)
    engine = Executor(Transformer(preset("tiny", max_seq_len=256)).to(device), calibration="off").step_engine(
        None, None, slots=2, max_len=256)
    profiler = StepProfiler(out, torch.device(device))
    profiler.start()
    t0, turns = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        if engine.idle:
            for _ in range(2):
                engine.add(Sequence(prompt=list(range(1, 9)), params=SamplingParams(max_new_tokens=4)))
        with phase(TURN):
            engine.step()
        turns += 1
    t0 = time.perf_counter()
    halted = profiler.stop()
    return halted, turns, time.perf_counter() - t0


def one(way: str, seconds: float, device: str) -> dict:
    """In this process: a profile, then its write the `way` asked; the times and memory."""
    with tempfile.TemporaryDirectory() as tmp:
        halted, turns, stop_s = profiled(seconds, device, Path(tmp))
        before, t0 = rss_mb(), time.perf_counter()
        if way == "torch":
            halted.prof.export_chrome_trace(str(Path(tmp) / "trace.pt.trace.json.gz"))
            sort = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
            events = len(halted.prof.events())
            halted.prof.key_averages().table(sort_by=sort, row_limit=60)
        else:
            halted.write()
            events = None
        s = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        size = sum(p.stat().st_size for p in Path(tmp).glob("*.gz"))
    return {"way": way, "turns": turns, "events": events, "stop_s": round(stop_s, 2), "write_s": round(s, 2),
            "stopped_rss_mb": before,
            "peak_rss_mb": peak, "beyond_stopped_mb": peak - before, "gz_mb": round(size / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="profile length (default: %(default)g)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, each way once a round (default: %(default)d)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--one", choices=("torch", "ours"), help=argparse.SUPPRESS)  # a child's run
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.seconds, args.device)))
        return
    rows = []
    for r in range(args.rounds):
        for way in ("torch", "ours"):
            cmd = [sys.executable, __file__, "--one", way, "--seconds", str(args.seconds), "--device", args.device]
            got = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            rows.append({"round": r + 1, **got})
            print(rows[-1], flush=True)
    print("\n| round | way | turns | stop s | write s | MB beyond the stopped profile's | trace .gz MB |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['round']} | {row['way']} | {row['turns']} | {row['stop_s']} | {row['write_s']} | "
              f"{row['beyond_stopped_mb']} | {row['gz_mb']} |")


if __name__ == "__main__":
    main()
