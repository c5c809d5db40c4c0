"""The README's test command installs the `dev` extra, and about 20 test modules skip themselves where one of its
packages is missing (importorskip, for a user who installed less). Where the whole extra was asked for, a missing
package is a broken install, not a reason to skip: this test names it, so that CI fails instead of going green
with those modules skipped."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parents[1]


def dev_requirements() -> list[str]:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return [re.match(r"[A-Za-z0-9_.-]+", req).group(0) for req in extras["dev"]]


def test_every_package_of_the_dev_extra_is_installed():
    try:
        importlib.metadata.version("moeserve")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("moeserve is not installed (run from a checkout on PYTHONPATH): no extra was asked for")
    missing = []
    for name in dev_requirements():
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    assert not missing, f"the dev extra's {missing} are not installed: pip install -e '.[dev]' (README)"
    assert {"pytest-xdist", "ray", "onnxruntime", "transformers"} <= set(dev_requirements())


def test_the_c_kernel_builds_where_a_compiler_is_present():
    """About 40 tests need the C kernel and skip without it. On a Linux x86 machine with a C compiler (CI's), a
    kernel that fails to build, to load, or one of its own checks is a broken install: named here, not skipped."""
    import os
    import platform
    import shutil

    from moeserve.runtime.backends import cpu_kernel

    cc = os.environ.get("CC") or "cc"
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64") or not shutil.which(cc):
        pytest.skip(f"not a Linux x86 machine with a C compiler ({cc!r}): the kernel is optional here")
    if os.environ.get(cpu_kernel.ENV, "").lower() == "off":
        pytest.skip(f"${cpu_kernel.ENV}=off")
    assert cpu_kernel.available(), f"the C kernel is not available: {cpu_kernel.unavailable_reason()}"
