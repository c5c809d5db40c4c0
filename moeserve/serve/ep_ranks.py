"""The rank actors of `moeserve serve --ray --expert-parallel N`, and the placement group a group of them lives in.

    RankGroup: a Ray placement group of N bundles ({"GPU": 1} each, or {"CPU": k}), STRICT_PACK on one node (PACK:
               across nodes if need be), gang-scheduled: a group is placed whole or not at all
      -> RankActor r in bundle r, for r in 0..N-1
      -> rendezvous: rank 0's actor picks a free port on its node's address and returns tcp://ip:port; every actor
         then joins the torch.distributed group there (gloo on CPUs, NCCL on GPUs: expert_parallel.join_group)
         and loads its slice of the checkpoint (ep_rank.EPRank.load): the dense layers whole, its experts only
      -> each actor runs its EPRank's step loop on a thread of its own (the lockstep: ep_rank.py)

A rank actor is an async actor: its methods run on its event loop, never on the step loop's thread, so that any
number of requests can wait on it at once. `submit` queues a job; `updates` is one streaming generator (Ray's
`num_returns="streaming"`) that the ingress keeps open, and that yields, for every job of the rank together,
whatever stream events and completions the step loop has emitted since its last yield: one Ray object a step
rather than one a token (at 16 sequences a rank, 16 times fewer). Failures come as values (`("error", kind,
message)`) rather than raised, so that the ingress tells the request's fault (422) from a broken group (503)
without unpickling Ray's wrapped exceptions.

The rendezvous port is bound on the node's address (Ray's node IP), not on every interface, and is open only
while the group forms and its ranks are connected; torch.distributed has no authentication of its own, so the
nodes of a group must sit on a network that only the cluster reaches (docs: README, "Ray").
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from moeserve.errors import UserError
from moeserve.runtime.ep_rank import EPRank, RankOptions, run_rank
from moeserve.runtime.sampling import SamplingParams
from moeserve.serve.config import ExpertParallelOptions
from moeserve.serve.state import freeze_loaded_heap

__all__ = ["RankActor", "RankGroup"]


class RankActor:
    """One rank of an expert-parallel group, as a Ray actor (RankGroup makes it). `address` (rank 0 only) and
    `join` bring it up; `submit` (its items on `updates`), `score` and `cancel` serve; `info` says what it holds and has served."""

    def __init__(self, rank: int, world: int, group_index: int):
        self.rank, self.world, self.group_index = rank, world, group_index
        self.ep: EPRank | None = None
        self.jobs: dict[str, list] = {}  # job id -> its sequences' futures, for `cancel`
        self._outbox = _Outbox()  # the jobs' items, taken by `updates`
        self.served = {"sequences": 0, "score_rows": 0}

    def address(self) -> str:
        """A free port on this node's address, for the group's rendezvous (rank 0's)."""
        ip = ray.util.get_node_ip_address()
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return f"tcp://[{ip}]:{port}" if family == socket.AF_INET6 else f"tcp://{ip}:{port}"

    async def join(self, init_method: str, checkpoint: str, options: RankOptions, device: str,
                   timeout_s: float) -> dict:
        """Join the group at `init_method`, load this rank's slice, warm it up and start its loop (every rank of the
        group together: the collectives wait for all). What it holds (`info`)."""
        self.ep = await asyncio.to_thread(run_rank, checkpoint, init_method, self.rank, self.world, options,
                                          device=device, timeout_s=timeout_s)
        # one short completion per rank, so the first request pays no first-call costs; every rank does it at
        # once, each its own (the lockstep pads the others); its expert load is not traffic
        tok = self.ep.engine.tokenizer
        bos = [tok.bos_id] if tok is not None and tok.bos_id is not None else []
        await asyncio.wrap_future(self.ep.submit(bos + [1, 2, 3], SamplingParams(max_new_tokens=2)))
        self.ep.engine.expert_load.reset()
        freeze_loaded_heap()
        return self.info()

    def info(self) -> dict:
        """This rank's place, the weights it holds (parameters and buffers), the experts of each MoE layer it
        computes, and the work it has served (the warm-up not counted)."""
        ep = self.ep
        model = ep.engine.model
        return {"group": self.group_index, "rank": self.rank, "world": self.world, "node": ray.util.get_node_ip_address(),
                "device": str(ep.group.device), "backend": ep.group.backend, "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "parameters": sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers()),
                "experts": ep.expert_ids(), "served": dict(self.served),
                "running": len(ep.steps.running), "failed": None if ep.failed is None else repr(ep.failed),
                "steps": ep.stats.steps, "empty_passes": ep.stats.empty_passes, "iterations": ep.stats.iterations,
                "last_step_age_s": None if ep.stats.last_step_at is None else time.monotonic() - ep.stats.last_step_at}

    def submit(self, job_id: str, rows: list[list[int]], params: list[SamplingParams], stream: bool) -> tuple | None:
        """A job's rows as sequences on this rank; None once queued, or ("error", "request" | "group", message). What
        it brings comes on `updates` under `job_id`: ("event", row, StreamEvent) as they come (only the first, as
        ("first",), when not `stream`: the time to first token), then ("done", [Completion]) or ("error", "request" |
        "group" | "cancelled", message)."""
        job = _Job(job_id, len(rows), stream, self._outbox)
        try:
            for i, (row, p) in enumerate(zip(rows, params)):
                job.futures.append(self.ep.submit(row, p, on_event=job.on_event(i)))
        except Exception as e:
            for f in job.futures:
                f.cancel()
            return ("error", "request" if isinstance(e, UserError) and self.ep.failed is None else "group", str(e))
        self.jobs[job_id] = job.futures
        self.served["sequences"] += len(rows)
        for f in job.futures:  # after each sequence's last event: the loop thread emits, then resolves
            f.add_done_callback(lambda _, job=job: self._ended(job))
        return None

    def _ended(self, job: "_Job") -> None:
        """A sequence's future is done (on the step loop's thread, or a cancel's): the job's last item once all are."""
        if not job.one_done():
            return
        self.jobs.pop(job.id, None)
        futures = job.futures
        if any(f.cancelled() for f in futures):
            item = ("error", "cancelled", "the request was cancelled")
        else:
            failed = next((f.exception() for f in futures if f.exception() is not None), None)
            item = (("done", [f.result() for f in futures]) if failed is None else
                    ("error", "request" if isinstance(failed, UserError) and self.ep.failed is None else "group",
                     str(failed)))
        self._outbox.put(job.id, item)

    async def updates(self):
        """Every job's items (`submit`) as they come, a list of (job id, item) per yield: whatever the step loop has
        emitted since the last yield, across the rank's jobs, so the ingress pays one Ray object per step rather than
        one per token. One subscriber (the ingress): a later call takes over, and the earlier one ends."""
        outbox = self._outbox
        turn = outbox.subscribe(asyncio.get_running_loop())
        while True:
            items = await outbox.take(turn)
            if items is None:
                return
            yield items

    def cancel(self, job_id: str) -> bool:
        """End a job's sequences at the next step (its deadline passed, or its client left)."""
        futures = self.jobs.get(job_id)
        for f in futures or []:
            f.cancel()
        return futures is not None

    async def score(self, rows: list[list[int]], stride: int | None) -> tuple:
        """("done", [RowScore]) or ("error", kind, message), as `complete`."""
        try:
            future = self.ep.submit_scores(rows, stride)
            self.served["score_rows"] += len(rows)
            return ("done", await asyncio.wrap_future(future))
        except Exception as e:
            return ("error", "request" if isinstance(e, UserError) and self.ep.failed is None else "group", str(e))

    def check_health(self, stall_s: float = 60.0) -> dict:
        """Raises where this rank cannot serve: not loaded, its last step failed, its loop ended, or its loop has not
        advanced for `stall_s` although it has work (EPRank.unhealthy). Else its counters (EPRank.counters): the
        supervisor's probe carries the per-rank metrics, with no call of their own."""
        if self.ep is None:
            raise RuntimeError(f"rank {self.rank} is not loaded")
        why = self.ep.unhealthy(stall_s)
        if why is not None:
            raise RuntimeError(why)
        return self.ep.counters()


class _Outbox:
    """The items of a rank's jobs on their way to the ingress: put from any thread (the step loop's, mostly), taken
    in batches on the actor's event loop. The loop is woken once per batch, not once per item."""

    def __init__(self):
        self._lock = threading.Lock()
        self._items: list[tuple[str, tuple]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None
        self._turn = 0

    def subscribe(self, loop: asyncio.AbstractEventLoop) -> int:
        with self._lock:
            if self._ready is not None:
                self._loop.call_soon_threadsafe(self._ready.set)  # the earlier subscriber sees it is not its turn
            self._turn += 1
            self._loop, self._ready = loop, asyncio.Event()
            if self._items:
                self._ready.set()
            return self._turn

    def put(self, job_id: str, item: tuple) -> None:
        with self._lock:
            self._items.append((job_id, item))
            if len(self._items) == 1 and self._ready is not None:
                self._loop.call_soon_threadsafe(self._ready.set)

    async def take(self, turn: int) -> list[tuple[str, tuple]] | None:
        """The items since the last take (waiting for one), or None once another subscriber has taken over."""
        while True:
            with self._lock:
                if turn != self._turn:
                    return None
                ready = self._ready
                if self._items:
                    items, self._items = self._items, []
                    ready.clear()
                    return items
            await ready.wait()
            ready.clear()


class _Job:
    """One `submit`'s sequences on a rank: their futures, and how its stream events reach the outbox."""

    def __init__(self, job_id: str, rows: int, stream: bool, outbox: _Outbox):
        self.id, self.stream, self.outbox = job_id, stream, outbox
        self.futures: list = []
        self._left, self._first = rows, True
        self._lock = threading.Lock()

    def on_event(self, row: int):
        def emit(event) -> None:
            if self.stream:
                self.outbox.put(self.id, ("event", row, event))
            elif self._first:
                self._first = False
                self.outbox.put(self.id, ("first",))
        return emit

    def one_done(self) -> bool:
        """Count a sequence done; True for the last."""
        with self._lock:
            self._left -= 1
            return self._left == 0


class RankGroup:
    """One expert-parallel group: its placement group and its N rank actors, brought up by `start` and torn
    down as a unit by `stop`. `healthy` turns False, for good, once any of its ranks fails as a group (a failed
    step, a dead actor, a stalled loop): the ingress sends no more requests there, and `on_fail` (the supervisor's,
    ep_groups.py) tears it down and starts a new group in its place."""

    def __init__(self, index: int, checkpoint: str, options: ExpertParallelOptions, rank_options: RankOptions):
        self.index, self.checkpoint, self.options, self.rank_options = index, checkpoint, options, rank_options
        strategy = "STRICT_PACK" if options.placement == "strict-pack" else "PACK"
        # named for `ray list`, uniquely: a replaced ingress's groups may still be going away
        self.name = f"moeserve-ep-{uuid.uuid4().hex[:8]}-{index}"
        self.pg = placement_group([options.bundle() for _ in range(options.ranks)], strategy=strategy, name=self.name)
        actor = ray.remote(RankActor)
        cpus = 0.0 if options.gpus else options.bundle()["CPU"]
        self.actors = [actor.options(num_cpus=cpus, num_gpus=1 if options.gpus else 0, max_restarts=0,
                                     name=f"{self.name}-rank-{r}", namespace="moeserve",
                                     scheduling_strategy=PlacementGroupSchedulingStrategy(
                                         self.pg, placement_group_bundle_index=r))
                       .remote(r, options.ranks, index) for r in range(options.ranks)]
        self.healthy = False
        self.error: str | None = None
        self.infos: list[dict] = []
        self._joins: list | None = None
        self.up_at: float | None = None  # time.monotonic() once every rank is up
        self.on_fail = None  # called once with this group when it fails (GroupSupervisor.failed)
        self._fail_lock = threading.Lock()  # the router's loop and the supervisor's watch may both see it fail

    def begin(self) -> None:
        """Placement (gang: the group's bundles all at once, or none), then the rendezvous and loading, under way."""
        ray.get(self.pg.ready(), timeout=self.options.ready_timeout_s)
        address = ray.get(self.actors[0].address.remote(), timeout=self.options.ready_timeout_s)
        device = "cuda" if self.options.gpus else "cpu"
        self._joins = [a.join.remote(address, self.checkpoint, self.rank_options, device,
                                     self.options.collective_timeout_s) for a in self.actors]

    def finish(self, deadline: float) -> None:
        """Wait for every rank to be up (or the error that stopped one, which tears the group down)."""
        try:
            self.infos = ray.get(self._joins, timeout=max(1.0, deadline - time.monotonic()))
        except Exception:
            self.stop()
            raise
        self.healthy, self.up_at = True, time.monotonic()

    def fail(self, why: str) -> None:
        """Take no more requests; the first failure of a serving group calls `on_fail` (its teardown and restart)."""
        with self._fail_lock:
            first, self.healthy = self.healthy, False
            if first:
                self.error = why
        if first:
            if self.on_fail is not None:
                self.on_fail(self)

    def stop(self) -> None:
        """Kill the ranks and free the placement group (the group lives and dies as a unit)."""
        self.healthy = False
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass
        try:
            remove_placement_group(self.pg)
        except Exception:
            pass


def start_groups(checkpoint: str, options: ExpertParallelOptions, rank_options: RankOptions) -> list[RankGroup]:
    """Every group placed, joined and loaded: all at once, each group's ranks together."""
    groups = [RankGroup(g, checkpoint, options, rank_options) for g in range(options.groups)]
    deadline = time.monotonic() + options.ready_timeout_s
    try:
        for g in groups:
            g.begin()
        for g in groups:
            g.finish(deadline)
    except Exception:
        for g in groups:
            g.stop()
        raise
    return groups
