"""`moeserve study`: the three papers' claims measured again at a small scale, on the embedded corpus and the
built-in classification task, with every routing method trained the same way and several seeds.

  X-MoE   lower routing fluctuation through pre-training and a larger RC than softmax routing (section 4.5)
  VQMoE   fine-tuning the discrete path alone costs fewer FLOPs at comparable accuracy (section 3.3)
  OMoE    more diverse experts and better fine-tuning accuracy than the same model trained with AdamW (4.2)

For each recipe and seed: pre-train, diagnose (training/diagnostics.py) on held-out text, fine-tune on the built-in
task (full; plus frozen routing for the X-MoE comparison and discrete-only for VQ). The inter-run consistency
follows X-MoE: one pre-trained model (seed 0) fine-tuned with each seed, the expert loads of those runs on the
same texts correlated; for softmax and X-MoE, the pair the paper compares (it costs seeds - 1 more fine-tunes).
A claim is "supported" when the means differ in the claimed direction by more than the larger of the two spreads
(standard deviation over seeds), "contradicted" when they differ the other way by as much, and "inconclusive"
otherwise. Nothing is tuned toward the papers' answers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from moeserve.config import MoEConfig, preset
from moeserve.runtime.loading import load_model
from moeserve.tokenizer import ByteTokenizer
from moeserve.training.data import Corpus, eval_batches, load_corpus
from moeserve.training.diagnostics import (collect, expert_outputs, expert_weights, inter_run_consistency,
                                           output_variance, parameter_difference, representation_collapse,
                                           strict_json)
from moeserve.training.finetune import FinetuneConfig, encode, finetune
from moeserve.training.tasks import ClassificationData, stdlib_task
from moeserve.training.trainer import LOG_NAME, RECIPES, TrainConfig, train


@dataclass
class StudyConfig:
    recipes: tuple[str, ...] = tuple(RECIPES)
    seeds: int = 3
    model: dict = dataclasses.field(default_factory=lambda: dict(d_model=128, n_heads=4, n_kv_heads=None,
                                                                  max_seq_len=128, d_ff=256))
    preset: str = "small"  # the model: this preset with `model` applied (8 experts, top-2, 4 MoE layers)
    steps: int = 300
    eval_every: int = 25  # routing fluctuation is measured at each evaluation
    finetune_steps: int = 300  # 150 left test accuracy near 0.25 (chance 0.125); 450 reached 0.42 on one model
    consistency_recipes: tuple[str, ...] = ("softmax", "xmoe")  # the X-MoE claim; seeds - 1 more fine-tunes each
    per_class_train: int = 200
    per_class_test: int = 100
    diagnose_tokens: int = 8192

    @classmethod
    def quick(cls) -> StudyConfig:
        """Every step of the full study at a toy size that runs in about half a minute: the tiny preset, 2 seeds
        (what CI runs: the study's plumbing, not its claims)."""
        return cls(seeds=2, preset="tiny", model={}, steps=20, eval_every=5, finetune_steps=6, per_class_train=24,
                   per_class_test=12, diagnose_tokens=1024)


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]  # None: nan read back from study.json
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def _lm_diagnostics(path: Path, corpus: Corpus, tokens: int) -> dict:
    model, ckpt = load_model(path)
    seq_len = min(128, ckpt.config.max_seq_len)
    batches = [x for x, _ in eval_batches(corpus.val, 8, seq_len, max(1, tokens // (8 * seq_len)))]
    routing = collect(model, batches)
    outputs = expert_outputs(model, [r.inputs for r in routing], 512)
    return {"rc": statistics.fmean(representation_collapse(r.inputs, r.top1) for r in routing),
            "param_diff": statistics.fmean(parameter_difference(w) for w in expert_weights(model)),
            "output_var_rel": statistics.fmean(output_variance(y)[1] for y in outputs)}


def _loads(path: Path, texts_ids: list[list[int]], seq_len: int) -> torch.Tensor:
    """[layers, E]: the expert loads of a fine-tuned model on the test texts, as one stream of windows."""
    model, _ = load_model(path)
    stream = torch.tensor([t for row in texts_ids for t in row])
    n = len(stream) // seq_len
    batches = list(stream[:n * seq_len].reshape(n, seq_len).split(16))
    return torch.stack([r.counts for r in collect(model, batches)]).double()


def _fluctuation(run: Path) -> list[tuple[int, float]]:
    """(step, RF ratio averaged over layers) at each evaluation after the first, from the run's log."""
    rows = [json.loads(line) for line in (run / LOG_NAME).read_text().splitlines()]
    return [(r["step"] + 1, statistics.fmean(r["routing_fluctuation"])) for r in rows if "routing_fluctuation" in r]


def layer_flops(cfg: MoEConfig, tokens: int = 64) -> int:
    """FLOPs of one MoE layer's forward over `tokens` tokens (torch's own counter)."""
    from torch.utils.flop_counter import FlopCounterMode

    from moeserve.runtime.moe import MoELayer

    layer = MoELayer(cfg).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        layer(torch.randn(1, tokens, cfg.d_model))
    return counter.get_total_flops()


def run_study(sc: StudyConfig, work: Path, log: Callable[[str], None] = lambda m: None) -> dict:
    """Train, diagnose and fine-tune every recipe and seed under `work`; the raw results (study.json)."""
    corpus = load_corpus()
    base_cfg = preset(sc.preset, **sc.model)
    task = stdlib_task(snippet_bytes=min(256, base_cfg.max_seq_len - 1), per_class_train=sc.per_class_train,
                       per_class_test=sc.per_class_test)
    t0 = time.perf_counter()
    results: dict[str, Any] = {"config": dataclasses.asdict(sc), "model": base_cfg.to_dict(), "task": {
        "labels": task.labels, "train": len(task.train), "test": len(task.test), "sha256": task.sha256},
        "recipes": {}}
    ft_tc = TrainConfig(steps=sc.finetune_steps, batch_size=16, lr=1e-3, warmup_steps=min(20, sc.finetune_steps),
                        weight_decay=0.01, eval_every=sc.finetune_steps)
    for name in sc.recipes:
        overrides, optimizer = RECIPES[name]
        cfg = base_cfg.replace(**overrides)
        rows: list[dict] = []
        for seed in range(sc.seeds):
            run = work / name.replace("+", "-") / f"seed{seed}"
            log(f"{name} seed {seed}: pre-training {sc.steps} steps")
            tc = TrainConfig(steps=sc.steps, batch_size=16, seq_len=cfg.max_seq_len, optimizer=optimizer,
                             eval_every=sc.eval_every, eval_batches=4, seed=seed, warmup_steps=min(30, sc.steps))
            m = train(cfg, tc, run / "lm", progress=False, corpus=corpus)
            row: dict[str, Any] = {"seed": seed, "val_bpb": m["val_bits_per_byte"], "train_s": m["train_seconds"],
                                   "fluctuation": _fluctuation(run / "lm"),
                                   **_lm_diagnostics(run / "lm", corpus, sc.diagnose_tokens)}
            ft_opt = dataclasses.replace(ft_tc, seed=seed, optimizer=optimizer)
            modes = {"full": FinetuneConfig()}
            if name in ("softmax", "xmoe"):
                modes["frozen"] = FinetuneConfig(routing="frozen")
            if cfg.router == "vq":
                modes["discrete"] = FinetuneConfig(vq="discrete")
            for mode, fc in modes.items():
                log(f"{name} seed {seed}: fine-tuning ({mode})")
                tc_mode = ft_opt if mode != "frozen" else dataclasses.replace(ft_opt, optimizer="adamw")
                row[f"acc_{mode}"] = finetune(run / "lm", task, tc_mode, fc, run / f"cls-{mode}",
                                              progress=False)["test_accuracy"]
            rows.append(row)
        results["recipes"][name] = {"seeds": rows}
        if name in sc.consistency_recipes:
            results["recipes"][name]["consistency"] = _consistency(work / name.replace("+", "-"), task, ft_tc,
                                                                   optimizer, sc, log)
        if cfg.router == "vq":
            results["recipes"][name]["discrete_flops_ratio"] = (layer_flops(cfg.replace(vq_mode="discrete"))
                                                                / layer_flops(cfg))
    results["wall_s"] = time.perf_counter() - t0
    return results


def _consistency(root: Path, task: ClassificationData, ft_tc: TrainConfig, optimizer: str, sc: StudyConfig,
                 log) -> float:
    """X-MoE's inter-run consistency: seed 0's pre-trained model fine-tuned with every seed (seed 0's run is the
    one above), their expert loads on the test texts correlated; the mean over MoE layers."""
    runs = [root / "seed0" / "cls-full"]
    for seed in range(1, sc.seeds):
        log(f"{root.name}: fine-tuning seed 0's model with seed {seed} (inter-run consistency)")
        out = root / "seed0" / f"cls-full-seed{seed}"
        finetune(root / "seed0" / "lm", task, dataclasses.replace(ft_tc, seed=seed, optimizer=optimizer),
                 FinetuneConfig(), out, progress=False)
        runs.append(out)
    seq_len = preset(sc.preset, **sc.model).max_seq_len
    ids = encode(ByteTokenizer(), task.test, seq_len)
    loads = torch.stack([_loads(r, ids, seq_len) for r in runs])  # [runs, layers, E]
    return statistics.fmean(inter_run_consistency(loads[:, i]) for i in range(loads.shape[1]))


# ---- docs/study.md --------------------------------------------------------------------------------------------
def _values(results: dict, recipe: str, key: str) -> list[float]:
    return [row[key] for row in results["recipes"].get(recipe, {}).get("seeds", []) if key in row]


def _late_fluctuation(row: dict) -> float:
    """RF ratio averaged over the evaluations of the second half of pre-training (X-MoE compares the curves
    after the first part of training, once routing has formed)."""
    points = row["fluctuation"]
    late = [rf for step, rf in points if step > points[-1][0] / 2] if points else []
    return statistics.fmean(late) if late else math.nan


def verdict(claimed: list[float], other: list[float], higher: bool) -> tuple[str, str]:
    """("supported" | "contradicted" | "inconclusive", the numbers): the claimed side against the other, by
    more than the larger spread over seeds."""
    (a, sa), (b, sb) = _mean_sd(claimed), _mean_sd(other)
    text = f"{a:.4g} ± {sa:.2g} vs {b:.4g} ± {sb:.2g}"
    if math.isnan(a) or math.isnan(b):
        return "inconclusive", text
    diff, margin = (a - b) if higher else (b - a), max(sa, sb)
    return ("supported" if diff > margin else "contradicted" if diff < -margin else "inconclusive"), text


def claims(results: dict) -> list[tuple[str, str, str]]:
    """(claim, verdict, numbers) for each claim the three papers make that the study measures."""
    r = results["recipes"]
    late = {name: [_late_fluctuation(row) for row in r[name]["seeds"]] for name in r}
    out = []
    if "xmoe" in r and "softmax" in r:
        out.append(("X-MoE routes more stably than softmax: lower RF ratio (second half of pre-training)",
                    *verdict(late["xmoe"], late["softmax"], higher=False)))
        out.append(("X-MoE collapses less than softmax: larger RC of router inputs",
                    *verdict(_values(results, "xmoe", "rc"), _values(results, "softmax", "rc"), higher=True)))
        a, b = (_mean_sd([r[n].get("consistency")])[0] for n in ("xmoe", "softmax"))
        out.append(("X-MoE fine-tunes more consistently than softmax: larger inter-run consistency",
                    "supported" if a > b else "contradicted" if a < b else "inconclusive",
                    f"{a:.4g} vs {b:.4g} (one value per recipe: no spread)"))
    if "vq" in r:
        ratio = r["vq"].get("discrete_flops_ratio", math.nan)
        status, text = verdict(_values(results, "vq", "acc_discrete"), _values(results, "vq", "acc_full"),
                               higher=True)
        status = "supported" if status in ("supported", "inconclusive") and ratio < 1 else "contradicted"
        out.append(("VQMoE fine-tunes the discrete path alone at lower cost and comparable accuracy",
                    status, f"accuracy discrete vs mixed {text}; FLOPs per token {ratio:.2f}x the mixed layer's"))
    if "xmoe+omoe" in r and "xmoe" in r:
        out.append(("OMoE makes experts more diverse: larger share of differing parameters",
                    *verdict(_values(results, "xmoe+omoe", "param_diff"), _values(results, "xmoe", "param_diff"),
                             higher=True)))
        out.append(("OMoE makes experts more diverse: larger relative variance of expert outputs",
                    *verdict(_values(results, "xmoe+omoe", "output_var_rel"),
                             _values(results, "xmoe", "output_var_rel"), higher=True)))
        out.append(("OMoE fine-tunes to better accuracy than AdamW (X-MoE routing both)",
                    *verdict(_values(results, "xmoe+omoe", "acc_full"), _values(results, "xmoe", "acc_full"),
                             higher=True)))
    return out


def _cell(results: dict, recipe: str, key: str, fmt: str = ".4f") -> str:
    vals = _values(results, recipe, key)
    if not vals:
        return "-"
    m, sd = _mean_sd(vals)
    return f"{m:{fmt}} ± {sd:{fmt}}"


def markdown(results: dict, plots: list[str], command: str) -> str:
    sc, model = results["config"], results["model"]
    lines = ["# The papers' claims, measured again", "",
             f"Generated by `{command}` in {results['wall_s'] / 60:.1f} minutes (`docs/study/study.json` holds every "
             "number). Do not edit by hand.", "",
             f"Model: d_model {model['d_model']}, {model['n_layers']} layers, all MoE, {model['n_experts']} experts, "
             f"top-{model['top_k']}, experts of {model['d_ff']}, context {model['max_seq_len']}; {sc['steps']} "
             f"pre-training steps of 16 x {model['max_seq_len']} bytes of the built-in corpus; {sc['seeds']} seeds "
             f"each. Fine-tuning: the built-in task ({len(results['task']['labels'])} standard-library packages, "
             f"{results['task']['train']} train / {results['task']['test']} test snippets), {sc['finetune_steps']} "
             "steps. Values are mean ± standard deviation over seeds. A claim is supported when the means differ in "
             "its direction by more than the larger spread, contradicted when they differ the other way by as "
             "much, inconclusive otherwise.", "",
             "## Claims", "", "| claim | verdict | measured |", "| --- | --- | --- |"]
    lines += [f"| {c} | **{v}** | {t} |" for c, v, t in claims(results)]
    chance = 1 / len(results["task"]["labels"])
    reached = [_mean_sd(_values(results, n, "acc_full"))[0] for n in results["recipes"]]
    lines += ["", "Reading these numbers:",
              f"- Fine-tuning accuracy is {chance:.3f} by chance; at this size and budget the models reach "
              f"{min(reached):.2f}-{max(reached):.2f}, so a fine-tuning claim needs a large effect to clear the "
              "spread over seeds.",
              "- The experts here are initialised independently, so nearly every parameter differs by more than 1e-3 "
              "between two experts from the first step; the OMoE paper's experts start as copies of one pre-trained "
              "FFN, where the share is what the optimizer changes. Read the relative output variance first.",
              "- The RF claim is judged on the second half of pre-training (decided before the run, as X-MoE reads "
              "its curve after routing has formed); the mean over all evaluations is in the table beside it and "
              "the curves in the first plot.",
              "", "## Pre-training", "",
              "| recipe | val bits/byte | RF ratio, 2nd half | RF ratio, all evaluations | RC | parameter difference | "
              "relative output variance |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, rec in results["recipes"].items():
        late = _mean_sd([_late_fluctuation(row) for row in rec["seeds"]])
        whole = _mean_sd([statistics.fmean(rf for _, rf in row["fluctuation"]) for row in rec["seeds"]
                          if row["fluctuation"]])
        lines.append(f"| {name} | {_cell(results, name, 'val_bpb')} | {late[0]:.4f} ± {late[1]:.4f} | "
                     f"{whole[0]:.4f} ± {whole[1]:.4f} | "
                     f"{_cell(results, name, 'rc', '.4g')} | {_cell(results, name, 'param_diff')} | "
                     f"{_cell(results, name, 'output_var_rel')} |")
    lines += ["", "## Fine-tuning on the built-in task", "",
              "| recipe | accuracy, full | accuracy, routing frozen | accuracy, discrete VQ | inter-run consistency |",
              "| --- | ---: | ---: | ---: | ---: |"]
    for name, rec in results["recipes"].items():
        consistency = f"{rec['consistency']:.4f}" if rec.get("consistency") is not None else "-"
        lines.append(f"| {name} | {_cell(results, name, 'acc_full')} | {_cell(results, name, 'acc_frozen')} | "
                     f"{_cell(results, name, 'acc_discrete')} | {consistency} |")
    if "vq" in results["recipes"]:
        lines += ["", f"Discrete-only VQ layer: {results['recipes']['vq']['discrete_flops_ratio']:.2f}x the FLOPs "
                  "per token of the mixed layer (torch's FLOP counter, one layer, 64 tokens)."]
    lines += [""] + [f"![{Path(p).stem}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def draw(results: dict, directory: Path) -> list[Path]:
    from moeserve.bench.plots import bars, pyplot, save

    plt = pyplot()
    names = list(results["recipes"])
    paths = []

    def stat(key: str) -> tuple[list[float], list[float]]:
        pairs = [_mean_sd(_values(results, n, key)) for n in names]
        return [m for m, _ in pairs], [s for _, s in pairs]

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    m, s = stat("val_bpb")
    bars(a, names, {"val": m}, "bits per byte", "validation bits per byte (lower is better)", errors={"val": s})
    for name in names:
        curves = [row["fluctuation"] for row in results["recipes"][name]["seeds"]]
        if curves and curves[0]:
            steps = [p[0] for p in curves[0]]
            b.plot(steps, [statistics.fmean(c[i][1] for c in curves) for i in range(len(steps))], label=name)
    b.set_xlabel("step")
    b.set_ylabel("RF ratio")
    b.set_title("routing fluctuation between evaluations")
    b.legend(fontsize=7)
    paths.append(directory / "pretraining.png")
    save(fig, paths[-1], "pre-training")

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, key, title in ((a, "rc", "RC (larger: less collapse)"), (b, "param_diff", "share of differing parameters"),
                           (c, "output_var_rel", "relative output variance")):
        m, s = stat(key)
        bars(ax, names, {key: m}, key, title, errors={key: s})
    paths.append(directory / "routing.png")
    save(fig, paths[-1], "representation collapse and expert diversity")

    fig, ax = plt.subplots(figsize=(9, 4.2))
    series, errs = {}, {}
    for mode in ("full", "frozen", "discrete"):
        pairs = [_mean_sd(_values(results, n, f"acc_{mode}")) for n in names]
        series[mode] = [None if math.isnan(p[0]) else p[0] for p in pairs]
        errs[mode] = [None if math.isnan(p[1]) else p[1] for p in pairs]
    bars(ax, names, series, "test accuracy", "fine-tuning accuracy on the built-in task", errors=errs)
    paths.append(directory / "finetuning.png")
    save(fig, paths[-1], "fine-tuning")
    return paths


def render(out: Path) -> list[Path]:
    """The page and its plots drawn again from the JSON beside it (`moeserve study --render`): no training."""
    figures = out.parent / out.stem
    results = json.loads((figures / "study.json").read_text())
    plots = [p.relative_to(out.parent).as_posix() for p in draw(results, figures)]
    out.write_text(markdown(results, plots, results.get("command", "moeserve study")))
    return [figures / Path(p).name for p in plots]


def main(args) -> int:
    from moeserve.bench.plots import pyplot

    pyplot()  # matplotlib before an hour of training, not after
    if args.render:
        drawn = render(Path(args.out))
        print(f"wrote {args.out} and {len(drawn)} plots from {Path(args.out).parent / Path(args.out).stem}/study.json")
        return 0
    sc = StudyConfig.quick() if args.quick else StudyConfig()
    if args.seeds is not None:
        if args.seeds < 2:
            raise ValueError(f"--seeds {args.seeds}: expected at least 2 (spreads and inter-run consistency)")
        sc = dataclasses.replace(sc, seeds=args.seeds)
    out = Path(args.out)
    figures = out.parent / out.stem  # docs/study.md -> docs/study/: the JSON and the plots
    if args.work and Path(args.work).exists() and any(Path(args.work).iterdir()):
        raise FileExistsError(f"{args.work} is not empty: remove it or give --work another directory")
    figures.mkdir(parents=True, exist_ok=True)
    log = (lambda m: None) if args.quiet else (lambda m: print(f"moeserve study: {m}", file=sys.stderr))
    with tempfile.TemporaryDirectory() as tmp:  # the checkpoints, kept only with --work
        results = run_study(sc, Path(args.work or tmp), log)
    results["command"] = " ".join(args.argv)
    (figures / "study.json").write_text(json.dumps(strict_json(results), indent=1, allow_nan=False))
    plots = [p.relative_to(out.parent).as_posix() for p in draw(results, figures)]
    out.write_text(markdown(results, plots, results["command"]))
    print(f"wrote {out}, {len(plots)} plots and {figures / 'study.json'} in {results['wall_s'] / 60:.1f} min")
    return 0
