"""`moeserve bench score`: batch scoring's tokens per second from a cold process and from a warm engine, beside
llama.cpp's perplexity tool on the same weights where it is installed, in one run.

Every `moeserve score` run is a fresh process, so the number a user meets is the cold one: import, load, the first
batch. It is timed as a user runs it (`moeserve score CHECKPOINT --input F --output G`, a child process, wall
clock); the warm engine is the same rows through `Engine.score_ids` in this process after one untimed pass. The
two should be close: a cold run within 1.3x of a warm one is the goal (issue 44).

llama.cpp's `llama-perplexity -m MODEL.gguf -f TEXT -c 512 -b 2048 -t THREADS` evaluates the same text in
512-token windows, timed by wall clock too, from its start, model load included. It tokenizes the text itself:
a GGUF's vocabulary converted from the same SentencePiece model may cut it into other tokens, so each side's
tokens/s counts its own tokens, and the text's bytes per second compare the two end to end. Without the binary
or a GGUF for a dtype, the command to run is reported instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from moeserve.bench.report import BenchError, run_bench
from moeserve.runtime.device import machine
from moeserve.runtime.engine import Engine


def records(engine: Engine, n: int, tokens: int) -> list[str]:
    """`n` texts of about `tokens` tokens each (this engine's tokenizer), consecutive lines of the built-in corpus
    (the standard library's source)."""
    from moeserve.bench.serve import corpus_text

    lines = corpus_text(8 * n * tokens + 100_000).splitlines(keepends=True)  # ~4 characters a token of source
    out, cur, i = [], [], 0
    while len(out) < n:
        if i == len(lines):
            raise BenchError(f"the built-in corpus has fewer than {n} records of {tokens} tokens")
        cur.append(lines[i])
        i += 1
        if len(engine.encode("".join(cur), any_length=True)) >= tokens - 2:
            out.append("".join(cur))
            cur = []
    return out


def parse_llama_perplexity(log: str) -> int:
    """The tokens llama.cpp's perplexity tool evaluated, from its log: `perplexity: calculating perplexity over N
    chunks, n_ctx=C, ...` (N windows of C tokens of its own tokenization)."""
    m = re.search(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)", log)
    if m is None:
        raise BenchError("llama-perplexity printed no 'calculating perplexity over N chunks, n_ctx=C' line")
    return int(m.group(1)) * int(m.group(2))


def cold_score(checkpoint: Path, input_path: Path, dtype: str, threads: int | None,
               batch_tokens: str = "auto") -> dict:
    """`moeserve score` in a child process, timed from its start to its exit, with its peak resident memory and
    the batch size it chose (None where it settled on none, or was given one)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "scores.jsonl"
        cmd = [sys.executable, "-m", "moeserve.cli", "score", str(checkpoint), "--input", str(input_path),
               "--output", str(out), "--dtype", dtype, "--batch-tokens", batch_tokens, "--quiet"]
        env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
        log = Path(tmp) / "stderr.txt"
        with open(log, "w") as err:
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
            peak_kb = 0
            while proc.poll() is None:  # its VmHWM: getrusage's maxrss of a child starts at this process's size
                peak_kb = max(peak_kb, _high_water_kb(proc.pid))
                time.sleep(0.05)
            seconds = time.perf_counter() - t0
        stderr = log.read_text()
        if proc.returncode != 0:
            raise BenchError(f"moeserve score exited {proc.returncode}: {stderr.strip()[-1000:]}")
        lines = [json.loads(line) for line in out.read_text().splitlines()]
    chosen = re.search(r"batches of up to (\d+) tokens \(measured tokens/s by size: ([^)]*)\)", stderr)
    return {"seconds": round(seconds, 2), "logprobs": [r["logprob"] for r in lines], "max_rss_mb": round(peak_kb / 1024),
            "batch_tokens": batch_tokens, "chosen": int(chosen.group(1)) if chosen else None,
            "rates": chosen.group(2) if chosen else None, "command": " ".join(["moeserve", *cmd[3:]])}


def _high_water_kb(pid: int) -> int:
    """A live process's peak resident set since its exec (/proc's VmHWM), 0 where it cannot be read."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    m = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
    return int(m.group(1)) if m else 0


def llama_perplexity(binary: str, gguf: Path, text: Path, threads: int) -> dict:
    cmd = [binary, "-m", str(gguf), "-f", str(text), "-c", "512", "-b", "2048", "-t", str(threads)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-1000:]}")
    return {"seconds": round(seconds, 2), "tokens": parse_llama_perplexity(proc.stderr + proc.stdout),
            "command": " ".join(cmd)}


def bench_score(checkpoint: Path, dtypes: list[str], n_records: int = 16, tokens: int = 512, repeats: int = 2,
                threads: int | None = None, llama: str | None = None, gguf: dict[str, Path] | None = None,
                batch_tokens: list[str] | None = None, progress=print) -> dict:
    threads = threads or torch.get_num_threads()
    llama = llama or shutil.which("llama-perplexity")
    batch_tokens = batch_tokens or ["auto"]
    rows, skipped = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in dtypes:
            progress(f"{dtype}: loading a warm engine ...")
            engine = Engine.load(checkpoint, dtype=dtype, device="cpu")
            if engine.tokenizer is None:
                raise BenchError(f"{checkpoint} has no tokenizer: scoring text needs one")
            texts = records(engine, n_records, tokens)
            input_path, text_path = Path(tmp) / f"score-{dtype}.jsonl", Path(tmp) / f"score-{dtype}.txt"
            input_path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
            text_path.write_text("".join(texts))
            text_bytes = text_path.stat().st_size
            ids = [engine.encode(t, any_length=True) for t in texts]
            n_tokens = sum(map(len, ids))
            warm, want = [], None  # want: the scores the cold runs are checked against
            if repeats:  # 0: no warm engine (a long run's cold process against llama.cpp only)
                engine.score_ids(ids)  # untimed: the warm engine's first pass
                for r in range(repeats):
                    t0 = time.perf_counter()
                    want = [s.logprob for s in engine.score_ids(ids)]
                    warm.append(time.perf_counter() - t0)
            warm_s = statistics.median(warm) if warm else None
            del engine
            base = {"dtype": dtype, "records": n_records, "tokens": n_tokens,
                    "warm_s": round(warm_s, 4) if warm_s else None,
                    "warm_tokens_per_s": round(n_tokens / warm_s, 1) if warm_s else None}
            model = (gguf or {}).get(dtype)
            if llama and model:
                progress(f"{dtype}: llama-perplexity ...")
                ll = llama_perplexity(llama, model, text_path, threads)
                base |= {"llama_s": ll["seconds"], "llama_tokens": ll["tokens"],
                         "llama_tokens_per_s": round(ll["tokens"] / ll["seconds"], 1), "text_bytes": text_bytes,
                         "llama_bytes_per_s": round(text_bytes / ll["seconds"]), "llama_command": ll["command"]}
            else:
                why = "no llama-perplexity (--llama-perplexity or on PATH)" if not llama else f"no --gguf {dtype}=FILE"
                skipped[dtype] = (f"llama.cpp: {why}; run `llama-perplexity -m MODEL-{dtype}.gguf -f TEXT -c 512 -b "
                                  f"2048 -t {threads}` on the same weights (convert_hf_to_gguf.py --outtype "
                                  f"{'f32' if dtype == 'float32' else 'bf16'})")
            for setting in batch_tokens:
                progress(f"{dtype}: moeserve score --batch-tokens {setting} from a cold process ...")
                cold = cold_score(checkpoint, input_path, dtype, threads, setting)
                got = cold.pop("logprobs")
                want = want or got  # without a warm engine, the first cold run is the reference
                same = max(abs(a - b) for a, b in zip(got, want))
                row = base | {"cold_batch_tokens": setting, "cold_chosen_batch_tokens": cold["chosen"],
                              "cold_rates_by_batch_tokens": cold["rates"],
                              "cold_s": cold["seconds"], "cold_tokens_per_s": round(n_tokens / cold["seconds"], 1),
                              "cold_over_warm": round(cold["seconds"] / warm_s, 2) if warm_s else None,
                              "cold_max_rss_mb": cold["max_rss_mb"],
                              "max_logprob_diff": same, "cold_command": cold["command"]}
                if "llama_s" in base:
                    row |= {"cold_over_llama": round(n_tokens / cold["seconds"] / (base["llama_tokens"] / base["llama_s"]),
                                                     2), "cold_bytes_per_s": round(text_bytes / cold["seconds"])}
                rows.append(row)
    return {"checkpoint": str(checkpoint), "threads": threads, "records": n_records, "tokens_per_record": tokens,
            "repeats": repeats, "machine": machine(), "results": rows, "skipped": skipped}


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio}x"


def markdown(report: dict) -> str:
    lines = [f"checkpoint: {report['checkpoint']}, {report['records']} records of ~{report['tokens_per_record']} "
             f"tokens, {report['threads']} threads", "",
             "| dtype | tokens | warm engine tokens/s | --batch-tokens (chosen) | moeserve score (cold) tokens/s | "
             "cold / warm time | cold max resident MB | llama-perplexity tokens/s (wall) | "
             "moeserve cold / llama.cpp (tokens/s) | text bytes/s, cold / llama.cpp |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in report["results"]:
        setting = r.get("cold_batch_tokens", "16384")
        chosen = f" ({r['cold_chosen_batch_tokens']})" if r.get("cold_chosen_batch_tokens") else ""
        lines.append(f"| {r['dtype']} | {r['tokens']} | {r['warm_tokens_per_s'] or '-'} | {setting}{chosen} | "
                     f"{r['cold_tokens_per_s']} | {_x(r['cold_over_warm'])} | {r.get('cold_max_rss_mb', '-')} | "
                     f"{r.get('llama_tokens_per_s', '-')} | "
                     f"{_x(r.get('cold_over_llama'))} | "
                     + (f"{r['cold_bytes_per_s']} / {r['llama_bytes_per_s']} |" if "llama_bytes_per_s" in r else "- |"))
    lines += [""] + [f"skipped {d}: {why}" for d, why in report["skipped"].items()]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    from moeserve.bench.plots import bars, pyplot, save

    rows = report["results"]
    dtypes = [r["dtype"] + ("" if r.get("cold_batch_tokens", "auto") == "auto" else f" ({r['cold_batch_tokens']})")
              for r in rows]
    series = {"warm engine": [r["warm_tokens_per_s"] for r in rows],
              "moeserve score (cold)": [r["cold_tokens_per_s"] for r in rows],
              "llama-perplexity": [r.get("llama_tokens_per_s") for r in rows]}
    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    bars(ax, dtypes, series, "tokens/s", f"{report['records']} records of ~{report['tokens_per_record']} tokens")
    save(fig, path, f"moeserve bench score: {Path(report['checkpoint']).name}")


def _gguf(values: list[str]) -> dict[str, Path]:
    out = {}
    for v in values:
        dtype, sep, file = v.partition("=")
        if not sep or dtype not in ("float32", "bfloat16") or not file:
            raise BenchError(f"--gguf {v!r}: expected DTYPE=FILE with DTYPE float32 or bfloat16")
        if not Path(file).is_file():
            raise BenchError(f"--gguf {v!r}: no such file")
        out[dtype] = Path(file)
    return out


def main(args) -> int:
    def measure(progress) -> dict:
        if args.llama_perplexity and not (shutil.which(args.llama_perplexity) or Path(args.llama_perplexity).is_file()):
            raise BenchError(f"--llama-perplexity {args.llama_perplexity}: not found")
        checkpoint = args.checkpoint
        if checkpoint is None:
            from moeserve.training.default_model import default_model_path

            checkpoint = default_model_path(progress=True)
        return bench_score(checkpoint, args.dtypes, args.records, args.tokens, args.repeats, args.threads,
                           args.llama_perplexity, _gguf(args.gguf or []), args.batch_tokens, progress=progress)

    return 2 if run_bench(args, "score", measure) is None else 0
