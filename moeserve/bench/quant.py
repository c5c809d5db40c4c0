"""`moeserve bench quant`: each weight format against the unquantized model on the same held-out text, reported as
llama.cpp reports a quantization (`llama-perplexity --kl-divergence`): how much worse it predicts, how far its
next-token distributions move, how often its likeliest token stays the same, and what it buys in bytes and speed.

  bits per byte      -sum log2 p(token) / UTF-8 bytes, over every token after each record's first
  mean KL            mean over those tokens of KL(P_float || P_quantized) of the next-token distributions, in nats
  top-1 agreement    the fraction of them whose likeliest next token is the float model's
  weight bytes/token the weight bytes a batch-1 decode step reads: every dense weight, the experts' K of E, one
                     embedding row (the LM head's matrix where it is the tied embedding)
  decode tokens/s    batch-1 greedy generation, the prompt's prefill subtracted

The text is the default corpus's validation documents (training/data.py's split: never trained on), cut into
records of about --tokens tokens of the model's own tokenizer.

Beside it, where given, llama.cpp on the same weights converted to GGUF (a Mixtral): `llama-perplexity
--kl-divergence` against the F32 GGUF's logits on the same text (its own tokens, 512-token windows) for Q8_0 and
Q4_0, and `llama-bench`'s batch-1 decode (tg) tokens/s for each.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from moeserve.bench.report import BenchError, run_bench
from moeserve.convert import kept_weights
from moeserve.runtime.device import machine
from moeserve.runtime.engine import Engine, SamplingParams
from moeserve.runtime.quant import QuantLinear, QuantSpec, describe

PROMPT_TOKENS = 32


def held_out_records(engine: Engine, n: int, tokens: int) -> list[str]:
    """`n` texts of about `tokens` tokens (at most the context), consecutive lines of the held-out documents."""
    from moeserve.training.data import default_val_texts

    tokens = min(tokens, engine.cfg.max_seq_len)
    out, cur = [], ""
    for line in "".join(default_val_texts(8 * n * tokens + 50_000)).splitlines(keepends=True):
        if len(engine.encode(cur + line, any_length=True)) > tokens:
            if cur:
                out.append(cur)
            if len(out) == n:
                return out
            cur = "" if len(engine.encode(line, any_length=True)) > tokens else line  # a line too long alone: out
        else:
            cur += line
    raise BenchError(f"the held-out corpus has fewer than {n} records of {tokens} tokens")


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """The weight bytes one batch-1 decode step reads (see the module docstring)."""
    cfg, total = model.cfg, 0
    k_of_e = cfg.experts_per_token / cfg.n_experts
    emb = model.tok_embeddings.weight
    for name, t in model.state_dict().items():
        if name == "tok_embeddings.weight":
            continue
        total += t.numel() * t.element_size() * (k_of_e if ".ffn.experts." in name else 1)
    tied_float_head = cfg.task == "lm" and not isinstance(model.output, QuantLinear) and cfg.tie_embeddings
    total += emb.numel() * emb.element_size() if tied_float_head else emb.shape[1] * emb.element_size()
    return int(total)


@torch.inference_mode()
def next_token_logp(engine: Engine, ids: list[int]) -> torch.Tensor:
    """log p of the next token at every position but the last [S-1, V], float32."""
    return engine.forward(torch.tensor([ids]))[0, :-1].float().log_softmax(-1)


def decode_rate(engine: Engine, prompt: list[int], new_tokens: int, repeats: int) -> float:
    """Tokens/s of batch-1 greedy decode: generation of new_tokens + 1 less generation of 1, median of `repeats`."""
    def run(n: int) -> float:
        t0 = time.perf_counter()
        engine.complete([prompt], SamplingParams(n, ignore_eos=True))
        return time.perf_counter() - t0

    run(2)  # untimed: first-call costs
    times = []
    for _ in range(repeats):
        one, whole = run(1), run(new_tokens + 1)
        times.append(max(whole - one, 1e-9))
    return new_tokens / statistics.median(times)


def measure_format(engine: Engine, records: list[tuple[list[int], int]], base: list[torch.Tensor] | None,
                   new_tokens: int, repeats: int) -> tuple[dict, list[torch.Tensor]]:
    """(this format's row, its log-probabilities per record), against `base`'s (None: this is the base)."""
    nll = kl = agree = 0.0
    n_tok = n_bytes = 0
    logps = []
    for (ids, nbytes), ref in zip(records, base or [None] * len(records)):
        lp = next_token_logp(engine, ids)
        targets = torch.tensor(ids[1:])
        nll -= lp.gather(1, targets[:, None]).sum().item()
        n_tok += len(targets)
        n_bytes += nbytes
        if ref is not None:
            kl += (ref.exp() * (ref - lp)).sum().item()
            agree += (ref.argmax(-1) == lp.argmax(-1)).sum().item()
        logps.append(lp)
    model = engine.model
    row = {"format": describe(model.cfg.quantization), "bits_per_byte": round(nll / math.log(2) / n_bytes, 5),
           "weight_bytes_per_token": weight_bytes_per_token(model),
           "decode_tokens_per_s": round(decode_rate(engine, records[0][0][:PROMPT_TOKENS], new_tokens, repeats), 2),
           "backend": engine.runner.name}
    if base is not None:
        row |= {"mean_kl": round(kl / n_tok, 6), "top1_agreement": round(agree / n_tok, 5)}
    return row, logps


def bench_quant(checkpoint: Path, formats: list[str], group: int | None, dtype: str, n_records: int, tokens: int,
                new_tokens: int, repeats: int, progress=print, llama_perplexity: str | None = None,
                llama_bench: str | None = None, gguf: dict[str, Path] | None = None,
                int8: tuple[str, ...] | None = None, int6: tuple[str, ...] | None = None) -> dict:
    progress(f"{dtype}: loading the unquantized model ...")
    base = Engine.load(checkpoint, dtype=dtype, device="cpu")
    if base.cfg.task != "lm" or base.tokenizer is None:
        raise BenchError(f"{checkpoint}: a language model with a tokenizer is needed")
    if base.cfg.quantization is not None:
        raise BenchError(f"{checkpoint} is already quantized ({describe(base.cfg.quantization)}): give the "
                         "unquantized checkpoint")
    texts = held_out_records(base, n_records, tokens)
    records = [(base.encode(t, any_length=True), len(t.encode("utf-8"))) for t in texts]
    progress(f"{len(records)} held-out records, {sum(len(r) - 1 for r, _ in records)} tokens scored")
    ref_row, ref = measure_format(base, records, None, new_tokens, repeats)
    rows = [ref_row]
    del base
    for fmt in formats:
        spec = QuantSpec.parse(fmt, *((group, int8, int6) if fmt == "int4" else ()))
        progress(f"{dtype}: {describe(spec.as_dict())} ...")
        engine = Engine.load(checkpoint, dtype=dtype, device="cpu", quantize=spec)
        row, _ = measure_format(engine, records, ref, new_tokens, repeats)
        row["bpb_change_pct"] = round(100 * (row["bits_per_byte"] / ref_row["bits_per_byte"] - 1), 3)
        row["decode_speedup"] = round(row["decode_tokens_per_s"] / ref_row["decode_tokens_per_s"], 3)
        rows.append(row)
        del engine
    report = {"checkpoint": str(checkpoint), "dtype": dtype, "records": len(records),
              "tokens": sum(len(r) - 1 for r, _ in records), "new_tokens": new_tokens,
              "threads": torch.get_num_threads(), "machine": machine(), "results": rows}
    if gguf:
        report["llama"] = llama_rows(llama_perplexity, llama_bench, gguf, "".join(texts), new_tokens,
                                     torch.get_num_threads(), progress)
    return report


LLAMA_FORMATS = {"float": "F32", "int8": "Q8_0", "int4": "Q4_0"}  # our format -> the llama.cpp type it is compared with


def parse_kl(log: str) -> dict:
    """llama-perplexity --kl-divergence's mean KLD and "Same top p" (percent) from its log."""
    kl = re.search(r"Mean\s+KLD:\s+([0-9.eE+-]+)", log)
    top = re.search(r"Same top p:\s+([0-9.]+)", log)
    if kl is None or top is None:
        raise BenchError("llama-perplexity printed no 'Mean KLD' / 'Same top p' lines")
    return {"mean_kl": float(kl.group(1)), "top1_agreement": round(float(top.group(1)) / 100, 5)}


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-800:]}")
    return proc


def llama_rows(perplexity: str | None, bench: str | None, gguf: dict[str, Path], text: str, new_tokens: int,
               threads: int, progress=print) -> dict[str, dict]:
    """Per format given a GGUF ({"float": F32, "int8": Q8_0, "int4": Q4_0}): llama.cpp's KL against the F32 one
    and its decode tokens/s."""
    out: dict[str, dict] = {fmt: {"gguf": str(path)} for fmt, path in gguf.items()}
    with tempfile.TemporaryDirectory() as tmp:
        if perplexity and "float" in gguf:
            text_file, base = Path(tmp) / "text.txt", Path(tmp) / "base.kld"
            text_file.write_text(text)
            progress("llama.cpp: the F32 GGUF's logits ...")
            _run([perplexity, "-m", str(gguf["float"]), "-f", str(text_file), "-c", "512", "-b", "2048", "-t",
                  str(threads), "--kl-divergence-base", str(base)])
            for fmt in ("int8", "int4"):
                if fmt in gguf:
                    progress(f"llama.cpp: {LLAMA_FORMATS[fmt]} KL divergence ...")
                    proc = _run([perplexity, "-m", str(gguf[fmt]), "-t", str(threads), "--kl-divergence-base",
                                 str(base), "--kl-divergence"])
                    out[fmt] |= parse_kl(proc.stdout + proc.stderr)
        if bench:
            for fmt, path in gguf.items():
                progress(f"llama.cpp: {LLAMA_FORMATS[fmt]} decode ...")
                rows = json.loads(_run([bench, "-m", str(path), "-p", "0", "-n", str(new_tokens), "-t", str(threads),
                                        "-r", "3", "-o", "json"]).stdout)
                out[fmt]["decode_tokens_per_s"] = round(rows[0]["avg_ts"], 2)
    return out


def markdown(report: dict) -> str:
    lines = [f"checkpoint: {report['checkpoint']}, {report['dtype']} activations, {report['records']} held-out "
             f"records ({report['tokens']} tokens scored), decode of {report['new_tokens']} tokens at batch 1, "
             f"{report['threads']} threads", "",
             "| weights | bits per byte | vs float | mean KL (nats) | top-1 agreement | weight MB/token | "
             "decode tokens/s | vs float | backend |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in report["results"]:
        change = f"{r['bpb_change_pct']:+.2f}%" if "bpb_change_pct" in r else "-"
        lines.append(f"| {r['format']} | {r['bits_per_byte']} | {change} | {r.get('mean_kl', '-')} | "
                     f"{r.get('top1_agreement', '-')} | {r['weight_bytes_per_token'] / 1e6:.2f} | "
                     f"{r['decode_tokens_per_s']} | {r.get('decode_speedup', '-')}{'x' if 'decode_speedup' in r else ''} | "
                     f"{r['backend']} |")
    if report.get("llama"):
        ours = {r["format"].split(" ")[0]: r for r in report["results"]}
        lines += ["", "llama.cpp on the same weights (GGUF; KL against the F32 GGUF's logits on the same text, its own "
                  "tokens):", "", "| llama.cpp type | mean KL (nats) | top-1 agreement | decode tokens/s | moeserve "
                  "decode / llama.cpp |", "| --- | ---: | ---: | ---: | ---: |"]
        for fmt, r in report["llama"].items():
            tps = r.get("decode_tokens_per_s")
            ratio = f"{ours[fmt]['decode_tokens_per_s'] / tps:.2f}x" if tps and fmt in ours else "-"
            lines.append(f"| {LLAMA_FORMATS[fmt]} | {r.get('mean_kl', '-')} | {r.get('top1_agreement', '-')} | "
                         f"{tps or '-'} | {ratio} |")
    return "\n".join(lines)


def _gguf(values: list[str]) -> dict[str, Path]:
    out = {}
    for v in values:
        fmt, sep, file = v.partition("=")
        if not sep or fmt not in LLAMA_FORMATS or not file:
            raise BenchError(f"--gguf {v!r}: expected FORMAT=FILE with FORMAT one of {', '.join(LLAMA_FORMATS)}")
        if not Path(file).is_file():
            raise BenchError(f"--gguf {v!r}: no such file")
        out[fmt] = Path(file)
    return out


def plot(report: dict, path: Path) -> None:
    from moeserve.bench.plots import bars, pyplot, save

    rows = report["results"]
    fig, (a, b) = pyplot().subplots(1, 2, figsize=(10, 4.5))
    names = [r["format"] for r in rows]
    bars(a, names, {"decode tokens/s": [r["decode_tokens_per_s"] for r in rows]}, "tokens/s", "batch-1 decode")
    bars(b, names, {"bits per byte": [r["bits_per_byte"] for r in rows]}, "bits per byte", "held-out text")
    save(fig, path, f"moeserve bench quant: {Path(report['checkpoint']).name}")


def main(args) -> int:
    def measure(progress) -> dict:
        gguf = _gguf(args.gguf or [])  # the flags first: a bad one is named before the default model is trained
        if args.llama_perplexity and "float" not in gguf:
            raise BenchError("--llama-perplexity compares with the F32 GGUF's logits: give --gguf float=F32.gguf")
        checkpoint = args.checkpoint
        if checkpoint is None:
            from moeserve.training.default_model import default_model_path

            checkpoint = default_model_path(progress=True)
        return bench_quant(checkpoint, args.formats, args.group_size, args.dtype, args.records, args.tokens,
                           args.new_tokens, args.repeats, progress=progress, llama_perplexity=args.llama_perplexity,
                           llama_bench=args.llama_bench, gguf=gguf, int8=kept_weights(args.int8_weights),
                           int6=kept_weights(args.int6_weights))

    return 2 if run_bench(args, "quant", measure) is None else 0
