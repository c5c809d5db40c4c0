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
