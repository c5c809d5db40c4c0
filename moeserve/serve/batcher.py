"""Dynamic batching: requests queue, and the thread that owns the model runs them in batches.

The event loop never runs the model: a handler submits a `Job` and awaits its future. The model thread
takes the oldest job, waits at most `wait_s` from that job's arrival for others of the same kind to
join (a lone request pays at most that wait; under load the queue fills while the previous batch
runs, so batches form with no wait), and runs up to `max_batch_size` rows and `max_batch_tokens`
padded tokens as one engine call. Each prompt keeps its own sampling parameters and seed, and the
engine makes every row compute what it would alone, so batching changes throughput, not answers.

The queue is bounded: `submit` refuses at once (`QueueFull`, with a retry-after estimate) rather than
letting latency grow without limit. A job whose deadline passes, or whose client leaves, is dropped:
skipped if it has not started, and cut off at its next token if it is generating, without holding up
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
from typing import Callable, Generator, Literal

from moeserve.errors import MoeServeError, UserError
from moeserve.serve.config import BatchConfig
from moeserve.runtime.engine import Engine, SamplingParams, TokenLogprob
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
    """A part the model needs (an expert shard on Ray: serve/ray_app.py) is not answering; the request can
    be retried once it is back."""


@dataclass(eq=False)
class Job:
    kind: Kind
    rows: list[list[int]]  # token ids per prompt / text, <bos> first
    params: list[SamplingParams] | None = None  # per row, for "complete"
    stride: int | None = None  # "score": rolling windows over rows longer than the context (None: the default)
    # (row of this job, token id, text, log-probability record or None), on the model thread
    on_token: Callable[[int, int, str, TokenLogprob | None], None] | None = None
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


class Batcher:
    """The queue, and the loop (`run`) that the one thread owning the model spends its life in."""

    def __init__(self, engine: Engine, cfg: BatchConfig, metrics=None):
        self.engine, self.cfg, self.metrics = engine, cfg, metrics
        self._queue: deque[Job] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._batch_s = 0.05  # moving average of batch time, for Retry-After
        self._held = 0  # places held by admitted requests whose bodies are still being read and parsed

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
        `submit` (before places were held, all 37 refusals of a burst of 40 at a queue of 2 came from there)."""
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

    def close(self) -> None:
        """Refuse new work, drop what is queued, and end `run` once the running batch finishes (or is
        cut off by its jobs' cancellation)."""
        with self._cv:
            self._closed = True
            for job in self._queue:
                job.future.set_exception(Closed("the server shut down before this request ran"))
            self._queue.clear()
            self._cv.notify_all()

    # ---- worker ----------------------------------------------------------------------------------
    def _take(self) -> list[Job] | None:
        """Block for the next batch: jobs of the oldest job's kind, in arrival order, within limits."""
        cfg = self.cfg
        with self._cv:
            while not self._queue and not self._closed:
                self._cv.wait()
            if self._closed:
                return None
            first = self._queue[0]
            while not self._closed:  # give others until first.arrival + wait_s to join
                rows = sum(len(j.rows) for j in self._queue if j.kind == first.kind)
                left = first.arrival + cfg.wait_s - time.monotonic()
                if rows >= cfg.max_batch_size or left <= 0:
                    break
                self._cv.wait(left)
            batch, rows, cost, keep = [], 0, 0, deque()
            for job in self._queue:
                fits = (job.kind == first.kind and rows + len(job.rows) <= cfg.max_batch_size
                        and cost + job.cost() <= cfg.max_batch_tokens)
                if fits or not batch and job is first:  # the oldest always runs, even if over a limit alone
                    batch.append(job)
                    rows, cost = rows + len(job.rows), cost + job.cost()
                else:
                    keep.append(job)
            self._queue = keep
            return batch

    def run(self) -> None:
        """Take and run batches until `close`."""
        while (batch := self._take()) is not None:
            self.run_batch(batch)

    def run_batch(self, batch: list[Job]) -> None:
        """Run taken jobs to the end (each alone if the call fails); jobs past their deadline are dropped, and the
        work stops between two model calls once every job of the batch has gone."""
        work = self.begin(batch)
        while work is not None and not work.advance(self.cfg.max_batch_tokens):
            pass

    def begin(self, batch: list[Job]) -> BatchWork | None:
        """The taken jobs still wanted, as work run one model call at a time (BatchWork.advance)."""
        now = time.monotonic()
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
        return BatchWork(self, live)

    def _token(self, job: Job, i: int, token: int, text: str, logprob: TokenLogprob | None) -> None:
        """A new token of row i of `job`: time to first token, then the job's own callback (streaming)."""
        if job.first_token_at is None:
            job.first_token_at = time.monotonic()
            if self.metrics:
                self.metrics.ttft.observe(job.first_token_at - job.arrival)
        if job.on_token is not None:
            job.on_token(i, token, text, logprob)

    @staticmethod
    def _fail(job: Job, e: Exception) -> None:
        if isinstance(e, Unavailable):
            log.warning("a %s request failed: %s", job.kind, e)
        elif not isinstance(e, UserError):  # the request's fault, not a bug
            log.error("a %s request failed", job.kind, exc_info=e)
        if not job.future.done():
            job.future.set_exception(e)

    def _calls(self, jobs: list[Job], budget: int) -> Generator[int, int, None]:
        """The jobs' model work, one engine call per step of the generator, then the answers. It yields each call's
        padded tokens and is sent the next call's token budget (`budget` the first's); a completion batch is one
        call."""
        owners = [(job, i) for job in jobs for i in range(len(job.rows))]
        rows = [job.rows[i] for job, i in owners]
        kind = jobs[0].kind
        if kind == "complete":
            params = [job.params[i] for job, i in owners]

            def on_token(r: int, token: int, text: str, logprob: TokenLogprob | None) -> None:
                job, i = owners[r]
                self._token(job, i, token, text, logprob)

            def cancel(r: int) -> bool:
                return owners[r][0].dropped(time.monotonic())

            results = self.engine.complete_ids(rows, params, on_token, cancel)
            yield sum(len(r) for r in rows)
        elif kind == "score":
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
                results += self.engine.classify_ids(rows[start:end])
                budget = yield (end - start) * max(len(r) for r in rows[start:end])
                start = end
        if self.metrics:
            self.metrics.prompt_tokens.inc(sum(len(r) for r in rows))
            if kind == "complete":
                self.metrics.generation_tokens.inc(sum(c.completion_tokens for c in results))
        now, start = time.monotonic(), 0
        for job in jobs:
            mine, start = results[start:start + len(job.rows)], start + len(job.rows)
            if job.future.done():
                continue
            if job.dropped(now) or any(getattr(c, "finish_reason", None) == "cancelled" for c in mine):
                job.future.set_exception(DeadlineExceeded("the request's deadline passed while it was running"))
            else:
                job.future.set_result(mine)


class BatchWork:
    """A taken batch run one model call at a time (`advance`), so that the model thread can step the running
    sequences between two calls of a long scoring request (continuous.py), and stops work whose requests have
    all gone (deadline or client) at the next call rather than after the last."""

    def __init__(self, batcher: Batcher, jobs: list[Job]):
        self.batcher, self.jobs, self.kind = batcher, jobs, jobs[0].kind
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
            return self._end()
        t0, done = time.monotonic(), True
        try:
            if self._calls is None:
                self._calls = self.batcher._calls(self.jobs, budget)
                next(self._calls)
            else:
                self._calls.send(budget)
            done = False
        except StopIteration:
            pass
        except Exception as e:
            self._failed(e, budget)
        self.model_s += time.monotonic() - t0
        return self._end() if done else False

    def _failed(self, e: Exception, budget: int) -> None:
        """A failed call fails every job at once where no request can run now (a shard unavailable: 503 for each);
        else each job runs again alone, so that one bad request does not fail the others."""
        if len(self.jobs) == 1 or isinstance(e, Unavailable):
            for job in self.jobs:
                self.batcher._fail(job, e)
            return
        for job in self.jobs:
            try:
                for _ in self.batcher._calls([job], budget):
                    pass
            except Exception as e1:
                self.batcher._fail(job, e1)

    def _end(self) -> bool:
        b = self.batcher
        b._batch_s = 0.8 * b._batch_s + 0.2 * self.model_s
        if b.metrics:
            b.metrics.batch_seconds.labels(self.kind).observe(self.model_s)
        return True
