"""`moeserve bench score`: a real `moeserve score` child process against a warm engine on the same records, the
report and its refusals; llama.cpp's log parsed as it prints it (the tool itself is not installed here)."""

from __future__ import annotations

import pytest
import torch

from moeserve.bench.report import BenchError
from moeserve.bench.score import _gguf, bench_score, markdown, parse_llama_perplexity
from moeserve.checkpoint import save_checkpoint
from moeserve.config import preset
from moeserve.runtime.model import Transformer

LLAMA_LOG = """0.00.310.174 I perplexity: tokenizing the input ..
0.00.314.170 I perplexity: tokenization took 3.991 ms
0.00.314.179 I perplexity: calculating perplexity over 5 chunks, n_ctx=512, batch_size=2048, n_seq=4
0.08.445.679 I perplexity: 8.13 seconds per pass - ETA 0.10.492.593 I Final estimate: PPL = 43728.9362 +/- 731.13021
"""  # llama.cpp 0c1e570's llama-perplexity, as it printed on this project's 644M Mixtral


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(preset("tiny", max_seq_len=128))
    return save_checkpoint(tmp_path_factory.mktemp("score-bench") / "tiny", model.cfg, model.state_dict())


def test_llama_perplexity_token_count_is_parsed():
    assert parse_llama_perplexity(LLAMA_LOG) == 5 * 512
    with pytest.raises(BenchError, match="no 'calculating perplexity over N chunks"):
        parse_llama_perplexity("Final estimate: PPL = 13.1\n")


def test_cold_process_and_warm_engine_score_the_same_records(checkpoint, tmp_path):
    report = bench_score(checkpoint, ["float32"], n_records=3, tokens=40, repeats=1, threads=1,
                         batch_tokens=["auto", "64"], progress=lambda msg: None)
    row, fixed = report["results"]
    assert (row["cold_batch_tokens"], fixed["cold_batch_tokens"]) == ("auto", "64")
    assert fixed["max_logprob_diff"] <= 1e-3 and "--batch-tokens 64" in fixed["cold_command"]
    assert 100 < row["cold_max_rss_mb"] < 10_000  # the child's own peak: torch alone takes a few hundred MB
    assert row["records"] == 3 and row["tokens"] >= 3 * 38
    assert row["max_logprob_diff"] <= 1e-3  # the child's scores are the warm engine's
    assert row["cold_s"] > 0 and row["warm_s"] > 0 and row["warm_tokens_per_s"] > 0  # a tiny model: milliseconds
    assert row["cold_tokens_per_s"] == round(row["tokens"] / row["cold_s"], 1)
    assert row["cold_command"].startswith(f"moeserve score {checkpoint} --input ")
    assert "llama_tokens_per_s" not in row and "llama-perplexity -m MODEL-float32.gguf" in report["skipped"]["float32"]
    page = markdown(report)
    assert f"| float32 | {row['tokens']} | {row['warm_tokens_per_s']} | auto | {row['cold_tokens_per_s']} |" in page
    assert f"| 64 | {fixed['cold_tokens_per_s']} | {fixed['cold_over_warm']}x | {fixed['cold_max_rss_mb']} |" in page


def test_without_a_warm_engine_the_cold_runs_are_checked_against_each_other(checkpoint):
    report = bench_score(checkpoint, ["float32"], n_records=2, tokens=40, repeats=0, threads=1,
                         batch_tokens=["64", "auto"], progress=lambda msg: None)
    first, second = report["results"]
    assert first["warm_s"] is None and first["cold_over_warm"] is None and first["max_logprob_diff"] == 0
    assert second["max_logprob_diff"] <= 1e-3
    assert f"| float32 | {first['tokens']} | - | 64 | {first['cold_tokens_per_s']} | - |" in markdown(report)


def test_refusals(tmp_path, capsys):
    with pytest.raises(BenchError, match="expected DTYPE=FILE"):
        _gguf(["f32.gguf"])
    with pytest.raises(BenchError, match="no such file"):
        _gguf([f"float32={tmp_path / 'none.gguf'}"])
    from moeserve.cli import main  # the exit status of a real process is main()'s: tests/test_cli.py

    assert main(["bench", "score", "--llama-perplexity", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "--llama-perplexity" in err and "not found" in err
