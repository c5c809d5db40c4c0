"""`moeserve bench shards` on a real local Ray: every remote path gives the in-process layer's output
(checked inside the bench before anything is timed), and the report has a row per path and token count."""

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
pytest.importorskip("ray.serve")

from moeserve.bench.shards import bench_shards, markdown  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (conftest.py)
PATHS = ["in process", "serve handles", "ray actors", "ray compiled graph", "ray actors, sockets",
         "compute, slowest shard", "to/from arrays, both ways"]


def test_report_rows_and_table():
    report = bench_shards(2, [1, 3], calls=3, model="tiny")
    assert [(r["path"], r["tokens"]) for r in report["results"]] == [(p, t) for t in (1, 3) for p in PATHS]
    assert all(r["p50_ms"] > 0 and r["p99_ms"] >= r["p50_ms"] for r in report["results"])
    assert [r["vs_in_process"] for r in report["results"] if r["path"] == "in process"] == [1.0, 1.0]
    table = markdown(report)
    assert "| serve handles | 1 |" in table and "over 2 shards" in table
