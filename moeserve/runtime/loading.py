"""From a checkpoint directory (moeserve's, or a Hugging Face Mixtral one) to a Transformer.

checkpoint.py knows the directory format and nothing of the model; this module puts the two together, so
that the dependencies point one way (runtime -> checkpoint, never back). `Engine.load` and `load_engine`
(engine.py) build on it; the trainer resumes through `load_into`.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from moeserve.checkpoint import (
    INDEX_FILE, WEIGHTS_FILE, CheckpointError, LoadedCheckpoint, is_expert_weight, is_hashed, is_quant_state,
    load_checkpoint, verify_checkpoint,
)
from moeserve.runtime.model import ExpertsFactory, Transformer

__all__ = ["load_into", "load_model", "verifying"]


def load_into(model: torch.nn.Module, ckpt: LoadedCheckpoint, *, assign: bool = False,
              keep: Callable[[str], bool] | None = None) -> None:
    """Copy a checkpoint's tensors into `model` (assign: make them the model's own, no copy: the model
    is `Transformer.empty`), naming the tensor at fault instead of torch's bare size-mismatch error: a
    missing, unexpected or wrongly shaped tensor means the weights and config.json disagree, and the
    user needs to know which. `keep(name)`: only the model's tensors it accepts come from the checkpoint (the
    rest, an experts_factory's own slice of the experts, are already in place)."""
    expected = {k: t for k, t in model.state_dict().items() if keep is None or keep(k)}
    where = f"{ckpt.path}/{WEIGHTS_FILE if (ckpt.path / WEIGHTS_FILE).exists() else INDEX_FILE}"
    missing = sorted(set(expected) - set(ckpt.state_dict))
    unexpected = sorted(set(ckpt.state_dict) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{where}: tensors do not match config.json: missing {missing[:5]}"
                              f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                              f"{'...' if len(unexpected) > 5 else ''}")
    for name, t in ckpt.state_dict.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, config.json implies "
                                  f"{tuple(expected[name].shape)}")
    model.load_state_dict(ckpt.state_dict, assign=assign, strict=keep is None)


def load_model(path: str | os.PathLike, *, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = torch.float32, verify: bool = True,
               experts_factory: ExpertsFactory | None = None) -> tuple[Transformer, LoadedCheckpoint]:
    """(Transformer, LoadedCheckpoint) for a checkpoint directory: config, verified weights, model, in
    `dtype` (None: as stored) on `device`. With `experts_factory`, each MoE layer's experts are the
    factory's (an expert-parallel rank's slice: runtime/ep_rank.py) and the checkpoint's expert tensors are
    not read.

    The model takes the checkpoint's tensors as its weights: on a CPU, in the stored dtype, they are
    the memory-mapped file itself (checkpoint.load_checkpoint), so loading reads no byte it does not
    need and holds no second copy; converted or moved, each tensor is copied once."""
    keep = (lambda name: not is_expert_weight(name)) if experts_factory is not None else None
    ckpt = load_checkpoint(path, device=str(device), verify=verify, dtype=dtype, keep=keep)
    stored = next((t.dtype for k, t in ckpt.state_dict.items() if t.is_floating_point() and not is_quant_state(k)),
                  torch.float32)
    model = Transformer.empty(ckpt.config, device, dtype or stored, experts_factory)
    load_into(model, ckpt, assign=True, keep=keep)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # a tensor neither in the checkpoint nor computed by Transformer.empty: a bug here, not the user's
        raise RuntimeError(f"Transformer.empty left {left[:5]} unset; compute them there")
    return model.eval(), ckpt


@contextmanager
def verifying(path: str | os.PathLike, verify: bool = True) -> Iterator[None]:
    """Check the checkpoint's hashes on a thread while the body loads and lays out the model; leaving
    the block waits for the check and raises its CheckpointError, so the body's model is used only if
    the files are intact. hashlib releases the GIL, so the hashing overlaps the loading and the layout
    instead of adding to them. Nothing to check: a Hugging Face directory."""
    if not verify or not is_hashed(path):
        yield
        return
    with ThreadPoolExecutor(1, thread_name_prefix="moeserve-verify") as pool:
        hashes = pool.submit(verify_checkpoint, path)
        try:
            yield
        finally:
            hashes.result()  # a mismatch is the error to report, even when the body failed on the bad bytes
