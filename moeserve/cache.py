"""Where moeserve keeps what it makes once per machine: the built-in default model and the dispatch
calibrations. $MOESERVE_CACHE, else $XDG_CACHE_HOME/moeserve, else ~/.cache/moeserve."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    if os.environ.get("MOESERVE_CACHE"):
        return Path(os.environ["MOESERVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "moeserve"
