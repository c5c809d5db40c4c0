"""`moeserve bench engine`: greedy generation end to end, moeserve's Engine against transformers'
`generate` on the same Mixtral checkpoint, dtype, prompt and token count, in one run.

The checkpoint is a small random Mixtral written by transformers itself (`save_pretrained`), which
the Engine loads as is: the comparison also exercises the no-conversion import. Both decode with a
KV cache and must produce the same tokens (checked, and reported).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moeserve.runtime.device import dtype_unsupported, machine
from moeserve.runtime.engine import DTYPES, Engine, SamplingParams

TINY_MIXTRAL = dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                    max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False)


def write_tiny_mixtral(path: Path, seed: int = 0, **overrides) -> Path:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(**{**TINY_MIXTRAL, **overrides})
    MixtralForCausalLM(cfg).eval().save_pretrained(path)
    return path


def bench_engine(dtypes: list[str], new_tokens: int = 128, prompt_len: int = 16, repeats: int = 5,
                 backends: tuple[str, ...] = ("eager", "grouped_mm"), checkpoint: Path | None = None,
                 calibration: str | None = None, compiled: bool = False) -> dict:
    """Runs of the implementations are interleaved (one of each per round, after a warm-up of each),
    so that drift in the machine's speed hits all of them alike; the median round is reported. The
    Engine runs the dispatch plan calibrated for this machine (reported); a dtype torch does not run
    here is skipped, with the reason. `compiled`: the Engine with its compiled decode step too (`--compile
    on`: its compile time is reported, and kept out of the timed rounds by the warm-up)."""
    from transformers import MixtralForCausalLM

    rows, costs, plans, skipped = [], [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint or write_tiny_mixtral(Path(tmp) / "tiny-mixtral")
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            why = dtype_unsupported("cpu", dtype)
            if why is not None:
                skipped[dtype_name] = f"torch does not run {dtype_name} on this CPU ({why})"
                continue
            engine = Engine.load(path, dtype=dtype, device="cpu", calibration=calibration)
            plans[dtype_name] = {"plan": engine.plan.describe(), "reason": engine.plan.reason}
            torch.manual_seed(1)
            prompt = torch.randint(0, engine.cfg.vocab_size, (1, prompt_len))
            params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
            impls = {"moeserve Engine": lambda: engine.generate_ids([prompt[0].tolist()], params)[0][0]}
            if compiled:
                fast = Engine.load(path, dtype=dtype, device="cpu", calibration=calibration, compile="on")
                t0 = time.perf_counter()
                fast.warm_up(1)
                plans[dtype_name]["compile_s"] = round(time.perf_counter() - t0, 1)
                impls["moeserve Engine, compiled decode"] = \
                    lambda: fast.generate_ids([prompt[0].tolist()], params)[0][0]
            for backend in backends:
                hf = MixtralForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation=backend).eval()
                hf.generation_config.eos_token_id = None
                hf.generation_config.pad_token_id = 0

                def run(hf=hf):
                    with torch.inference_mode():
                        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                          max_new_tokens=new_tokens, min_new_tokens=new_tokens)
                    return out[0, prompt_len:].tolist()

                impls[f"transformers generate ({backend})"] = run
            tokens = {name: fn() for name, fn in impls.items()}  # warm-up, and the tokens compared
            times: dict[str, list[float]] = {name: [] for name in impls}
            for _ in range(repeats):
                for name, fn in impls.items():
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            accounting = accounting_cost(engine)
            ours = tokens["moeserve Engine"]
            ours_tps = new_tokens / statistics.median(times["moeserve Engine"])
            for name in impls:
                tps = new_tokens / statistics.median(times[name])
                row = {"dtype": dtype_name, "impl": name, "tokens_per_s": round(tps, 1),
                       "p50_s": round(statistics.median(times[name]), 4), "same_tokens": tokens[name] == ours}
                if name != "moeserve Engine":
                    row["matching_prefix"] = next((i for i, (a, b) in enumerate(zip(ours, tokens[name])) if a != b),
                                                  len(ours))
                    row["speedup_of_moeserve"] = round(ours_tps / tps, 2)
                rows.append(row)
            for a in accounting:
                a["dtype"] = dtype_name
            costs.extend(accounting)
    return {"accounting": costs, "model": TINY_MIXTRAL if checkpoint is None else str(checkpoint),
            "new_tokens": new_tokens, "prompt_len": prompt_len, "batch": 1, "repeats": repeats, "machine": machine(),
            "plans": plans, "skipped": skipped, "results": rows}


def accounting_cost(engine: Engine, tokens: tuple[int, ...] = (1, 128), rounds: int = 200) -> list[dict]:
    """p50 of Engine.forward with expert-load accounting on and off (the per-layer bincount and the
    engine's add into its counter), rounds interleaved."""
    rows = []
    for T in tokens:
        ids = torch.randint(0, engine.cfg.vocab_size, (1, T))
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds + 5):
            for on in (True, False):
                for layer in engine.model.moe_layers:
                    layer.count_load = on
                t0 = time.perf_counter()
                engine.forward(ids)
                times[on].append(time.perf_counter() - t0)
        for layer in engine.model.moe_layers:
            layer.count_load = True
        on, off = (statistics.median(times[k][5:]) * 1e3 for k in (True, False))
        rows.append({"tokens": T, "on_ms": round(on, 4), "off_ms": round(off, 4),
                     "overhead_pct": round(100 * (on - off) / off, 2)})
    return rows


def markdown(report: dict) -> str:
    lines = [f"calibration ({dtype}): {p['plan']}  \nwhy: {p['reason']}"
             + (f"  \ncompiled decode step built in {p['compile_s']} s" if "compile_s" in p else "")
             for dtype, p in report["plans"].items()]
    lines += [f"skipped {dtype}: {why}" for dtype, why in report["skipped"].items()]
    lines += [""] if lines else []
    lines += ["| dtype | implementation | tokens/s | p50 s | same tokens | moeserve speed-up |",
             "| --- | --- | ---: | ---: | --- | ---: |"]
    for r in report["results"]:
        same = "yes" if r["same_tokens"] else f"no (first {r.get('matching_prefix')} equal)"
        lines.append(f"| {r['dtype']} | {r['impl']} | {r['tokens_per_s']} | {r['p50_s']} | {same} | "
                     f"{r.get('speedup_of_moeserve', '-')} |")
    lines += ["", "Expert-load accounting (Engine.forward, on vs off):", "",
              "| dtype | tokens | on ms | off ms | overhead |", "| --- | ---: | ---: | ---: | ---: |"]
    for a in report["accounting"]:
        lines.append(f"| {a['dtype']} | {a['tokens']} | {a['on_ms']} | {a['off_ms']} | {a['overhead_pct']}% |")
    return "\n".join(lines)


def main(args) -> int:
    report = bench_engine(args.dtypes, args.new_tokens, args.prompt_len, args.repeats, checkpoint=args.checkpoint,
                          calibration="redo" if args.calibrate else None, compiled=args.compile)
    print(markdown(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0
