"""`moeserve serve`: its flags, mapped onto ServeConfig (and, with --ray, ExpertParallelOptions), and the command that
starts the single-process server or the Ray application."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from moeserve.cli_common import (BACKEND_HELP, CALIBRATE_HELP, COMPILE_HELP, QUANTIZE_HELP, calibration_of,
                                 default_checkpoint, field_default)
from moeserve.config import MANIFEST_FILE
from moeserve.runtime import BACKENDS, COMPILE_MODES, GPU_QUANT_FORMATS, QUANT_FORMATS
from moeserve.serve.config import PLACEMENTS, SCHEDULERS, BatchConfig, ExpertParallelOptions, ServeConfig


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The server's configuration from `moeserve serve`'s flags."""
    batch = BatchConfig(max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens,
                        wait_s=args.batch_wait_ms / 1000, max_queue=args.max_queue)
    return ServeConfig(host=args.host, port=args.port, model_name=args.model_name, api_key=args.api_key, batch=batch,
                       request_timeout_s=args.request_timeout, max_body_bytes=args.max_body_bytes,
                       body_timeout_s=args.body_timeout,
                       max_inputs=args.max_inputs, max_tokens=args.max_tokens,
                       max_request_tokens=args.max_request_tokens, expert_metrics=args.expert_metrics,
                       shutdown_timeout_s=args.shutdown_timeout, threads=args.threads, scheduler=args.scheduler,
                       kv_slots=args.kv_slots, prefill_chunk=args.prefill_chunk, chat_template=args.chat_template,
                       profile_dir=args.profile_dir, profile_max_s=args.profile_max_s)


def cmd_serve(args: argparse.Namespace) -> int:
    if args.checkpoint is not None and not (args.ray or args.print_config):
        _hash_ahead(args.checkpoint)  # first, while the imports below take a core for ~2 s
    from moeserve.serve.server import serve

    retired = [flag for dest, flag in RETIRED_FLAGS.items() if getattr(args, dest) is not None]
    if retired:
        raise ValueError(f"{retired[0]} was the shard exchange's, which is retired: serve with --ray "
                         "--expert-parallel N (N ranks, each with 1/N of every MoE layer's experts and its own KV "
                         "cache; see --help)")
    cfg = serve_config(args)
    ray_only = [flag for flag, v in (("--expert-parallel", args.expert_parallel),
                                     ("--data-parallel-groups", args.data_parallel_groups),
                                     ("--cpus-per-rank", args.cpus_per_rank), ("--placement", args.placement),
                                     ("--redundant-experts", args.redundant_experts),
                                     ("--rebalance-every", args.rebalance_every)) if v is not None]
    if ray_only and not (args.ray or args.print_config):
        raise ValueError(f"{ray_only[0]} needs --ray (it places its processes with Ray)")
    if args.profile_dir is not None:  # a directory the traces cannot go to is named now, not at the first stop
        if args.ray:
            raise ValueError("--profile-dir profiles the single-process server's model thread; not with --ray")
        try:
            args.profile_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=args.profile_dir):
                pass
        except OSError as e:
            print(f"moeserve serve: --profile-dir {args.profile_dir}: cannot write there ({e.strerror or e})",
                  file=sys.stderr)
            return 2
    if args.chat_template is not None:  # a bad template is named before the model loads
        from moeserve.chat import ChatTemplate, ChatTemplateError

        try:
            ChatTemplate.from_file(args.chat_template)
        except ChatTemplateError as e:
            print(f"moeserve serve: {e}", file=sys.stderr)
            return 2
    path = args.checkpoint
    onnx = path is not None and (path.suffix == ".onnx" or args.backend == "onnx")  # its config is in the graph
    if path is not None and not onnx:  # a config the runtime cannot run is named now (exit 2), not after the start
        from moeserve.checkpoint import CheckpointError, read_config

        try:
            read_config(path)
        except CheckpointError as e:
            print(f"moeserve serve: {e}", file=sys.stderr)
            return 2
    if path is None:  # the default model: verified here, so the server loads its weights once, unhashed
        from moeserve.training.default_model import DEFAULT_MODEL_NAME

        path, cfg.model_name = default_checkpoint(args.quiet), cfg.model_name or DEFAULT_MODEL_NAME
    if args.ray or args.print_config:
        return _serve_ray(args, path, cfg)
    return serve(path, cfg, dtype=args.dtype, device=args.device, backend=args.backend,
                 calibration=calibration_of(args), compile=args.compile, verify=args.checkpoint is not None,
                 access_log=not args.no_access_log, log_level=args.log_level, quantize=args.quantize)


def _hash_ahead(path: Path) -> None:
    """The checkpoint's files hashed on a thread from now on (cache.hash_ahead), where `path` is a moeserve
    checkpoint directory; anything else is left for the load to name. The manifest is read here rather than
    by checkpoint.py, which imports torch: the very import this hash is meant to run beside."""
    from moeserve.cache import hash_ahead

    try:
        hash_ahead([path / name for name in json.loads((path / MANIFEST_FILE).read_text())["files"]])
    except (OSError, ValueError, KeyError, TypeError):
        return


# The shard exchange's flags (`--ray --expert-shards S`, retired for --expert-parallel N): still parsed, unlisted, so
# that a command line written for it gets a named error and exit 2 rather than argparse's "unrecognized arguments".
RETIRED_FLAGS = {"expert_shards": "--expert-shards", "shard_replicas": "--shard-replicas",
                 "cpus_per_shard": "--cpus-per-shard", "gpus_per_shard": "--gpus-per-shard",
                 "ingress_gpus": "--ingress-gpus", "shard_timeout": "--shard-timeout", "exchange": "--exchange"}


def _serve_ray(args: argparse.Namespace, path: Path, cfg) -> int:
    """`--ray [--expert-parallel N]` (N = 1 when not given: each group one rank with every expert): the flags
    checked (each misuse named), then the groups served (serve/ep_app.py), or their `serve deploy` file printed."""
    ranks = 1 if args.expert_parallel is None else args.expert_parallel
    if args.quantize:
        raise ValueError("--ray: quantize the checkpoint first (moeserve quantize CKPT --bits 8|4 --out DIR): the "
                         "ranks load their experts' integers and scales as stored")
    if path.suffix == ".onnx" or args.backend not in ("auto", "torch") or not path.is_dir():
        raise ValueError("--ray serves a checkpoint directory on torch, not an ONNX export")
    if args.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device {args.device!r} with --ray: expected auto, cpu or cuda (Ray gives each rank its "
                         "own GPU)")
    if args.rebalance_every is not None and not args.redundant_experts:
        raise ValueError("--rebalance-every is --redundant-experts's: give it K copies to place")
    given = {field: v for field, v in (("groups", args.data_parallel_groups), ("placement", args.placement),
                                       ("redundant_experts", args.redundant_experts),
                                       ("rebalance_every", args.rebalance_every)) if v is not None}
    options = ExpertParallelOptions(ranks=ranks, cpus_per_rank=args.cpus_per_rank, compile=args.compile,
                                    **given)  # unset: its defaults
    if options.redundant_experts and ranks == 1:
        raise ValueError("--redundant-experts needs --expert-parallel N >= 2: one rank already holds every expert")
    try:
        from moeserve.serve import ep_app
    except ImportError as e:
        raise ValueError(f"--ray needs Ray Serve: pip install -e '.[ray]' ({e})") from None
    ep_app.check_checkpoint(path, options)  # before Ray starts
    dtype = "float32" if args.dtype == "auto" else args.dtype  # every rank the same: rows cross in it
    if args.print_config:
        import yaml  # a dependency of ray

        print(yaml.safe_dump(ep_app.deploy_config(path, cfg, options, dtype=dtype, device=args.device),
                             sort_keys=False), end="")
        return 0
    return ep_app.run_ep(path, cfg, options, dtype=dtype, device=args.device, access_log=not args.no_access_log,
                         log_level=args.log_level)


def _serve_default(name: str) -> Any:
    return field_default(ServeConfig, name)


def _batch_default(name: str) -> Any:
    return field_default(BatchConfig, name)


def _ep_default(name: str) -> Any:
    return field_default(ExpertParallelOptions, name)


def add_serve(sub) -> None:
    sv = sub.add_parser("serve", help="serve a model over HTTP (no checkpoint: the built-in default model)",
                        description="Serve a checkpoint over HTTP: OpenAI-style /v1/completions and "
                        "/v1/chat/completions (with streaming), /v1/score, /v1/classify, /v1/models, /healthz, /readyz and Prometheus /metrics, with dynamic "
                        "batching. With no checkpoint, the built-in default model (trained on first use, then "
                        "cached). SIGTERM stops intake and lets requests in flight finish.")
    sv.add_argument("checkpoint", type=Path, nargs="?", help="checkpoint, Hugging Face MoE directory (Mixtral, "
                    "Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss), or an exported .onnx file (default: the built-in model)")
    sv.add_argument("--host", default=_serve_default("host"), help="address to bind (default: %(default)s, this "
                    "machine only)")
    sv.add_argument("--port", type=int, default=_serve_default("port"), help="port (default: %(default)s)")
    sv.add_argument("--model-name", help="the model id clients send (default: the checkpoint directory's name; "
                    "moeserve-default for the built-in model)")
    sv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (default: $MOESERVE_API_KEY "
                    "if set, else no auth)")
    sv.add_argument("--dtype", default="auto", help="auto (bf16 where the CPU or GPU is fast at it), float32, bfloat16")
    sv.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: a GPU if there is one)")
    sv.add_argument("--backend", default="auto", choices=BACKENDS, help=BACKEND_HELP)
    sv.add_argument("--quantize", choices=QUANT_FORMATS + GPU_QUANT_FORMATS, help=QUANTIZE_HELP)
    sv.add_argument("--threads", type=int, metavar="N",
                    help="threads for the model (default: one per core): torch's, or an ONNX export's session's "
                         "(torch, which then only samples, gets one)")
    sv.add_argument("--calibrate", action="store_true", help=CALIBRATE_HELP)
    sv.add_argument("--compile", default="auto", choices=COMPILE_MODES,
                    help=COMPILE_HELP + "; with --ray, every rank: a rank of --expert-parallel N > 1 runs its "
                    "graphs in the steps where every rank only decodes (int8 / int4 or redundant experts: eager "
                    "with auto, refused with on)")
    sv.add_argument("--scheduler", default=_serve_default("scheduler"), choices=SCHEDULERS,
                    help="continuous: completions join the running decode steps and leave when done; batch: "
                    "run-to-completion batches, the baseline (default: %(default)s)")
    sv.add_argument("--kv-slots", type=int, default=_serve_default("kv_slots"), metavar="N",
                    help="continuous: sequences generating at once, each a KV cache of the model's context "
                    "(default: %(default)s)")
    sv.add_argument("--prefill-chunk", type=int, metavar="N",
                    help="continuous: prompt tokens per step while others generate; the running sequences' "
                    "tokens share the step's model call (default: 64 on a CPU, 512 on a GPU)")
    sv.add_argument("--chat-template", type=Path, metavar="FILE",
                    help="a Jinja2 chat template for /v1/chat/completions, in place of the checkpoint's own "
                    "(chat_template.jinja, or chat_template in tokenizer_config.json)")
    sv.add_argument("--max-batch-size", type=int, default=_batch_default("max_batch_size"), metavar="N",
                    help="rows per model batch (scoring and classification; completions with --scheduler batch) "
                    "(default: %(default)s)")
    sv.add_argument("--max-batch-tokens", type=int, default=_batch_default("max_batch_tokens"), metavar="N",
                    help="padded tokens per model batch (default: %(default)s)")
    sv.add_argument("--batch-wait-ms", type=float, default=_batch_default("wait_s") * 1000, metavar="MS",
                    help="how long a request may wait for others to join its batch (default: %(default)g)")
    sv.add_argument("--max-queue", type=int, default=_batch_default("max_queue"), metavar="N",
                    help="requests waiting at most; past it, 429 with Retry-After (default: %(default)s)")
    sv.add_argument("--request-timeout", type=float, default=_serve_default("request_timeout_s"), metavar="S",
                    help="seconds from arrival to answer; past it, 504 and the work is dropped (default: %(default)g)")
    sv.add_argument("--max-body-bytes", type=int, default=_serve_default("max_body_bytes"), metavar="N",
                    help=f"413 past this (default: {_serve_default('max_body_bytes') / 2**20:g} MiB)")
    ray = sv.add_argument_group("Ray Serve (pip install -e '.[ray]')")
    ray.add_argument("--ray", action="store_true", help="serve as a Ray Serve application (the cluster at "
                     "$RAY_ADDRESS, else a local Ray): groups of --expert-parallel N rank actors behind one ingress "
                     "(N = 1 when not given: each group one rank with every expert, a plain replica). The ranks "
                     "of a group reach each other on torch.distributed's rendezvous port, which has no "
                     "authentication: keep the cluster's network private (README, Ray)")
    ray.add_argument("--expert-parallel", type=int, metavar="N",
                     help="expert parallelism as vLLM and SGLang serve it: N rank actors in one Ray placement group "
                     "(a GPU each where the cluster has them, NCCL; else CPU bundles, gloo), each with the dense "
                     "layers, its own KV cache and scheduler, and experts [r*E/N, (r+1)*E/N) of every MoE layer, "
                     "exchanging routed tokens inside each MoE layer (torch.distributed all-to-all); N must divide "
                     "the experts. The ingress sends each request to the least loaded rank")
    ray.add_argument("--data-parallel-groups", type=int, metavar="R",
                     help="with --ray: R independent groups of N ranks (replicas), each request served by one "
                     f"(default: {_ep_default('groups')})")
    ray.add_argument("--cpus-per-rank", type=float, metavar="N",
                     help="with --ray on CPUs: each rank's CPU bundle (default: 1, or what the "
                     "ingress leaves, shared, where the cluster has fewer)")
    ray.add_argument("--redundant-experts", type=int, metavar="K",
                     help="with --expert-parallel N >= 2: room on each rank for K copies of other ranks' experts a "
                     "MoE layer, "
                     "the hottest placed from the live load every --rebalance-every steps, each expert's tokens "
                     f"split over its copies (default: {_ep_default('redundant_experts')}, off)")
    ray.add_argument("--rebalance-every", type=int, metavar="M",
                     help="with --redundant-experts: steps with work between two placements (default: "
                     f"{_ep_default('rebalance_every')})")
    ray.add_argument("--placement", choices=PLACEMENTS,
                     help="with --ray: strict-pack keeps a group on one node; pack lets it span nodes "
                     f"where one node cannot hold it (default: {_ep_default('placement')})")
    for dest, flag in RETIRED_FLAGS.items():  # named errors, not listed (RETIRED_FLAGS)
        ray.add_argument(flag, dest=dest, metavar="X", help=argparse.SUPPRESS)
    ray.add_argument("--print-config", action="store_true",
                     help="print a Ray Serve config file for `serve deploy` on a cluster (the same application: "
                     "its ingress, and its groups' options, from which the ingress makes their placement groups), "
                     "and exit")
    sv.add_argument("--body-timeout", type=float, default=_serve_default("body_timeout_s"), metavar="S",
                    help="408 when a request's body stalls this long (default: %(default)g)")
    sv.add_argument("--max-inputs", type=int, default=_serve_default("max_inputs"), metavar="N",
                    help="prompts or texts per request (default: %(default)s)")
    sv.add_argument("--max-tokens", type=int, metavar="N", help="largest max_tokens accepted (default: the context)")
    sv.add_argument("--max-request-tokens", type=int, default=_serve_default("max_request_tokens"), metavar="N",
                    help="model work one request may ask for, in tokens: prompt plus max_tokens of each sequence, "
                    "every window of each scored text; past it, 413 before anything runs (default: %(default)s)")
    sv.add_argument("--expert-metrics", action=argparse.BooleanOptionalAction, default=None,
                    help="per-(layer, expert) routed-token series (default: on unless layers x experts > 4096)")
    sv.add_argument("--shutdown-timeout", type=float, default=_serve_default("shutdown_timeout_s"), metavar="S",
                    help="on SIGTERM, seconds for requests in flight to finish (default: %(default)g)")
    sv.add_argument("--profile-dir", type=Path, metavar="DIR",
                    help="turn on POST /start_profile and POST /stop_profile (the bearer token as on /v1/*): a torch "
                    "profiler trace of the model thread's steps between the two (CUDA kernels included on a GPU), "
                    "its operator table and a summary of where each step's time went, written to DIR (default: off)")
    sv.add_argument("--profile-max-s", type=float, default=_serve_default("profile_max_s"), metavar="S",
                    help="a profile not stopped ends, written, after S seconds: it holds every op in memory until "
                    "then, ~0.5 GB a second of a busy step loop, and its stop pauses the model thread about a second "
                    "a second profiled (default: %(default)g)")
    sv.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    sv.add_argument("--no-access-log", action="store_true", help="no line per request")
    sv.add_argument("--quiet", action="store_true", help="no progress bar while training the default model")
    sv.set_defaults(func=cmd_serve)
