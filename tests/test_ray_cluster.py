"""ray_cluster.local_ray_lost on a real local Ray: `moeserve serve --ray` stops waiting for its application's
deletion once the Ray it started has lost its GCS (a signal to the process group reaches Ray's processes too; the
wait ran to its 45 s bound under load, docs/bench/log.md). The other side, a cluster joined at $RAY_ADDRESS whose
deletion is waited for, is test_ep_deploy.py's SIGTERM test (the application is gone when the CLI exits)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (conftest.py)

SCRIPT = """
import os, signal, time
import ray
from moeserve.ray_cluster import connect, local_ray_lost
connect()
print("alive", local_ray_lost(), flush=True)
gcs = ray._private.worker._global_node.all_processes["gcs_server"][0].process.pid
os.kill(gcs, signal.SIGKILL)
deadline = time.monotonic() + 20
while not local_ray_lost() and time.monotonic() < deadline:
    time.sleep(0.05)
print("killed", local_ray_lost(), flush=True)
ray.shutdown()
"""


def test_local_ray_lost_says_when_the_ray_started_here_lost_its_gcs():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a Ray of its own
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert out.stdout.split("\n")[:2] == ["alive False", "killed True"], out.stderr[-3000:]
