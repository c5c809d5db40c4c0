"""Parity of an exported graph with the torch model: held-out inputs of several shapes through both,
the absolute difference per output at real (unpadded) positions, and how often each MoE layer's
top-1 expert agrees. The export report (onnx_export.py) is built from this.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from moeserve.export.onnx_graph import expert_output_name
from moeserve.runtime.engine import Engine
from moeserve.runtime.backends.onnx import presents_as_past, session_feed

# fp32 graphs: the same math in another order, ~1e-6 on logits of trained models; past 1e-4 something differs.
TOLERANCE = {"float32": 1e-4, "float16": 5e-2, "bfloat16": 2e-1}


def held_out_shapes(max_seq_len: int) -> list[tuple[int, int]]:
    """Batch 1 and 4 at several lengths; the batch-4 rows are right-padded to unequal lengths."""
    long = min(64, max_seq_len)
    shapes = [(1, 1), (1, min(7, max_seq_len)), (1, long), (4, min(9, max_seq_len)), (4, long)]
    return list(dict.fromkeys(shapes))


def held_out_inputs(batch: int, seq: int, vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded random token ids and a right-padding mask: row b keeps seq, seq - 1, seq / 2, 1, ... tokens."""
    gen = np.random.default_rng(seed)
    ids = gen.integers(0, vocab, size=(batch, seq), dtype=np.int64)
    lengths = [seq, max(1, seq - 1), max(1, seq // 2), 1][:batch] if batch > 1 else [seq]
    mask = np.zeros((batch, seq), dtype=np.int64)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    return ids, mask


@dataclass
class Diff:
    max_abs: float = 0.0
    total: float = 0.0
    count: int = 0

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
        self.max_abs = max(self.max_abs, float(d.max()) if d.size else 0.0)
        self.total += float(d.sum())
        self.count += d.size

    def as_dict(self) -> dict:
        return {"max_abs_diff": self.max_abs, "mean_abs_diff": self.total / max(self.count, 1)}


@dataclass
class Parity:
    shapes: list[tuple[int, int]]
    outputs: dict[str, Diff] = field(default_factory=dict)
    agree: list[int] = field(default_factory=list)  # per MoE layer: tokens whose top-1 expert agrees
    tokens: int = 0

    def top1_agreement(self) -> list[float]:
        return [a / max(self.tokens, 1) for a in self.agree]


def reference_top1(engine: Engine, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(logits, top-1 expert per real token per MoE layer) from the torch model."""
    with torch.inference_mode():
        out = engine.executor.run(ids, attention_mask=mask)
    top1 = [(a.routing.expert_ids[:, 0] if a.routing is not None else a.codes) for a in out.aux]
    return out.logits.float(), top1


def check(session, engine: Engine, seed: int = 0) -> Parity:
    """Run `session` (an onnxruntime InferenceSession of `engine`'s model) and the engine on the same inputs."""
    cfg = engine.cfg
    n_moe = len(engine.cfg.moe_layer_ids)
    parity = Parity(held_out_shapes(cfg.max_seq_len), agree=[0] * n_moe)
    names = [o.name for o in session.get_outputs()]
    cached = any(i.name.startswith("past_") for i in session.get_inputs())

    def run(feed: dict) -> dict:
        return dict(zip(names, session.run(None, feed)))

    for i, (batch, seq) in enumerate(parity.shapes):
        ids, mask = held_out_inputs(batch, seq, cfg.vocab_size, seed + i)
        got = run(session_feed(session, ids, mask))
        ref_logits, ref_top1 = reference_top1(engine, torch.from_numpy(ids), torch.from_numpy(mask))
        real = mask.astype(bool)
        if cfg.task == "classify":
            parity.outputs.setdefault("logits", Diff()).add(got["logits"], ref_logits.numpy())
            parity.outputs.setdefault("probs", Diff()).add(got["probs"], ref_logits.softmax(-1).numpy())
        else:
            parity.outputs.setdefault("logits", Diff()).add(got["logits"][real], ref_logits.numpy()[real])
        parity.tokens += int(real.sum())
        for n in range(n_moe):
            graph_top1 = got[expert_output_name(n)][real][:, 0]
            parity.agree[n] += int((graph_top1 == ref_top1[n].numpy()).sum())
        if cached and seq > 1:
            # each row's last real token as one decode step of all rows on the cache of the others: rows of
            # unequal lengths in one call, as the ONNX runner decodes (a shorter row's padding inside its cache)
            lengths = real.sum(1)
            prompt_mask = (np.arange(seq - 1)[None] < lengths[:, None] - 1).astype(np.int64)
            past = presents_as_past(run(session_feed(session, ids[:, :-1], prompt_mask)))
            rows = np.arange(batch)
            last = ids[rows, lengths - 1][:, None]
            step_mask = np.concatenate([prompt_mask, np.ones((batch, 1), np.int64)], axis=1)
            step = run(session_feed(session, last, step_mask, past, (lengths - 1)[:, None]))["logits"][:, -1]
            parity.outputs.setdefault("logits, cached step", Diff()).add(step, ref_logits.numpy()[rows, lengths - 1])
    return parity
