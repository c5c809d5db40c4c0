"""`moeserve bench engine`: greedy generation end to end, moeserve's Engine against transformers'
`generate` on the same checkpoint (a Mixtral, or a preset of another Hugging Face MoE family), dtype, device,
prompts and token count, in one run.

The checkpoint is a random model of a chosen size written by transformers itself (`save_pretrained`),
which the Engine loads as is: the comparison also exercises the no-conversion import. Both decode with a
KV cache and must produce the same tokens (checked, and reported). At batch 1 a decode step reads every
weight it uses once, so its speed is set by memory bandwidth: the report gives the weight bytes a decode step
reads per second against the machine's copy and read bandwidths, measured in the same run. The decode steps are
timed as generation to the last token less generation to the first (the prompt's prefill, which reads every
expert), both in each round, as llama-bench times its tg apart from its pp.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moeserve.bench.quant import weight_bytes_per_token
from moeserve.bench.report import BenchError, run_bench
from moeserve.checkpoint import parameter_counts
from moeserve.runtime.backends.calibration import interleaved_ms
from moeserve.runtime.device import dtype_unsupported, machine
from moeserve.runtime.engine import DTYPES, Engine, SamplingParams
from moeserve.runtime.backends.packing import onednn_packing_available

_MIXTRAL = dict(num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
                tie_word_embeddings=False)
FIRST = "(first token)"  # an implementation timed to its first token only
GROUPED = "grouped_mm experts"  # the compiled step's experts as one grouped GEMM (decode_grouped), not indexed
REDUCED = "GEMV experts"  # a few rows' experts as reductions over the indexed weights (decode_reduce_max)
REDUCED_MAX_BATCH = 4  # past it each row's experts read again cost more than the grouped GEMM: not timed
MODELS = {  # transformers MixtralConfig fields; the sizes are those of issue 11's measurements
    "tiny": dict(_MIXTRAL, vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2),
    "644m": dict(_MIXTRAL, vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                 num_attention_heads=16, num_key_value_heads=8),
    "2.4b": dict(_MIXTRAL, vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                 num_attention_heads=16, num_key_value_heads=8),
}
_IDS = dict(vocab_size=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=1024,
            tie_word_embeddings=False)
# The other Hugging Face families at about the tiny Mixtral's active size, each with its own shape of expert layer:
# (model_type, transformers config fields). Shared experts and a dense first layer (Qwen2-MoE), QK-norm per head
# and heads wider than hidden / heads (Qwen3-MoE), QK-norm over the projection (OLMoE), sinks, alternating windows,
# biases and YaRN (gpt-oss: its own rope defaults).
FAMILY_MODELS = {
    "qwen2-moe": ("qwen2_moe", dict(_IDS, hidden_size=512, intermediate_size=1408, moe_intermediate_size=352,
                                    shared_expert_intermediate_size=1408, num_experts=16, num_experts_per_tok=4,
                                    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                                    mlp_only_layers=[0])),
    "qwen3-moe": ("qwen3_moe", dict(_IDS, hidden_size=512, head_dim=128, intermediate_size=1408,
                                    moe_intermediate_size=352, num_experts=16, num_experts_per_tok=4,
                                    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                    norm_topk_prob=True)),
    "olmoe": ("olmoe", dict(_IDS, hidden_size=512, intermediate_size=352, num_experts=16, num_experts_per_tok=4,
                            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8)),
    "gpt-oss": ("gpt_oss", dict(_IDS, hidden_size=512, intermediate_size=512, num_local_experts=8,
                                num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=8,
                                num_key_value_heads=2, head_dim=64, sliding_window=128, max_position_embeddings=4096)),
}


def model_fields(model: str) -> dict:
    """The transformers config fields of a --model (a Mixtral size or a family preset)."""
    return MODELS[model] if model in MODELS else {"model_type": FAMILY_MODELS[model][0], **FAMILY_MODELS[model][1]}


def write_model(path: Path, model: str = "tiny", seed: int = 0, dtype: torch.dtype | None = None,
                **overrides) -> Path:
    """A random model of one of MODELS' Mixtral sizes or FAMILY_MODELS' presets, saved by transformers (in
    `dtype`: fp32 unless given)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(model_fields(model))
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type", "mixtral"),
                                                               **{**fields, **overrides})).eval()
    (hf if dtype is None else hf.to(dtype)).save_pretrained(path)
    return path


write_mixtral = write_model  # the Mixtral sizes' name, which the GPU bench and the tests use


def copy_bandwidth(device: str, nbytes: int = 1 << 30, rounds: int = 5) -> float:
    """GB/s of copying a buffer far larger than any cache, counted as STREAM's copy counts it (bytes read
    plus bytes written); the best of `rounds`. Benchmarks take the median of several such measurements,
    between their timed rounds, against their own medians."""
    src = torch.ones(nbytes // 8, device=device)  # two buffers of nbytes / 2
    dst = torch.empty_like(src)
    times = []
    for _ in range(rounds + 1):  # the first touches the pages
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return nbytes / min(times[1:]) / 1e9


def read_bandwidth(device: str, nbytes: int = 1 << 30, rounds: int = 5) -> float:
    """GB/s of summing a buffer far larger than any cache: reads only, as a decode step's weight traffic is.
    The copy's count (reads plus writes) is the goal's yardstick, but it is not a read's roof: on a 2-core VM
    the two have been seen to part (a copy counted 52-59 GB/s in minutes when a decode step read at most 41),
    and the read says which of the two the step fell short of."""
    buf = torch.ones(nbytes // 4, device=device)
    times = []
    for _ in range(rounds + 1):  # the first left out, as the copy's is
        _sync(device)
        t0 = time.perf_counter()
        buf.sum()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return nbytes / min(times[1:]) / 1e9


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def decode_weight_bytes(engine: Engine) -> int:
    """Bytes of weights one token reads in a batch-1 decode step: each dense weight, top_k of E experts,
    and one row of the embedding table (the LM head reads all of it, tied or not)."""
    model = engine.model
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    active = parameter_counts(engine.cfg, shapes)["active_per_token"]
    if not engine.cfg.tie_embeddings:
        active -= model.tok_embeddings.weight.numel() - model.tok_embeddings.weight.shape[1]
    return active * model.tok_embeddings.weight.element_size()


def bench_engine(dtypes: list[str], new_tokens: int = 128, prompt_len: int = 16, repeats: int = 5,
                 backends: tuple[str, ...] = ("eager", "grouped_mm"), checkpoint: Path | None = None,
                 calibration: str | None = None, compiled: bool = False, model: str = "tiny", device: str = "cpu",
                 batch: int = 1, quantize: tuple[str, ...] = (), progress=print) -> dict:
    """Runs of the implementations are interleaved (one of each per round, after a warm-up of each), so that drift
    in the machine's speed hits all of them alike; the median round is reported. The Engine runs the dispatch plan
    calibrated for this machine (reported); a dtype torch does not run here is skipped, with the reason. `compiled`:
    the Engine with its compiled decode step too (`--compile on`: its compile time is reported, and kept out of the
    timed rounds by the warm-up), and on CUDA in bf16 again with its experts as one grouped GEMM
    (DispatchPlan.decode_grouped), and up to REDUCED_MAX_BATCH rows as GEMVs (DispatchPlan.decode_reduce_max): which
    way is faster is measured per batch size, not assumed. `batch` prompts of `prompt_len` random tokens each,
    decoded together (no padding: the same length). `quantize`: the Engine again with its weights quantized at load
    in each of these formats (int8, int4, fp8: runtime/quant.py), compiled where `compiled` is, in the same rounds;
    their tokens differ from the float model's by the quantization (same_tokens says whether), and their bandwidth
    counts the quantized bytes a token reads. Each row's prefill rate is the prompt's tokens over the time to the
    first token (the prefill and one sampled token)."""
    from transformers import AutoModelForCausalLM

    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    if model not in {**MODELS, **FAMILY_MODELS} and checkpoint is None:
        raise BenchError(f"--model {model!r}: expected one of {', '.join([*MODELS, *FAMILY_MODELS])}")
    rows, costs, plans, skipped = [], [], {}, {}
    bandwidths = [copy_bandwidth(device)]  # and once per round: a shared machine's bandwidth drifts
    reads = [read_bandwidth(device)]
    with tempfile.TemporaryDirectory() as tmp:
        if checkpoint is None:
            progress(f"writing a random {model if model in FAMILY_MODELS else model + ' Mixtral'} with transformers ...")
        path = checkpoint or write_model(Path(tmp) / f"hf-{model}", model)
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            why = dtype_unsupported(device, dtype)
            if why is not None:
                skipped[dtype_name] = f"torch does not run {dtype_name} on this {device} ({why})"
                continue
            progress(f"{dtype_name}: loading, warming up and checking the tokens of each implementation ...")
            engine = Engine.load(path, dtype=dtype, device=device, calibration=calibration)
            weight_bytes = decode_weight_bytes(engine)
            plans[dtype_name] = {"plan": engine.plan.describe(), "reason": engine.plan.reason,
                                 "decode_weight_bytes": weight_bytes}
            torch.manual_seed(1)
            prompts = torch.randint(0, engine.cfg.vocab_size, (batch, prompt_len))
            params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)

            def ours(e: Engine, n: int = new_tokens) -> list[list[int]]:
                done = e.complete(prompts.tolist(), dataclasses.replace(params, max_new_tokens=n))
                return [c.token_ids for c in done]

            impls = {"moeserve Engine": lambda n=new_tokens: ours(engine, n)}  # each: n new tokens
            engines = {"moeserve Engine": engine}  # whose decode tokens by path (graph / eager) each row reports
            if engine.plan.kernel_experts or engine.plan.kernel_dense or engine.plan.kernel_norms:  # the baseline
                pack = onednn_packing_available(device, dtype)  # the C kernel replaced
                torch_plan = dataclasses.replace(engine.plan, kernel_experts=False, kernel_dense=False,
                                                 kernel_norms=False, pack_experts=pack, pack_dense=pack)
                torch_kernels = Engine.load(path, dtype=dtype, device=device, plan=torch_plan)
                impls["moeserve Engine, torch's kernels"] = lambda n=new_tokens: ours(torch_kernels, n)
            if compiled:
                # the eager engine's plan, with indexed experts (grouped is CUDA bf16's default: the next row)
                fast = Engine.load(path, dtype=dtype, device=device, compile="on",
                                   plan=dataclasses.replace(engine.plan, decode_grouped=False, decode_reduce_max=0))
                t0 = time.perf_counter()
                fast.executor.warm_up(batch, rows=batch)
                plans[dtype_name]["compile_s"] = round(time.perf_counter() - t0, 1)
                impls["moeserve Engine, compiled decode"] = lambda n=new_tokens: ours(fast, n)
                engines["moeserve Engine, compiled decode"] = fast
                if torch.device(device).type == "cuda" and dtype == torch.bfloat16:  # the experts the other way
                    grouped = Engine.load(path, dtype=dtype, device=device, compile="on",
                                          plan=dataclasses.replace(fast.plan, grouped_mm=True, decode_grouped=True))
                    grouped.executor.warm_up(batch, rows=batch)
                    impls[f"moeserve Engine, compiled decode, {GROUPED}"] = lambda n=new_tokens: ours(grouped, n)
                    engines[f"moeserve Engine, compiled decode, {GROUPED}"] = grouped
                    if batch <= REDUCED_MAX_BATCH:  # and as GEMVs (moe_reduced), the candidate at batch 1
                        gemv = Engine.load(path, dtype=dtype, device=device, compile="on",
                                           plan=dataclasses.replace(grouped.plan, decode_reduce_max=batch))
                        gemv.executor.warm_up(batch, rows=batch)
                        impls[f"moeserve Engine, compiled decode, {REDUCED}"] = lambda n=new_tokens: ours(gemv, n)
                        engines[f"moeserve Engine, compiled decode, {REDUCED}"] = gemv
            quantized_bytes = {}
            for fmt in quantize:
                name = f"moeserve Engine, {fmt}" + (", compiled decode" if compiled else "")
                q = Engine.load(path, dtype=dtype, device=device, quantize=fmt, compile="on" if compiled else "off")
                q.executor.warm_up(batch, rows=batch)
                impls[name] = lambda n=new_tokens, q=q: ours(q, n)
                engines[name], quantized_bytes[name] = q, weight_bytes_per_token(q.model)
            ids = prompts.to(device)
            for backend in backends:
                hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation=backend)
                hf = hf.to(device).eval()
                hf.generation_config.eos_token_id = None
                hf.generation_config.pad_token_id = 0

                def run(hf=hf, n: int = new_tokens) -> list[list[int]]:
                    with torch.inference_mode():
                        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                          max_new_tokens=n, min_new_tokens=n)
                    return out[:, prompt_len:].tolist()

                impls[f"transformers generate ({backend})"] = run
            tokens = {name: fn() for name, fn in impls.items()}  # warm-up, and the tokens compared

            beside, read_beside = [], []  # the bandwidths this dtype's rounds ran at, measured between them

            def between(r: int) -> None:
                beside.append(copy_bandwidth(device, rounds=2))
                read_beside.append(read_bandwidth(device, rounds=2))
                bandwidths.append(beside[-1])
                reads.append(read_beside[-1])
                progress(f"{dtype_name}: round {r + 1} of {repeats} timed")

            # each also to its first token only, in the same rounds: the decode steps' time is the difference
            firsts = {f"{name} {FIRST}": functools.partial(fn, n=1) for name, fn in impls.items()}
            times = {name: [ms / 1e3 for ms in ts] for name, ts in interleaved_ms(
                impls | firsts, 0.0, min_rounds=repeats, max_rounds=repeats, warmup=0, after_round=between).items()}
            if batch == 1 and torch.device(device).type == "cpu" and model == "tiny" and checkpoint is None:
                accounting = accounting_cost(engine)
                for a in accounting:
                    a["dtype"] = dtype_name
                costs.extend(accounting)
            bandwidth, read = statistics.median(beside), statistics.median(read_beside)
            plans[dtype_name]["copy_bandwidth_gb_per_s"] = round(bandwidth, 1)
            plans[dtype_name]["read_bandwidth_gb_per_s"] = round(read, 1)
            ours_tps = batch * new_tokens / statistics.median(times["moeserve Engine"])
            for name in impls:
                tps = batch * new_tokens / statistics.median(times[name])
                decode_s = statistics.median(times[name]) - statistics.median(times[f"{name} {FIRST}"])
                decode_tps = batch * (new_tokens - 1) / decode_s if decode_s > 0 and new_tokens > 1 else float("nan")
                first_s = statistics.median(times[f"{name} {FIRST}"])  # the prompt's prefill and one token
                row = {"dtype": dtype_name, "impl": name, "tokens_per_s": round(tps, 1),
                       "p50_s": round(statistics.median(times[name]), 4),
                       "decode_tokens_per_s": round(decode_tps, 1),
                       "prefill_tokens_per_s": round(batch * prompt_len / first_s, 1),
                       "same_tokens": tokens[name] == tokens["moeserve Engine"]}
                if name in engines:  # every run's decode tokens, warm-up's included: a compiled row's must replay
                    row["decode_paths"] = dict(engines[name].executor.decode_tokens)
                if batch == 1:  # a decode step reads each weight once for one token: bandwidth-bound
                    wb = quantized_bytes.get(name, weight_bytes)
                    row["weights_gb_per_s"] = round(wb * decode_tps / 1e9, 1)
                    row["pct_of_copy_bandwidth"] = round(100 * wb * decode_tps / 1e9 / bandwidth, 1)
                    row["pct_of_read_bandwidth"] = round(100 * wb * decode_tps / 1e9 / read, 1)
                if name != "moeserve Engine":
                    ours_flat = [t for row_ in tokens["moeserve Engine"] for t in row_]
                    theirs = [t for row_ in tokens[name] for t in row_]
                    row["matching_prefix"] = next((i for i, (a, b) in enumerate(zip(ours_flat, theirs)) if a != b),
                                                  len(ours_flat))
                    row["speedup_of_moeserve"] = round(ours_tps / tps, 2)
                rows.append(row)
    return {"accounting": costs, "model": model_fields(model) if checkpoint is None else str(checkpoint),
            "model_name": model if checkpoint is None else None, "device": device,
            "copy_bandwidth_gb_per_s": round(statistics.median(bandwidths), 1),
            "read_bandwidth_gb_per_s": round(statistics.median(reads), 1), "new_tokens": new_tokens,
            "prompt_len": prompt_len, "batch": batch, "repeats": repeats, "machine": machine(), "plans": plans,
            "skipped": skipped, "results": rows}


def accounting_cost(engine: Engine, tokens: tuple[int, ...] = (1, 128), rounds: int = 200) -> list[dict]:
    """p50 of Engine.forward with expert-load accounting on and off (the per-layer bincount and the
    engine's add into its counter), rounds interleaved."""
    def forward(ids: torch.Tensor, on: bool) -> None:
        for layer in engine.model.moe_layers:
            layer.count_load = on
        engine.forward(ids)

    rows = []
    for T in tokens:
        ids = torch.randint(0, engine.cfg.vocab_size, (1, T))
        times = interleaved_ms({"on": lambda: forward(ids, True), "off": lambda: forward(ids, False)}, 0.0,
                               min_rounds=rounds, max_rounds=rounds, warmup=5)
        for layer in engine.model.moe_layers:
            layer.count_load = True
        on, off = (statistics.median(times[k]) for k in ("on", "off"))
        rows.append({"tokens": T, "on_ms": round(on, 4), "off_ms": round(off, 4),
                     "overhead_pct": round(100 * (on - off) / off, 2)})
    return rows


def markdown(report: dict) -> str:
    name = report["model_name"] or report["model"]
    lines = [f"model: {name}, device: {report['device']}, batch {report['batch']}, {report['prompt_len']} prompt "
             f"tokens, {report['new_tokens']} new tokens; copy bandwidth {report['copy_bandwidth_gb_per_s']} GB/s"
             + (f", read bandwidth {report['read_bandwidth_gb_per_s']} GB/s" if "read_bandwidth_gb_per_s" in report
                else ""), ""]
    lines += [f"calibration ({dtype}): {p['plan']}  \nwhy: {p['reason']}"
              + (f"  \ncopy bandwidth in its rounds {p['copy_bandwidth_gb_per_s']} GB/s"
                 if "copy_bandwidth_gb_per_s" in p else "")
              + (f", read {p['read_bandwidth_gb_per_s']} GB/s" if "read_bandwidth_gb_per_s" in p else "")
              + (f"  \ncompiled decode step built in {p['compile_s']} s (the batch's graph at each span, and the "
                 "prompt chunk's)" if "compile_s" in p else "")
              for dtype, p in report["plans"].items()]
    lines += [f"skipped {dtype}: {why}" for dtype, why in report["skipped"].items()]
    lines += [""] if lines else []
    per_token = report["batch"] == 1
    reads = per_token and all("pct_of_read_bandwidth" in r for r in report["results"])  # older reports: copy only
    extra = (" weights GB/s | % of copy bandwidth |" + (" % of read bandwidth |" if reads else "")) if per_token else ""
    prefill = all("prefill_tokens_per_s" in r for r in report["results"])  # older reports: none
    lines += ["| dtype | implementation | tokens/s | p50 s | decode tokens/s |" + (" prefill tokens/s |" * prefill)
              + " same tokens | moeserve speed-up |" + extra,
              "| --- | --- | ---: | ---: | ---: |" + " ---: |" * prefill + " --- | ---: |" + extra.count("|") * " ---: |"]
    for r in report["results"]:
        same = "yes" if r["same_tokens"] else f"no (first {r.get('matching_prefix')} equal)"
        lines.append(f"| {r['dtype']} | {r['impl']} | {r['tokens_per_s']} | {r['p50_s']} | "
                     f"{r.get('decode_tokens_per_s', '-')} | " + (f"{r['prefill_tokens_per_s']} | " if prefill else "")
                     + f"{same} | "
                     f"{r.get('speedup_of_moeserve', '-')} |"
                     + (f" {r['weights_gb_per_s']} | {r['pct_of_copy_bandwidth']}% |" if per_token else "")
                     + (f" {r['pct_of_read_bandwidth']}% |" if reads else ""))
    if report["accounting"]:
        lines += ["", "Expert-load accounting (Engine.forward, on vs off):", "",
                  "| dtype | tokens | on ms | off ms | overhead |", "| --- | ---: | ---: | ---: | ---: |"]
        for a in report["accounting"]:
            lines.append(f"| {a['dtype']} | {a['tokens']} | {a['on_ms']} | {a['off_ms']} | {a['overhead_pct']}% |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Generated tokens per second by implementation, per dtype."""
    from moeserve.bench.plots import bars, pyplot, save

    rows = report["results"]
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    tps = {(r["dtype"], r["impl"]): r["tokens_per_s"] for r in rows}
    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    bars(ax, dtypes, {impl: [tps.get((d, impl)) for d in dtypes] for impl in impls}, "tokens/s",
         f"batch {report['batch']}, {report['new_tokens']} new tokens")
    save(fig, path, f"moeserve bench engine: {report['model_name'] or report['model']} on {report['device']}")


def main(args) -> int:
    report = run_bench(args, "engine", lambda progress: bench_engine(
        args.dtypes, args.new_tokens, args.prompt_len, args.repeats, checkpoint=args.checkpoint,
        calibration="redo" if args.calibrate else None, compiled=args.compile, model=args.model, device=args.device,
        batch=args.batch, quantize=tuple(args.quantize or ()), progress=progress))
    return 2 if report is None else 0
