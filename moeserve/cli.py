"""The `moeserve` command. Each subcommand maps its flags onto a config dataclass and calls the
library; errors a user can cause print one line naming what is wrong and exit with status 2."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from pathlib import Path
from typing import Iterator

from moeserve.bench.cli import add_bench
from moeserve.cli_common import (BACKEND_HELP, CALIBRATE_HELP, COMPILE_HELP, QUANTIZE_HELP, calibration_of,
                                 default_checkpoint)
from moeserve.convert import add_convert, add_quantize
from moeserve.papers_cli import add_paper_commands
from moeserve.config import PRESETS, ROUTERS, ConfigError, preset
from moeserve.export import MODES
from moeserve.runtime import BACKENDS, COMPILE_MODES, GPU_QUANT_FORMATS, QUANT_FORMATS
from moeserve.cli_serve import add_serve

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError,
                                                PermissionError)


def _parse_set(items: list[str]) -> dict:
    """--set FIELD=VALUE, VALUE read as JSON when it parses (numbers, true, null, lists), else a string."""
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected FIELD=VALUE, e.g. --set d_model=128")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            out[k.strip()] = v
    return out


def cmd_train(args: argparse.Namespace) -> int:
    from moeserve.training.trainer import TrainConfig, train

    overrides = {"router": args.router, **_parse_set(args.set)}
    for flag, field in (("top_k", "top_k"), ("experts", "n_experts"), ("xmoe_gate", "xmoe_gate"),
                        ("vq_mode", "vq_mode"), ("vq_input", "vq_input")):
        if getattr(args, flag) is not None:
            overrides[field] = getattr(args, flag)
    cfg = preset(args.preset, **overrides)
    tc = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, optimizer=args.optimizer,
        omoe_every=args.omoe_every, eval_every=args.eval_every, save_every=args.save_every, seed=args.seed,
        dtype=args.dtype, data=args.data or [], text_field=args.text_field, time_budget_s=args.time_budget,
    )
    metrics = train(cfg, tc, args.out, resume=args.resume, progress=not args.quiet)
    print(json.dumps({"out": str(args.out), **metrics}, indent=2))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from moeserve.checkpoint import describe

    print(describe(args.checkpoint))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from moeserve.runtime.engine import load_engine

    path = args.checkpoint if args.checkpoint is not None else default_checkpoint(args.quiet)
    engine = load_engine(path, args.backend, dtype=args.dtype, calibration=calibration_of(args),
                         verify=args.checkpoint is not None, compile=args.compile, quantize=args.quantize)
    if engine.cfg.task != "lm":
        raise ValueError(f"{path} is a '{engine.cfg.task}' model; generate needs a language model")
    text = engine.generate(args.prompt, args.max_tokens, args.temperature, top_k=args.top_k, top_p=args.top_p,
                           seed=args.seed)[0]
    print(args.prompt + text)
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    from moeserve.scoring import ScoreConfig, score_file

    cfg = ScoreConfig(
        input=args.input, output=args.output, format=args.format, text_field=args.text_field, id_field=args.id_field,
        dtype=args.dtype, device=args.device, backend=args.backend, quantize=args.quantize, batch_size=args.batch_size,
        batch_tokens=args.batch_tokens, stride=args.stride, chunk_size=args.chunk_size, resume=args.resume,
        overwrite=args.overwrite, progress=not args.quiet,
    )
    def log(msg: str) -> None:
        print(f"moeserve score: {msg}", file=sys.stderr)

    if _foreign_directory(args.checkpoint):
        log(f"{args.checkpoint} is a Hugging Face directory, whose experts are restacked in memory at every load; "
            f"`moeserve convert {args.checkpoint} --out DIR` once writes them as they run, so that DIR loads without "
            f"the copies (less memory, a faster start)")
    if args.ray:
        from moeserve.scoring_ray import score_file_ray  # ray is an optional dependency

        summary = score_file_ray(args.checkpoint, cfg, args.workers, log=log)
    elif args.workers is not None:
        raise ValueError("--workers is for a Ray run: pass --ray too")
    else:
        summary = score_file(args.checkpoint, cfg, log=log)
    if summary.already_complete:
        print(f"moeserve score: {summary.output} is already complete ({summary.records} records); nothing to do",
              file=sys.stderr)
    else:
        print(f"moeserve score: scored {summary.scored}, errors {summary.errors} -> {summary.output}", file=sys.stderr)
    return 0


def cmd_export_onnx(args: argparse.Namespace) -> int:
    from moeserve.export.onnx_export import ParityError, export_onnx

    path = args.checkpoint if args.checkpoint is not None else default_checkpoint(args.quiet)
    try:
        report = export_onnx(path, args.out, args.mode, kv_cache=args.kv_cache, log=_stderr_log("export", args.quiet))
    except ParityError as e:
        print(f"moeserve export: {e}", file=sys.stderr)
        return 1
    print(report.summary())
    return 0


def cmd_export_tensorrt(args: argparse.Namespace) -> int:
    from moeserve.export.tensorrt import export_tensorrt

    path = args.model if args.model is not None else default_checkpoint(args.quiet)
    report = export_tensorrt(path, args.out, args.precision, max_batch=args.max_batch, max_seq=args.max_seq,
                             log=_stderr_log("export", args.quiet))
    print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


def _stderr_log(command: str, quiet: bool):
    return (lambda msg: None) if quiet else (lambda msg: print(f"moeserve {command}: {msg}", file=sys.stderr))


def build_parser() -> argparse.ArgumentParser:
    from moeserve import __version__

    p = argparse.ArgumentParser(prog="moeserve", description="Train, inspect and run sparse Mixture-of-Experts models.")
    p.add_argument("--version", action="version", version=f"moeserve {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(sub)
    _add_inspect(sub)
    _add_generate(sub)
    add_serve(sub)
    _add_export(sub)
    _add_score(sub)
    add_convert(sub)
    add_quantize(sub)
    add_paper_commands(sub)
    add_bench(sub, CALIBRATE_HELP)
    return p


def _add_train(sub) -> None:
    t = sub.add_parser("train", help="train an MoE language model and write a checkpoint",
                       description="Train an MoE language model (byte-level) and write a checkpoint directory.")
    t.add_argument("--preset", default="small", choices=sorted(PRESETS), help="model size (default: small)")
    t.add_argument("--router", default="softmax", choices=ROUTERS, help="routing method (default: softmax)")
    t.add_argument("--optimizer", default="adamw", choices=("adamw", "omoe"), help="adamw, or OMoE around AdamW")
    t.add_argument("--data", nargs="+", metavar="FILE", help="text or JSONL files (default: the embedded corpus, "
                   "the Python standard library's source)")
    t.add_argument("--text-field", default="text", help="JSONL field holding the text (default: text)")
    t.add_argument("--steps", type=int, default=300, help="optimizer steps (default: 300)")
    t.add_argument("--time-budget", type=float, metavar="S", help="fit the run to this machine: after 10 timed steps, "
                   "train only as many of --steps as fit in S seconds (the learning-rate schedule is that of the "
                   "shorter run; the checkpoint's recipe records it)")
    t.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    t.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's context)")
    t.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: 3e-3)")
    t.add_argument("--omoe-every", type=int, default=5, help="OMoE: every N-th step is an orthogonal step")
    t.add_argument("--eval-every", type=int, default=100, help="steps between validation runs")
    t.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: at the end only)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="auto: bf16 autocast where the CPU has AMX/AVX512-BF16")
    t.add_argument("--top-k", type=int, help="experts per token")
    t.add_argument("--experts", type=int, help="experts per MoE layer")
    t.add_argument("--xmoe-gate", choices=("softmax", "sigmoid"), help="X-MoE gate function")
    t.add_argument("--vq-mode", choices=("mixed", "discrete"), help="VQ layer form")
    t.add_argument("--vq-input", choices=("code", "blend"), help="what the VQ-chosen expert sees")
    t.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="set any MoEConfig field, e.g. --set d_model=128 --set moe_layers=[1,3]")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_train)


def _add_inspect(sub) -> None:
    i = sub.add_parser("inspect", help="print a checkpoint's config, sizes, hashes and recipe")
    i.add_argument("checkpoint", type=Path)
    i.set_defaults(func=cmd_inspect)


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="continue a prompt (no checkpoint: the built-in default model)")
    g.add_argument("checkpoint", type=Path, nargs="?", help="checkpoint directory or exported .onnx file (default: "
                   "the built-in model, trained on first use and cached)")
    g.add_argument("--prompt", default="def ", help="text to continue")
    g.add_argument("--max-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: 0.8)")
    g.add_argument("--top-k", type=int, default=40, help="sample from the k likeliest tokens (default: 40)")
    g.add_argument("--top-p", type=float, help="sample from the smallest set of tokens with this much probability")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default="auto", help="auto (bf16 where the CPU or GPU is fast at it), float32, bfloat16")
    g.add_argument("--backend", default="auto", choices=BACKENDS, help=BACKEND_HELP)
    g.add_argument("--quantize", choices=QUANT_FORMATS + GPU_QUANT_FORMATS, help=QUANTIZE_HELP)
    g.add_argument("--calibrate", action="store_true", help=CALIBRATE_HELP)
    g.add_argument("--compile", default="auto", choices=COMPILE_MODES, help=COMPILE_HELP)
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.set_defaults(func=cmd_generate)


def _add_export(sub) -> None:
    ex = sub.add_parser("export", help="export a checkpoint: ONNX (portable, fused, vq-table) or a TensorRT engine",
                        description="Export a checkpoint and check the result against the torch model on held-out "
                        "inputs; every export writes OUT.report.json and fails (writing no model) past tolerance.")
    exsub = ex.add_subparsers(dest="format", required=True, metavar="FORMAT")
    eo = exsub.add_parser("onnx", help="ONNX graph: input ids -> logits (and class probabilities), expert ids",
                          description="Write the forward graph (dynamic batch and sequence axes; inputs input_ids "
                          "and a right-padding attention_mask) in one of three modes. portable: standard operators "
                          "only, inside TensorRT's ONNX parser's set. fused: each router as a few nodes feeding ONNX "
                          "Runtime's com.microsoft MoE operator (layers it cannot express stay portable; the report "
                          "says why). vq-table: VQ code layers as nearest code + a row of the precomputed table.")
    eo.add_argument("checkpoint", type=Path, nargs="?", help="checkpoint directory (default: the built-in model)")
    eo.add_argument("--out", type=Path, required=True, metavar="FILE", help="the .onnx file to write")
    eo.add_argument("--mode", default="portable", choices=MODES, help="graph form (default: portable)")
    eo.add_argument("--kv-cache", action="store_true", help="a decoding graph: past_key.N / past_value.N inputs, "
                    "present_* outputs (language models; serve and generate then decode one token per step)")
    eo.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    eo.set_defaults(func=cmd_export_onnx)
    et = exsub.add_parser("tensorrt", help="TensorRT engine from the portable graph (needs a CUDA GPU and tensorrt)",
                          description="Build a serialized TensorRT engine from the portable ONNX graph with one "
                          "optimisation profile, run it on held-out inputs and compare with ONNX Runtime. Needs a "
                          "CUDA GPU and the tensorrt package; without them it says which is missing and exits 2.")
    et.add_argument("model", type=Path, nargs="?", help="checkpoint directory or a portable .onnx export "
                    "(default: the built-in model)")
    et.add_argument("--out", type=Path, required=True, metavar="FILE", help="the engine file to write")
    et.add_argument("--precision", default="fp16", choices=("fp32", "fp16", "bf16"),
                    help="fp32, fp16 (default) or bf16; max abs tolerance on logits 1e-4, 5e-2, 2e-1")
    et.add_argument("--max-batch", type=int, default=8, metavar="N", help="largest batch of the profile (default: 8)")
    et.add_argument("--max-seq", type=int, metavar="N", help="longest sequence of the profile (default: the context)")
    et.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    et.set_defaults(func=cmd_export_tensorrt)


def _foreign_directory(path: Path | None) -> bool:
    """Whether `path` is a checkpoint in another format (a Hugging Face directory) that loads with copies."""
    from moeserve.checkpoint import CheckpointError, is_hashed

    try:
        return path is not None and path.is_dir() and not is_hashed(path)
    except (CheckpointError, OSError):
        return False  # loading it says what is wrong


def _batch_tokens(value: str) -> int | None:
    """`--batch-tokens`: auto (None: measured, batch_size.py) or a count (ScoreConfig checks its range)."""
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected auto or a number of tokens") from None


def _add_score(sub) -> None:
    s = sub.add_parser("score", help="score a file of texts: log-probability and bits per byte, one JSON line each",
                       description="Score every record of a JSONL or text file with a language model: one output "
                       "line per record, in input order, keyed by its id; a bad record gives an error line and the "
                       "run goes on. The output is written to OUTPUT.partial and renamed when complete; an "
                       "interrupted run continues with --resume and writes exactly what an uninterrupted one would.")
    s.add_argument("checkpoint", type=Path, help="checkpoint directory or exported .onnx file (a language model)")
    s.add_argument("--input", type=Path, required=True, metavar="FILE",
                   help="JSONL (one object per line) or text (one record per non-blank line) file")
    s.add_argument("--output", type=Path, required=True, metavar="FILE",
                   help="JSONL file to write: {id, logprob, n_tokens, bits_per_byte, windows} or {id, error} per record")
    s.add_argument("--format", default="auto", choices=("auto", "jsonl", "text"),
                   help="input format (default: auto: .jsonl and .json are JSONL, anything else text)")
    s.add_argument("--text-field", default="text", metavar="NAME",
                   help="JSONL field holding the text (default: text)")
    s.add_argument("--id-field", default="id", metavar="NAME", help="JSONL field holding the id (default: id; "
                   "without it, the 1-based line number)")
    s.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "auto"),
                   help="weights and activations (default: float32, for reproducible scores; auto: bf16 on GPUs "
                   "and CPUs with fast bf16)")
    s.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: auto: a GPU if there is one)")
    s.add_argument("--backend", default="auto", choices=BACKENDS, help=BACKEND_HELP)
    s.add_argument("--quantize", choices=QUANT_FORMATS + GPU_QUANT_FORMATS, help=QUANTIZE_HELP)
    s.add_argument("--batch-size", type=int, default=64, metavar="N", help="most rows per forward pass (default: 64)")
    s.add_argument("--batch-tokens", type=_batch_tokens, default=None, metavar="N|auto",
                   help="most tokens per forward pass, padding included. auto (the default): chosen from the run's "
                   "measured tokens/s, doubling from 2048 while a doubling gains 5%%, at most 16384")
    s.add_argument("--stride", type=int, default=None, metavar="N",
                   help="a text longer than the model's context is scored in windows of the context, each scoring "
                   "the N tokens past the last (default: half the context). Smaller: more context per token, "
                   "more windows; context - 1: disjoint windows, as lm-evaluation-harness")
    s.add_argument("--chunk-size", type=int, default=256, metavar="N", help="records per committed chunk; batches "
                   "are formed within a chunk, sorted by length (default: 256)")
    again = s.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue an interrupted run from OUTPUT.partial "
                       "(refused if the input or settings differ)")
    again.add_argument("--overwrite", action="store_true",
                       help="start again even if OUTPUT or OUTPUT.partial exists (OUTPUT is replaced at the end)")
    s.add_argument("--ray", action="store_true", help="score on Ray Data workers: the cluster at $RAY_ADDRESS, "
                   "else a local Ray; the same output, line for line (needs pip install -e '.[ray]')")
    s.add_argument("--workers", type=int, default=None, metavar="N", help="with --ray: scoring actors, each "
                   "loading the model once (default: one per GPU of the cluster, else one per CPU)")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_score)


@contextlib.contextmanager
def _runtime_log_to_stderr(quiet: bool) -> Iterator[None]:
    """What the runtime reports while it loads (a calibration, the first time a model's shape is met) goes to
    stderr, apart from the command's output, for the length of the command only."""
    log = logging.getLogger("moeserve.runtime")
    if quiet:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("moeserve: %(message)s"))
    level, propagate = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # the server's own logging config would print it twice
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = ["moeserve", *(sys.argv[1:] if argv is None else argv)]  # what a bench report records
    from moeserve.checkpoint import CheckpointError

    try:
        with _runtime_log_to_stderr(quiet=getattr(args, "quiet", False)):
            return args.func(args)
    except (CheckpointError, *USER_ERRORS) as e:
        print(f"moeserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        hint = {"train": "; the last checkpoint (--save-every) continues with --resume",
                "score": "; rerun with --resume to continue from the last completed chunk",
                "generate": "; rerun to continue training the default model from its last checkpoint",
                "serve": "; rerun to continue training the default model from its last checkpoint"}
        print(f"moeserve {args.command}: interrupted{hint.get(args.command, '')}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
