"""`moeserve bench http` end to end on a tiny random checkpoint: real server subprocesses, tiny settings."""

import json

import torch

from moeserve.checkpoint import save_checkpoint
from moeserve.cli import main
from moeserve.config import preset
from moeserve.runtime.model import Transformer

from .test_report import png_size


def test_bench_http_end_to_end(tmp_path, capsys):
    torch.manual_seed(0)
    model = Transformer(preset("tiny", router="xmoe"))  # random weights, context 64, byte tokenizer
    ckpt = save_checkpoint(tmp_path / "tiny", model.cfg, model.state_dict())
    out = tmp_path / "bench.json"
    rc = main(["bench", "http", "--checkpoint", str(ckpt), "--dtype", "float32", "--clients", "4", "--duration", "0.8",
               "--warmup", "0.3", "--max-tokens", "4", "--long-tokens", "24", "--requests", "5", "--overload", "40", "--overload-queue", "8",
               "--overload-tokens", "16", "--choice-rounds", "2", "--quiet", "--json", str(out),
               "--plot", str(tmp_path / "http.png")])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["machine"]["cores"] >= 1 and report["dtype"] == "float32"

    continuous, batched, single = report["throughput"]["rows"]
    mixed = report["mixed"]["rows"]
    for row in (continuous, batched, single, *mixed):
        assert row["requests"] > 0 and row["errors"] == 0 and row["rps"] > 0, row
        assert row["p50_ms"] > 0 and row["mean_batch_size"] >= 1, row
    assert [r["config"] for r in mixed] == ["continuous", "batch"]
    assert single["mean_batch_size"] == 1 and report["throughput"]["speedup"] > 0
    assert report["throughput"]["continuous_vs_batch"] > 0 and report["mixed"]["rps_ratio"] > 0
    assert sorted(mixed[0]["by_max_tokens"]) == ["24", "4"]  # both lengths answered, latency reported for each

    for row in report["overhead"]:
        assert row["requests"] == 5 and row["same_text"], row
        assert row["p50_http_ms"] > 0 and row["p50_direct_ms"] > 0 and row["p50_overhead_ms"] is not None, row
    assert [row["batch_wait_ms"] for row in report["overhead"]] == [0, 5]

    overload = report["overload"]
    assert overload["requests"] == 40 and overload["other"] == 0, overload
    assert overload["rejected_429"] >= 1 and overload["ok"] >= 1 and overload["all_429_retry_after"], overload

    choices = report["choices"]
    assert choices["rounds"] == 2 and choices["prompt_tokens"] == 1 + 32  # <bos>, half the context of 64
    assert choices["same_choices"] and choices["same_text"], choices  # n=4 is four requests; logprobs change nothing
    assert choices["n_vs_separate"] > 0 and choices["logprobs_cost"] > 0, choices

    assert report["bench"] == "http" and report["command"].startswith("moeserve bench http --checkpoint ")
    assert png_size(tmp_path / "http.png") == (1650, 450)  # three panels of 5.5 x 4.5 inches at 100 dpi

    table = capsys.readouterr().out
    assert "Batching vs batch size 1" in table and "Continuous vs batch: req/s" in table and "| --batch-wait-ms 0 |" in table
    assert "n=4: choices/s" in table
