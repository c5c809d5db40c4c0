"""Joining Ray, for the parts of moeserve that run on it (scoring_ray.py, serve/ep_app.py): moeserve
grows no cluster layer of its own."""

from __future__ import annotations

import logging


def connect():
    """The `ray` module, joined to a cluster: the one this process already joined, else $RAY_ADDRESS's (ray.init
    reads it), else a new local one. `ray.shutdown()` later stops only what this call started."""
    try:
        import ray
    except ImportError as e:
        raise ValueError("--ray needs Ray: pip install -e '.[ray]' (ray[serve,data])") from e
    if not ray.is_initialized():
        ray.init(include_dashboard=False, logging_level=logging.WARNING, configure_logging=True)
    return ray
