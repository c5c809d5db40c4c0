"""`moeserve bench engine`: the same tokens as transformers at batch 1 and above, the decode steps timed apart
from the prompt, the weight bytes a decode token reads (counted by hand here), the model sizes its names promise,
and clear refusals."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")
from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402

from moeserve.bench.engine import (  # noqa: E402
    GROUPED, MODELS, REDUCED, BenchError, bench_engine, copy_bandwidth, decode_weight_bytes, markdown, model_fields,
    plot, read_bandwidth, write_mixtral, write_model,
)
from .test_report import png_size  # noqa: E402
from moeserve.runtime.engine import Engine  # noqa: E402

SMALL = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, num_local_experts=4)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return write_mixtral(tmp_path_factory.mktemp("bench") / "small", **SMALL)


def test_a_family_preset_gives_transformers_tokens(tmp_path):
    """A preset of another Hugging Face family (here Qwen3-MoE's, shrunk), written by transformers' Auto classes and
    compared with AutoModelForCausalLM's generate; each row's prefill rate is the prompt over its first token."""
    path = write_model(tmp_path / "qwen3", "qwen3-moe", vocab_size=300, hidden_size=64, head_dim=24,
                       intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_hidden_layers=2)
    report = bench_engine(["float32"], new_tokens=6, prompt_len=5, repeats=1, backends=("eager",), checkpoint=path,
                          progress=lambda msg: None)
    ours, theirs = report["results"]
    assert ours["same_tokens"] and theirs["same_tokens"] and theirs["matching_prefix"] == 6
    for row in (ours, theirs):
        assert 0 < row["prefill_tokens_per_s"] < float("inf")
        assert f"| {row['prefill_tokens_per_s']} |" in markdown(report)
    assert model_fields("qwen3-moe")["model_type"] == "qwen3_moe" and model_fields("tiny") is MODELS["tiny"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("batch", [1, 3])
def test_same_tokens_as_transformers_and_bandwidth_at_batch_1(small, batch, device, tmp_path):
    report = bench_engine(["float32"], new_tokens=6, prompt_len=5, repeats=1, backends=("eager",), checkpoint=small,
                          batch=batch, device=device, progress=lambda msg: None)
    assert report["device"] == device
    ours, theirs = report["results"]
    assert ours["impl"] == "moeserve Engine" and theirs["impl"] == "transformers generate (eager)"
    assert ours["same_tokens"] and theirs["same_tokens"] and theirs["matching_prefix"] == batch * 6
    assert report["batch"] == batch and report["copy_bandwidth_gb_per_s"] > 0 and report["read_bandwidth_gb_per_s"] > 0
    assert list(ours["decode_paths"]) == ["eager"] and ours["decode_paths"]["eager"] > 0  # no compiled step asked
    assert "decode_paths" not in theirs
    text = markdown(report)
    plot(report, tmp_path / "engine.png")
    assert png_size(tmp_path / "engine.png") == (800, 450)
    for row in (ours, theirs):  # 5 decode steps: generation to the 6th token less generation to the 1st
        assert 0 < row["decode_tokens_per_s"] < float("inf")
        assert f"| {row['decode_tokens_per_s']} |" in text
    if batch == 1:  # the bandwidth of the decode steps alone
        bytes_ = report["plans"]["float32"]["decode_weight_bytes"]
        assert ours["weights_gb_per_s"] == pytest.approx(bytes_ * ours["decode_tokens_per_s"] / 1e9, abs=0.06)
        for kind in ("copy", "read"):  # against the bandwidths measured between the dtype's own rounds
            measured = report["plans"]["float32"][f"{kind}_bandwidth_gb_per_s"]
            assert ours[f"pct_of_{kind}_bandwidth"] == pytest.approx(
                100 * bytes_ * ours["decode_tokens_per_s"] / 1e9 / measured, rel=0.05, abs=0.1)
        assert "% of copy bandwidth | % of read bandwidth |" in text
        assert f"| {ours['pct_of_copy_bandwidth']}% | {ours['pct_of_read_bandwidth']}% |" in text
        old = {**report, "results": [{k: v for k, v in r.items() if k != "pct_of_read_bandwidth"}
                                     for r in report["results"]]}  # a report written before the read was measured
        assert "% of copy bandwidth |\n" in markdown(old) and "read bandwidth |" not in markdown(old)
    else:
        assert "weights_gb_per_s" not in ours and "pct_of_read_bandwidth" not in ours
        assert "% of copy bandwidth" not in text


@pytest.mark.cuda
def test_compiled_decode_both_ways_on_cuda(small):
    """On a GPU in bf16 --compile times the compiled step three times at batch 1: experts indexed per token, as one
    grouped GEMM, and as GEMVs. Each gives a row with a decode rate; greedy tokens are reported, not required equal
    (bf16)."""
    report = bench_engine(["bfloat16"], new_tokens=6, prompt_len=5, repeats=1, backends=("eager",), checkpoint=small,
                          compiled=True, device="cuda", progress=lambda msg: None)
    rows = {r["impl"]: r for r in report["results"]}
    for impl in ("moeserve Engine, compiled decode", f"moeserve Engine, compiled decode, {GROUPED}",
                 f"moeserve Engine, compiled decode, {REDUCED}"):
        assert 0 < rows[impl]["decode_tokens_per_s"] < float("inf"), impl
        assert list(rows[impl]["decode_paths"]) == ["graph"], rows[impl]  # every decode token a replay
    assert report["plans"]["bfloat16"]["compile_s"] > 0


def test_decode_weight_bytes_counted_by_hand(small):
    engine = Engine.load(small, dtype="float32", device="cpu")
    V, D, F, E, L, K = 211, 64, 96, 4, 2, 2
    q, kv = D, 2 * D // 4  # 4 heads of 16; 2 kv heads
    per_layer = 2 * D * q + 2 * D * kv + 2 * D + E * D + K * 3 * D * F  # attention, 2 norms, router, K experts
    expected = L * per_layer + D + V * D + D  # + final norm, LM head, one embedding row
    assert decode_weight_bytes(engine) == 4 * expected
    assert decode_weight_bytes(Engine.load(small, dtype="bfloat16", device="cpu")) == 2 * expected


@pytest.mark.parametrize("name, params", [("644m", 644e6), ("2.4b", 2.4e9)])
def test_model_sizes_are_what_their_names_say(name, params):
    with torch.device("meta"):
        model = MixtralForCausalLM(MixtralConfig(**MODELS[name]))
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(params, rel=0.02)


def test_refusals(small):
    if not torch.cuda.is_available():
        with pytest.raises(BenchError, match="--device cuda: no CUDA device"):
            bench_engine(["float32"], checkpoint=small, device="cuda", progress=lambda msg: None)
    with pytest.raises(BenchError, match="--model 'huge': expected one of tiny, 644m, 2.4b"):
        bench_engine(["float32"], model="huge", progress=lambda msg: None)


@pytest.mark.parametrize("measure", [copy_bandwidth, read_bandwidth])
def test_bandwidths_are_rates(measure):
    assert 0.1 < measure("cpu", nbytes=1 << 24, rounds=2) < 10_000


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_quantized_engines_in_the_same_rounds(small, device):
    """--quantize adds the Engine on int8 and int4 weights (fp8 too on a GPU: the issue's GPU goal, int8 against
    bf16 at batch 1, is this report's rows), each with its own bytes a token in its bandwidth."""
    from moeserve.bench.quant import weight_bytes_per_token

    formats = ("int8", "int4") + (("fp8",) if device == "cuda" else ())
    dtype = "bfloat16" if device == "cuda" else "float32"
    report = bench_engine([dtype], new_tokens=24, prompt_len=5, repeats=1, backends=("eager",), checkpoint=small,
                          device=device, compiled=device == "cuda", quantize=formats, progress=lambda msg: None)
    rows = {r["impl"]: r for r in report["results"]}
    for fmt in formats:
        row = rows[f"moeserve Engine, {fmt}" + (", compiled decode" if device == "cuda" else "")]
        tps = row["decode_tokens_per_s"]
        # decode's time is a run's less its first token's, one sample each: nan where a loaded machine's noise
        # outweighed 23 decode steps (the report says so rather than a negative rate)
        assert tps > 0 or math.isnan(tps), tps
        if math.isnan(tps):
            continue
        # the rate times the format's own bytes a token (a float model's would be 2-4x these), to its rounding
        q = Engine.load(small, dtype=dtype, device=device, quantize=fmt)
        assert row["weights_gb_per_s"] == pytest.approx(weight_bytes_per_token(q.model) * tps / 1e9, abs=0.06)


def test_fp8_on_a_cpu_is_refused_by_the_bench(small):
    from moeserve.runtime.quant_fp8 import Fp8Unavailable

    with pytest.raises(Fp8Unavailable, match="fp8"):
        bench_engine(["float32"], new_tokens=2, prompt_len=2, repeats=1, backends=(), checkpoint=small,
                     quantize=("fp8",), progress=lambda msg: None)
