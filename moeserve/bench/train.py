"""`moeserve bench train`: the routing methods trained side by side on one corpus, one machine, one run.

Each recipe trains the same preset for the same steps on the same batches; the table reports wall time,
throughput and validation bits per byte against the corpus's unigram baseline, measured in the same run.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from pathlib import Path

from moeserve.bench.report import check_plot, finish
from moeserve.config import preset
from moeserve.runtime.device import machine
from moeserve.training.data import load_corpus
from moeserve.training.default_model import DEFAULT_TRAIN
from moeserve.training.trainer import RECIPES, train



def bench_train(preset_name: str, recipes: list[str], steps: int | None, out_dir: Path | None,
                progress: bool = True) -> dict:
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        raise ValueError(f"unknown recipe(s) {unknown}; choose from {sorted(RECIPES)}")
    corpus = load_corpus()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = out_dir or Path(tmp)
        for name in recipes:
            overrides, optimizer = RECIPES[name]
            # the same steps for every recipe, whatever the machine: no time budget here
            tc = replace(DEFAULT_TRAIN, optimizer=optimizer, steps=steps or DEFAULT_TRAIN.steps, time_budget_s=None)
            t0 = time.perf_counter()
            m = train(preset(preset_name, **overrides), tc, root / name.replace("+", "-"), progress=progress,
                      corpus=corpus)
            wall = time.perf_counter() - t0
            tokens = tc.steps * tc.batch_size * (tc.seq_len or 0)
            rows.append({"recipe": name, "steps": tc.steps, "wall_s": round(wall, 1),
                         "tokens_per_s": round(tokens / m["train_seconds"]), "val_bpb": round(m["val_bits_per_byte"], 4),
                         "unigram_bpb": round(m["unigram_bits_per_byte"], 4)})
    return {"preset": preset_name, "machine": machine(), "corpus_sha256": corpus.sha256, "results": rows}


def markdown(report: dict) -> str:
    lines = [f"preset `{report['preset']}` on {report['machine']['cpu']}, {report['machine']['cores']} cores, "
             f"torch {report['machine']['torch']}", "",
             "| recipe | steps | wall (s) | tokens/s | val bits/byte | unigram bits/byte |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in report["results"]:
        lines.append(f"| {r['recipe']} | {r['steps']} | {r['wall_s']} | {r['tokens_per_s']} | {r['val_bpb']} | "
                     f"{r['unigram_bpb']} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Validation bits per byte (against the unigram baseline) and training tokens/s, per recipe."""
    from moeserve.bench.plots import bars, pyplot, save

    rows = report["results"]
    recipes = [r["recipe"] for r in rows]
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(11, 4.5))
    bars(left, recipes, {"validation": [r["val_bpb"] for r in rows], "unigram": [r["unigram_bpb"] for r in rows]},
         "bits per byte", "held-out bits per byte (lower is better)")
    bars(right, recipes, {"tokens/s": [r["tokens_per_s"] for r in rows]}, "tokens/s", "training throughput")
    save(fig, path, f"moeserve bench train: preset {report['preset']}, {rows[0]['steps'] if rows else 0} steps")


def main(args) -> int:
    check_plot(args)
    report = bench_train(args.preset, args.recipes, args.steps, args.out, progress=not args.quiet)
    print(markdown(report))
    finish(report, args, "train")
    return 0
