"""`moeserve bench layer` on a tiny shape: every implementation this machine runs is timed and checked
against the fp32 reference, the calibration's plan is reported, and what the machine cannot run is
skipped with its reason instead of ending the run."""

from __future__ import annotations

import pytest
import torch

import moeserve.bench.layer as layer_bench
from moeserve.bench.layer import Shape, bench_layer, markdown, speedups
from moeserve.cli import main as cli_main
from moeserve.runtime import device
from moeserve.runtime.backends import cpu_kernel
from moeserve.runtime.backends.packing import onednn_packing_available

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHAPE = Shape(d_model=32, d_ff=48, n_experts=4, top_k=2)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("MOESERVE_CALIBRATION", "auto")


def impls(report: dict, dtype: str, T: int) -> set[str]:
    return {r["impl"] for r in report["results"] if r["dtype"] == dtype and r["tokens"] == T}


@pytest.mark.parametrize("onednn_bf16", ["this cpu", "forced off"])
def test_every_implementation_the_machine_runs_is_timed_and_correct(monkeypatch, onednn_bf16):
    if onednn_bf16 == "forced off":
        monkeypatch.setattr(device, "onednn_bf16_available", lambda: False)
    report = bench_layer([1, 3], ["bfloat16", "float32"], SHAPE, min_time=0.01, hf_backends=("eager",),
                         progress=False)
    assert set(report["plans"]) == {"bfloat16", "float32"}
    for dtype, p in report["plans"].items():
        assert p["source"] == "measured" and p["reason"].startswith("experts ")
    always = {"dense GEMM (same FLOPs)", "reference loop", "moeserve (auto)", "moeserve gather, plain",
              "moeserve grouped, plain", "moeserve grouped_mm, plain", "transformers eager"}
    packed = {"dense GEMM (same FLOPs), oneDNN packed", "moeserve gather, packed", "moeserve grouped, packed"}
    kernel = {"moeserve gather, C kernel", "moeserve grouped, C kernel"}
    for dtype in ("bfloat16", "float32"):
        can_pack = onednn_packing_available("cpu", getattr(torch, dtype))
        has_kernel = cpu_kernel.unavailable_for(getattr(torch, dtype)) is None
        # grouped_mm is timed wherever this torch has it; where it does not, it is skipped with the reason
        named_skips = {s["impl"] for s in report["skipped"] if s["dtype"] == dtype and s["why"]}
        for T in (1, 3):
            ran = impls(report, dtype, T)
            assert ran | (named_skips & {"moeserve grouped_mm, plain"}) == (
                always | (packed if can_pack else set()) | (kernel if has_kernel else set()))
        assert any(s["dtype"] == dtype and s["impl"] == "oneDNN-packed implementations"
                   for s in report["skipped"]) == (not can_pack)
        assert any(s["dtype"] == dtype and s["impl"] == "C kernel implementations"
                   for s in report["skipped"]) == (not has_kernel)
    if onednn_bf16 == "forced off":
        assert not report["plans"]["bfloat16"]["pack_experts"]
    for r in report["results"]:
        if r["max_abs_err_vs_fp32"] is not None:
            assert r["max_abs_err_vs_fp32"] < (1e-5 if r["dtype"] == "float32" else 5e-2), r
    rows = speedups(report)
    assert [(s["dtype"], s["tokens"]) for s in rows] == [("bfloat16", 1), ("bfloat16", 3), ("float32", 1),
                                                         ("float32", 3)]
    assert all(s["speedup_vs_reference"] > 0 and s["hf_best"] == "transformers eager" for s in rows)
    text = markdown(report)
    assert "calibration (float32): experts " in text and "| float32 | 3 | moeserve (auto) |" in text


def test_what_the_machine_cannot_run_is_skipped_not_fatal(monkeypatch):
    monkeypatch.setattr(layer_bench, "dtype_unsupported", lambda dev, dt: "no bf16 here" if dt is torch.bfloat16
                        else None)

    def broken(layer, backend):
        class Raises(torch.nn.Module):
            def forward(self, x):
                raise RuntimeError(f"{backend} backend: not implemented for this CPU")
        return Raises()

    monkeypatch.setattr(layer_bench, "hf_block", broken)
    report = bench_layer([2], ["bfloat16", "float32"], SHAPE, min_time=0.01, hf_backends=("grouped_mm",),
                         progress=False)
    assert {r["dtype"] for r in report["results"]} == {"float32"} and "bfloat16" not in report["plans"]
    assert {"dtype": "bfloat16", "impl": "every implementation",
            "why": "torch does not run bfloat16 on this CPU (no bf16 here)"} in report["skipped"]
    assert {"dtype": "float32", "impl": "transformers grouped_mm",
            "why": "grouped_mm backend: not implemented for this CPU"} in report["skipped"]
    assert speedups(report)[0]["hf_best"] is None and "| float32 | 2 | " in markdown(report)


def test_cli_bench_layer_and_sweep_finish(capsys):
    args = ["bench", "layer", "--tokens", "1", "--d-model", "32", "--d-ff", "48", "--experts", "4",
            "--min-time", "0.01", "--quiet"]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "calibration (bfloat16)" in out and "calibration (float32)" in out and "x reference" in out
    assert cli_main(args[:-3] + ["--sweep", "--dtypes", "float32"]) == 0
    out = capsys.readouterr().out
    assert "| T | gather/plain ms |" in out and "float32: experts " in out and "why: experts " in out
