"""`moeserve bench quant`: each format against the unquantized model on held-out text, on a real (tiny) model."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from moeserve.bench.quant import bench_quant, markdown, weight_bytes_per_token
from moeserve.bench.report import BenchError
from moeserve.checkpoint import save_checkpoint
from moeserve.config import preset
from moeserve.runtime.model import Transformer
from moeserve.runtime.quant import QuantSpec, quantize_model_


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(preset("tiny", max_seq_len=128))
    return save_checkpoint(tmp_path_factory.mktemp("quant-bench") / "tiny", model.cfg, model.state_dict())


def test_formats_against_the_float_model(checkpoint, one_torch_thread):
    report = bench_quant(checkpoint, ["int8", "int4"], None, "float32", 3, 60, 4, 1, progress=lambda msg: None)
    base, int8, int4 = report["results"]
    assert [r["format"] for r in report["results"]] == \
        ["float", "int8", "int4 (group 32; wk, wv at int8; output at int6)"]
    assert report["records"] == 3 and report["tokens"] > 3 * 30
    assert "mean_kl" not in base and 0 <= int8["mean_kl"] < int4["mean_kl"]  # int8 moves the distributions less
    assert int8["top1_agreement"] >= int4["top1_agreement"] and 0.5 < int4["top1_agreement"] <= 1
    assert abs(int8["bpb_change_pct"]) < abs(int4["bpb_change_pct"]) + 0.5
    # bytes a decode step reads: fp32 -> int8 about a quarter, int4 less again (the embedding row stays fp32)
    assert base["weight_bytes_per_token"] > 3 * int8["weight_bytes_per_token"] > 1.5 * int4["weight_bytes_per_token"]
    assert all(r["decode_tokens_per_s"] > 0 for r in report["results"])
    page = markdown(report)
    assert f"| int8 | {int8['bits_per_byte']} | {int8['bpb_change_pct']:+.2f}% | {int8['mean_kl']} |" in page


def test_the_kept_weights_reach_the_format_measured(checkpoint, one_torch_thread):
    """--int8-weights and --int6-weights (convert.kept_weights) reach int4's spec; int8 ignores them."""
    from moeserve.convert import kept_weights

    report = bench_quant(checkpoint, ["int8", "int4"], None, "float32", 1, 40, 2, 1, progress=lambda msg: None,
                         int8=kept_weights("none"), int6=kept_weights("wv, output"))
    assert [r["format"] for r in report["results"]] == ["float", "int8", "int4 (group 32; wv, output at int6)"]


def test_weight_bytes_per_token_counts_what_decode_reads():
    cfg = preset("tiny")  # tied head: the embedding matrix is read by the head
    model = Transformer(cfg)
    D, V, F, E, K, L = cfg.d_model, cfg.vocab_size, cfg.d_ff, cfg.n_experts, cfg.top_k, cfg.n_layers
    attention = 4 * D * D  # tiny: multi-head, so wk and wv are D x D too
    per_layer = attention + 3 * F * D * K + D * E + 2 * D  # K experts of E, the router, two norms
    assert weight_bytes_per_token(model) == 4 * (L * per_layer + D + V * D)
    quantize_model_(model, QuantSpec.parse("int8"))  # the head is its own int8 matrix; one embedding row is read
    per_layer = (attention + 4 * 4 * D) + (3 * F * D + 4 * (2 * F + D)) * K + 4 * D * E + 4 * 2 * D
    assert weight_bytes_per_token(model) == L * per_layer + 4 * D + (V * D + 4 * V) + 4 * D


def test_weight_bytes_per_token_counts_an_int6_head_at_its_packing():
    """A head 128 wide is int6 in the int4 recipe: 96 bytes a 128 weights and a float16 scale per 32, the same
    scales as int4's and 32 bytes a row more than int4's 64 (quant.py's bytes_per_weight: 6.5 bits against 4.5)."""
    cfg = dataclasses.replace(preset("tiny"), d_model=128, n_heads=4, n_kv_heads=2)
    got = {}
    for int6 in (None, ()):
        torch.manual_seed(0)
        model = Transformer(cfg)
        quantize_model_(model, QuantSpec.parse("int4", int6=int6))
        got[int6] = weight_bytes_per_token(model)
    assert got[None] - got[()] == cfg.vocab_size * 32
    assert QuantSpec(6, 32).bytes_per_weight() * 128 == 96 + 4 * 2


def test_a_quantized_checkpoint_is_refused(checkpoint, tmp_path):
    out = tmp_path / "q"
    assert subprocess.run([sys.executable, "-m", "moeserve.cli", "quantize", str(checkpoint), "--bits", "8", "--out",
                           str(out)], capture_output=True, timeout=120).returncode == 0
    with pytest.raises(BenchError, match=r"already quantized \(int8\): give the unquantized checkpoint"):
        bench_quant(out, ["int4"], None, "float32", 1, 40, 2, 1, progress=lambda msg: None)


KL_LOG = """Mean    KLD:   0.028133 ±   0.000280
Maximum KLD:   0.074031
RMS Δp    :  0.001 ± 0.000 %
Same top p: 60.196 ± 1.533 %
"""  # llama.cpp 0c1e570's llama-perplexity --kl-divergence, as it printed on this project's 644M Mixtral (Q4_0)


def test_llama_kl_divergence_is_parsed_and_refusals(capsys):
    from moeserve.bench.quant import _gguf, parse_kl

    assert parse_kl(KL_LOG) == {"mean_kl": 0.028133, "top1_agreement": 0.60196}
    with pytest.raises(BenchError, match="no 'Mean KLD'"):
        parse_kl("Final estimate: PPL = 13.1\n")
    with pytest.raises(BenchError, match="expected FORMAT=FILE with FORMAT one of float, int8, int4"):
        _gguf(["q4.gguf"])
    from moeserve.cli import main  # the exit status of a real process is main()'s: tests/test_cli.py

    assert main(["bench", "quant", "--llama-perplexity", "x"]) == 2
    assert "give --gguf float=F32.gguf" in capsys.readouterr().err
