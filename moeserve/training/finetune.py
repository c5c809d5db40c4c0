"""Fine-tuning a pre-trained language-model checkpoint into a classifier, as the papers fine-tune:

  full             every parameter trains (the baseline)
  routing frozen   routers and experts are frozen; the balance loss may stay on (X-MoE 3.3: "we freeze all the
                   parameters of experts, including both the router and expert networks ... we still use load
                   balancing loss", which then trains the trunk that feeds the routers)
  vq discrete      the VQ codebook is frozen and the continuous path and mixing gate are dropped: each token goes
                   to the expert of its code and nowhere else (VQMoE 3.3, eq. 5), so a step runs one expert per
                   token instead of top-k plus one. The checkpoint is a discrete model: `vq_mode` "discrete",
                   which the table fold and the vq-table export take.

The head is the runtime's classify head (mean-pooled final hidden states, one linear layer), so the checkpoint
is served and exported as any classification checkpoint is. The loop is the trainer's (trainer.py): the same
learning-rate schedule, optimizer groups, log file, progress bar and exact resume.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from moeserve.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from moeserve.config import MoEConfig
from moeserve.runtime.loading import load_into, load_model
from moeserve.runtime.model import Transformer
from moeserve.tokenizer import load_checkpoint_tokenizer
from moeserve.training.losses import aux_losses
from moeserve.training.tasks import ClassificationData, Example
from moeserve.training.trainer import (LOG_NAME, StepLoss, TrainConfig, _make_optimizer, _read_log,
                                       _restore_train_state, _train_state, _write_log, autocast_dtype, run_steps)

ROUTING = ("trained", "frozen")
VQ = ("mixed", "discrete")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass
class FinetuneConfig:
    routing: str = "trained"  # frozen: routers and experts keep their pre-trained values (X-MoE)
    vq: str = "mixed"  # discrete: VQ layers run the discrete path only, codebook frozen (VQMoE)
    balance_loss: bool = True  # with frozen routing, the balance loss still trains the trunk (X-MoE)
    bidirectional: bool = False  # attend both ways (an encoder's classifier); default: the trunk's causal attention

    def __post_init__(self) -> None:
        if self.routing not in ROUTING:
            raise ValueError(f"finetune option 'routing' = {self.routing!r}: expected one of {', '.join(ROUTING)}")
        if self.vq not in VQ:
            raise ValueError(f"finetune option 'vq' = {self.vq!r}: expected one of {', '.join(VQ)}")


def classifier_config(base: MoEConfig, labels: list[str], fc: FinetuneConfig) -> MoEConfig:
    """The fine-tuned model's config: the base trunk with a classify head over `labels`."""
    if base.task != "lm":
        raise ValueError(f"the base checkpoint is a '{base.task}' model; fine-tune a language model")
    changes: dict[str, Any] = {"task": "classify", "n_classes": len(labels), "labels": list(labels),
                               "causal": not fc.bidirectional}
    if fc.vq == "discrete":
        if base.router != "vq":
            raise ValueError(f"--vq discrete needs a VQ checkpoint; this one routes with '{base.router}'")
        changes["vq_mode"] = "discrete"
    return base.replace(**changes)


def build_classifier(base: Transformer, cfg: MoEConfig) -> Transformer:
    """A classifier whose trunk is `base`'s weights. Only the head is new; what a discrete VQ layer does not
    have (the continuous router, the mixing gate) and the LM head are left behind."""
    model = Transformer(cfg)
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    dropped = (".ffn.router.", ".ffn.mix.") if cfg.router == "vq" and cfg.vq_mode == "discrete" else ()
    missing = [k for k in missing if not k.startswith("classifier.")]
    unexpected = [k for k in unexpected if k != "output.weight" and not any(d in k for d in dropped)]
    if missing or unexpected:  # the two configs differ only in the head: anything else is a bug here
        raise RuntimeError(f"trunk weights do not match: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return model


def freeze(model: Transformer, fc: FinetuneConfig) -> list[str]:
    """Turn off the gradients the recipe freezes; the names of the frozen parameters. A frozen codebook is also
    marked initialised, so that the quantizer's first-batch initialisation from data never rewrites it."""
    for layer in model.moe_layers:
        if fc.routing == "frozen":
            for part in (layer.router, layer.experts, layer.quantizer, layer.mix):
                if part is not None:
                    part.requires_grad_(False)
        if layer.quantizer is not None and (fc.vq == "discrete" or fc.routing == "frozen"):
            layer.quantizer.codebook.requires_grad_(False)
            layer.quantizer.initialized.fill_(True)
    return [n for n, p in model.named_parameters() if not p.requires_grad]


def encode(tokenizer, examples: list[Example], max_len: int) -> list[list[int]]:
    """Token ids as the engine frames a text to classify (<bos> first), cut to the model's context."""
    return [tokenizer.encode(ex.text, bos=True)[:max_len] for ex in examples]


def pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and their attention mask, as Engine.classify pads."""
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = True
    return ids, mask


class Batches:
    """The train examples in a fresh order each epoch, a pure function of (seed, step) like the LM Batcher, so
    a resumed run sees the same batches as an uninterrupted one."""

    def __init__(self, rows: list[list[int]], labels: list[int], batch_size: int, seed: int):
        self.rows, self.labels, self.batch_size, self.seed = rows, torch.tensor(labels), batch_size, seed

    @functools.lru_cache(maxsize=2)
    def _order(self, epoch: int) -> torch.Tensor:
        return torch.randperm(len(self.rows), generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        idx = [int(self._order(k // len(self.rows))[k % len(self.rows)])
               for k in range(step * self.batch_size, (step + 1) * self.batch_size)]
        ids, mask = pad([self.rows[i] for i in idx])
        return ids, mask, self.labels[idx]


@torch.no_grad()
def evaluate(model: Transformer, rows: list[list[int]], labels: list[int], amp: torch.dtype | None,
             batch_size: int = 64) -> tuple[float, float]:
    """(accuracy, mean cross-entropy in nats) over the test examples."""
    was_training = model.training
    model.eval()
    correct, loss = 0, 0.0
    for b in range(0, len(rows), batch_size):
        ids, mask = pad(rows[b:b + batch_size])
        y = torch.tensor(labels[b:b + batch_size])
        with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
            logits = model(ids, attention_mask=mask).logits.float()
        correct += int((logits.argmax(-1) == y).sum())
        loss += float(F.cross_entropy(logits, y, reduction="sum"))
    model.train(was_training)
    return correct / len(rows), loss / len(rows)


def finetune(base_path: str | Path, data: ClassificationData, tc: TrainConfig, fc: FinetuneConfig,
             out: str | Path, *, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Fine-tune the LM checkpoint at `base_path` on `data` into the classification checkpoint `out`; returns the
    final metrics (test accuracy among them)."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return _finetune(Path(base_path), data, tc, fc, Path(out), resume, progress)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)


def _finetune(base_path: Path, data: ClassificationData, tc: TrainConfig, fc: FinetuneConfig, out: Path,
              resume: bool, progress: bool) -> dict[str, Any]:
    if out.exists() and any(out.iterdir()) and not resume:
        raise FileExistsError(f"{out} already exists and is not empty; pass --resume to continue it, or choose "
                              "another --out")
    if fc.routing == "frozen" and tc.optimizer == "omoe":
        raise ValueError("--routing frozen freezes the experts that OMoE's orthogonal steps update; use adamw")
    torch.manual_seed(tc.seed)
    base, base_ckpt = load_model(base_path)
    cfg = classifier_config(base_ckpt.config, data.labels, fc)
    tokenizer = load_checkpoint_tokenizer(base_path, base_ckpt.config)
    if tokenizer is None:
        raise ValueError(f"{base_path}: has no tokenizer (tokenizer 'none'); fine-tuning reads text")
    model = build_classifier(base, cfg)
    del base
    frozen = freeze(model, fc)
    adamw, omoe = _make_optimizer(model, tc)
    optimizer = omoe or adamw
    start, train_seconds = 0, 0.0
    if resume and (out / "config.json").exists():
        ckpt = load_checkpoint(out, load_train_state=True)
        if ckpt.train_state is None:
            raise CheckpointError(f"{out}: has no train_state.safetensors to resume from")
        was = ckpt.manifest.get("recipe", {})
        if ckpt.config != cfg or was.get("data_sha256") != data.sha256 or was.get("finetune") != dataclasses.asdict(fc):
            raise CheckpointError(f"{out} was fine-tuned from another model, recipe or data; resume with the same "
                                  "flags")
        load_into(model, ckpt)
        _restore_train_state(adamw, omoe, ckpt.train_state, ckpt.train_meta)
        start, train_seconds = int(ckpt.train_meta["step"]), float(ckpt.train_meta.get("train_seconds", 0.0))
    amp = autocast_dtype(tc)
    train_rows = encode(tokenizer, data.train, cfg.max_seq_len)
    test_rows, test_labels = encode(tokenizer, data.test, cfg.max_seq_len), [ex.label for ex in data.test]
    batches = Batches(train_rows, [ex.label for ex in data.train], tc.batch_size, tc.seed)
    recipe = {"train": dataclasses.asdict(tc), "finetune": dataclasses.asdict(fc), "base": str(base_path),
              "base_files": base_ckpt.manifest.get("files", {}), "data": data.source, "data_sha256": data.sha256,
              "labels": data.labels, "frozen_parameters": len(frozen), "torch": torch.__version__,
              "python": platform.python_version(), "autocast": str(amp).replace("torch.", "") if amp else "float32"}
    log_path = out / LOG_NAME
    records = _read_log(log_path, start)
    metrics: dict[str, Any] = {"train_seconds": train_seconds, "train_examples": len(train_rows),
                               "test_examples": len(test_rows)}
    for r in records:
        if "test_accuracy" in r:
            metrics.update(test_accuracy=r["test_accuracy"], test_loss=r["test_loss"], step=r["step"])

    def save(step: int) -> None:
        state, meta = _train_state(adamw, omoe)
        meta.update(step=step, train_seconds=metrics["train_seconds"])
        save_checkpoint(out, cfg, model.state_dict(), recipe=recipe, metrics=metrics, train_state=state,
                        train_meta=meta)
        for name in TOKENIZER_FILES:  # a Hugging Face tokenizer travels with the weights
            if (base_path / name).is_file():
                shutil.copyfile(base_path / name, out / name)
        _write_log(log_path, records)

    loss_cfg = cfg if fc.balance_loss else cfg.replace(balance_alpha=0.0)

    def forward(step: int) -> StepLoss:
        ids, mask, y = batches.get(step)
        with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
            out_ = model(ids, attention_mask=mask)
        task = F.cross_entropy(out_.logits.float(), y)
        aux = aux_losses(out_.aux, cfg)
        return StepLoss(task, task + aux.total(loss_cfg), {"balance_loss": aux.balance.item()}, len(y))

    def evaluate_step(step: int, rec: dict) -> dict[str, str]:
        acc, test_loss = evaluate(model, test_rows, test_labels, amp)
        rec.update(test_accuracy=acc, test_loss=test_loss)
        metrics.update(test_accuracy=acc, test_loss=test_loss, step=step + 1)
        return {"test_acc": f"{acc:.3f}"}

    def after_update() -> None:
        if fc.routing == "trained":  # X-MoE's ||e_i|| constraint rewrites the embeddings: not when they are frozen
            model.constrain_()

    model.train()
    run_steps(tc, optimizer, [p for p in model.parameters() if p.requires_grad], start=start,
              train_seconds=train_seconds, records=records, metrics=metrics, forward=forward, evaluate=evaluate_step,
              after_update=after_update, save=save, per_s="examples_per_s", desc="finetune", progress=progress)
    return metrics
