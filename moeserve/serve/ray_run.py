"""Running a Ray Serve application from `moeserve serve --ray`: started on the Ray this process joined, announced
once its /readyz says ready, served until SIGTERM or Ctrl-C, then deleted (which drains its replicas) before this
process leaves Ray. Only the process around the application; what it serves is serve/ep_app.py's."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Callable

import ray
from ray import serve

from moeserve.ray_cluster import local_ray_lost
from moeserve.serve.state import ServeConfig

__all__ = ["APP_NAME", "serve_until_stopped"]

APP_NAME = "moeserve"  # the application's name in Serve (its deployments are "ingress" and Serve's own)


def serve_until_stopped(build: Callable[[], object], serve_cfg: ServeConfig, what: str, name: str,
                        ready_timeout_s: float = 600.0, access_log: bool = True, log_level: str = "info") -> int:
    """Run the application `build()` makes on the Ray this process joined, say when it is ready, serve until SIGTERM
    or Ctrl-C, then delete it and leave Ray. 1 if it never became ready."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": serve_cfg.host, "port": serve_cfg.port})
        serve.run(build(), name=APP_NAME, route_prefix="/", blocking=False,
                  logging_config={"log_level": log_level.upper(), "enable_access_log": access_log})
        host = "127.0.0.1" if serve_cfg.host in ("0.0.0.0", "::") else serve_cfg.host
        url, deadline = f"http://{host}:{serve_cfg.port}", time.monotonic() + ready_timeout_s
        while not stop.wait(0.5):
            status = _readiness(url)
            if status == "ready":
                print(f"moeserve: {serve_cfg.model_name or name} is ready on {url} (Ray Serve, {what})",
                      file=sys.stderr)
                break
            if status == "failed" or time.monotonic() > deadline:
                print(f"moeserve serve: error: the model did not load ({status}); see the replica logs "
                      f"(ray logs, or /tmp/ray/session_latest/logs)", file=sys.stderr)
                return 1
        stop.wait()
        return 0
    finally:
        # deleting the application drains its replicas (each app's lifespan lets requests in flight finish);
        # bounded, and not waited for once the local Ray is gone: a signal to the process group (Ctrl-C) stops
        # Ray's processes too, and the wait would run to its bound (45 s under load, docs/bench/log.md)
        deleting = threading.Thread(target=_delete_app, daemon=True)
        deleting.start()
        deadline = time.monotonic() + serve_cfg.shutdown_timeout_s + 15
        while deleting.is_alive() and time.monotonic() < deadline and not local_ray_lost():
            deleting.join(0.2)
        ray.shutdown()


def _delete_app() -> None:
    with contextlib.suppress(Exception):
        serve.delete(APP_NAME)


def _readiness(url: str) -> str:
    """/readyz's status: ready, loading, failed; starting while nothing answers."""
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=5) as r:
            return json.loads(r.read()).get("status", "starting")
    except urllib.error.HTTPError as e:  # 503: loading, failed or draining
        with contextlib.suppress(ValueError):
            return json.loads(e.read()).get("status", "starting")
        return "starting"
    except (OSError, ValueError):
        return "starting"
