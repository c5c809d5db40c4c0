"""The server's model thread: requests queue, and the thread that owns the model runs them.

The event loop never runs the model: a handler submits a `Job` and awaits its future. The model thread
(`Batcher.run`) turns: the one scheduler (runtime/scheduler.py) says which queued requests start, under
the server's policy (`--scheduler continuous`: completions join the running steps; `batch`: run to
completion, a batch taken only when nothing runs, waiting at most `wait_s` from its oldest request's
arrival for others to join); a scoring or classification batch runs one slice of model work a turn, so a
long one does not hold the thread; then the step engine runs the scheduler's plan for the sequences
(runtime/steps.py). A request is answered the turn its last sequence ends, so a short request that
arrives while a long one generates is answered after its own tokens, not the long one's. Each prompt
keeps its own sampling parameters and seed, and every row computes what it would alone, so batching
changes throughput, not answers.

The queue is bounded: `submit` refuses at once (`QueueFull`, with a retry-after estimate) rather than
letting latency grow without limit. A job whose deadline passes, or whose client leaves, is dropped:
skipped if it has not started, and cut off at its next step if it is generating, without holding up
the rest of its batch.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Generator, Literal

from moeserve.errors import MoeServeError, UserError
from moeserve.runtime.engine import Engine, EngineError, SamplingParams
from moeserve.runtime.output import StreamEvent
from moeserve.runtime.profiling import PLAN, TURN, StepProfiler, phase
from moeserve.runtime.scheduler import Admission, Plan, Policy, Scheduler, Sequence, default_prefill_chunk
from moeserve.runtime.steps import StepEngine
from moeserve.serve.config import BatchConfig
from moeserve.runtime.windows import batch_end, default_stride, rolling_windows

log = logging.getLogger("moeserve.serve")
Kind = Literal["complete", "score", "classify"]


class QueueFull(MoeServeError):
    def __init__(self, depth: int, retry_after_s: int):
        super().__init__(f"the request queue is full ({depth} waiting); retry in {retry_after_s} s")
        self.depth, self.retry_after_s = depth, retry_after_s


class Closed(MoeServeError):
    """The server is shutting down and takes no new work."""


class DeadlineExceeded(MoeServeError):
    pass


class Unavailable(MoeServeError):
    """A part the model needs (an expert-parallel group on Ray: serve/ep_router.py) is not answering; the
    request can be retried once it is back."""


@dataclass(eq=False)
class Job:
    kind: Kind
    rows: list[list[int]]  # token ids per prompt / text, <bos> first
    params: list[SamplingParams] | None = None  # per row, for "complete"
    stride: int | None = None  # "score": rolling windows over rows longer than the context (None: the default)
    # (row of this job, its next stream event: runtime/output.py), on the model thread
    on_event: Callable[[int, StreamEvent], None] | None = None
    deadline: float = math.inf  # time.monotonic() past which the job is dropped
    arrival: float = field(default_factory=time.monotonic)
    cancelled: bool = False  # set by the request side: the client left or gave up
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    first_token_at: float | None = None

    def cost(self) -> int:
        """Padded tokens this job adds to a batch: rows x the widest row (plus its new tokens)."""
        new = max((p.max_new_tokens for p in self.params), default=0) if self.params else 0
        return len(self.rows) * (max(len(r) for r in self.rows) + new)

    def dropped(self, now: float) -> bool:
        return self.cancelled or now > self.deadline

    def work(self, context: int) -> int:
        """The model work this job asks for, in tokens run through the model: per sequence, the prompt and the
        tokens it may generate (within the context); per scored text, every window's tokens (a text longer than
        the context overlaps its windows: windows.py); per classified text, its tokens. What the server's
        --max-request-tokens caps, so that no one request can hold the model for long."""
        if self.kind == "complete":
            return sum(min(len(r) + p.max_new_tokens, max(context, len(r))) for r, p in zip(self.rows, self.params))
        if self.kind == "score":
            stride = default_stride(context) if self.stride is None else self.stride
            return sum(end - start for r in self.rows for start, end, _ in rolling_windows(len(r), context, stride))
        return sum(len(r) for r in self.rows)


class Place:
    """A place held in a batcher's queue (`Batcher.hold`); `release` gives it back, once."""

    def __init__(self, batcher: Batcher):
        self._batcher: Batcher | None = batcher

    def release(self) -> bool:
        """Give the place back; False if it was given back already."""
        batcher, self._batcher = self._batcher, None
        if batcher is None:
            return False
        with batcher._cv:
            batcher._held -= 1
        return True


def policy_of(cfg: BatchConfig, scheduler: str) -> Policy:
    """The scheduler's policy: "continuous" or "batch" (run to completion), within the batch limits."""
    return Policy(scheduler, cfg.max_batch_size, cfg.max_batch_tokens, cfg.wait_s, cfg.slice_tokens,
                  cfg.idle_slice_tokens)


class Batcher:
    """The queue, and the loop (`run`) that the one thread owning the model spends its life in: the scheduler
    admits and plans, a scoring or classification batch runs a slice a turn, the step engine runs the plan.

    `scheduler`: "continuous" (completions join the running steps, over `slots` cache slots) or "batch" (run to
    completion, over `max_batch_size` slots). A model that generates nothing (a classifier) has no step engine:
    its requests are slice work either way."""

    def __init__(self, engine: Engine, cfg: BatchConfig, metrics=None, *, scheduler: str = "batch", slots: int = 8,
                 prefill_chunk: int | None = None):
        self.engine, self.cfg, self.metrics = engine, cfg, metrics
        self.model = engine  # what the handlers check requests against (runner.py)
        policy = policy_of(cfg, scheduler)
        self.steps: StepEngine | None = None
        if engine.cfg.task == "lm":
            self.steps = engine.step_engine(slots if policy.mode == "continuous" else cfg.max_batch_size,
                                            prefill_chunk=prefill_chunk or default_prefill_chunk(engine.device))
            self.scheduler = self.steps.scheduler
            self.scheduler.policy = policy
        else:
            self.scheduler = Scheduler(0, policy=policy)
        self._queue: deque[Job] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._batch_s = 0.05  # moving average of batch (continuous: step) time, for Retry-After
        self._held = 0  # places held by admitted requests whose bodies are still being read and parsed
        self._live: dict[Job, list[Sequence]] = {}  # completions generating, with their sequences
        self._alone: deque[Job] = deque()  # run to completion: a failed batch's jobs, each to run again alone
        self._round_s: float | None = None  # run to completion: model time of the completion batch running
        self._calls: deque[tuple[Callable[[], object], concurrent.futures.Future]] = deque()  # `call`'s, to run
        self.profiler: StepProfiler | None = None  # set by a server that profiles (--profile-dir): ticked each turn

    @property
    def depth(self) -> int:
        return len(self._queue)

    def check_room(self) -> None:
        """Raise Closed or QueueFull if a job submitted now would be refused: the server asks before it reads
        a request's body, so a refusal costs no parsing and no tokenising."""
        if self._closed:
            raise Closed("the server is shutting down")
        depth = len(self._queue) + self._held
        if depth >= self.cfg.max_queue:
            waves = math.ceil(depth / self.cfg.max_batch_size) + 1
            raise QueueFull(depth, max(1, math.ceil(waves * self._batch_s)))

    def hold(self) -> Place:
        """A place in the queue for a request admitted before its body is read (raises as `check_room`). Until
        it is submitted or let go, no later request can take it: under a burst, the requests let through
        are the ones the queue has room for, and none is parsed and tokenised only to be refused at
        `submit`."""
        with self._cv:
            self.check_room()
            self._held += 1
        return Place(self)

    def submit(self, job: Job, place: Place | None = None) -> concurrent.futures.Future:
        with self._cv:
            if place is None or not place.release():
                self.check_room()
            self._queue.append(job)
            self._cv.notify()
        return job.future

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run `fn` on the model thread between two turns, its result (or exception) in the future: what must run on
        the thread whose torch ops it acts on (a profiler records the ops of the thread that starts it)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._closed:
                raise Closed("the server is shutting down")
            self._calls.append((fn, future))
            self._cv.notify()
        return future

    def close(self) -> None:
        """Refuse new work, drop what is queued, and end `run` once the running work finishes (or is cut off by
        its jobs' cancellation)."""
        with self._cv:
            self._closed = True
            for job in self._queue:
                job.future.set_exception(Closed("the server shut down before this request ran"))
            self._queue.clear()
            self._cv.notify_all()

    # ---- the model thread ------------------------------------------------------------------------
    def run(self) -> None:
        """Turn until `close` and the last running request has ended: admit, run a slice of the scoring or
        classification batch, step, answer."""
        while (turn := self._next()) is not None:
            self._run_calls()
            if self.profiler is not None:
                self.profiler.tick()
            with phase(TURN):
                self._turn(*turn)
        self._run_calls()  # those queued before `close` (later ones were refused)
        if self.profiler is not None:  # what was profiled is written, not lost
            self.profiler.close()

    def _turn(self, taken: Admission, again: bool) -> None:
        with phase(PLAN):
            now = time.monotonic()
            self._admit(taken.complete, now, again)
            if taken.batch:
                self.scheduler.work = self._begin_slices(taken.batch, now)
            plan = self.steps.plan() if self.steps is not None else self.scheduler.schedule(False, False)
        if plan.slice_tokens is not None:
            self._slice(plan.slice_tokens)
        if plan.calls:
            self._step(plan)
        self._settle()

    def _run_calls(self) -> None:
        if not self._calls:  # every turn: no lock taken for nothing (one queued now runs at the next turn)
            return
        with self._cv:
            calls, self._calls = self._calls, deque()
        for fn, future in calls:
            try:
                future.set_result(fn())
            except Exception as e:  # noqa: BLE001 - the caller's to handle, not the model thread's
                future.set_exception(e)

    def _next(self) -> tuple[Admission, bool] | None:
        """What starts this turn (the scheduler's choice from the queue), and whether it is a failed batch's job run
        again alone (before anything else), once there is anything to do; None once closed with nothing left
        running."""
        with self._cv:
            while True:
                busy = self.scheduler.busy
                if self._closed and not busy:
                    return None
                if self._alone and not busy:
                    return Admission(complete=[self._alone.popleft()]), True
                taken = self.scheduler.admit(list(self._queue), time.monotonic()) if self._queue else Admission()
                if taken.complete or taken.batch or busy or self._calls:
                    chosen = {*taken.complete, *taken.batch}
                    self._queue = deque(job for job in self._queue if job not in chosen)
                    return taken, False
                self._cv.wait(taken.wait_s)

    def _admit(self, jobs: list[Job], now: float, again: bool = False) -> None:
        """Completion jobs' rows join the scheduler as sequences (a job run again after a failed batch is not
        counted again)."""
        live = []
        for job in jobs:
            if job.dropped(now):
                job.future.set_exception(DeadlineExceeded("the request's deadline passed while it was queued"))
                continue
            if self.metrics and not again:
                self.metrics.queue_seconds.observe(now - job.arrival)
                self.metrics.prompt_tokens.inc(sum(len(r) for r in job.rows))
            seqs = [Sequence(row, p, cancelled=partial(_dropped, job)) for row, p in zip(job.rows, job.params)]
            for i, seq in enumerate(seqs):
                seq.on_event = partial(self._event, job, i, seq)
            try:
                self.engine.text_tokenizer()  # completions are text: a model without a tokenizer cannot give them
                if self.steps is None:
                    raise EngineError(f"{self.engine.name} is a {self.engine.cfg.task} model; generation needs a "
                                      "language model")
                for seq in seqs:
                    self.steps.add(seq)
            except Exception as e:  # a row the engine refuses fails its request, not the ones running
                for seq in seqs:
                    self.scheduler.end(seq)
                _fail(job, e)
                continue
            self._live[job] = seqs
            live.append(job)
        if live and self.scheduler.policy.mode == "batch" and not again:
            self._round_s = 0.0  # a run-to-completion batch: its size now, its model time when it ends
            if self.metrics:
                self.metrics.batch_size.labels("complete").observe(sum(len(j.rows) for j in live))

    def _step(self, plan: Plan) -> None:
        """Run the plan's model calls (continuous: each step is a batch, in the metrics)."""
        t0 = time.monotonic()
        continuous = self.scheduler.policy.mode == "continuous"
        if self.metrics and continuous:
            self.metrics.batch_size.labels("complete").observe(len(plan.sequences))
        try:
            with self.engine.lock:
                self.steps.execute(plan)
        except Exception as e:
            return self._step_failed(e)
        dt = time.monotonic() - t0
        if continuous:
            self._batch_s = 0.8 * self._batch_s + 0.2 * dt
            if self.metrics:
                self.metrics.batch_seconds.labels("complete").observe(dt)
        elif self._round_s is not None:
            self._round_s += dt

    def _event(self, job: Job, i: int, seq: Sequence, event: StreamEvent) -> None:
        """Row i of `job` has text (or has ended): at the job's first, its time to first token (when the row's first
        token was chosen, not when the step ended), then the job's own callback (streaming)."""
        if job.first_token_at is None:
            job.first_token_at = seq.output.first_token_at or time.monotonic()
            if self.metrics:
                self.metrics.ttft.observe(job.first_token_at - job.arrival)
        if job.on_event is not None:
            job.on_event(i, event)

    def _step_failed(self, e: Exception) -> None:
        """A failed step leaves the cache in an unknown state: start afresh, and fail the requests that were in it.
        Run to completion, where several shared the batch, each that has given no token yet runs again alone, so
        that one bad request does not fail the others (not where no request can run now: the model unavailable)."""
        self.steps.reset()
        jobs, self._live = self._live, {}
        alone = self.scheduler.policy.mode == "batch" and len(jobs) > 1 and not isinstance(e, Unavailable)
        for job, seqs in jobs.items():
            if alone and not any(s.out for s in seqs):
                self._alone.append(job)
            else:
                _fail(job, e)

    def _settle(self) -> None:
        """Answer every request whose rows have all ended; end a run-to-completion batch once nothing runs."""
        now = time.monotonic()
        for job, seqs in list(self._live.items()):
            if not all(s.done for s in seqs):
                continue
            del self._live[job]
            completions = [s.completion() for s in seqs]
            if self.metrics:
                self.metrics.generation_tokens.inc(sum(c.completion_tokens for c in completions))
            if job.future.done():
                continue
            if job.dropped(now) or any(c.finish_reason == "cancelled" for c in completions):
                job.future.set_exception(DeadlineExceeded("the request's deadline passed while it was running"))
            else:
                job.future.set_result(completions)
        if self._round_s is not None and self.scheduler.idle and not self._alone:
            self._ended("complete", self._round_s)
            self._round_s = None

    def _begin_slices(self, batch: list[Job], now: float) -> SliceWork | None:
        """The taken scoring or classification jobs still wanted, as work run one model call at a time."""
        live = []
        for job in batch:
            if job.dropped(now):
                job.future.set_exception(DeadlineExceeded("the request's deadline passed while it was queued"))
            else:
                live.append(job)
                if self.metrics:
                    self.metrics.queue_seconds.observe(now - job.arrival)
        if not live:
            return None
        if self.metrics:  # counted before any answer leaves, so a client that reads /metrics sees it
            self.metrics.batch_size.labels(live[0].kind).observe(sum(len(j.rows) for j in live))
        return SliceWork(self.engine, live, self.metrics)

    def _slice(self, budget: int) -> None:
        work: SliceWork = self.scheduler.work
        if work.advance(budget):
            self.scheduler.work = None
            self._ended(work.kind, work.model_s)

    def _ended(self, kind: str, model_s: float) -> None:
        """A batch ended after `model_s` seconds in the model: Retry-After's estimate and the metrics."""
        self._batch_s = 0.8 * self._batch_s + 0.2 * model_s
        if self.metrics:
            self.metrics.batch_seconds.labels(kind).observe(model_s)


def _dropped(job: Job) -> bool:
    return job.dropped(time.monotonic())


def _fail(job: Job, e: Exception) -> None:
    if isinstance(e, Unavailable):
        log.warning("a %s request failed: %s", job.kind, e)
    elif not isinstance(e, UserError):  # the request's fault, not a bug
        log.error("a %s request failed", job.kind, exc_info=e)
    if not job.future.done():
        job.future.set_exception(e)


class SliceWork:
    """A batch of scoring or classification jobs run one model call at a time (`advance`), so that the model
    thread can step the running sequences between two calls of a long scoring request, and stops work whose
    requests have all gone (deadline or client) at the next call rather than after the last."""

    def __init__(self, engine: Engine, jobs: list[Job], metrics=None):
        self.engine, self.jobs, self.metrics, self.kind = engine, jobs, metrics, jobs[0].kind
        self._calls: Generator[int, int, None] | None = None
        self.model_s = 0.0  # time in the batch's own model calls

    def advance(self, budget: int) -> bool:
        """One model call of at most `budget` padded tokens (one window or text at least); True once the batch
        has ended: answered, failed, or dropped."""
        if all(job.dropped(time.monotonic()) for job in self.jobs):
            if self._calls is not None:
                self._calls.close()
            for job in self.jobs:
                if not job.future.done():
                    job.future.set_exception(DeadlineExceeded("the request's deadline passed while it was running"))
            return True
        t0, done = time.monotonic(), True
        try:
            if self._calls is None:
                self._calls = self.calls(self.jobs, budget)
                next(self._calls)
            else:
                self._calls.send(budget)
            done = False
        except StopIteration:
            pass
        except Exception as e:
            self._failed(e, budget)
        self.model_s += time.monotonic() - t0
        return done

    def _failed(self, e: Exception, budget: int) -> None:
        """A failed call fails every job at once where no request can run now (the model unavailable: 503 for each);
        else each job runs again alone, so that one bad request does not fail the others."""
        if len(self.jobs) == 1 or isinstance(e, Unavailable):
            for job in self.jobs:
                _fail(job, e)
            return
        for job in self.jobs:
            try:
                for _ in self.calls([job], budget):
                    pass
            except Exception as e1:
                _fail(job, e1)

    def calls(self, jobs: list[Job], budget: int) -> Generator[int, int, None]:
        """The jobs' model work, one engine call per step of the generator, then the answers. It yields each call's
        padded tokens and is sent the next call's token budget (`budget` the first's)."""
        owners = [(job, i) for job in jobs for i in range(len(job.rows))]
        rows = [job.rows[i] for job, i in owners]
        if jobs[0].kind == "score":
            results = [None] * len(rows)
            for stride in {job.stride for job in jobs}:  # jobs of one stride per engine call
                mine = [r for r, (job, _) in enumerate(owners) if job.stride == stride]
                scores = yield from self.engine.score_slices([rows[r] for r in mine], stride, budget)
                for r, score in zip(mine, scores):
                    results[r] = score
        else:
            results, start = [], 0
            while start < len(rows):
                end = batch_end([len(r) for r in rows], start, budget)
                results += self.engine.classify(rows[start:end])
                budget = yield (end - start) * max(len(r) for r in rows[start:end])
                start = end
        if self.metrics:
            self.metrics.prompt_tokens.inc(sum(len(r) for r in rows))
        now, start = time.monotonic(), 0
        for job in jobs:
            mine, start = results[start:start + len(job.rows)], start + len(job.rows)
            if job.future.done():
                continue
            if job.dropped(now):
                job.future.set_exception(DeadlineExceeded("the request's deadline passed while it was running"))
            else:
                job.future.set_result(mine)
