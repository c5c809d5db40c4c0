"""`moeserve convert`: a checkpoint (a Hugging Face MoE directory, typically) written once in moeserve's own
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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moeserve.runtime.quant import QuantSpec

# what the loaders read beside the weights: the tokenizer (tokenizer.py) and the chat template (chat.py)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def convert(src: str | Path, out: str | Path, dtype: str | None = None, overwrite: bool = False,
            quantize: QuantSpec | None = None) -> Path:
    """The checkpoint at `src` (any directory `Engine.load` takes), in `dtype` (None: as stored), its weights
    quantized where `quantize` says (runtime/quant.py), written to `out` as a moeserve checkpoint with the tokenizer
    files `src` has."""
    from moeserve.checkpoint import CheckpointError, read_config, save_checkpoint
    from moeserve.runtime.engine import DTYPES
    from moeserve.runtime.loading import load_model
    from moeserve.runtime.quant import QuantError, describe, quantize_model_

    out = Path(out)
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} exists; --overwrite replaces it")
    if Path(src).resolve() == out.resolve():
        raise CheckpointError(f"{out}: the output must not be the checkpoint it is converted from")
    stored = read_config(src).quantization if quantize is not None else None
    if stored is not None:  # named before gigabytes are read
        raise QuantError(f"{src} is already quantized ({describe(stored)}); quantize the unquantized checkpoint")
    model, ckpt = load_model(src, dtype=None if dtype is None else DTYPES[dtype])
    if quantize is not None:
        quantize_model_(model, quantize)
    path = save_checkpoint(out, model.cfg, model.state_dict())
    for name in TOKENIZER_FILES:
        if (ckpt.path / name).is_file():
            shutil.copy2(ckpt.path / name, path / name)
    return path


def add_convert(sub) -> None:
    c = sub.add_parser("convert", help="write a checkpoint (a Hugging Face MoE directory) in moeserve's format, "
                       "which loads without copying its experts",
                       description="Load a checkpoint (a Hugging Face MoE directory, or a moeserve one) and write "
                       "it as a moeserve checkpoint with its tokenizer and chat template files: a Mixtral's experts "
                       "are stacked once here rather than at every load, so loading reads the file as it lies "
                       "(memory-mapped, no copy).")
    c.add_argument("checkpoint", type=Path, help="the checkpoint directory to convert")
    c.add_argument("--out", type=Path, required=True, help="the directory to write")
    c.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="convert the weights (default: as "
                   "stored)")
    c.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    c.set_defaults(func=cmd_convert)


def add_quantize(sub) -> None:
    q = sub.add_parser("quantize", help="write a checkpoint with int8 or int4 weights",
                       description="Load a checkpoint (moeserve's or a Hugging Face MoE directory) and write it "
                       "with its linear maps, experts and LM head quantized weight-only: int8 with a scale per output "
                       "channel, or int4 in groups with a float16 scale per group (llama.cpp's Q4_0 rule). The "
                       "embedding, norms and routers stay as they are. The output is a moeserve checkpoint (hashed, "
                       "with the tokenizer beside it) that every command loads as any other.")
    q.add_argument("checkpoint", type=Path, help="the checkpoint directory to quantize")
    q.add_argument("--bits", type=int, required=True, choices=(8, 4), help="8: int8; 4: int4")
    q.add_argument("--group-size", type=int, metavar="G", help="int4: input elements per scale, a multiple of 32 "
                   "dividing every weight's width (default: 32)")
    add_kept_weights(q)
    q.add_argument("--out", type=Path, required=True, help="the directory to write")
    q.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="the weights left in full precision "
                   "(default: as stored)")
    q.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    q.set_defaults(func=cmd_quantize)


def add_kept_weights(parser: argparse.ArgumentParser) -> None:
    """--int8-weights and --int6-weights: what an int4 model keeps at more bits (QuantSpec.parse's lists)."""
    names = "comma-separated among wq, wk, wv, wo, w1, w2, w3 (the dense FFNs') and output (the LM head), or none"
    parser.add_argument("--int8-weights", metavar="NAMES", help=f"int4: the weights kept at int8, {names} (default: "
                        "wk,wv, as llama.cpp's Q4_0 files of 8-expert models keep attn_k and attn_v at Q8_0; a name "
                        "given here leaves --int6-weights' default less that name)")
    parser.add_argument("--int6-weights", metavar="NAMES", help=f"int4: the weights kept at int6 (6.5 bits a weight), "
                        f"{names} (default: output, the LM head, as those files keep the output at Q6_K; a weight "
                        "whose width is not a multiple of 128 is kept at int8 instead; a name given here leaves "
                        "--int8-weights' default less that name)")


def kept_weights(text: str | None) -> tuple[str, ...] | None:
    """--int8-weights' or --int6-weights' names (None: the format's default; 'none': no weight)."""
    if text is None:
        return None
    return () if text.strip() == "none" else tuple(n.strip() for n in text.split(",") if n.strip())


def cmd_quantize(args: argparse.Namespace) -> int:
    from moeserve.runtime.quant import QuantSpec

    spec = QuantSpec.parse(f"int{args.bits}", args.group_size, kept_weights(args.int8_weights),
                           kept_weights(args.int6_weights))
    return _write(args, spec)


def cmd_convert(args: argparse.Namespace) -> int:
    return _write(args, None)


def _write(args: argparse.Namespace, spec) -> int:
    t0 = time.perf_counter()
    path = convert(args.checkpoint, args.out, args.dtype, args.overwrite, spec)
    size = sum(f.stat().st_size for f in path.iterdir() if f.suffix == ".safetensors")
    print(f"wrote {path} ({size / 1e9:.2f} GB of weights) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0
