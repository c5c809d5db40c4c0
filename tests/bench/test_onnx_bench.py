"""`moeserve bench onnx` on a tiny checkpoint: every backend timed at every shape against the eager baseline."""

from __future__ import annotations

import pytest
import torch

from moeserve.bench.onnx import bench_onnx, markdown, plot
from moeserve.checkpoint import save_checkpoint
from moeserve.config import preset
from moeserve.runtime.model import Transformer

from .test_report import png_size

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bench_onnx_times_every_export_against_eager(tmp_path):
    torch.manual_seed(0)
    model = Transformer(preset("tiny", router="vq", vq_mode="discrete"))
    for layer in model.moe_layers:
        layer.quantizer.initialized.fill_(True)
    ckpt = save_checkpoint(tmp_path / "vq", model.cfg, model.state_dict())
    report = bench_onnx(ckpt, batches=[1, 2], seqs=[1, 5], repeats=3, new_tokens=3)
    backends = ["torch eager fp32", "onnxruntime portable", "onnxruntime fused", "onnxruntime vq-table"]
    assert [(r["backend"], r["batch"], r["seq"]) for r in report["results"]] == [
        (b, batch, seq) for batch in (1, 2) for seq in (1, 5) for b in backends]
    assert all(r["p50_ms"] > 0 for r in report["results"])
    assert {r["speedup_vs_eager"] for r in report["results"] if r["backend"] == "torch eager fp32"} == {1.0}
    assert [e["mode"] for e in report["exports"]] == ["portable", "fused", "vq-table"]
    assert all(e["max_abs_diff"] <= 1e-4 for e in report["exports"])
    assert report["exports"][2]["file_mib"] < report["exports"][0]["file_mib"]  # the table replaced the experts
    assert [(r["backend"], r["batch"]) for r in report["generation"]] == [
        ("torch eager fp32", 1), ("onnxruntime fused, KV cache", 1), ("torch eager fp32", 2),
        ("onnxruntime fused, KV cache", 2)]
    assert "| onnxruntime vq-table | 2 x 5 |" in markdown(report)
    plot(report, tmp_path / "onnx.png")
    assert png_size(tmp_path / "onnx.png") == (1400, 450)  # two panels of 7 x 4.5 inches at 100 dpi
