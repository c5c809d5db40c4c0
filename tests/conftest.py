"""Fixtures shared across the test tree."""

import atexit
import contextlib
import faulthandler
import os

import pytest
import torch

# Engines in tests take the unmeasured default dispatch plan: a timed calibration would make the path a
# test runs depend on the machine's load, and cost seconds per model shape. The calibration itself is
# tested in tests/runtime/test_calibration.py, with its own cache directory; subprocesses inherit this.
os.environ["MOESERVE_CALIBRATION"] = "off"

# The README's command runs the suite on two pytest-xdist workers (`-n 2`), one per core of the machines CI runs on.
# Each worker and what it starts (servers, CLIs, Ray's workers) then computes with one thread: two OpenMP threads
# per worker on two cores spin-wait on each other (see one_torch_thread). Ray's modules are one xdist_group, so at
# most one Ray cluster runs at a time (`ray.init()` joins the newest cluster on the machine where it can).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# pytest's own fault handler is off again once the session ends; a crash after that (a library's thread
# outliving its runtime while the interpreter shuts down) would leave only "Segmentation fault" and exit
# status 139 in CI. Registered first, so it runs after the atexit hooks of Ray and the rest.
atexit.register(faulthandler.enable, all_threads=True)


UNGROUPED = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` run where torch sees a CUDA GPU (README, "On a GPU"); elsewhere each is skipped with
    the reason, so a CPU machine's report still lists what it did not check. Under `--dist loadgroup`, a test of an
    xdist_group whose id lacks the group's suffix means pytest-xdist could not group it (pytest 9.2 with xdist 3.8):
    each such test fails with the reason rather than run beside its group (two Ray clusters, or two expert-parallel
    compiles, at once). A worker cannot stop the session with a message of its own: xdist reports a crash."""
    if config.getoption("loadgroup", False) and any(
            item.get_closest_marker("xdist_group") and "@" not in item.nodeid for item in items):
        config.stash[UNGROUPED] = (f"pytest-xdist's --dist loadgroup does not group tests under pytest "
                                   f"{pytest.__version__}: install the pytest that the dev extra allows")
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU: the CUDA paths run only where one is present (pytest -m cuda)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def pytest_runtest_setup(item):
    if UNGROUPED in item.config.stash and item.get_closest_marker("xdist_group"):
        pytest.fail(item.config.stash[UNGROUPED], pytrace=False)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module of tiny models: they gain nothing from a second one, and on a
    busy 2-core machine two OpenMP threads spin-wait on each other (test_dispatch.py: 8 s with one
    thread, 70 s with two; scoring 10x slower). Results do not depend on it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def wait_ready(url: str, timeout_s: float) -> float | None:
    """Seconds until a Ray Serve application's /readyz says 200 with every group it lists serving (an
    expert-parallel app lists its groups), or None after timeout_s."""
    import time

    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            r = httpx.get(f"{url}/readyz", timeout=5)
            if r.status_code == 200 and all(g.get("state") == "serving" for g in r.json().get("groups", [])):
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return None


@contextlib.contextmanager
def ray_serve_on(port: int, **init):
    """A local Ray for one test module (2 CPUs, a small object store; `init` adds ray.init's options) with Serve's
    HTTP proxy on 127.0.0.1:port; yields its URL, and leaves nothing of Ray running after."""
    import ray
    from ray import serve

    ray.init(num_cpus=2, object_store_memory=200 << 20, include_dashboard=False, log_to_driver=False, **init)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        wait_for_ray_to_exit()


def wait_for_ray_to_exit(timeout_s: float = 30.0) -> None:
    """After ray.shutdown(): wait until this machine's Ray processes (raylet, GCS, workers) are gone, so that
    their teardown does not take the CPU from the timing-sensitive tests that run next."""
    import os
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = False
        for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if b"raylet" in cmd or b"gcs_server" in cmd or cmd.startswith(b"ray::"):
                alive = True
                break
        if not alive:
            return
        time.sleep(0.2)
