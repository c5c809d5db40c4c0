"""`moeserve bench ep` at a tiny size: two gloo ranks, each layer call checked against the in-process layer before
it is timed; the report has a row per token count, exchange (variable, packed) and rank, and the command writes its
JSON."""

from __future__ import annotations

import json

from moeserve.bench.ep import markdown
from moeserve.cli import main


def test_the_command_at_tiny_size(tmp_path, capsys):
    out = tmp_path / "ep.json"
    assert main(["bench", "ep", "--model", "tiny", "--ranks", "2", "--tokens", "1", "3", "--calls", "3", "--quiet",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["bench"] == "ep" and report["ranks"] == 2 and report["backend"] == "gloo"
    assert [(r["tokens"], r["exchange"], r["rank"]) for r in report["results"]] == [
        (T, exchange, rank) for T in (1, 3) for exchange in ("variable", "packed") for rank in (0, 1)]
    for r in report["results"]:
        assert 0 < r["a2a_p50_ms"] <= r["a2a_p99_ms"] and r["a2a_p50_ms"] <= r["layer_p50_ms"]
        assert r["in_process_p50_ms"] > 0 and r["kb_out_and_back"] >= 0
    assert "| 3 | packed | 1 |" in capsys.readouterr().out and "over 2 expert-parallel ranks" in markdown(report)


def test_bad_arguments_are_named(capsys):
    assert main(["bench", "ep", "--model", "tiny", "--ranks", "5", "--calls", "1"]) == 2
    assert "--ranks 5: expected 1..4" in capsys.readouterr().err
