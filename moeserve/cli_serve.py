"""`moeserve serve`: its flags, mapped onto ServeConfig (and, with --ray, RayServeOptions or ExpertParallelOptions),
and the command that starts the single-process server or the Ray application."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from moeserve.cli_common import (BACKEND_HELP, CALIBRATE_HELP, COMPILE_HELP, QUANTIZE_HELP, calibration_of,
                                 default_checkpoint, field_default)
from moeserve.config import MANIFEST_FILE
from moeserve.runtime import BACKENDS, COMPILE_MODES, GPU_QUANT_FORMATS, QUANT_FORMATS
from moeserve.serve.config import (EXCHANGES, PLACEMENTS, SCHEDULERS, BatchConfig, ExpertParallelOptions,
                                   RayServeOptions, ServeConfig)


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
                       kv_slots=args.kv_slots, prefill_chunk=args.prefill_chunk, chat_template=args.chat_template)


def cmd_serve(args: argparse.Namespace) -> int:
    if args.checkpoint is not None and not (args.ray or args.print_config):
        _hash_ahead(args.checkpoint)  # first, while the imports below take a core for ~2 s
    from moeserve.serve.server import serve

    cfg = serve_config(args)
    ray_only = [flag for flag, v in (("--expert-parallel", args.expert_parallel),
                                     ("--data-parallel-groups", args.data_parallel_groups),
                                     ("--expert-shards", args.expert_shards)) if v is not None]
    if ray_only and not (args.ray or args.print_config):
        raise ValueError(f"{ray_only[0]} needs --ray (it places its processes with Ray)")
    if args.chat_template is not None:  # a bad template is named before the model loads
        from moeserve.chat import ChatTemplate, ChatTemplateError

        try:
            ChatTemplate.from_file(args.chat_template)
        except ChatTemplateError as e:
            print(f"moeserve serve: {e}", file=sys.stderr)
            return 2
    path = args.checkpoint
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


SHARD_FLAGS = {"expert_shards": "--expert-shards", "shard_replicas": "--shard-replicas",
               "cpus_per_shard": "--cpus-per-shard", "gpus_per_shard": "--gpus-per-shard",
               "ingress_gpus": "--ingress-gpus", "shard_timeout_s": "--shard-timeout", "exchange": "--exchange"}
SHARD_ARGS = {"shard_timeout_s": "shard_timeout"}  # the argparse names that differ from the field's


def _serve_ray(args: argparse.Namespace, path: Path, cfg) -> int:
    from moeserve.checkpoint import read_config

    given = {field: getattr(args, SHARD_ARGS.get(field, field)) for field in SHARD_FLAGS}
    given = {field: v for field, v in given.items() if v is not None}
    if args.data_parallel_groups is not None and args.expert_parallel is None:
        raise ValueError("--data-parallel-groups needs --expert-parallel N (groups of N ranks)")
    if args.expert_parallel is not None:
        return _serve_expert_parallel(args, path, cfg, given)
    if any(v is not None for v in (args.placement, args.cpus_per_rank, args.redundant_experts, args.rebalance_every)):
        raise ValueError("--placement, --cpus-per-rank, --redundant-experts and --rebalance-every are "
                         "--expert-parallel's")
    if args.quantize or (path.is_dir() and read_config(path).quantization is not None):
        raise ValueError("--ray: the expert shards hold float weights; serve a quantized model without --ray, or "
                         "with --expert-parallel")
    try:
        from moeserve.serve import ray_app
    except ImportError as e:
        raise ValueError(f"--ray needs Ray Serve: pip install -e '.[ray]' ({e})") from None
    if path.suffix == ".onnx" or args.backend == "onnx":
        raise ValueError("--ray serves a checkpoint directory on torch, not an ONNX export")
    opts = RayServeOptions(**given)
    dtype = "float32" if args.dtype == "auto" else args.dtype  # auto is resolved per device; shards share one
    device = "cuda" if opts.ingress_gpus else "cpu"
    if args.print_config:
        import yaml  # a dependency of ray

        print(yaml.safe_dump(ray_app.deploy_config(path, cfg, opts, dtype=dtype, device=device), sort_keys=False),
              end="")
        return 0
    return ray_app.run(path, cfg, opts, dtype=dtype, device=device, access_log=not args.no_access_log,
                       log_level=args.log_level)


def _serve_expert_parallel(args: argparse.Namespace, path: Path, cfg, shard_flags: dict) -> int:
    """`--ray --expert-parallel N`: the flags checked (each misuse named), then the groups served (serve/ep_app.py)."""
    if shard_flags:
        field = next(iter(shard_flags))
        raise ValueError(f"{SHARD_FLAGS[field]} is the shard exchange's; --expert-parallel replaces it (drop one)")
    if args.quantize:
        raise ValueError("--expert-parallel: quantize the checkpoint first (moeserve quantize CKPT --bits 8|4 --out "
                         "DIR): the ranks load their experts' integers and scales as stored")
    if path.suffix == ".onnx" or args.backend not in ("auto", "torch") or not path.is_dir():
        raise ValueError("--expert-parallel serves a checkpoint directory on torch, not an ONNX export")
    if args.print_config:
        raise ValueError("--print-config is not written for --expert-parallel yet (issue 38)")
    if args.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device {args.device!r} with --expert-parallel: expected auto, cpu or cuda (Ray gives "
                         "each rank its own GPU)")
    if args.rebalance_every is not None and not args.redundant_experts:
        raise ValueError("--rebalance-every is --redundant-experts's: give it K copies to place")
    options = ExpertParallelOptions(ranks=args.expert_parallel, groups=args.data_parallel_groups or 1,
                                    gpus=args.device == "cuda", cpus_per_rank=args.cpus_per_rank,
                                    placement=args.placement or "strict-pack",
                                    redundant_experts=args.redundant_experts or 0,
                                    rebalance_every=args.rebalance_every or 64)
    try:
        from moeserve.serve import ep_app
    except ImportError as e:
        raise ValueError(f"--ray needs Ray Serve: pip install -e '.[ray]' ({e})") from None
    ep_app.check_checkpoint(path, options)  # before Ray starts
    dtype = "float32" if args.dtype == "auto" else args.dtype  # every rank the same: rows cross in it
    return ep_app.run_ep(path, cfg, options, dtype=dtype, gpus_if_there=args.device == "auto",
                         access_log=not args.no_access_log, log_level=args.log_level)


def _serve_default(name: str) -> Any:
    return field_default(ServeConfig, name)


def _batch_default(name: str) -> Any:
    return field_default(BatchConfig, name)


def _ray_default(name: str) -> Any:
    return field_default(RayServeOptions, name)


def add_serve(sub) -> None:
    sv = sub.add_parser("serve", help="serve a model over HTTP (no checkpoint: the built-in default model)",
                        description="Serve a checkpoint over HTTP: OpenAI-style /v1/completions and "
                        "/v1/chat/completions (with streaming), /v1/score, /v1/classify, /v1/models, /healthz, /readyz and Prometheus /metrics, with dynamic "
                        "batching. With no checkpoint, the built-in default model (trained on first use, then "
                        "cached). SIGTERM stops intake and lets requests in flight finish.")
    sv.add_argument("checkpoint", type=Path, nargs="?", help="checkpoint or Hugging Face Mixtral directory, or an "
                    "exported .onnx file (default: the built-in model)")
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
    sv.add_argument("--threads", type=int, metavar="N", help="torch threads for the model (default: one per core)")
    sv.add_argument("--calibrate", action="store_true", help=CALIBRATE_HELP)
    sv.add_argument("--compile", default="auto", choices=COMPILE_MODES, help=COMPILE_HELP)
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
                     "$RAY_ADDRESS, else a local Ray): with --expert-parallel N, groups of N ranks; else the older "
                     "shard exchange (--expert-shards)")
    ray.add_argument("--expert-parallel", type=int, metavar="N",
                     help="expert parallelism as vLLM and SGLang serve it: N rank actors in one Ray placement group "
                     "(a GPU each where the cluster has them, NCCL; else CPU bundles, gloo), each with the dense "
                     "layers, its own KV cache and scheduler, and experts [r*E/N, (r+1)*E/N) of every MoE layer, "
                     "exchanging routed tokens inside each MoE layer (torch.distributed all-to-all); N must divide "
                     "the experts. The ingress sends each request to the least loaded rank")
    ray.add_argument("--data-parallel-groups", type=int, metavar="R",
                     help="with --expert-parallel: R independent groups of N ranks (replicas) (default: 1)")
    ray.add_argument("--cpus-per-rank", type=float, metavar="N",
                     help="with --expert-parallel on CPUs: each rank's CPU bundle (default: 1, or what the "
                     "ingress leaves, shared, where the cluster has fewer)")
    ray.add_argument("--redundant-experts", type=int, metavar="K",
                     help="with --expert-parallel: room on each rank for K copies of other ranks' experts a MoE layer, "
                     "the hottest placed from the live load every --rebalance-every steps, each expert's tokens "
                     "split over its copies (default: 0, off)")
    ray.add_argument("--rebalance-every", type=int, metavar="M",
                     help="with --redundant-experts: steps with work between two placements (default: 64)")
    ray.add_argument("--placement", choices=PLACEMENTS,
                     help="with --expert-parallel: strict-pack keeps a group on one node; pack lets it span nodes "
                     "where one node cannot hold it (default: strict-pack)")
    ray.add_argument("--expert-shards", type=int, metavar="S",
                     help="the older shard exchange: shard s holds experts [s*E/S, (s+1)*E/S) of every MoE layer, "
                     f"called per MoE layer by one ingress that holds everything else (default: "
                     f"{_ray_default('expert_shards')})")
    ray.add_argument("--shard-replicas", type=int, metavar="R",
                     help=f"replicas per shard, with --exchange handles (default: {_ray_default('shard_replicas')})")
    ray.add_argument("--cpus-per-shard", type=float, metavar="N",
                     help="CPUs per shard replica "
                     "(default: 1, or what the ingress's CPU leaves, shared, where the cluster has fewer)")
    ray.add_argument("--gpus-per-shard", type=float, metavar="N",
                     help="GPUs per shard replica; fractional shares a GPU between shards (default: "
                     f"{_ray_default('gpus_per_shard'):g}, CPU actors)")
    ray.add_argument("--ingress-gpus", type=float, metavar="N",
                     help="GPUs for the shard exchange's ingress (the dense layers and the step engine) (default: "
                     f"{_ray_default('ingress_gpus'):g})")
    ray.add_argument("--exchange", choices=EXCHANGES,
                     help="how the ingress reaches the shards. sockets: they are Ray actors of the ingress, sent "
                     "their rows over a TCP connection each (the fastest; idle shards cost nothing); compiled: the "
                     "same actors behind one Ray Compiled Graph (each shard spins a core while it waits); actors: "
                     "the same actors called as Ray tasks; handles: Serve deployments called through handles, with "
                     f"replicas (default: {_ray_default('exchange')})")
    ray.add_argument("--shard-timeout", type=float, metavar="S",
                     help="an expert exchange unanswered this long fails its requests with 503: a shard whose "
                     f"replicas are all gone until Serve replaces one (default: {_ray_default('shard_timeout_s'):g})")
    ray.add_argument("--print-config", action="store_true",
                     help="print a Ray Serve config file for `serve deploy` on a cluster, and exit")
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
    sv.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    sv.add_argument("--no-access-log", action="store_true", help="no line per request")
    sv.add_argument("--quiet", action="store_true", help="no progress bar while training the default model")
    sv.set_defaults(func=cmd_serve)
