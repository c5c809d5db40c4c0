"""The server's configuration: what `moeserve serve`'s flags set, and where their defaults live.

Apart from the server's machinery (no torch, no FastAPI), so that the CLI reads the defaults from these fields to
build its flags without importing a model runtime.
"""

from __future__ import annotations

import os
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from moeserve.errors import UserError
from moeserve.runtime import COMPILE_MODES, SCHEDULERS

API_KEY_ENV = "MOESERVE_API_KEY"


@dataclass
class BatchConfig:
    max_batch_size: int = 32  # rows per engine call; more raises throughput and each request's latency
    max_batch_tokens: int = 16384  # padded tokens per engine call (rows x width), bounds activation memory
    wait_s: float = 0.005  # how long the oldest request may wait for others to join its batch
    max_queue: int = 256  # requests waiting; past it, 429 at once
    # continuous scheduler: padded tokens of scoring or classification run between two decode steps while sequences
    # are generating; smaller keeps their tokens coming, larger runs a long scoring request in fewer, faster calls
    slice_tokens: int = 2048
    # continuous scheduler, while nothing is generating: larger calls run faster, and a completion that arrives waits
    # for at most one of them (at most max_batch_tokens)
    idle_slice_tokens: int = 8192


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"  # loopback unless told otherwise: a model server is not a public service by default
    port: int = 8000
    model_name: str | None = None  # the id clients send as `model` (default: the checkpoint's directory name)
    api_key: str | None = None  # bearer token required on /v1/* (default: $MOESERVE_API_KEY, else none)
    batch: BatchConfig = field(default_factory=BatchConfig)
    request_timeout_s: float = 60.0  # arrival to last token; past it, 504 and the work is dropped
    max_body_bytes: int = 1 << 20  # 413 past this
    body_timeout_s: float = 10.0  # a body that has not all arrived this long after its last part: 408
    max_inputs: int = 32  # prompts or texts per request
    max_tokens: int | None = None  # largest max_tokens accepted (default: the model's context)
    # model work one request may ask for, in tokens (Job.work): a few seconds of the default model on 2 CPU cores
    max_request_tokens: int = 16384
    expert_metrics: bool | None = None  # per-(layer, expert) series; None: on unless layers x experts > 4096
    shutdown_timeout_s: float = 30.0  # SIGTERM: in-flight requests get this long to finish
    threads: int | None = None  # torch threads of the model (default: torch's, one per core)
    scheduler: str = "continuous"  # continuous: requests join running steps; batch: run-to-completion batches
    kv_slots: int = 8  # continuous: sequences generating at once (cache slots of the model's context each)
    prefill_chunk: int | None = None  # continuous: prompt tokens per step while others generate (None: by device)
    chat_template: Path | None = None  # a Jinja2 file for /v1/chat/completions, over the checkpoint's own
    # where POST /start_profile and /stop_profile write torch profiler traces of the model thread (None: no profiling)
    profile_dir: Path | None = None
    profile_max_s: float = 10.0  # a profile nobody stops ends after this long: it holds every op until written
    # (~0.5 GB a second of a small model's busy step loop)

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = os.environ.get(API_KEY_ENV) or None
        for name in ("request_timeout_s", "max_body_bytes", "max_inputs", "shutdown_timeout_s", "body_timeout_s",
                     "max_request_tokens", "profile_max_s"):
            if not getattr(self, name) > 0:
                raise UserError(f"{name} = {getattr(self, name)!r}: expected a positive number")
        b = self.batch
        for name in ("max_batch_size", "max_batch_tokens", "max_queue", "slice_tokens", "idle_slice_tokens"):
            if isinstance(getattr(b, name), bool) or not isinstance(getattr(b, name), int) or getattr(b, name) < 1:
                raise UserError(f"{name} = {getattr(b, name)!r}: expected an integer >= 1")
        if self.max_tokens is not None and not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise UserError(f"max_tokens = {self.max_tokens!r}: expected an integer >= 1 or None")
        if self.threads is not None and not (isinstance(self.threads, int) and self.threads >= 1):
            raise UserError(f"threads = {self.threads!r}: expected an integer >= 1 or None")
        if not 0 <= self.port <= 65535:
            raise UserError(f"port = {self.port!r}: expected 0..65535")
        if self.scheduler not in SCHEDULERS:
            raise UserError(f"scheduler = {self.scheduler!r}: expected one of {', '.join(SCHEDULERS)}")
        for name in ("kv_slots", "prefill_chunk"):
            value = getattr(self, name)
            if (value is not None or name == "kv_slots") and (isinstance(value, bool) or not isinstance(value, int)
                                                               or value < 1):
                raise UserError(f"{name} = {value!r}: expected an integer >= 1")
        if not b.wait_s >= 0:
            raise UserError(f"batch wait = {b.wait_s!r}: expected a number of seconds >= 0")


PLACEMENTS = ("strict-pack", "pack")


@dataclass
class ExpertParallelOptions:
    """`--ray --expert-parallel N`: R groups (replicas) of N rank actors, each group in one Ray placement group."""

    ranks: int = 2  # N: rank r holds experts [r*E/N, (r+1)*E/N) of every MoE layer, and its own KV cache and steps
    groups: int = 1  # R: independent groups; a request runs on one rank of one group
    gpus: bool = False  # a GPU per rank (NCCL), else CPU bundles (gloo)
    cpus_per_rank: float | None = None  # CPU bundles: None = 1, or what the ingress leaves, shared, on a small cluster
    # strict-pack: a group's ranks on one node (its collectives stay off the network); pack: across nodes if need be
    placement: str = "strict-pack"
    ingress_cpus: float = 0.5  # the thin ingress: HTTP, tokenising, routing; no model work
    # a collective waiting longer than this fails its group (a rank died or hung); it must exceed any one forward
    collective_timeout_s: float = 300.0
    ready_timeout_s: float = 600.0  # placement, rendezvous and loading of every group, at start-up
    # room on each rank for copies of other ranks' hot experts, placed from the live load (runtime/expert_replicas.py)
    redundant_experts: int = 0
    rebalance_every: int = 64  # steps with work between two placements
    # a group whose rank fails is torn down and started again (serve/ep_groups.py). How often every rank is asked
    # whether it is healthy: the longest a dead rank goes unnoticed when no request finds it first
    probe_every_s: float = 0.5
    # a rank whose step loop has not advanced for this long with work queued is unhealthy (a collective waits on a
    # dead or hung peer): it must exceed any one step of the model
    stall_s: float = 60.0
    # restarts: the first after a group that served is immediate; after a start that failed, or a group that failed
    # within restart_stable_s of coming up, the next waits restart_backoff_s, doubling up to restart_backoff_max_s;
    # after restart_attempts such failures in a row the group is given up and the ingress's health check fails
    restart_backoff_s: float = 2.0
    restart_backoff_max_s: float = 60.0
    restart_stable_s: float = 60.0
    restart_attempts: int = 8
    # --compile for every rank (auto: CUDA graphs on a GPU). A group of one loads the whole model as one process
    # does; a rank of N > 1 compiles its slice, whose exchange runs in fixed-size buffers in the steps where every
    # rank decodes through its graph (runtime/ep_rank.py), and runs eager where its experts cannot (auto)
    compile: str = "auto"

    def __post_init__(self) -> None:
        for name, flag, least in (("ranks", "--expert-parallel", 1), ("groups", "--data-parallel-groups", 1),
                                  ("redundant_experts", "--redundant-experts", 0),
                                  ("rebalance_every", "--rebalance-every", 1),
                                  ("restart_attempts", "restart_attempts", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise UserError(f"{flag} {v!r}: expected an integer >= {least}")
        if self.placement not in PLACEMENTS:
            raise UserError(f"--placement {self.placement!r}: expected one of {', '.join(PLACEMENTS)}")
        if self.compile not in COMPILE_MODES:
            raise UserError(f"--compile {self.compile!r}: expected one of {', '.join(COMPILE_MODES)}")
        if self.compile == "on" and self.ranks > 1 and self.redundant_experts:
            raise UserError(f"--compile on with --redundant-experts {self.redundant_experts}: a compiled rank's "
                            f"exchange has no copies of experts (their rows are counted on the host); pick one")
        for name in ("cpus_per_rank", "ingress_cpus"):
            v = getattr(self, name)
            if v is None and name == "cpus_per_rank":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise UserError(f"{name} = {v!r}: expected a number >= 0")
        for name in ("collective_timeout_s", "ready_timeout_s", "probe_every_s", "stall_s", "restart_backoff_s",
                     "restart_backoff_max_s", "restart_stable_s"):
            if not (isinstance(getattr(self, name), (int, float)) and getattr(self, name) > 0):
                raise UserError(f"{name} = {getattr(self, name)!r}: expected a number of seconds > 0")

    @property
    def world(self) -> int:
        return self.ranks * self.groups

    def check_experts(self, n_experts: int) -> None:
        """N must split the experts evenly (as vLLM asks of its expert-parallel size): every rank then holds and
        computes the same share of each layer."""
        if n_experts % self.ranks:
            fits = ", ".join(str(d) for d in range(1, n_experts + 1) if n_experts % d == 0)
            raise UserError(f"--expert-parallel {self.ranks}: the model's {n_experts} experts do not split evenly "
                            f"over {self.ranks} ranks; use a divisor of {n_experts} ({fits})")

    def fitted(self, cluster_cpus: float) -> "ExpertParallelOptions":
        """cpus_per_rank resolved for a cluster of `cluster_cpus`: 1 each where they fit beside the ingress, else
        the rest shared (at least 0.1), so that N = 2 runs on a 2-core machine. GPU ranks take no CPU bundle."""
        if self.cpus_per_rank is not None:
            return self
        if self.gpus:
            return replace(self, cpus_per_rank=0.0)
        share = (cluster_cpus - self.ingress_cpus) / self.world
        return replace(self, cpus_per_rank=1.0 if share >= 1 else max(0.1, math.floor(share * 10) / 10))

    def check_fits(self, cpus: float, gpus: float) -> None:
        """A UserError naming the flags where Ray could never place the groups (they would wait forever)."""
        need_cpus = self.ingress_cpus + self.world * (self.cpus_per_rank or 0)
        need_gpus = self.world if self.gpus else 0
        if need_cpus > cpus + 1e-9 or need_gpus > gpus + 1e-9:
            raise UserError(f"{self.groups} group(s) x {self.ranks} ranks need {need_cpus:g} CPUs and {need_gpus} "
                            f"GPUs (--cpus-per-rank {self.cpus_per_rank or 0:g}, and the ingress's "
                            f"{self.ingress_cpus:g}); the cluster has {cpus:g} CPUs and {gpus:g} GPUs")

    def bundle(self) -> dict[str, float]:
        """One rank's bundle of its group's placement group."""
        return {"GPU": 1.0} if self.gpus else {"CPU": float(self.cpus_per_rank or 0.1)}
