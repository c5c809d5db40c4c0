"""Joining Ray, for the parts of moeserve that run on it (scoring_ray.py, serve/ep_app.py): moeserve
grows no cluster layer of its own."""

from __future__ import annotations

import logging
import os


def connect():
    """The `ray` module, joined to a cluster: the one this process already joined, else $RAY_ADDRESS's (ray.init
    reads it), else a new local one. `ray.shutdown()` later stops only what this call started."""
    try:
        import ray
    except ImportError as e:
        raise ValueError("--ray needs Ray: pip install -e '.[ray]' (ray[serve,data])") from e
    if not ray.is_initialized():
        # at ray.shutdown, task events are flushed to the GCS for up to 5 s, even to a GCS already gone (a signal to
        # the process group stops it too: local_ray_lost); events for Ray's state API, not moeserve's own
        os.environ.setdefault("RAY_task_events_shutdown_flush_timeout_ms", "1000")
        if not os.environ.get("RAY_ADDRESS"):
            # a Ray of our own has no GCS fault tolerance: its GCS gone, every Ray process that calls it gives up
            # after this long (Ray's default, 60 s, held `ray.shutdown` and this process's exit that long, now and
            # then, once Ctrl-C had stopped the GCS: tests/test_ray_cluster.py's run took 67 s instead of 8)
            os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", "10")
        ray.init(include_dashboard=False, logging_level=logging.WARNING, configure_logging=True)
    return ray


def local_ray_lost() -> bool:
    """Whether the local Ray that `connect` started here has lost its GCS server or raylet. A signal to the whole
    process group (Ctrl-C in a terminal, SIGTERM from a supervisor) reaches Ray's own processes too, and then no call
    to Ray can finish: there is nothing left to wait for. False on a cluster this process joined, whose processes are
    not its own. Ray's node object is private API, so any change to it reads as False (the caller's bounded wait)."""
    import ray

    try:
        node = ray._private.worker._global_node
        return bool(node is not None and node.head
                    and any(kind in ("gcs_server", "raylet") for kind, _ in node.dead_processes()))
    except Exception:  # noqa: BLE001 - see the docstring
        return False
