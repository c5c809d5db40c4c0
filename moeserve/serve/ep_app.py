"""`moeserve serve CKPT --ray --expert-parallel N [--data-parallel-groups R]`: expert parallelism served as vLLM and
SGLang serve it, placed by Ray.

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
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import ray
from ray import serve

from moeserve.errors import UserError
from moeserve.ray_cluster import connect
from moeserve.runtime.ep_rank import RankOptions
from moeserve.serve import ray_metrics
from moeserve.serve.app import create_app
from moeserve.serve.config import ExpertParallelOptions
from moeserve.serve.ep_groups import GroupSupervisor
from moeserve.serve.ep_metrics import RankCollector
from moeserve.serve.ep_router import Rank, RankRouter
from moeserve.serve.metrics import Metrics
from moeserve.serve.ray_app import ingress_max_ongoing, serve_until_stopped
from moeserve.serve.runner import ModelFacts
from moeserve.serve.state import ServeConfig

__all__ = ["EPIngress", "build_ep_app", "check_checkpoint", "run_ep"]


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
                                   rebalance_every=self.options.rebalance_every)
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
    """The bound application: one ingress replica that makes the groups."""
    checkpoint = str(Path(checkpoint).absolute())
    options = options.fitted(float("inf"))  # unset: one CPU per rank (run_ep fits them to the cluster first)
    ingress = serve.deployment(EPIngress, name="ingress",
                               max_ongoing_requests=ingress_max_ongoing_ep(serve_cfg, options),
                               ray_actor_options={"num_cpus": options.ingress_cpus})
    return ingress.bind(checkpoint, serve_cfg, options, dtype)


def ingress_max_ongoing_ep(serve_cfg: ServeConfig, options: ExpertParallelOptions) -> int:
    """As the single-process ingress (ray_app.ingress_max_ongoing), with every rank's cache slots."""
    return ingress_max_ongoing(dataclasses.replace(serve_cfg, kv_slots=serve_cfg.kv_slots * options.world))


def run_ep(checkpoint: str | Path, serve_cfg: ServeConfig, options: ExpertParallelOptions, *, dtype: str = "float32",
           gpus_if_there: bool = False, access_log: bool = True, log_level: str = "info") -> int:
    """`moeserve serve --ray --expert-parallel N`: on the cluster at $RAY_ADDRESS, else a local Ray, until SIGTERM.
    `gpus_if_there` (--device auto): a GPU per rank where the cluster has one for every rank, else CPU bundles."""
    check_checkpoint(checkpoint, options)
    ray_ = connect()
    resources = ray_.cluster_resources()
    if gpus_if_there and resources.get("GPU", 0) >= options.world:
        options = dataclasses.replace(options, gpus=True)
    options = options.fitted(resources.get("CPU", 0))
    try:
        options.check_fits(resources.get("CPU", 0), resources.get("GPU", 0))
    except UserError:
        ray_.shutdown()
        raise
    what = (f"{options.groups} expert-parallel group(s) of {options.ranks} ranks, "
            f"{'a GPU each (NCCL)' if options.gpus else f'{options.cpus_per_rank:g} CPU each (gloo)'}")
    return serve_until_stopped(lambda: build_ep_app(checkpoint, serve_cfg, options, dtype=dtype), serve_cfg, what,
                               Path(checkpoint).name, options.ready_timeout_s, access_log, log_level)
