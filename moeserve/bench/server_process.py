"""A `moeserve serve` subprocess under a benchmark's control: the real command line on a free port,
waited for until /readyz says ready, and always stopped (SIGTERM, then SIGKILL) on the way out, with
what it wrote and how it exited kept for the report."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

MODEL_NAME = "bench"  # the --model-name the servers are started with
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 40.0


@dataclass
class ServerLog:
    """What a server subprocess wrote, read when it has stopped."""
    text: str = ""
    exit_code: int | None = None
    pid: int | None = None  # while it runs

    def summary(self) -> dict:
        lines = self.text.splitlines()
        errors = [ln for ln in lines if "ERROR" in ln or "Traceback" in ln]
        # uvicorn re-raises the SIGTERM it handled once it has shut down gracefully: -15 is a clean stop
        graceful = self.exit_code in (0, -signal.SIGTERM)
        return {"exit_code": self.exit_code, "graceful_stop": graceful, "error_lines": len(errors),
                "first_errors": errors[:5]}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(checkpoint: Path, port: int, dtype: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "moeserve.cli", "serve", str(checkpoint), "--port", str(port), "--no-access-log",
            "--model-name", MODEL_NAME, "--dtype", dtype, "--log-level", "warning", "--quiet", *extra]


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=5) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
            with contextlib.suppress(httpx.HTTPError):
                if client.get("/readyz").status_code == 200:
                    return
            time.sleep(0.05)
    raise RuntimeError(f"the server was not ready within {timeout_s:g} s")


def stop_server(proc: subprocess.Popen) -> int:
    """SIGTERM (graceful: requests in flight finish), then SIGKILL if it does not exit in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of process `pid`'s threads, summed by the name the OS knows them by, the main thread's as
    "main" (a server's event loop). The server names its model's thread ("moeserve-model", serve/state.py) and, once
    warmed up, the OpenMP team that thread started ("moeserve-omp"). Empty where /proc cannot be read (not Linux, or
    the process ended)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    head, fields = f.read().rsplit(")", 1)
            except OSError:  # the thread ended meanwhile
                continue
            name = "main" if int(tid) == pid else head.split("(", 1)[1]
            utime, stime = fields.split()[11:13]
            out[name] = out.get(name, 0.0) + (int(utime) + int(stime)) / tick
    return out


def cores_busy(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """What each thread name used between two thread_cpu readings, in cores (CPU seconds a second of `wall_s`)."""
    return {name: round((after[name] - before.get(name, 0.0)) / wall_s, 2) for name in sorted(after)
            if after[name] > before.get(name, 0.0)}


@contextlib.contextmanager
def running_server(checkpoint: Path, dtype: str, extra: list[str], log: ServerLog,
                   prefix: list[str] = (), cwd: Path | None = None,
                   ready_timeout_s: float = READY_TIMEOUT_S) -> Iterator[str]:
    """A `moeserve serve` subprocess on a free port, ready; yields its base URL. It is stopped on the way
    out, whatever happens (an exception, Ctrl-C); `log` gets what it wrote and its exit status. `prefix` runs
    the command under another (`taskset -c 0,1`: the server on two cores). `cwd` is where it runs, which decides
    its moeserve ahead of PYTHONPATH: `python -m` puts the working directory first on sys.path, and a local Ray's
    workers get the driver's working directory first too."""
    port = free_port()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen([*prefix, *server_command(checkpoint, port, dtype, extra)], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd)
        log.pid = proc.pid  # the server's own: a prefix such as taskset execs it
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(proc, url, ready_timeout_s)
            yield url
        finally:
            log.exit_code = stop_server(proc)
            out.seek(0)
            log.text = out.read()


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """While the bench runs, SIGTERM unwinds like Ctrl-C does, so its servers are stopped on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
