"""`moeserve convert`: a checkpoint (a Hugging Face Mixtral directory, typically) written once in moeserve's own
format, whose weights then load as they lie.

A Mixtral directory keeps each expert's w1, w2 and w3 apart; the engine runs a layer's experts stacked, so every
load of it copies the experts into new tensors, while the file's pages it read stay mapped: a 2.6 GB model held
5.2-5.5 GB resident while scoring, against 3.4 GB from its conversion (docs/bench/log.md, issue 44). The converted
directory is a moeserve checkpoint (hashed, `moeserve inspect` reads it) with the source's tokenizer and chat
template files beside it, so that it serves, scores and chats as the source does.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

# what the loaders read beside the weights: the tokenizer (tokenizer.py) and the chat template (chat.py)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def convert(src: str | Path, out: str | Path, dtype: str | None = None, overwrite: bool = False) -> Path:
    """The checkpoint at `src` (any directory `Engine.load` takes), in `dtype` (None: as stored), written to `out`
    as a moeserve checkpoint with the tokenizer files `src` has."""
    from moeserve.checkpoint import CheckpointError, save_checkpoint
    from moeserve.runtime.engine import DTYPES
    from moeserve.runtime.loading import load_model

    out = Path(out)
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} exists; --overwrite replaces it")
    if Path(src).resolve() == out.resolve():
        raise CheckpointError(f"{out}: the output must not be the checkpoint it is converted from")
    model, ckpt = load_model(src, dtype=None if dtype is None else DTYPES[dtype])
    path = save_checkpoint(out, ckpt.config, model.state_dict())
    for name in TOKENIZER_FILES:
        if (ckpt.path / name).is_file():
            shutil.copy2(ckpt.path / name, path / name)
    return path


def add_convert(sub) -> None:
    c = sub.add_parser("convert", help="write a checkpoint (a Hugging Face Mixtral directory) in moeserve's format, "
                       "which loads without copying its experts",
                       description="Load a checkpoint (a Hugging Face Mixtral directory, or a moeserve one) and write "
                       "it as a moeserve checkpoint with its tokenizer and chat template files: a Mixtral's experts "
                       "are stacked once here rather than at every load, so loading reads the file as it lies "
                       "(memory-mapped, no copy).")
    c.add_argument("checkpoint", type=Path, help="the checkpoint directory to convert")
    c.add_argument("--out", type=Path, required=True, help="the directory to write")
    c.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="convert the weights (default: as "
                   "stored)")
    c.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    c.set_defaults(func=cmd_convert)


def cmd_convert(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    path = convert(args.checkpoint, args.out, args.dtype, args.overwrite)
    size = sum(f.stat().st_size for f in path.iterdir() if f.suffix == ".safetensors")
    print(f"wrote {path} ({size / 1e9:.2f} GB of weights) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0
