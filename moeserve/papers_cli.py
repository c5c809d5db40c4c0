"""`moeserve finetune`, `moeserve diagnose` and `moeserve study`: the commands of the papers' own measures
(training/finetune.py, training/diagnostics.py, study.py), kept beside the main CLI (cli.py), which registers them."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_paper_commands(sub) -> None:
    _finetune_parser(sub)
    _diagnose_parser(sub)
    _study_parser(sub)


def cmd_finetune(args: argparse.Namespace) -> int:
    from moeserve.training.finetune import FinetuneConfig, finetune
    from moeserve.training.tasks import load_classification, stdlib_task
    from moeserve.training.trainer import TrainConfig

    if args.data is None and args.test_data is not None:
        raise ValueError("--test-data needs --data (the built-in task has its own test split)")
    data = (stdlib_task() if args.data is None else
            load_classification(args.data, args.test_data, text_field=args.text_field, label_field=args.label_field))
    tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup_steps=min(20, args.steps),
                     weight_decay=0.01, optimizer=args.optimizer, eval_every=args.eval_every,
                     save_every=args.save_every, seed=args.seed, dtype=args.dtype)
    fc = FinetuneConfig(routing=args.routing, vq=args.vq, balance_loss=not args.no_balance_loss,
                        bidirectional=args.bidirectional)
    metrics = finetune(args.checkpoint, data, tc, fc, args.out, resume=args.resume, progress=not args.quiet)
    print(json.dumps({"out": str(args.out), "labels": data.labels, **metrics}, indent=2))
    return 0


def cmd_study(args: argparse.Namespace) -> int:
    from moeserve.study import main as study

    return study(args)


def cmd_diagnose(args: argparse.Namespace) -> int:
    from moeserve.training.diagnostics import diagnose, strict_json, table

    if args.tokens <= 0:
        raise ValueError(f"--tokens {args.tokens}: expected a positive number")
    def log(msg: str) -> None:
        if not args.quiet:
            print(f"moeserve diagnose: {msg}", file=sys.stderr)

    report = diagnose([str(p) for p in args.checkpoints], data=args.data, tokens=args.tokens, seq_len=args.seq_len,
                      log=log)
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(strict_json(report), indent=1, allow_nan=False))
    return 0



def _finetune_parser(sub) -> None:
    f = sub.add_parser("finetune", help="fine-tune a language-model checkpoint into a classifier",
                       description="Fine-tune CKPT (a language model) with a classification head, on JSONL with a "
                       "text and a label per line, or by default on the built-in task (which of 8 standard-library "
                       "packages a snippet of source comes from). --routing frozen freezes routers and experts "
                       "(X-MoE); --vq discrete trains a VQ checkpoint's discrete path only, codebook frozen, and "
                       "saves a discrete model (VQMoE). Same schedule, log, progress bar and --resume as train.")
    f.add_argument("checkpoint", type=Path, help="the pre-trained language-model checkpoint")
    f.add_argument("--out", type=Path, required=True, help="the classification checkpoint to write")
    f.add_argument("--data", help="train JSONL (default: the built-in task)")
    f.add_argument("--test-data", help="test JSONL (default: a deterministic 20%% of --data, by text)")
    f.add_argument("--text-field", default="text")
    f.add_argument("--label-field", default="label", help="strings or integers; stored as the class names")
    f.add_argument("--routing", choices=["trained", "frozen"], default="trained")
    f.add_argument("--vq", choices=["mixed", "discrete"], default="mixed")
    f.add_argument("--no-balance-loss", action="store_true", help="drop the balance loss (kept by default, as "
                   "X-MoE keeps it with frozen routing)")
    f.add_argument("--bidirectional", action="store_true", help="attend both ways (default: the trunk's causal "
                   "attention)")
    f.add_argument("--steps", type=int, default=300)
    f.add_argument("--batch-size", type=int, default=16)
    f.add_argument("--lr", type=float, default=1e-3)
    f.add_argument("--optimizer", choices=["adamw", "omoe"], default="adamw")
    f.add_argument("--eval-every", type=int, default=50, help="test accuracy every N steps (and at the end)")
    f.add_argument("--save-every", type=int, default=0)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    f.add_argument("--resume", action="store_true")
    f.add_argument("--quiet", action="store_true")
    f.set_defaults(func=cmd_finetune)


def _study_parser(sub) -> None:
    st = sub.add_parser("study", help="the three papers' claims measured again: every routing method, several "
                        "seeds, diagnostics and fine-tuning, written to docs/study.md",
                        description="Pre-train softmax, sigmoid, xmoe, vq and xmoe+omoe on the built-in corpus "
                        "with 3 seeds, diagnose each, fine-tune each on the built-in task (full; routing frozen for "
                        "softmax and xmoe; discrete-only for vq) and write a page of tables and plots stating, "
                        "claim by claim, whether the measurement supports it. About an hour on 2 CPU cores; "
                        "--quick runs every step at a toy size in about a minute. Needs matplotlib.")
    st.add_argument("--out", default="docs/study.md", help="the page (default: docs/study.md; the JSON and plots "
                    "go in docs/study/)")
    st.add_argument("--quick", action="store_true", help="the tiny preset, 2 seeds, a few steps: a check, not a "
                    "measurement")
    st.add_argument("--seeds", type=int, help="seeds per recipe (default: 3; 2 with --quick)")
    st.add_argument("--work", help="keep the checkpoints here (default: a temporary directory)")
    st.add_argument("--render", action="store_true", help="only draw the page and plots again from the JSON beside "
                    "--out (docs/study/study.json), after a change to how they are written")
    st.add_argument("--quiet", action="store_true")
    st.set_defaults(func=cmd_study)


def _diagnose_parser(sub) -> None:
    d = sub.add_parser("diagnose", help="the papers' routing and expert measures of checkpoints on the same tokens",
                       description="Per checkpoint and MoE layer: representation collapse RC (X-MoE 4.5), load "
                       "entropy, max/mean load and dead experts, expert diversity (OMoE 4.2: share of parameters "
                       "differing by > 1e-3 between experts, variance of their outputs), VQ code use. Between "
                       "checkpoints: the routing fluctuation ratio of each against the one before it (checkpoints of "
                       "one run, in order) and the inter-run consistency of all (runs with different seeds).")
    d.add_argument("checkpoints", nargs="+", type=Path, metavar="CKPT", help="checkpoint directories")
    d.add_argument("--data", nargs="+", help="text or JSONL files (default: the built-in corpus's validation split)")
    d.add_argument("--tokens", type=int, default=16384, help="tokens routed (default: 16384)")
    d.add_argument("--seq-len", type=int, default=256, help="window length (default: 256, at most the context)")
    d.add_argument("--json", help="write the report here as JSON")
    d.add_argument("--quiet", action="store_true")
    d.set_defaults(func=cmd_diagnose)
