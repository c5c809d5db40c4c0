"""A GPU's compiled decode experts, measured (decode_calibration.py): the rows up to which GEMVs beat grouped_mm
from any timings (pure), the plan a bf16 GPU gets and its cache (the timing and the GPU's name stood in for on a
CPU), the timing itself on this CPU in bf16 (one layer compiled both ways), and on CUDA for real."""

from __future__ import annotations

import pytest
import torch

from moeserve.runtime.backends import decode_calibration as dc
from moeserve.runtime.backends.calibration import ExpertShape
from moeserve.runtime.backends.compiled import compile_unavailable

SHAPE = ExpertShape(d_model=64, d_ff=128, n_experts=4, top_k=2, act="swiglu")


def rows(reduced: list[float], grouped: list[float]) -> dict[str, dict[int, float]]:
    return {"decode/reduced": dict(zip((1, 2, 4), reduced)), "decode/grouped": dict(zip((1, 2, 4), grouped))}


def test_gemvs_up_to_the_last_count_where_they_win_at_every_one():
    assert dc.reduce_max_of(rows([1, 2, 5], [3, 3, 4])) == 2
    assert dc.reduce_max_of(rows([1, 2, 3], [3, 3, 4])) == 4
    assert dc.reduce_max_of(rows([3, 2, 1], [3, 3, 4])) == 0  # a tie at one row: grouped_mm, the default
    assert dc.reduce_max_of(rows([1, 4, 1], [3, 3, 4])) == 1  # not past a count where they lose


def test_a_bf16_gpu_measures_once_then_reads_its_cache(tmp_path, monkeypatch):
    calls = []
    measured = rows([0.05, 0.09, 0.3], [0.2, 0.2, 0.2])
    monkeypatch.setattr(dc, "time_decode_paths", lambda *a: calls.append(a) or measured)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A GPU")
    first = dc.gpu_decode_plan(SHAPE, "cuda", torch.bfloat16, "auto", root=tmp_path)
    assert (first.source, first.decode_grouped, first.decode_reduce_max) == ("measured", True, 2)
    assert "1 row: 0.05 against 0.2, 2 rows: 0.09 against 0.2, 4 rows: 0.3 against 0.2" in first.reason
    assert "GEMVs up to 2 rows (measured)" in first.describe()
    second = dc.gpu_decode_plan(SHAPE, "cuda", torch.bfloat16, "auto", root=tmp_path)
    assert (second.source, second.decode_reduce_max, second.timings) == ("cached", 2, first.timings)
    assert len(calls) == 1
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Another GPU")  # another GPU: measured
    for mode, source, measured_so_far in (("auto", "measured", 2), ("redo", "measured", 3), ("off", "default", 3)):
        plan = dc.gpu_decode_plan(SHAPE, "cuda", torch.bfloat16, mode, root=tmp_path)
        assert (plan.source, len(calls)) == (source, measured_so_far)
    assert plan.decode_reduce_max == 0 and plan.reason == "calibration off"
    fp32 = dc.gpu_decode_plan(SHAPE, "cuda", torch.float32, "auto", root=tmp_path)  # no grouped_mm step to time
    assert (fp32.source, fp32.decode_grouped, fp32.decode_reduce_max, len(calls)) == ("default", False, 0, 3)


def test_a_measurement_that_cannot_run_leaves_the_defaults(tmp_path, monkeypatch, caplog):
    def fail(*a):
        raise RuntimeError("capture refused")

    monkeypatch.setattr(dc, "time_decode_paths", fail)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A GPU")
    with caplog.at_level("WARNING", logger="moeserve.runtime"):
        plan = dc.gpu_decode_plan(SHAPE, "cuda", torch.bfloat16, "auto", root=tmp_path)
    assert (plan.source, plan.decode_grouped, plan.decode_reduce_max) == ("default", True, 0)
    assert "timing the decode experts failed (RuntimeError: capture refused)" in plan.reason
    assert "GEMVs off" in caplog.text and not (tmp_path / "calibration").exists()  # tried again at the next load


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_each_path_is_compiled_and_timed_at_each_count(device):
    """On a CPU in bf16 (grouped_mm compiles for bf16 only), as on a GPU, where each is a CUDA graph's replay."""
    why = compile_unavailable(torch.device(device))
    if why is not None:
        pytest.skip(why)
    got = dc.time_decode_paths(SHAPE, device, torch.bfloat16)
    assert set(got) == {"decode/reduced", "decode/grouped"}
    assert all(set(t) == {1, 2, 4} and all(0 < ms < 1000 for ms in t.values()) for t in got.values())


@pytest.mark.cuda
def test_a_gpu_measures_its_plan(tmp_path):
    why = compile_unavailable(torch.device("cuda"))
    if why is not None:
        pytest.skip(why)
    plan = dc.gpu_decode_plan(SHAPE, "cuda", torch.bfloat16, "redo", root=tmp_path)
    assert plan.source == "measured" and plan.decode_grouped and plan.decode_reduce_max in (0, 1, 2, 4)
    assert plan.decode_reduce_max == dc.reduce_max_of(plan.timings)
