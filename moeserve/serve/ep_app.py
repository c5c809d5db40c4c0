"""`moeserve serve CKPT --ray [--expert-parallel N] [--data-parallel-groups R]`: expert parallelism served as vLLM
and SGLang serve it, placed by Ray. Without --expert-parallel, N = 1: each group is one rank holding every expert,
loaded as one process loads it, so the R groups are plain replicas of the model behind the same ingress.

    HTTP -> Ray Serve proxy -> EPIngress replica: the same FastAPI app as one process (create_app), no weights;
            its runner is a RankRouter (ep_router.py): each request to the least loaded rank of a healthy group
         -> RankActor (ep_ranks.py), N per group, each group in one placement group: the dense layers whole, its
            own KV cache and step engine, 1/N of every MoE layer's experts; the ranks exchange routed rows inside
            each MoE layer with torch.distributed all-to-all (runtime/expert_parallel.py), in lockstep
            (runtime/ep_rank.py)

Its /metrics adds, per rank and group, the all-to-all time, routed and computed rows, queue depth and running
sequences, and the imbalance across ranks (ep_metrics.py), from the counters the supervisor's health probe
brings back.

The ingress makes the groups when its model "loads" (ServerState's model thread), so /readyz says 503 until every
group is placed, joined and warmed up. A group whose rank fails is torn down and started again by the ingress
(ep_groups.py), and /readyz lists each group's state; Serve's health check of the ingress fails only once a group
has been given up after repeated failed restarts. The rank actors and placement groups are the ingress replica's:
they share its fate, and Serve's restart of the ingress makes them again.

On a cluster: `--print-config` writes a `serve deploy` file (deploy_config) whose builder (app_builder) makes this
same application from its args; `moeserve serve --ray` itself joins the cluster at $RAY_ADDRESS (ray_cluster.py).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import ray
from ray import serve

from moeserve.errors import UserError
from moeserve.ray_cluster import connect
from moeserve.runtime.ep_rank import RankOptions, uncompilable_experts
from moeserve.serve import ray_metrics
from moeserve.serve.app import create_app
from moeserve.serve.config import BatchConfig, ExpertParallelOptions
from moeserve.serve.ep_groups import GroupSupervisor
from moeserve.serve.ep_metrics import RankCollector
from moeserve.serve.ep_router import Rank, RankRouter
from moeserve.serve.metrics import Metrics
from moeserve.serve.ray_run import APP_NAME, serve_until_stopped
from moeserve.serve.runner import ModelFacts
from moeserve.serve.state import ServeConfig

__all__ = ["EPIngress", "app_builder", "build_ep_app", "check_checkpoint", "deploy_config", "run_ep"]


def check_checkpoint(checkpoint: str | Path, options: ExpertParallelOptions) -> ModelFacts:
    """What expert parallelism needs of the checkpoint, checked before anything starts (UserError names it)."""
    model = ModelFacts.read(checkpoint)
    cfg = model.cfg
    if cfg.task != "lm":
        raise UserError(f"--expert-parallel: {checkpoint} is a {cfg.task} model; the ranks serve language models")
    if not cfg.moe_layer_ids:
        raise UserError(f"--expert-parallel: {checkpoint} has no MoE layer, so there is nothing to split")
    if cfg.quantization is not None and "bits" not in cfg.quantization:
        raise UserError(f"--expert-parallel: {checkpoint}'s weights are quantized at load on one GPU; the ranks serve "
                        "float, int8 and int4 checkpoints (moeserve quantize)")
    if options.compile == "on" and options.ranks > 1 and (why := uncompilable_experts(cfg)) is not None:
        raise UserError(f"--compile on with --expert-parallel {options.ranks}: {checkpoint}'s {why} have no compiled "
                        f"exchange (a rank counts their rows on the host); use --compile off")
    options.check_experts(cfg.n_experts)
    return model


@serve.ingress()
class EPIngress:
    """The FastAPI app of one process, whose runner sends each request to a rank (module docstring)."""

    def __init__(self, checkpoint: str, serve_cfg: ServeConfig, options: ExpertParallelOptions, dtype: str):
        self.checkpoint, self.serve_cfg, self.options, self.dtype = checkpoint, serve_cfg, options, dtype
        self.supervisor: GroupSupervisor | None = None

    def __serve_build_asgi_app__(self):
        self.metrics = Metrics(twins=ray_metrics.twin)
        self.copier = ray_metrics.ScrapeTimeCopier(self.metrics).start()
        return create_app(self._start, self.serve_cfg, self.metrics)

    def _start(self) -> RankRouter:
        model = check_checkpoint(self.checkpoint, self.options)
        c = self.serve_cfg
        rank_options = RankOptions(slots=c.kv_slots, prefill_chunk=c.prefill_chunk, dtype=self.dtype,
                                   redundant_experts=self.options.redundant_experts,
                                   rebalance_every=self.options.rebalance_every,
                                   compile=self.options.compile)
        supervisor = GroupSupervisor(self.checkpoint, self.options, rank_options)
        groups = supervisor.start()
        ranks = [Rank(actor, g, r, c.kv_slots) for g in groups for r, actor in enumerate(g.actors)]
        router = RankRouter(model, ranks, c.batch, self.metrics, health=supervisor.health)
        supervisor.on_up = router.replace_group
        self.metrics.watch_collector(RankCollector(supervisor.book))  # per rank and group (ep_metrics.py)
        self.supervisor = supervisor
        return router

    def ranks(self) -> list[dict]:
        """Every serving rank's RankActor.info, now: what it holds and has served."""
        groups = [g for g in self.supervisor.groups if g.healthy] if self.supervisor else []
        return ray.get([a.info.remote() for g in groups for a in g.actors], timeout=60)

    def groups(self) -> list[dict]:
        """Each group's state, restarts and last error (GroupSupervisor.health)."""
        return self.supervisor.health() if self.supervisor else []

    def check_health(self) -> None:
        """Serve's health check. A failed rank (a failed step, an ended or stalled loop, a dead actor) is found by
        the supervisor's watch, which restarts its group; this fails only once a group has been given up."""
        if self.supervisor is not None:
            self.supervisor.check()

    def __del__(self):
        if getattr(self, "copier", None) is not None:
            self.copier.stop()
        if getattr(self, "supervisor", None) is not None:
            self.supervisor.stop()


def build_ep_app(checkpoint: str | Path, serve_cfg: ServeConfig, options: ExpertParallelOptions, *,
                 dtype: str = "float32"):
    """The bound application: one ingress replica that makes the groups. One replica only: each ingress makes
    groups of its own, so a second would hold a second copy of every group rather than share them."""
    checkpoint = str(Path(checkpoint).absolute())
    options = options.fitted(math.inf)  # unset: one CPU per rank (run_ep fits them to the cluster first)
    ingress = serve.deployment(EPIngress, name="ingress", **ingress_options(serve_cfg, options))
    return ingress.bind(checkpoint, serve_cfg, options, dtype)


# How often a stopping ingress looks for requests still going. Serve sleeps one such period before its first look,
# so its default (2 s) was the whole stop of an idle application (`serve.delete`, SIGTERM of `moeserve serve --ray`);
# requests in flight are waited for either way, up to graceful_shutdown_timeout_s.
SHUTDOWN_POLL_S = 0.25


def ingress_options(serve_cfg: ServeConfig, options: ExpertParallelOptions) -> dict:
    """The ingress deployment's Serve options, in code and in the file `--print-config` writes."""
    return {"num_replicas": 1, "max_ongoing_requests": ingress_max_ongoing(serve_cfg, options),
            "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S, "ray_actor_options": {"num_cpus": options.ingress_cpus}}


def ingress_max_ongoing(serve_cfg: ServeConfig, options: ExpertParallelOptions) -> int:
    """Requests Serve lets into the ingress replica at once: all that its own queue, every rank's cache slots (or a
    batch's rows), and probes can hold. Serve's default (5) kept all but 5 requests waiting in Ray's proxy: cache
    slots idle, the time to first token spent before the app saw the request, and no 429 from the app's queue bound,
    ever (docs/design-notes.md)."""
    b = serve_cfg.batch
    return b.max_queue + max(serve_cfg.kv_slots * options.world, b.max_batch_size) + 32


DEVICES = ("auto", "cpu", "cuda")


def with_device(options: ExpertParallelOptions, device: str, cluster_gpus: float) -> ExpertParallelOptions:
    """A GPU per rank for `cuda`, and for `auto` where the cluster has one for every rank; else CPU bundles."""
    if device not in DEVICES:
        raise UserError(f"--device {device!r} with --expert-parallel: expected {', '.join(DEVICES)} (Ray gives each "
                        "rank its own GPU)")
    gpus = device == "cuda" or (device == "auto" and cluster_gpus >= options.world)
    return dataclasses.replace(options, gpus=gpus) if gpus else options


def deploy_config(checkpoint: str | Path, serve_cfg: ServeConfig, options: ExpertParallelOptions, *, dtype: str,
                  device: str) -> dict:
    """`--print-config`: a Ray Serve config file (`serve deploy`'s schema) for this application on a cluster. Its one
    deployment is the ingress; its `args` carry the groups' options (ranks, groups, bundles, placement), so the
    placement groups the ingress makes (one per group, a bundle per rank) are edited there, and `device` is resolved
    by app_builder against the cluster it runs on. The API key is not written: give the ingress $MOESERVE_API_KEY
    through its runtime_env."""
    if device not in DEVICES:
        raise UserError(f"--device {device!r} with --expert-parallel: expected {', '.join(DEVICES)}")
    checkpoint = str(Path(checkpoint).absolute())
    options = options.fitted(math.inf)  # unset: one CPU per rank, for a cluster planned around the file
    served = dataclasses.asdict(serve_cfg)
    served.update(api_key=None, chat_template=str(serve_cfg.chat_template) if serve_cfg.chat_template else None)
    written = dataclasses.asdict(options)
    del written["gpus"]  # from `device`, on the cluster
    ingress = {"name": "ingress", **ingress_options(serve_cfg, options)}
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": serve_cfg.host, "port": serve_cfg.port},
        "applications": [{
            "name": APP_NAME, "route_prefix": "/", "import_path": "moeserve.serve.ep_app:app_builder",
            "args": {"checkpoint": checkpoint, "dtype": dtype, "device": device, "options": written,
                     "serve": served},
            "deployments": [ingress],
        }],
    }


def app_builder(args: dict):
    """The application from a Ray Serve config's `args` (what `--print-config` writes), for `serve deploy`: run by
    Serve on the cluster, so `device: auto` asks that cluster for its GPUs. The checkpoint is checked here, so that a
    wrong path or an expert count that does not split fails the deploy with its reason."""
    serve_args = dict(args.get("serve") or {})
    batch = BatchConfig(**serve_args.pop("batch", {}))
    if serve_args.get("chat_template"):
        serve_args["chat_template"] = Path(serve_args["chat_template"])
    options = ExpertParallelOptions(**(args.get("options") or {}))
    options = with_device(options, args.get("device", "auto"), ray.cluster_resources().get("GPU", 0))
    check_checkpoint(args["checkpoint"], options)
    return build_ep_app(args["checkpoint"], ServeConfig(**serve_args, batch=batch), options,
                        dtype=args.get("dtype", "float32"))


def run_ep(checkpoint: str | Path, serve_cfg: ServeConfig, options: ExpertParallelOptions, *, dtype: str = "float32",
           device: str = "auto", access_log: bool = True, log_level: str = "info") -> int:
    """`moeserve serve --ray [--expert-parallel N]`: on the cluster at $RAY_ADDRESS (ray_cluster.connect), else a
    local Ray, until SIGTERM. `device`: cuda, a GPU per rank; cpu, CPU bundles; auto, GPUs where the cluster has one
    for every rank."""
    check_checkpoint(checkpoint, options)
    ray_ = connect()
    resources = ray_.cluster_resources()
    try:
        options = with_device(options, device, resources.get("GPU", 0)).fitted(resources.get("CPU", 0))
        options.check_fits(resources.get("CPU", 0), resources.get("GPU", 0))
    except UserError:
        ray_.shutdown()
        raise
    what = (f"{options.groups} expert-parallel group(s) of {options.ranks} rank(s), "
            f"{'a GPU each (NCCL)' if options.gpus else f'{options.cpus_per_rank:g} CPU each (gloo)'}")
    return serve_until_stopped(lambda: build_ep_app(checkpoint, serve_cfg, options, dtype=dtype), serve_cfg, what,
                               Path(checkpoint).name, options.ready_timeout_s, access_log, log_level)
