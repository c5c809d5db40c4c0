"""docs/benchmarks.md is what `moeserve bench docs` writes from docs/bench: a number on the page traces to a
committed JSON file and the command in it, and a hand edit of the page (or a report committed without running
the command) fails here."""

from __future__ import annotations

import json
from pathlib import Path

from moeserve.bench.report import page

ROOT = Path(__file__).resolve().parents[2]


def test_benchmarks_page_is_generated_from_the_committed_reports(monkeypatch):
    monkeypatch.chdir(ROOT)
    committed = (ROOT / "docs" / "benchmarks.md").read_text()
    assert committed == page(Path("docs/bench"), Path("docs/benchmarks.md")), (
        "docs/benchmarks.md is stale: run `moeserve bench docs` (or `--no-plots`) and commit the result")


def test_every_committed_report_names_its_command_machine_and_plot():
    for path in sorted((ROOT / "docs" / "bench").glob("*.json")):
        report = json.loads(path.read_text())
        assert report["command"].startswith(f"moeserve bench {report['bench']} "), path
        assert f"--json docs/bench/{path.name}" in report["command"], path
        assert {"cpu", "cores", "torch"} <= set(report["machine"]), path
        assert path.with_suffix(".png").exists(), f"{path}: no plot beside it"
