"""Every bench's report carries its command and machine, draws itself into a PNG, and `moeserve bench docs`
renders a directory of reports into one page with their plots drawn again from the JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeserve.bench.layer import Shape, bench_layer
from moeserve.bench.plots import PlotUnavailable, pyplot
from moeserve.bench.train import plot as train_plot
from moeserve.cli import main
from moeserve.runtime.device import machine

pytest.importorskip("matplotlib")


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG, decoded."""
    from matplotlib.image import imread

    height, width = imread(path).shape[:2]
    return width, height


def train_report() -> dict:
    """The shape bench_train returns (training for real takes minutes; its rows are what is drawn)."""
    rows = [{"recipe": r, "steps": 10, "wall_s": 1.0, "tokens_per_s": t, "val_bpb": b, "unigram_bpb": 4.5}
            for r, t, b in (("softmax", 1000, 2.5), ("xmoe", 900, 2.4))]
    return {"preset": "tiny", "machine": machine(), "corpus_sha256": "0", "results": rows}


def test_layer_and_train_reports_draw_themselves(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESERVE_CACHE", str(tmp_path))
    report = bench_layer([1, 4], ["float32"], Shape(32, 48, 4, 2), min_time=0.01, hf_backends=(), progress=False)
    from moeserve.bench.layer import plot as layer_plot

    layer_plot(report, tmp_path / "layer.png")
    assert png_size(tmp_path / "layer.png") == (600, 450)
    train_plot(train_report(), tmp_path / "train.png")
    assert png_size(tmp_path / "train.png") == (1100, 450)


def test_bench_docs_renders_every_report_with_its_command(tmp_path, capsys):
    reports = tmp_path / "reports"
    reports.mkdir()
    rc = main(["bench", "layer", "--tokens", "1", "--dtypes", "float32", "--d-model", "32", "--d-ff", "48",
               "--experts", "4", "--min-time", "0.01", "--quiet", "--json", str(reports / "layer.json"),
               "--plot", str(tmp_path / "first.png")])
    assert rc == 0 and png_size(tmp_path / "first.png") == (600, 450)
    layer = json.loads((reports / "layer.json").read_text())
    assert layer["bench"] == "layer" and layer["command"].startswith("moeserve bench layer --tokens 1 ")
    assert {"cpu", "cpu_flags", "cores", "gpu", "torch"} <= set(layer["machine"])
    (reports / "train.json").write_text(json.dumps({**train_report(), "bench": "train", "command": "moeserve bench "
                                                    "train --preset tiny"}))
    (reports / "train.md").write_text("# Routing methods side by side\n\nxmoe is *faster* here.\n")
    (reports / "log.md").write_text("## Measurements along the way\n\nolder numbers\n")
    capsys.readouterr()
    out = tmp_path / "benchmarks.md"
    assert main(["bench", "docs", "--dir", str(reports), "--out", str(out)]) == 0
    page = out.read_text()
    assert "## layer (`moeserve bench layer`)" in page
    assert "## Routing methods side by side (`moeserve bench train`)" in page and "xmoe is *faster* here." in page
    assert page.index("(`moeserve bench layer`)") < page.index("(`moeserve bench train`)") < page.index("older numbers")
    assert f"`{layer['command']}`" in page and "`moeserve bench train --preset tiny`" in page
    assert "| float32 | 1 | moeserve (auto) |" in page and "| xmoe | 10 | 1.0 | 900 | 2.4 | 4.5 |" in page
    # images and files linked relative to the page, drawn again from the JSON
    assert "![layer](reports/layer.png)" in page and "[`train.json`](reports/train.json)" in page
    assert png_size(reports / "layer.png") == (600, 450) and png_size(reports / "train.png") == (1100, 450)
    assert "wrote" in capsys.readouterr().out
    (reports / "layer.png").unlink()
    assert main(["bench", "docs", "--dir", str(reports), "--out", str(out), "--no-plots"]) == 0
    assert not (reports / "layer.png").exists() and "![layer]" not in out.read_text()
    (reports / "broken.json").write_text("{}")
    assert main(["bench", "docs", "--dir", str(reports), "--out", str(out), "--no-plots"]) == 2
    assert "broken.json: not a bench report" in capsys.readouterr().err
    assert main(["bench", "docs", "--dir", str(tmp_path / "none")]) == 2


def test_plot_without_matplotlib_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlotUnavailable, match=r"pip install 'moeserve\[bench\]'"):
        pyplot()
