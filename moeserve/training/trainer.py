"""The training loop: language-model pre-training of any router, with AdamW or OMoE.

One step: batch(step) -> forward (bf16 autocast where the CPU has fast bf16) -> task loss + the
papers' auxiliary losses -> backward -> clip -> optimizer step -> constraints (X-MoE's ||e_i||).

Exact resume: a batch is a pure function of (seed, step), and a checkpoint holds the model, the
optimizer moments, the OMoE projectors and the RNG, so a run resumed at step s repeats the
uninterrupted run's steps s, s+1, ... bit for bit on the same machine.

A time budget fits the run to the machine (the built-in default model must train in minutes on any
CPU, and CPUs differ 2x in speed): the first `pace_steps` steps are timed, and `steps` shrinks to what
that pace fits in `time_budget_s`, evaluations included. Those first steps lie inside the warm-up,
whose learning rates do not depend on `steps`, so the fitted run is exactly the run that would have
asked for the fitted number of steps from the start; the fitted number is saved in the recipe and a
resumed run keeps it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from moeserve.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from moeserve.config import MoEConfig
from moeserve.files import atomic_write
from moeserve.runtime.device import cpu_has_fast_bf16
from moeserve.runtime.loading import load_into
from moeserve.runtime.model import Transformer
from moeserve.training.data import Batcher, Corpus, bits_per_byte, eval_batches, load_corpus, unigram_bits_per_byte
from moeserve.training.diagnostics import routing_fluctuation
from moeserve.training.losses import aux_losses, load_entropy

if TYPE_CHECKING:
    from moeserve.training.omoe import OMoE

LOG_NAME = "train_log.jsonl"
# the routing methods compared by `moeserve bench train` and `moeserve study`: name -> (config overrides, optimizer)
RECIPES: dict[str, tuple[dict, str]] = {
    "softmax": ({"router": "softmax"}, "adamw"),
    "sigmoid": ({"router": "sigmoid"}, "adamw"),
    "xmoe": ({"router": "xmoe"}, "adamw"),
    "vq": ({"router": "vq"}, "adamw"),
    "xmoe+omoe": ({"router": "xmoe"}, "omoe"),
}
TOP1_PREFIX = "eval.top1."  # train-state tensors: the last evaluation's top-1 expert per MoE layer


@dataclass
class TrainConfig:
    steps: int = 300
    batch_size: int = 16
    seq_len: int | None = None  # None = the model's max_seq_len
    lr: float = 3e-3  # peak; small models tolerate a high rate
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    optimizer: str = "adamw"  # adamw | omoe
    omoe_every: int = 5  # s of OMoE: every s-th step is an O step
    eval_every: int = 100
    eval_batches: int = 8
    save_every: int = 0  # 0 = only at the end
    seed: int = 0
    dtype: str = "auto"  # auto = bf16 autocast on CPUs with AMX / AVX512-BF16; float32; bfloat16
    time_budget_s: float | None = None  # fit `steps` to what this machine does in this many seconds (never more)
    pace_steps: int = 10  # with a budget: steps timed before the fit; at most warmup_steps (module docstring)
    data: list[str] = field(default_factory=list)  # empty = the embedded default corpus
    text_field: str = "text"

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_every", "eval_batches", "omoe_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"train option '{name}' = {v!r}: expected a positive integer")
        for name in ("warmup_steps", "save_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"train option '{name}' = {getattr(self, name)!r}: expected an integer >= 0")
        if self.seq_len is not None and self.seq_len <= 0:
            raise ValueError(f"train option 'seq_len' = {self.seq_len!r}: expected a positive integer")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"train option 'lr' = {self.lr!r}: expected a positive number")
        if self.optimizer not in ("adamw", "omoe"):
            raise ValueError(f"train option 'optimizer' = {self.optimizer!r}: expected 'adamw' or 'omoe'")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"train option 'dtype' = {self.dtype!r}: expected auto, float32 or bfloat16")
        if self.time_budget_s is not None:
            if not (self.time_budget_s > 0 and math.isfinite(self.time_budget_s)):
                raise ValueError(f"train option 'time_budget_s' = {self.time_budget_s!r}: expected a positive number")
            if not 2 <= self.pace_steps <= self.warmup_steps:
                raise ValueError(f"train option 'pace_steps' = {self.pace_steps!r}: expected 2 to warmup_steps "
                                 f"({self.warmup_steps}), so that the fit happens inside the warm-up")


def lr_at(step: int, tc: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to lr * min_lr_ratio at the last step."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps)
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def autocast_dtype(tc: TrainConfig) -> torch.dtype | None:
    if tc.dtype == "bfloat16" or (tc.dtype == "auto" and cpu_has_fast_bf16()):
        return torch.bfloat16
    return None


def lm_loss(model: Transformer, x: torch.Tensor, y: torch.Tensor, amp: torch.dtype | None):
    with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
        out = model(x)
    task = F.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]), y.reshape(-1))
    return task, out


def fit_steps(tc: TrainConfig, step_seconds: list[float], elapsed: float, done: int) -> int:
    """The most steps (at most tc.steps, at least the `done` ones and the warm-up) whose time at the measured
    pace, evaluations included (an evaluation batch costs about a third of a training step: forward only),
    fits in tc.time_budget_s, `elapsed` seconds of which are spent. The pace is the median step time, the
    first step left out (it pays for first-touch allocations)."""
    pace = _pace(step_seconds)
    eval_cost = tc.eval_batches * pace / 3

    def total(n: int) -> float:
        evals = n // tc.eval_every - done // tc.eval_every + (n % tc.eval_every != 0)
        return elapsed + (n - done) * pace + evals * eval_cost

    n = tc.steps
    while n > max(done, tc.warmup_steps) and total(n) > tc.time_budget_s:
        n -= 1
    return n


def _pace(step_seconds: list[float]) -> float:
    return statistics.median(step_seconds[1:] or step_seconds)


@torch.no_grad()
def evaluate(model: Transformer, batches, amp: torch.dtype | None) -> tuple[float, list[torch.Tensor]]:
    """Mean validation loss in nats per token over fixed windows, and each MoE layer's top-1 expert of every
    validation token (the routing fluctuation between two evaluations compares them; X-MoE 4.5)."""
    was_training = model.training
    model.eval()
    losses, top1 = [], []
    for x, y in batches:
        loss, out = lm_loss(model, x, y, amp)
        losses.append(loss.item())
        top1.append([(a.routing.expert_ids[:, 0] if a.routing is not None else a.codes).reshape(-1) for a in out.aux])
    model.train(was_training)
    return sum(losses) / len(losses), [torch.cat(layer).to(torch.int16) for layer in zip(*top1)]


def _make_optimizer(model: Transformer, tc: TrainConfig):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "expert_embeddings" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "expert_embeddings" in n]
    adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tc.lr, betas=(0.9, 0.95),
    )
    if tc.optimizer == "omoe":
        from moeserve.training.omoe import OMoE, OMoEConfig

        return adamw, OMoE(model, adamw, OMoEConfig(every=tc.omoe_every, total_steps=tc.steps))
    return adamw, None


# ---- training state <-> flat tensors (safetensors holds tensors only; nothing is pickled) ------
def _train_state(adamw: torch.optim.Optimizer, omoe: OMoE | None) -> tuple[dict[str, torch.Tensor], dict]:
    sd = adamw.state_dict()
    tensors = {f"adamw.{idx}.{k}": v for idx, st in sd["state"].items() for k, v in st.items()}
    if omoe is not None:
        tensors.update(omoe.state_dict())
    tensors["rng.torch"] = torch.get_rng_state()
    return tensors, {"param_groups": sd["param_groups"]}


def _restore_train_state(adamw, omoe, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, v in tensors.items():
        if key.startswith("adamw."):
            _, idx, name = key.split(".", 2)
            state.setdefault(int(idx), {})[name] = v
    adamw.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    if omoe is not None:
        omoe.load_state_dict({k: v for k, v in tensors.items() if k.startswith("omoe.")})
    torch.set_rng_state(tensors["rng.torch"])


def _read_log(path: Path, before_step: int) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as f:
        return [r for r in map(json.loads, f) if r.get("step", 0) < before_step]


def _write_log(path: Path, records: list[dict]) -> None:
    atomic_write(path, "".join(json.dumps(r) + "\n" for r in records))


@dataclass
class StepLoss:
    """What one step's forward pass gives the loop (run_steps); the task decides how it is computed."""

    task: torch.Tensor  # the task's own loss, logged as "loss"
    total: torch.Tensor  # what is minimised: the task's loss and the auxiliary losses
    record: dict[str, Any]  # the task's fields of the step's log record
    items: int  # tokens or examples in the step, for the record's throughput


def run_steps(tc: TrainConfig, optimizer: torch.optim.Optimizer, parameters: list[torch.Tensor], *, start: int,
              train_seconds: float, records: list[dict], metrics: dict[str, Any],
              forward: Callable[[int], StepLoss], evaluate: Callable[[int, dict], dict[str, str]],
              after_update: Callable[[], None], save: Callable[[int], None], per_s: str,
              fitted: Callable[[TrainConfig], None] | None = None, desc: str = "train", progress: bool = True) -> None:
    """Steps `start`.. of a run: the loop pre-training and fine-tuning share, so that a fix to one is a fix to both.

    Per step: the learning rate, `forward`, a finite-loss check, backward, clipping of `parameters`, the optimizer
    step, `after_update` (constraints); a log record (appended to `records`); every tc.eval_every steps and at the
    end, `evaluate(step, record)` (which adds its results to the record and to `metrics`, and returns the progress
    bar's fields); every tc.save_every steps and at the end, `save(step + 1)`. With `fitted` and a time budget,
    tc.steps is fitted to this machine after tc.pace_steps steps and `fitted` is told (module docstring).
    """
    t_start = time.perf_counter() - train_seconds
    bar = tqdm(initial=start, total=tc.steps, disable=not progress, desc=desc, unit="step", mininterval=1.0,
               dynamic_ncols=True)
    step_seconds: list[float] = []
    for step in range(start, tc.steps):
        t0 = time.perf_counter()
        for g in optimizer.param_groups:
            g["lr"] = lr_at(step, tc)
        out = forward(step)
        if not torch.isfinite(out.total):
            raise FloatingPointError(f"loss became {out.total.item()} at step {step}; lower --lr (now {tc.lr})")
        out.total.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, tc.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        after_update()
        dt = time.perf_counter() - t0
        step_seconds.append(dt)
        if fitted is not None and tc.time_budget_s is not None and step + 1 == tc.pace_steps:
            tc = dataclasses.replace(tc, steps=fit_steps(tc, step_seconds, time.perf_counter() - t_start, step + 1))
            bar.total = tc.steps
            fitted(tc)
            if progress:
                bar.write(f"{desc}: {_pace(step_seconds):.2f} s/step on this machine: {tc.steps} steps fit the "
                          f"{tc.time_budget_s:.0f} s budget")
        rec = {"step": step, "loss": out.task.item(), **out.record, "lr": lr_at(step, tc),
               "grad_norm": grad_norm.item(), per_s: out.items / dt}
        if (step + 1) % tc.eval_every == 0 or step + 1 == tc.steps:
            bar.set_postfix(loss=f"{out.task.item():.3f}", **evaluate(step, rec), refresh=False)
        elif step % 10 == 0:
            bar.set_postfix(loss=f"{out.task.item():.3f}", refresh=False)
        records.append(rec)
        metrics["train_seconds"] = time.perf_counter() - t_start
        if step + 1 == tc.steps or (tc.save_every and (step + 1) % tc.save_every == 0):
            save(step + 1)
        bar.update()
        if step + 1 == tc.steps:  # a fitted run ends before the range it started with
            break
    bar.close()


def train(cfg: MoEConfig, tc: TrainConfig, out: str | Path, *, resume: bool = False, progress: bool = True,
          corpus: Corpus | None = None) -> dict[str, Any]:
    """Train `cfg` for `tc.steps` steps into checkpoint directory `out`; returns the final metrics."""
    # Deterministic kernels (index_add_ is not, by default, across threads) make a run repeatable and a
    # resumed run identical to an uninterrupted one; the setting is restored on the way out.
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return _train(cfg, tc, Path(out), resume, progress, corpus)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)


def _train(cfg: MoEConfig, tc: TrainConfig, out: Path, resume: bool, progress: bool,
           corpus: Corpus | None) -> dict[str, Any]:
    if out.exists() and any(out.iterdir()) and not resume:
        raise FileExistsError(f"{out} already exists and is not empty; pass --resume to continue it, or choose another --out")
    torch.manual_seed(tc.seed)
    seq_len = tc.seq_len or cfg.max_seq_len
    if seq_len > cfg.max_seq_len:
        raise ValueError(f"train option 'seq_len' = {seq_len} exceeds the model's max_seq_len={cfg.max_seq_len}")
    corpus = corpus or load_corpus(tc.data or None, text_field=tc.text_field)
    model = Transformer(cfg)
    adamw, omoe = _make_optimizer(model, tc)
    start, train_seconds = 0, 0.0
    if resume and (out / "config.json").exists():
        ckpt = load_checkpoint(out, load_train_state=True)
        if ckpt.train_state is None:
            raise CheckpointError(f"{out}: has no train_state.safetensors to resume from (a final export?)")
        if ckpt.config != cfg:
            raise CheckpointError(f"{out}/config.json differs from the requested model config; resume with the same flags")
        trained_on = ckpt.manifest.get("recipe", {}).get("corpus_sha256")
        if trained_on != corpus.sha256:
            raise CheckpointError(f"{out} was trained on corpus sha256 {str(trained_on)[:12]}, not on this data "
                                  f"({corpus.sha256[:12]}); resume with the same --data")
        load_into(model, ckpt)
        _restore_train_state(adamw, omoe, ckpt.train_state, ckpt.train_meta)
        start, train_seconds = int(ckpt.train_meta["step"]), float(ckpt.train_meta.get("train_seconds", 0.0))
        if tc.time_budget_s is not None and start >= tc.pace_steps:  # fitted before the interruption: keep it
            tc = dataclasses.replace(tc, steps=int(ckpt.manifest["recipe"]["train"]["steps"]))
    optimizer = omoe or adamw
    amp = autocast_dtype(tc)
    batcher = Batcher(corpus.train, tc.batch_size, seq_len, tc.seed)
    val_batches = eval_batches(corpus.val, tc.batch_size, seq_len, tc.eval_batches)
    unigram = unigram_bits_per_byte(corpus.train, corpus.val)
    log_path = out / LOG_NAME
    records = _read_log(log_path, start)
    recipe = {
        "train": dataclasses.asdict(tc), "corpus_sha256": corpus.sha256, "corpus_sources": corpus.sources,
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "autocast": str(amp).replace("torch.", "") if amp else "float32",
    }
    metrics: dict[str, Any] = {"unigram_bits_per_byte": unigram, "train_seconds": train_seconds}
    for r in records:  # carry the last evaluation across a resume
        if "val_loss" in r:
            metrics.update(val_loss=r["val_loss"], val_bits_per_byte=r["val_bits_per_byte"], step=r["step"])

    # the last evaluation's routing, for the next one's fluctuation; kept in the train state so a resumed
    # run logs what the uninterrupted one does
    last_top1: list[torch.Tensor] = [ckpt.train_state[k] for k in sorted(ckpt.train_state)
                                     if k.startswith(TOP1_PREFIX)] if start else []

    def save(step: int) -> None:
        state, meta = _train_state(adamw, omoe)
        state.update({f"{TOP1_PREFIX}{i:03d}": t for i, t in enumerate(last_top1)})
        meta.update(step=step, train_seconds=metrics.get("train_seconds", 0.0))
        save_checkpoint(out, cfg, model.state_dict(), recipe=recipe, metrics=metrics, train_state=state,
                        train_meta=meta)
        _write_log(log_path, records)

    def forward(step: int) -> StepLoss:
        x, y = batcher.get(step)
        task, out_ = lm_loss(model, x, y, amp)
        aux = aux_losses(out_.aux, cfg)
        return StepLoss(task, task + aux.total(cfg), {
            "balance_loss": aux.balance.item(), "vq_codebook_loss": aux.vq_codebook.item(),
            "vq_commitment_loss": aux.vq_commitment.item(),
            "load_entropy_bits": [round(load_entropy(a.counts), 4) for a in out_.aux]}, x.numel())

    def evaluate_step(step: int, rec: dict) -> dict[str, str]:
        nonlocal last_top1
        val, top1 = evaluate(model, val_batches, amp)
        rec.update(val_loss=val, val_bits_per_byte=bits_per_byte(val))
        if last_top1:
            rec["routing_fluctuation"] = [round(routing_fluctuation(a, b), 4) for a, b in zip(last_top1, top1)]
        last_top1 = top1
        metrics.update(val_loss=val, val_bits_per_byte=bits_per_byte(val), step=step + 1)
        return {"val_bpb": f"{bits_per_byte(val):.3f}"}

    def fitted(fit: TrainConfig) -> None:
        recipe["train"]["steps"] = fit.steps

    model.train()
    run_steps(tc, optimizer, list(model.parameters()), start=start, train_seconds=train_seconds, records=records,
              metrics=metrics, forward=forward, evaluate=evaluate_step, after_update=model.constrain_, save=save,
              per_s="tokens_per_s", fitted=fitted, desc="train", progress=progress)
    return metrics
