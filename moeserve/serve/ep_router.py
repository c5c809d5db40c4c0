"""The expert-parallel ingress's runner (runner.py): each job to the least loaded rank of a healthy group, its
events and result relayed back.

    handler -> submit(job) -> the rank with the fewest sequences in flight from here (ties: round robin), of a
               healthy group -> RankActor.submit or .score -> this runner's event loop, on the server's model
               thread -> job.on_event / job.future
    RankActor.updates (a Ray streaming generator per rank, read by this loop while the rank has jobs): each yield
               is whatever the rank's step loop emitted since the last, across its jobs (about one Ray object a
               step, not one a token), handed to each job's queue

A request lives on one rank (data-parallel attention: its KV cache is there); its sequences (n choices, several
prompts) all run on that rank, so the choices of a prompt share its prefill as in one process. Load is what this
ingress has sent each rank and not yet had back (it is the only sender), so choosing costs no call.

The queue bound is the single-process server's: the sequences waiting beyond the ranks' cache slots, plus the
places held by admitted requests, may not pass --max-queue (429 with Retry-After). A job whose deadline passes or
whose client leaves is cancelled on its rank, which ends its sequences at the next step. A rank that fails as a
group (a failed step, a dead actor) marks its group unhealthy (RankGroup.fail), which tears the group down and starts
it again (ep_groups.py): its requests end with 503 (or an error event mid-stream) and new ones go to the other groups;
with none serving, 503 at once until one is back. A restarted group's ranks replace the old ones (`replace_group`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass, field

from moeserve.runtime.sampling import EngineError
from moeserve.serve.batcher import Closed, DeadlineExceeded, Job, QueueFull, Unavailable
from moeserve.serve.config import BatchConfig
from moeserve.serve.runner import ModelFacts

log = logging.getLogger("moeserve.serve")
WATCH_S = 0.05  # how often a running job's deadline and client are looked at


@dataclass(eq=False)
class Rank:
    """A rank actor as the router sees it: its group, and the sequences in flight there from here."""

    actor: object  # a Ray actor handle of ep_ranks.RankActor
    group: object  # its ep_ranks.RankGroup (`healthy`, `fail`)
    rank: int
    slots: int
    sequences: int = 0  # in flight: sent and not yet answered
    jobs: int = 0
    # on the router's loop: the relay of the rank's `updates` stream, and each job's queue of items from it
    pump: asyncio.Future | None = None
    waiting: dict = field(default_factory=dict)


class _Place:
    def __init__(self, router: "RankRouter"):
        self._router: RankRouter | None = router

    def release(self) -> bool:
        router, self._router = self._router, None
        if router is None:
            return False
        with router._lock:
            router._held -= 1
        return True


class RankRouter:
    """Runner over the ranks of R expert-parallel groups (module docstring)."""

    def __init__(self, model: ModelFacts, ranks: list[Rank], cfg: BatchConfig, metrics=None, health=None):
        self.model, self.ranks, self.cfg, self.metrics = model, ranks, cfg, metrics
        self.health = health  # () -> each group's state (GroupSupervisor.health), for /readyz; None: not known
        self.loop = asyncio.new_event_loop()
        self._lock = threading.RLock()  # submit releases the held place under it
        self._held = 0
        self._closed = False
        self._running: set[concurrent.futures.Future] = set()
        self._order = itertools.count()  # round robin among equally loaded ranks

    @property
    def depth(self) -> int:
        """Sequences waiting on the ranks beyond their cache slots (an estimate: what this ingress has sent)."""
        return sum(max(0, r.sequences - r.slots) for r in self.ranks)

    def check_room(self) -> None:
        if self._closed:
            raise Closed("the server is shutting down")
        depth = self.depth + self._held
        if depth >= self.cfg.max_queue:
            raise QueueFull(depth, max(1, math.ceil(depth / max(1, sum(r.slots for r in self.ranks)))))

    def hold(self) -> _Place:
        with self._lock:
            self.check_room()
            self._held += 1
        return _Place(self)

    def submit(self, job: Job, place: _Place | None = None) -> concurrent.futures.Future:
        with self._lock:
            if place is None or not place.release():
                self.check_room()
            rank = self._choose(job)
            if rank is None:
                job.future.set_exception(Unavailable("no expert-parallel group is serving (a rank failed; its group "
                                                     "is being restarted)"))
                return job.future
            rank.sequences += len(job.rows)
            rank.jobs += 1
        running = asyncio.run_coroutine_threadsafe(self._run(job, rank), self.loop)
        with self._lock:
            self._running.add(running)
        running.add_done_callback(self._ended)
        return job.future

    def _choose(self, job: Job) -> Rank | None:
        live = [r for r in self.ranks if r.group.healthy]
        if not live:
            return None
        turn, n = next(self._order), len(self.ranks)
        return min(live, key=lambda r: (r.sequences, (self.ranks.index(r) - turn) % n))

    def replace_group(self, group) -> None:
        """A restarted group's ranks in place of its old ones (GroupSupervisor.on_up). Jobs still on the old ranks
        keep their Rank and end there."""
        slots = next((r.slots for r in self.ranks), 1)
        with self._lock:
            self.ranks = sorted([r for r in self.ranks if r.group.index != group.index]
                                + [Rank(actor, group, r, slots) for r, actor in enumerate(group.actors)],
                                key=lambda r: (r.group.index, r.rank))

    def _ended(self, running: concurrent.futures.Future) -> None:
        with self._lock:
            self._running.discard(running)

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def run(self) -> None:
        """The event loop that relays every job, until closed with nothing running."""
        async def until_closed() -> None:
            while not (self._closed and not self._running):
                await asyncio.sleep(WATCH_S)

        try:
            self.loop.run_until_complete(until_closed())
        finally:
            self.loop.close()

    # ---- on the loop -------------------------------------------------------------------------------------------
    async def _run(self, job: Job, rank: Rank) -> None:
        now = time.monotonic()
        if self.metrics:
            self.metrics.queue_seconds.observe(now - job.arrival)
            self.metrics.prompt_tokens.inc(sum(len(r) for r in job.rows))
        failed: set[int] = set()  # the groups that failed this job before its first token
        try:
            while True:
                try:
                    result = await self._attempt(job, rank)
                    break
                except _GroupFailed as e:
                    log.warning("expert-parallel group %d failed: %s", rank.group.index, e)
                    rank.group.fail(str(e))
                    failed.add(rank.group.index)
                    # nothing of it has reached the client (no token yet): it may start again on another group
                    moved = self._move(job, rank, failed) if job.first_token_at is None else None
                    if moved is None:
                        raise Unavailable(f"expert-parallel group {rank.group.index} failed ({e}); retry") from None
                    rank = moved
        except Exception as e:
            if not job.future.done():
                job.future.set_exception(e)
        else:
            if not job.future.done():
                job.future.set_result(result)
        finally:
            with self._lock:
                rank.sequences -= len(job.rows)
                rank.jobs -= 1

    async def _attempt(self, job: Job, rank: Rank):
        """The job on `rank` once; _GroupFailed where the rank failed as a group (a dead actor, a failed step)."""
        try:
            if job.dropped(time.monotonic()):
                raise DeadlineExceeded("the request's deadline passed while it was queued")
            if job.kind == "complete":
                result = await self._complete(job, rank)
                if self.metrics:
                    self.metrics.generation_tokens.inc(sum(c.completion_tokens for c in result))
                return result
            if job.kind == "score":
                return self._outcome(await rank.actor.score.remote(job.rows, job.stride))
            raise EngineError(f"{self.model.name} is a {self.model.cfg.task} model; expert-parallel ranks serve "
                              "language models")
        except (DeadlineExceeded, EngineError, Unavailable, _GroupFailed):
            raise
        except Exception as e:  # the actor died, or Ray could not reach it
            raise _GroupFailed(f"rank {rank.rank}: {type(e).__name__}: {_last_line(e)}") from e

    def _move(self, job: Job, rank: Rank, failed: set[int]) -> Rank | None:
        """Another serving group's least loaded rank for a job whose group failed before its first token (its load
        moved there), or None."""
        with self._lock:
            live = [r for r in self.ranks if r.group.healthy and r.group.index not in failed]
            if not live:
                return None
            moved = min(live, key=lambda r: r.sequences)
            rank.sequences -= len(job.rows)
            rank.jobs -= 1
            moved.sequences += len(job.rows)
            moved.jobs += 1
        return moved

    async def _complete(self, job: Job, rank: Rank) -> list:
        job_id = uuid.uuid4().hex
        items = asyncio.Queue()
        rank.waiting[job_id] = items
        self._pump(rank)
        ended = False
        try:
            refused = await rank.actor.submit.remote(job_id, job.rows, job.params, job.on_event is not None)
            if refused is not None:
                ended = True
                return self._outcome(refused)
            watch = asyncio.ensure_future(self._watch(job, rank, job_id))
            try:
                while True:
                    item = await items.get()
                    if item[0] in ("event", "first") and job.first_token_at is None:
                        job.first_token_at = time.monotonic()
                        if self.metrics:
                            self.metrics.ttft.observe(job.first_token_at - job.arrival)
                    if item[0] == "event":
                        job.on_event(item[1], item[2])
                    elif item[0] != "first":
                        ended = True
                        return self._outcome(item)
            finally:
                watch.cancel()
        finally:
            rank.waiting.pop(job_id, None)
            if not ended:  # this relay went away first (an error relaying it): end the job on its rank too
                asyncio.ensure_future(self._cancel(rank, job_id))

    def _pump(self, rank: Rank) -> None:
        """The rank's `updates` stream, read on this loop while the rank has jobs: each job's items to its queue.
        A stream that breaks (the actor died, Ray could not reach it) ends every job waiting there as a group's
        failure."""
        if rank.pump is not None and not rank.pump.done():
            return

        async def pump() -> None:
            try:
                async for ref in rank.actor.updates.options(num_returns="streaming").remote():
                    for job_id, item in await ref:
                        queue = rank.waiting.get(job_id)
                        if queue is not None:  # else its relay has ended (and cancelled it)
                            queue.put_nowait(item)
                why = "its stream of updates ended"
            except Exception as e:
                why = f"{type(e).__name__}: {_last_line(e)}"
            for queue in list(rank.waiting.values()):
                queue.put_nowait(("error", "group", f"rank {rank.rank}: {why}"))

        rank.pump = asyncio.ensure_future(pump())

    async def _cancel(self, rank: Rank, job_id: str) -> None:
        try:
            await rank.actor.cancel.remote(job_id)
        except Exception:  # the rank is gone: so is the job
            pass

    async def _watch(self, job: Job, rank: Rank, job_id: str) -> None:
        """Cancel the job on its rank once its deadline passes or its client leaves."""
        while not job.dropped(time.monotonic()):
            await asyncio.sleep(WATCH_S)
        await self._cancel(rank, job_id)

    def _outcome(self, item: tuple):
        if item[0] == "done":
            return item[1]
        _, kind, message = item
        if kind == "request":
            raise EngineError(message)
        if kind == "cancelled":
            raise DeadlineExceeded("the request's deadline passed while it was running")
        raise _GroupFailed(message)


class _GroupFailed(Exception):
    """A rank failed as a group (RankGroup.fail); the router retries the job elsewhere or answers 503."""


def _last_line(e: BaseException) -> str:
    """The last line of an error's text (Ray's wrapped errors carry the remote traceback before it)."""
    text = str(e).strip()
    return text.splitlines()[-1] if text else ""
