"""export_onnx's refusals: bad input gets a named error before anything is written, a parity failure
writes the report but never the model, and an interrupted export leaves no temporary file behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from moeserve.checkpoint import CheckpointError, save_checkpoint
from moeserve.config import preset
from moeserve.export import parity as parity_module
from moeserve.export.onnx_export import ExportError, export_onnx
from moeserve.runtime.model import Transformer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-4  # fp32 parity, as the exporter's own check (parity.TOLERANCE["float32"], which one test patches)


def listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


# ---- bad input: ExportError, nothing written ------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Default-initialised tiny checkpoints (the brief's recipe): xmoe, softmax, and one with a capacity."""
    root = tmp_path_factory.mktemp("ckpts")
    made = {}
    for key, overrides in {"xmoe": dict(router="xmoe"), "softmax": dict(router="softmax"),
                           "capacity": dict(router="softmax", capacity_factor=1.25),
                           "sinks": dict(router="softmax", qk_norm="head", qkv_bias=True, attention_sinks=True,
                                         router_bias=True)}.items():
        torch.manual_seed(0)
        model = Transformer(preset("tiny", **overrides))
        made[key] = save_checkpoint(root / key, model.cfg, model.state_dict())
    return made


@pytest.fixture
def out_dir(tmp_path) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    return d


def test_missing_checkpoint(tmp_path, out_dir):
    with pytest.raises(CheckpointError, match="does not exist") as e:
        export_onnx(tmp_path / "no-such-checkpoint", out_dir / "m.onnx", "portable")
    assert "no-such-checkpoint" in str(e.value)
    assert listing(out_dir) == []


def test_unknown_mode(checkpoints, out_dir):
    with pytest.raises(ExportError, match="'turbo'") as e:
        export_onnx(checkpoints["xmoe"], out_dir / "m.onnx", "turbo")
    assert all(m in str(e.value) for m in ("portable", "fused", "vq-table"))
    assert listing(out_dir) == []


def test_output_directory_missing(checkpoints, tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ExportError, match="does not exist") as e:
        export_onnx(checkpoints["xmoe"], missing / "m.onnx", "portable")
    assert str(missing) in str(e.value)
    assert not missing.exists()


def test_output_path_is_a_directory(checkpoints, out_dir):
    (out_dir / "m.onnx").mkdir()
    with pytest.raises(ExportError, match="is a directory"):
        export_onnx(checkpoints["xmoe"], out_dir / "m.onnx", "portable")
    assert listing(out_dir) == ["m.onnx"] and listing(out_dir / "m.onnx") == []


def test_output_directory_read_only(checkpoints, out_dir):
    if os.geteuid() == 0:
        pytest.skip("running as root: root writes into a 0o555 directory anyway, so there is nothing to refuse")
    out_dir.chmod(0o555)
    try:
        with pytest.raises(ExportError, match="not writable"):
            export_onnx(checkpoints["xmoe"], out_dir / "m.onnx", "portable")
        assert listing(out_dir) == []
    finally:
        out_dir.chmod(0o755)


def test_vq_table_on_a_softmax_model(checkpoints, out_dir):
    with pytest.raises(ExportError, match="vq-table") as e:
        export_onnx(checkpoints["softmax"], out_dir / "m.onnx", "vq-table")
    assert "'softmax'" in str(e.value)
    assert listing(out_dir) == []


@pytest.mark.parametrize("mode", ["portable", "fused"])
def test_capacity_factor_has_no_onnx_form(checkpoints, out_dir, mode):
    with pytest.raises(ExportError, match="capacity_factor=1.25"):
        export_onnx(checkpoints["capacity"], out_dir / "m.onnx", mode)
    assert listing(out_dir) == []


@pytest.mark.parametrize("mode", ["portable", "fused"])
def test_a_family_addition_the_graph_lacks_is_refused_by_name(checkpoints, out_dir, mode):
    """Only the additions without operators here are named, each with why (qkv_bias and qk_norm, which the graph
    writes, are not)."""
    with pytest.raises(ExportError, match="turns on attention_sinks, router_bias .*does not write yet: "
                                          "attention_sinks: a learned logit .*; router_bias: a bias on the router") as e:
        export_onnx(checkpoints["sinks"], out_dir / "m.onnx", mode)
    assert "qkv_bias" not in str(e.value) and "qk_norm" not in str(e.value)
    assert listing(out_dir) == []


def test_parity_failure_writes_report_but_not_model(checkpoints, out_dir, monkeypatch):
    """A tolerance nothing can meet: the export fails naming parity; the model is not written (an older
    file at that path is left as it was), the report is, with passed false; no temporary file remains."""
    monkeypatch.setattr(parity_module, "TOLERANCE", {"float32": -1.0, "float16": -1.0, "bfloat16": -1.0})
    out = out_dir / "m.onnx"
    out.write_bytes(b"previous export")
    with pytest.raises(ExportError, match="parity") as e:
        export_onnx(checkpoints["xmoe"], out, "portable")
    assert "not written" in str(e.value)
    assert listing(out_dir) == ["m.onnx", "m.onnx.report.json"]
    assert out.read_bytes() == b"previous export"
    data = json.loads((out_dir / "m.onnx.report.json").read_text())
    assert data["passed"] is False and data["tolerance"] == -1.0
    assert data["outputs"]["logits"]["max_abs_diff"] <= TOL  # the graph itself is right; only the bar moved

    out.unlink()
    (out_dir / "m.onnx.report.json").unlink()
    with pytest.raises(ExportError, match="parity"):
        export_onnx(checkpoints["xmoe"], out, "fused")
    assert listing(out_dir) == ["m.onnx.report.json"]


def test_interrupted_export_leaves_nothing(checkpoints, out_dir, monkeypatch):
    """An export cut short after the graph was written to its temporary file (here: Ctrl-C during the
    parity run) removes that file and writes neither the model nor a report."""
    def interrupted(*args, **kwargs):
        assert [n for n in listing(out_dir) if n.startswith(".m.onnx.") and n.endswith(".tmp")], listing(out_dir)
        raise KeyboardInterrupt

    monkeypatch.setattr(parity_module, "check", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_onnx(checkpoints["xmoe"], out_dir / "m.onnx", "portable")
    assert listing(out_dir) == []
