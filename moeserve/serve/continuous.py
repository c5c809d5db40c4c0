"""Continuous batching: completion requests join the engine's running steps instead of waiting for a batch.

The model thread loops over steps of the step engine (runtime/steps.py). Before each step it admits
queued completion requests whose rows fit the free cache slots (in arrival order: a request that does
not fit waits, and nothing overtakes it), and runs one model call of the one batch of scoring or
classification requests in progress (those have no steps to share, but a long one must not hold the
thread: a request's model work is capped, Job.work, and run a slice at a time, BatchConfig.slice_tokens).
A request's rows leave the step they end, and the request is answered as soon as its last row has; a
short request that arrives while a long one is generating is answered after its own tokens, not the
long one's.

The queue, its bound (429), deadlines and cancellation (504), and the shutdown drain behave as in
the run-to-completion batcher (batcher.py, `--scheduler batch`), which this one extends.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from moeserve.runtime.engine import Engine
from moeserve.runtime.steps import Sequence, StepEngine
from moeserve.serve.batcher import BatchConfig, Batcher, BatchWork, DeadlineExceeded, Job


def default_prefill_chunk(device: torch.device) -> int:
    """Prompt tokens a step while others generate, where none is given. A step's model call carries the running
    sequences' tokens with the prompt's chunk (steps.py), so a small chunk costs them little throughput and stalls
    them less. On 2 CPU cores (the 644M Mixtral in fp32, 8 clients asking 64 tokens after ~72-token prompts),
    chunks of 32, 64 and 256 tokens served 1.28-1.32, 1.29-1.33 and 1.30-1.39 requests/s, with a p99 gap between
    tokens of 170, 250 and 450-530 ms. A GPU runs 512 prompt tokens in the time a CPU runs a few."""
    return 512 if device.type == "cuda" else 64


class StepBatcher(Batcher):
    """The run-to-completion batcher's queue, with a step engine of `slots` cache slots behind it."""

    def __init__(self, engine: Engine, cfg: BatchConfig, metrics=None, *, slots: int = 8,
                 prefill_chunk: int | None = None):
        super().__init__(engine, cfg, metrics)
        self.steps: StepEngine = engine.step_engine(slots, prefill_chunk=prefill_chunk
                                                    or default_prefill_chunk(engine.device))
        self._live: dict[Job, list[Sequence]] = {}
        self._work: BatchWork | None = None  # a scoring or classification batch, one slice a turn

    def _next(self) -> tuple[list[Job], list[Job]] | None:
        """(completion jobs to admit, a batch of score / classify jobs) once there is anything to do; None
        once closed with nothing left running."""
        with self._cv:
            while not self._queue and self.steps.idle and self._work is None and not self._closed:
                self._cv.wait()
            if self._closed and self.steps.idle and self._work is None:
                return None
            free = self.steps.free_slots - len(self.steps.waiting)  # slots that admitted rows do not wait for
            admit, batch, keep, rows, cost = [], [], deque(), 0, 0
            blocked = False  # a completion that does not fit keeps every later completion behind it
            for job in self._queue:
                if job.kind == "complete":
                    if not blocked and (len(job.rows) <= free or not self._live and not admit):
                        admit.append(job)
                        free -= len(job.rows)
                    else:
                        blocked = True
                        keep.append(job)
                elif self._work is not None:  # one scoring or classification batch at a time
                    keep.append(job)
                elif not batch or (job.kind == batch[0].kind and rows + len(job.rows) <= self.cfg.max_batch_size
                                   and cost + job.cost() <= self.cfg.max_batch_tokens):
                    batch.append(job)
                    rows, cost = rows + len(job.rows), cost + job.cost()
                else:
                    keep.append(job)
            self._queue = keep
            return admit, batch

    def run(self) -> None:
        """Admit, run a slice of the scoring or classification batch, step, answer, until `close` and the last
        running request has ended. A long scoring request runs `slice_tokens` at a time between decode steps, as
        a long prompt runs in chunks, so the streams beside it keep their pace."""
        while (work := self._next()) is not None:
            admit, batch = work
            now = time.monotonic()
            for job in admit:
                if job.dropped(now):
                    job.future.set_exception(DeadlineExceeded("the request's deadline passed while it was queued"))
                else:
                    self._admit(job, now)
            if batch:
                self._work = self.begin(batch)
            # small calls between decode steps; larger ones, which run faster, while no sequence is generating
            budget = (min(self.cfg.idle_slice_tokens, self.cfg.max_batch_tokens) if self.steps.idle
                      else self.cfg.slice_tokens)
            if self._work is not None and self._work.advance(budget):
                self._work = None
            if not self.steps.idle:
                self._step()

    def _admit(self, job: Job, now: float) -> None:
        if self.metrics:
            self.metrics.queue_seconds.observe(now - job.arrival)
            self.metrics.prompt_tokens.inc(sum(len(r) for r in job.rows))

        seqs = [Sequence(row, p, on_token=(lambda t, text, lp, i=i: self._token(job, i, t, text, lp)),
                         cancelled=lambda: job.dropped(time.monotonic()))
                for i, (row, p) in enumerate(zip(job.rows, job.params))]
        try:
            self.engine.text_tokenizer()  # completions are text: a model without a tokenizer cannot give them
            for seq in seqs:
                self.steps.add(seq)
        except Exception as e:  # a row the engine refuses fails its request, not the ones running
            for seq in seqs:
                if seq in self.steps.waiting:
                    self.steps.waiting.remove(seq)
            return self._fail(job, e)
        self._live[job] = seqs
        self._settle()  # rows with nothing to generate (max_tokens 0) are done already

    def _step(self) -> None:
        t0 = time.monotonic()
        if self.metrics:
            self.metrics.batch_size.labels("complete").observe(len(self.steps.running) + len(self.steps.prefilling)
                                                               + min(len(self.steps.waiting), self.steps.free_slots))
        try:
            with self.engine.lock:
                self.steps.step()
        except Exception as e:  # a failed step leaves the cache in an unknown state: fail what ran, start afresh
            for job in list(self._live):
                self._fail(job, e)
            self._live.clear()
            self.steps = self.engine.step_engine(self.steps.slots, prefill_chunk=self.steps.prefill_chunk)
            return
        dt = time.monotonic() - t0
        self._batch_s = 0.8 * self._batch_s + 0.2 * dt
        if self.metrics:
            self.metrics.batch_seconds.labels("complete").observe(dt)
        self._settle()

    def _settle(self) -> None:
        """Answer every request whose rows have all ended."""
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
