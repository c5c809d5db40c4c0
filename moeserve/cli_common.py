"""What the `moeserve` command's modules share (cli.py, cli_serve.py): the help of flags several commands take, and
the defaults and helpers behind them."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

BACKEND_HELP = "torch (a checkpoint directory) or onnx (a file from `moeserve export onnx`); default: auto, by the path"
CALIBRATE_HELP = ("measure again which weight layout and dispatch path are fastest on this machine for this model's "
                  "shapes (measured once and cached otherwise; MOESERVE_CALIBRATION=off skips it)")
QUANTIZE_HELP = ("quantize the weights as they load: int8 (a scale per output channel) or int4 (groups of 32), or fp8 "
                 "(e4m3, a scale per output channel; GPUs of compute capability 8.9+ only); the embedding, norms and "
                 "routers stay in full precision. `moeserve quantize` writes an int8 or int4 checkpoint once instead")
COMPILE_HELP = ("the decode step as one compiled graph per batch size (torch.compile; CUDA graphs on a GPU): on, off, "
                "or auto (default): on a GPU only, since on a CPU building it takes ~12 s per batch size at start-up")


def calibration_of(args: argparse.Namespace) -> str | None:
    """--calibrate: measure again; else None, which leaves it to $MOESERVE_CALIBRATION (default auto)."""
    return "redo" if args.calibrate else None


def default_checkpoint(quiet: bool) -> Path:
    from moeserve.training.default_model import default_model_path

    return default_model_path(progress=not quiet)


def field_default(cls: type, name: str) -> Any:
    """A config dataclass field's default: a flag shows and uses the library's own, never a copy that drifts."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default
