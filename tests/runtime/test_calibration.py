"""Dispatch calibration: the choice from measured times (pure, any timings), the measuring on this machine,
the cache (per machine, torch, dtype and shape; redo, off, corrupt or unwritable files), and an Engine laid
out by the plan it gets, giving the same answers as the unmeasured defaults."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from moeserve.config import preset
from moeserve.runtime.backends import calibration as cal
from moeserve.runtime import device
from moeserve.runtime.backends.calibration import CalibrationError, ExpertShape, calibrate, choose, plan_for
from moeserve.runtime.backends.plan import DispatchPlan, default_plan
from moeserve.runtime.engine import Engine
from moeserve.runtime.model import Transformer
from moeserve.runtime.backends.packing import PackedLinear, onednn_packing_available
from moeserve.tokenizer import ByteTokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHAPE = ExpertShape(d_model=32, d_ff=48, n_experts=4, top_k=2, act="swiglu")  # a call takes ~0.1 ms
COUNTS = (1, 2, 4, 8, 16)


def timings(**rows: list[float]) -> dict[str, dict[int, float]]:
    """Candidate name (with / for __) -> ms at COUNTS."""
    return {name.replace("__", "/"): dict(zip(COUNTS, ms)) for name, ms in rows.items()}


# ---- choose: times in, plan out --------------------------------------------------------------
def test_packed_wins_where_it_is_faster_at_every_count():
    t = timings(gather__plain=[1, 2, 4, 8, 16], grouped__plain=[2, 2.5, 3, 6, 10],
                gather__packed=[0.5, 1, 2, 4, 8], grouped__packed=[1, 1.2, 1.5, 3, 5])
    t["linear/plain"], t["linear/packed"] = {1: 1.0, 16: 2.0}, {1: 0.5, 16: 1.0}
    plan = choose(t)
    assert (plan.pack_experts, plan.grouped_mm, plan.gather_max, plan.pack_dense) == (True, False, 2, True)
    assert plan.source == "measured" and plan.reason.startswith("experts packed: 1.00x")
    assert "plain 2.00x" in plan.reason and "dense layers packed (packed/plain time 0.50x)" in plan.reason


def test_the_crossover_is_the_last_count_before_grouped_first_wins():
    base = dict(grouped__plain=[2, 2, 2, 2, 2])
    assert choose(timings(gather__plain=[1, 1, 1, 3, 1], **base)).gather_max == 4  # a later win does not count
    assert choose(timings(gather__plain=[3, 1, 1, 1, 1], **base)).gather_max == 0  # grouped even for one token
    plan = choose(timings(gather__plain=[1, 1, 1, 1, 1], **base))
    assert plan.gather_max == 16 and "gather faster at every count up to 16" in plan.reason


def test_the_score_is_the_mean_time_per_token_not_a_sum_of_times():
    """packed 2x faster at 1 token but 3x slower from 4 on: plain. Then packed 2x faster up to 4 tokens and
    10% slower at 8 and 16: packed, although its summed time is the larger (35.5 vs 35 ms): the largest
    count must not decide alone."""
    t = timings(gather__plain=[1, 2, 4, 8, 16], grouped__plain=[2, 2, 2, 2, 2],
                gather__packed=[0.5, 3, 6, 24, 48], grouped__packed=[1, 3, 6, 6, 6])
    assert not choose(t).pack_experts
    t = timings(gather__plain=[1, 2, 4, 8, 16], grouped__plain=[2, 2, 2, 10, 20],
                gather__packed=[0.5, 1, 2, 20, 40], grouped__packed=[1, 1, 1, 11, 22])
    plan = choose(t)
    assert plan.pack_experts and plan.gather_max == 2
    # per token: plain 1 + 2/2 + 2/4 + 10/8 + 20/16 = 5.0 ms, packed 0.5 + 1/2 + 1/4 + 11/8 + 22/16 = 4.0, the
    # best at each count (gather/plain at 8 and 16, past its own crossover) 0.5 + 1/2 + 1/4 + 8/8 + 16/16 = 3.25
    assert plan.reason.startswith("experts packed: 1.23x the best time per token (plain 1.54x)")


# The 644M Mixtral's experts (D 1024, F 2816, E 8, k 2, fp32) as calibrated on a 2-core AVX512 EPYC: the kernel
# 1.4x faster at one token, packing 1.5-2x faster at 256-512. Scored by the geometric mean of time / best (version
# 6), packing won this run 1.16x to 1.19x and the kernel the run before; decode was then 1.4x slower.
LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MEASURED_644M = {
    "grouped/plain": [4.98, 9.22, 19.34, 29.11, 34.55, 37.22, 39.55, 53.03, 74.63, 123.5],
    "grouped/packed": [2.95, 5.23, 8.46, 11.51, 14.43, 17.87, 25.28, 32.23, 51.93, 102.18],
    "grouped/kernel": [2.07, 4.52, 6.64, 9.17, 11.21, 17.13, 28.01, 50.34, 76.69, 187.93],
}


def test_the_kernel_fast_at_decode_wins_over_packing_fast_at_prefill():
    t = {n: dict(zip(LADDER, ms)) for n, ms in MEASURED_644M.items()}
    for layout in ("plain", "packed", "kernel"):
        t[f"gather/{layout}"] = {T: 2 * ms for T, ms in t[f"grouped/{layout}"].items()}  # grouped throughout
    plan = choose(t)
    assert plan.kernel_experts and not plan.pack_experts and plan.gather_max == 0
    assert plan.reason.startswith("experts kernel: 1.05x the best time per token") and "packed 1.23x" in plan.reason
    assert cal.per_token_ratio(t["grouped/packed"], t["grouped/kernel"]) == pytest.approx(1.178, abs=1e-3)
    # plain torch GEMMs on the same weights beat the kernel from 256 tokens on (74.63 against 76.69 ms): past 128
    # tokens the kernel's layers run them (no dense kernel here: nothing said of dense rows)
    assert plan.kernel_max_tokens == 128 and plan.dense_kernel_max_tokens is None
    assert "experts on torch's GEMMs past 128 tokens" in plan.reason
    assert "torch GEMMs past 128 tokens (experts)" in plan.describe()
    t["large/kernel"], t["large/plain"] = {1024: 400.0, 2048: 900.0}, {1024: 300.0, 2048: 500.0}
    assert choose(t).kernel_max_tokens == 128  # still losing at a scoring batch's counts
    t["large/kernel"][2048] = 450.0  # the kernel ahead again at the largest: it keeps every count
    assert choose(t).kernel_max_tokens is None


def test_kernel_limit_is_where_torch_wins_every_larger_count():
    k = {1: 1.0, 16: 2.0, 128: 10.0, 512: 40.0, 2048: 200.0}
    assert cal.kernel_limit(k, {T: 2 * ms for T, ms in k.items()}) is None  # the kernel everywhere
    assert cal.kernel_limit(k, {1: 2.0, 16: 4.0, 128: 9.0, 512: 30.0, 2048: 150.0}) == 16
    assert cal.kernel_limit(k, {1: 2.0, 16: 1.0, 128: 20.0, 512: 30.0, 2048: 150.0}) == 128  # an early win: no
    assert cal.kernel_limit(k, {T: ms / 2 for T, ms in k.items()}) == 0  # torch at every count
    # dense rows: the kernel past its limit hands over to torch's GEMM
    t = timings(gather__plain=[1, 2, 4, 8, 16], grouped__plain=[2, 2, 2, 2, 2],
                gather__kernel=[0.5, 1, 2, 4, 8], grouped__kernel=[1, 1, 1, 1, 1])
    t["linear/plain"], t["linear/kernel"] = {1: 1.0, 16: 2.0, 128: 5.0}, {1: 0.3, 16: 1.0, 128: 4.0}
    t["large-linear/plain"], t["large-linear/kernel"] = {512: 10.0, 2048: 40.0}, {512: 12.0, 2048: 60.0}
    plan = choose(t)
    assert plan.kernel_experts and plan.kernel_dense and plan.dense_kernel_max_tokens == 128
    assert plan.kernel_max_tokens is None and "dense layers on torch's GEMM past 128 rows" in plan.reason


def test_float32_gemms_on_upcast_weights_past_the_crossover_where_they_beat_the_dtypes_own():
    """A bf16 model on a CPU without bf16 arithmetic: torch's bf16 GEMMs lose to the kernel at every count, float32
    GEMMs on upcast weights win at a scoring batch's counts: past the crossover they run, for experts and dense."""
    t = timings(gather__plain=[1, 2, 4, 8, 16], grouped__plain=[2, 2, 4, 8, 16],
                gather__kernel=[0.5, 1, 2, 4, 8], grouped__kernel=[1, 1, 2, 4, 8])
    t["large/kernel"], t["large/plain"] = {1024: 400.0, 2048: 800.0}, {1024: 900.0, 2048: 1800.0}
    t["linear/plain"], t["linear/kernel"] = {1: 1.0, 16: 2.0, 128: 5.0}, {1: 0.3, 16: 1.0, 128: 4.0}
    t["large-linear/plain"], t["large-linear/kernel"] = {512: 30.0, 2048: 120.0}, {512: 12.0, 2048: 50.0}
    plan = choose(t)
    assert plan.kernel_max_tokens is None and plan.dense_kernel_max_tokens is None  # nothing beats the kernel
    assert not plan.upcast_experts and not plan.upcast_dense
    t["large/upcast"], t["large-linear/upcast"] = {1024: 300.0, 2048: 500.0}, {512: 10.0, 2048: 40.0}
    plan = choose(t)
    assert (plan.kernel_max_tokens, plan.upcast_experts) == (16, True)
    assert (plan.dense_kernel_max_tokens, plan.upcast_dense) == (128, True)
    assert "in float32 on upcast weights" in plan.reason and "float32 on upcast weights" in plan.describe()
    t["large/upcast"] = {1024: 890.0, 2048: 1790.0}  # within the tie margin of bf16's own: not worth a copy
    plan = choose(t)
    assert not plan.upcast_experts and plan.kernel_max_tokens is None and plan.upcast_dense


def test_within_two_percent_the_simpler_configuration_is_kept():
    t = timings(gather__plain=[1, 2, 4, 8, 16], grouped__plain=[2, 2, 2, 2, 2],
                gather__packed=[0.99, 2, 4, 8, 16], grouped__packed=[2, 1.98, 1.98, 1.98, 1.98],
                grouped_mm__plain=[2, 1.99, 1.99, 1.99, 1.99])
    plan = choose(t)
    assert not plan.pack_experts and not plan.grouped_mm
    t["grouped_mm/plain"] = {T: 1.0 for T in COUNTS}
    plan = choose(t)
    assert plan.grouped_mm and not plan.pack_experts


def test_a_tie_between_the_kernel_and_packing_goes_to_the_kernel():
    """The kernel reads the weights where they lie; packing copies them at load: within 2%, the kernel."""
    t = timings(gather__plain=[4, 8, 16, 32, 64], grouped__plain=[4, 8, 16, 32, 64],
                gather__packed=[2.0, 3.0, 4.0, 8.0, 16.0], grouped__packed=[2.0, 3.0, 4.0, 8.0, 16.0],
                gather__kernel=[1.8, 3.0, 4.4, 8.8, 16.8], grouped__kernel=[1.8, 3.0, 4.4, 8.8, 16.8])
    # per token: packed 2 + 1.5 + 1 + 1 + 1 = 6.5 ms, the kernel 1.8 + 1.5 + 1.1 + 1.1 + 1.05 = 6.55, the best 6.3
    plan = choose(t)
    assert plan.kernel_experts and not plan.pack_experts
    assert plan.reason.startswith("experts kernel: 1.04x") and "packed 1.03x" in plan.reason
    t["grouped/kernel"] = t["gather/kernel"] = {T: v * 1.05 for T, v in t["gather/kernel"].items()}  # no tie now
    assert choose(t).pack_experts


def test_packed_decode_with_grouped_mm_prefill_when_each_wins_its_half():
    t = timings(gather__plain=[2, 4, 8, 16, 32], grouped__plain=[3, 3, 4, 6, 10],
                gather__packed=[1, 2, 4, 8, 16], grouped__packed=[2, 2, 3, 6, 10],
                grouped_mm__plain=[3, 3, 3, 3, 5])
    plan = choose(t)
    assert (plan.pack_experts, plan.grouped_mm, plan.gather_max) == (True, True, 2)
    assert plan.reason.startswith("experts packed + grouped_mm: 1.00x")


def test_missing_candidates_are_named():
    plan = choose(timings(gather__plain=[1, 2, 4, 8, 16], grouped__plain=[2, 2, 2, 2, 2]),
                  {"packed": "oneDNN cannot pack bfloat16 weights on this CPU"})
    assert not plan.pack_experts and not plan.pack_dense
    assert "not candidates: packed: oneDNN cannot pack bfloat16" in plan.reason
    assert "dense layers plain (neither packing nor the C kernel runs this dtype here)" in plan.reason


# ---- calibrate: measured here -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_calibrate_times_every_candidate_this_cpu_can_run(dtype):
    plan = calibrate(SHAPE, dtype)
    can_pack = onednn_packing_available("cpu", dtype)
    assert ("gather/packed" in plan.timings) == can_pack and ("linear/packed" in plan.timings) == can_pack
    assert {"gather/plain", "grouped/plain"} <= set(plan.timings)
    counts = sorted(plan.timings["gather/plain"])
    assert counts == list(cal.TOKEN_COUNTS)  # a small shape: the whole ladder
    assert all(ms > 0 for row in plan.timings.values() for ms in row.values())
    if "gather/kernel" in plan.timings:  # the large counts: in float32 on upcast weights too, for bf16
        assert ("large/upcast" in plan.timings) == (dtype == torch.bfloat16) == ("large-linear/upcast" in plan.timings)
    assert plan.pack_experts <= can_pack and plan.pack_dense <= can_pack and plan.gather_max in (0, *counts)
    again = choose(plan.timings)  # the choice is choose()'s, on what was measured
    assert (again.pack_dense, again.pack_experts, again.grouped_mm, again.gather_max) == (
        plan.pack_dense, plan.pack_experts, plan.grouped_mm, plan.gather_max)


def test_consecutive_calls_read_other_weights_as_a_decode_step_does(monkeypatch):
    """One hot weight stays in the cache and hides what packing does to a model's stream of weights: the
    dense timings cycle through copies worth STREAM_BYTES, the expert timings through ROUTINGS routings."""
    D = SHAPE.d_model
    monkeypatch.setattr(cal, "STREAM_BYTES", 3 * D * D * 4)  # 3 copies: fewer than the calls at any count
    seen: dict[str, set[int]] = {"plain": set(), "packed": set()}
    real_linear, real_packed = cal.F.linear, cal.packed_linear
    monkeypatch.setattr(cal.F, "linear", lambda x, w: seen["plain"].add(w.data_ptr()) or real_linear(x, w))
    monkeypatch.setattr(cal, "packed_linear", lambda x, w: seen["packed"].add(id(w)) or real_packed(x, w))
    routings: list[int] = []
    real_routing = cal._routing
    monkeypatch.setattr(cal, "_routing", lambda *a: routings.append(a[1]) or real_routing(*a))
    cal._dense_timings(D, torch.float32, torch.Generator().manual_seed(0), 0.0)
    assert len(seen["plain"]) == 3
    assert len(seen["packed"]) == (3 if onednn_packing_available("cpu", torch.float32) else 0)
    calibrate(SHAPE, torch.float32, max_s=0.0)
    assert routings.count(1) == routings.count(2) == cal.ROUTINGS  # (and one probe of grouped_mm at 8)


def test_a_large_model_stops_the_ladder_where_the_time_cap_falls():
    plan = calibrate(SHAPE, torch.float32, max_s=0.0)
    assert sorted(plan.timings["gather/plain"]) == [1, 2]  # two counts at least, whatever the cap


def test_calibrate_without_onednn_bf16_measures_only_plain_weights(monkeypatch):
    """The fallback side of the probe on every machine: bf16 calibrated without packed candidates."""
    monkeypatch.setattr(device, "onednn_bf16_available", lambda: False)
    plan = calibrate(SHAPE, torch.bfloat16)
    assert not plan.pack_experts and not plan.pack_dense
    assert not any("packed" in name for name in plan.timings)
    assert "oneDNN cannot pack bfloat16 weights on this CPU" in plan.reason


# ---- plan_for: the cache -------------------------------------------------------------------------
def cache_files(root):
    return sorted((root / "calibration").glob("*.json")) if (root / "calibration").exists() else []


def test_measured_once_then_read_from_the_cache(tmp_path):
    first = plan_for(SHAPE, "cpu", torch.float32, "auto", root=tmp_path)
    assert first.source == "measured"
    [path] = cache_files(tmp_path)
    record = json.loads(path.read_text())
    assert record["key"]["shape"] == {"d_model": 32, "d_ff": 48, "n_experts": 4, "top_k": 2, "act": "swiglu"}
    assert record["key"]["dtype"] == "float32" and record["key"]["torch"] == torch.__version__
    assert record["key"]["threads"] == torch.get_num_threads()
    second = plan_for(SHAPE, "cpu", torch.float32, "auto", root=tmp_path)
    assert second.source == "cached"
    assert (second.pack_dense, second.pack_experts, second.grouped_mm, second.gather_max, second.reason,
            second.timings) == (first.pack_dense, first.pack_experts, first.grouped_mm, first.gather_max,
                                first.reason, first.timings)
    # another dtype, shape or thread count is another calibration
    plan_for(SHAPE, "cpu", torch.bfloat16, "auto", root=tmp_path)
    plan_for(ExpertShape(32, 48, 4, 1, "swiglu"), "cpu", torch.float32, "auto", root=tmp_path)
    assert len(cache_files(tmp_path)) == 3
    assert plan_for(SHAPE, "cpu", torch.float32, "redo", root=tmp_path).source == "measured"
    assert len(cache_files(tmp_path)) == 3


def test_off_measures_nothing(tmp_path, monkeypatch):
    plan = plan_for(SHAPE, "cpu", torch.float32, "off", root=tmp_path)
    assert plan.source == "default" and cache_files(tmp_path) == []
    pack = onednn_packing_available("cpu", torch.float32)
    assert (plan.pack_dense, plan.pack_experts, plan.grouped_mm, plan.gather_max) == (pack, pack, False, 1)
    monkeypatch.setenv("MOESERVE_CALIBRATION", "off")
    assert plan_for(SHAPE, "cpu", torch.float32, root=tmp_path).source == "default"
    monkeypatch.setenv("MOESERVE_CALIBRATION", "auto")
    assert plan_for(SHAPE, "cpu", torch.float32, root=tmp_path).source == "measured"


def test_a_bad_mode_is_named(tmp_path, monkeypatch):
    with pytest.raises(CalibrationError, match="calibration = 'sometimes': expected one of auto, off, redo"):
        plan_for(SHAPE, "cpu", torch.float32, "sometimes", root=tmp_path)
    monkeypatch.setenv("MOESERVE_CALIBRATION", "0")
    with pytest.raises(CalibrationError, match=r"\$MOESERVE_CALIBRATION = '0'"):
        plan_for(SHAPE, "cpu", torch.float32, root=tmp_path)


@pytest.mark.parametrize("damage", ["not json", "other key", "missing plan"])
def test_an_unusable_cache_file_is_measured_again(tmp_path, caplog, damage):
    plan_for(SHAPE, "cpu", torch.float32, "auto", root=tmp_path)
    [path] = cache_files(tmp_path)
    record = json.loads(path.read_text())
    if damage == "not json":
        path.write_text("{truncated")
    elif damage == "other key":
        record["key"]["cpu"] = "some other CPU"
        path.write_text(json.dumps(record))
    else:
        del record["plan"]
        path.write_text(json.dumps(record))
    with caplog.at_level(logging.WARNING, logger="moeserve.runtime"):
        plan = plan_for(SHAPE, "cpu", torch.float32, "auto", root=tmp_path)
    assert plan.source == "measured" and "is unusable" in caplog.text
    assert plan_for(SHAPE, "cpu", torch.float32, "auto", root=tmp_path).source == "cached"  # rewritten whole


def test_an_unwritable_cache_costs_a_warning_not_the_load(tmp_path, caplog):
    root = tmp_path / "a-file"
    root.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="moeserve.runtime"):
        plan = plan_for(SHAPE, "cpu", torch.float32, "auto", root=root)
    assert plan.source == "measured" and "could not save the calibration" in caplog.text


def test_where_calibration_does_not_apply_the_defaults_stand(tmp_path):
    assert plan_for(None, "cpu", torch.float32, "auto", root=tmp_path).reason == "no MoE layer to calibrate"
    cuda = plan_for(SHAPE, "cuda", torch.bfloat16, "auto", root=tmp_path)
    assert cuda.source == "default" and cuda.grouped_mm and not cuda.pack_experts
    assert cache_files(tmp_path) == []  # a GPU's decode GEMV rows: decode_calibration.py (test_decode_calibration.py)


# ---- an Engine laid out by its plan -------------------------------------------------------------
def tiny_model(**overrides) -> Transformer:
    torch.manual_seed(0)
    return Transformer(preset("tiny", router="softmax", **overrides))


def layout(engine: Engine) -> tuple:
    model = engine.model
    ws = [layer.experts.w for layer in model.moe_layers]
    return (any(isinstance(m, PackedLinear) for m in model.modules()), isinstance(model.output, PackedLinear),
            {w.packed for w in ws}, {w.grouped_mm for w in ws}, {w.gather_max for w in ws})


def test_engine_runs_the_calibrated_plan_and_answers_as_the_defaults_do(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESERVE_CACHE", str(tmp_path))
    calibrated = Engine.from_model(tiny_model(), ByteTokenizer(), calibration="auto")
    plan = calibrated.plan
    assert plan.source == "measured" and len(cache_files(tmp_path)) == 1
    assert layout(calibrated) == (plan.pack_dense, plan.pack_dense, {plan.pack_experts}, {plan.grouped_mm},
                                  {plan.gather_max})
    default = Engine.from_model(tiny_model(), ByteTokenizer(), calibration="off")
    assert default.plan.source == "default"
    ids = torch.tensor([default.encode("def f(x):\n    return x")])
    torch.testing.assert_close(calibrated.forward(ids), default.forward(ids), atol=1e-4, rtol=1e-4)
    prompts = ["def f(x):", "import os\n", "a"]
    assert calibrated.generate(prompts, max_new_tokens=12) == default.generate(prompts, max_new_tokens=12)
    assert Engine.from_model(tiny_model(), ByteTokenizer(), calibration="auto").plan.source == "cached"


@pytest.mark.parametrize("plan", [
    DispatchPlan(pack_dense=False, pack_experts=False, grouped_mm=True, gather_max=4),
    DispatchPlan(pack_dense=True, pack_experts=True, grouped_mm=False, gather_max=0),
], ids=["plain-grouped_mm", "packed-loop"])
def test_a_plan_given_is_the_layout_built_and_a_new_one_replaces_it(plan):
    if plan.pack_dense and not onednn_packing_available("cpu", torch.float32):
        pytest.skip("no oneDNN packing in this build of torch")
    engine = Engine.from_model(tiny_model(), ByteTokenizer(), plan=plan)
    assert engine.plan is plan
    assert layout(engine) == (plan.pack_dense, plan.pack_dense, {plan.pack_experts}, {plan.grouped_mm},
                              {plan.gather_max})
    before = engine.generate(["def "], max_new_tokens=8)
    other = DispatchPlan(pack_dense=not plan.pack_dense and onednn_packing_available("cpu", torch.float32))
    engine.executor.lay_out(other)  # packed modules go back to plain ones, and the other way
    assert layout(engine)[0] == other.pack_dense and layout(engine)[2] == {False}
    assert engine.generate(["def "], max_new_tokens=8) == before


def test_engine_load_names_a_bad_mode_before_reading_weights(tmp_path):
    with pytest.raises(CalibrationError, match="calibration = 'yes'"):
        Engine.load(tmp_path / "no-such-checkpoint", calibration="yes")


def test_default_plan_follows_the_device_and_dtype():
    assert default_plan("cpu", torch.float32).pack_experts == onednn_packing_available("cpu", torch.float32)
    assert default_plan("cpu", torch.bfloat16).pack_dense == onednn_packing_available("cpu", torch.bfloat16)
    assert "gather path up to 1 token then a loop over experts" in default_plan("cpu", torch.float32).describe()
    # a compiled decode step's experts: one grouped_mm call on CUDA in bf16 (measured on an H100), nowhere else
    assert default_plan("cuda", torch.bfloat16).decode_grouped and default_plan("cuda", torch.bfloat16).grouped_mm
    assert not default_plan("cuda", torch.float32).decode_grouped
    assert not default_plan("cpu", torch.bfloat16).decode_grouped


def test_interleaved_turns_blocks_and_between_rounds():
    """The benches' options of the one timing loop: warm-up calls, untimed calls at each turn, several timed
    calls per turn, and a hook between rounds; the order of calls is exactly that."""
    from moeserve.runtime.backends.calibration import interleaved_ms

    calls: list[str] = []
    times = interleaved_ms({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 0.0, min_rounds=2,
                           max_rounds=2, warmup=1, turn_warmup=1, per_turn=2,
                           after_round=lambda r: calls.append(f"round {r}"))
    turn = ["a"] * 3 + ["b"] * 3
    assert calls == ["a", "b", *turn, "round 0", *turn, "round 1"]
    assert {n: len(ts) for n, ts in times.items()} == {"a": 4, "b": 4}  # 2 rounds x 2 timed calls
