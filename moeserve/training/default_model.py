"""The built-in default model: trained from the embedded corpus on first use, then cached.

Nothing is downloaded: the corpus is the Python standard library's source, the model the `small`
preset. The cache key covers everything that shapes the weights (model and training configs, the
corpus's identity, the package version), so a changed recipe never serves a stale model. A start with
the model cached reads neither the corpus nor the weights here: the hashes are checked, and the
caller loads the weights once. The number of
steps is fitted to the machine's speed within a time budget (trainer.py), so a slower CPU trains a
shorter run of the same recipe; the checkpoint's recipe records how many steps it got.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import moeserve
from moeserve.cache import cache_root
from moeserve.checkpoint import CheckpointError, verify_checkpoint
from moeserve.config import MoEConfig, preset
from moeserve.training.data import default_corpus_fingerprint, load_corpus
from moeserve.training.trainer import TrainConfig, train

DEFAULT_MODEL_NAME = "moeserve-default"  # the id clients send as `model` to a server of the default model
DEFAULT_PRESET = "small"
DEFAULT_ROUTER = "xmoe"
# save_every: an interrupted first run (Ctrl-C while a user waits) picks up from its last checkpoint.
# time_budget_s: 300 steps where the CPU is fast enough (about 0.7 s/step: AVX512-BF16, bf16 autocast), fewer
# where it is not (1.0-1.3 s/step in fp32 on an AVX2-only EPYC: some 160-200 steps), so that the first start
# takes about 4 minutes on 2 cores of any CPU. The fp32 step is compute-bound (its GEMMs run at the EPYC's
# measured GEMM peak, docs/benchmarks.md), so no faster kernel closes that gap. 210 s, not 240: the pace is
# measured over 10 steps, and a shared VM slowed by 30% for tens of steps after that (a 240 s fit ran 272 s).
DEFAULT_TRAIN = TrainConfig(steps=300, batch_size=16, seq_len=256, lr=3e-3, warmup_steps=30, eval_every=100,
                            save_every=100, time_budget_s=210)


def default_config() -> MoEConfig:
    return preset(DEFAULT_PRESET, router=DEFAULT_ROUTER)


def default_model_dir(root: Path | None = None) -> Path:
    """Where the default checkpoint is (or will be) cached: named by a hash of everything that shapes it."""
    key = json.dumps([moeserve.__version__, default_config().to_dict(), DEFAULT_TRAIN.__dict__,
                      default_corpus_fingerprint()], sort_keys=True)
    return (root or cache_root()) / f"default-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def default_model_path(progress: bool = True, root: Path | None = None) -> Path:
    """The cached default checkpoint, its hashes verified (so a loader may skip that), training it first
    (a few minutes on 2 cores) if absent."""
    cfg, tc = default_config(), DEFAULT_TRAIN
    path = default_model_dir(root)
    if path.exists():
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as e:  # a corrupted cache is rebuilt, not served
            print(f"moeserve: cached default model is unusable ({e}); retraining")
            shutil.rmtree(path)
    partial = path.with_name(path.name + ".partial")
    if progress:
        print(f"moeserve: training the default model ({DEFAULT_PRESET} preset, {DEFAULT_ROUTER} router, "
              f"up to {tc.steps} steps, fitted to about {tc.time_budget_s / 60:.0f} minutes on this machine) into "
              f"{path}; this happens once")
    train(cfg, tc, partial, resume=True, progress=progress, corpus=load_corpus())  # resumes an interrupted first run
    os.replace(partial, path)
    return path
