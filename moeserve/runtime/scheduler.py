"""The scheduler: what each step runs, decided on the host, without running the model.

Generation is a sequence of steps over a slot KV cache, which sequences join and leave at any step
(continuous batching). Before each step the scheduler (1) ends cancelled sequences and frees their slots,
(2) admits waiting sequences into free slots, at most `prefill_chunk` prompt tokens a step while others
are decoding (a long prompt is written over several steps, so running streams keep flowing), and (3) lists
the running sequences to decode. It returns this as a `Plan`, which the executor (steps.StepEngine) runs
on the model runner; as in vLLM's v1 scheduler, the plan is all the scheduler gives, and what the model
chose comes back as sequences ending (`end`).

Where the runner takes rows of any lengths in one call (`step_rows`), prompts' chunks share one call, and
the running sequences' tokens ride in it: a model call reads every expert's weights whatever its rows, so
prompts arriving together share one read instead of one each, and the decode rows ride on the prompt's
read instead of a read of their own. Unless the runner decodes on a compiled graph: then the decode rows
take the graph after the chunk, as vLLM runs its decode batch on a CUDA graph beside the prefill. When a
prompt's prefill ends, waiting sequences with the same prompt (a request's n choices) take free slots with
a copy of its cache rows instead of prefilling it again.

A server's requests reach the scheduler through `admit` (which queued requests join now), under a
`Policy`: "continuous" lets completions join running steps whenever their rows fit the free slots, and
runs scoring or classification a slice of model work between two steps; "batch" (run to completion) takes
a batch only when nothing is running, so nothing joins mid-flight.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from moeserve.runtime import SCHEDULERS
from moeserve.runtime.output import Completion, EventCallback, OutputProcessor
from moeserve.runtime.sampling import SamplingParams, TokenLogprob


def default_prefill_chunk(device: torch.device) -> int:
    """Prompt tokens a step while others generate, where none is given. A step's model call carries the running
    sequences' tokens with the prompt's chunk, so a small chunk costs them little throughput and stalls them less
    (measured on 2 CPU cores: docs/benchmarks.md, "Prefill chunk"). A GPU runs 512 prompt tokens in the time a CPU
    runs a few."""
    return 512 if device.type == "cuda" else 64


@dataclass(eq=False)
class Sequence:
    """One prompt being continued: what it asked for, where it is in the cache, and its output (set when the
    executor adds it: steps.StepEngine.add)."""

    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    on_event: EventCallback | None = None  # its stream events, on the executor's thread
    cancelled: Callable[[], bool] | None = None  # asked before each step; True ends it ("cancelled")
    slot: int | None = None
    prefilled: int = 0  # prompt tokens scheduled into its slot (written once the step's plan has run)
    budget: int = 0  # new tokens it may have: max_new_tokens, within the context
    generator: torch.Generator | None = None  # its own, seeded: its tokens do not depend on its neighbours
    output: OutputProcessor | None = None

    @property
    def out(self) -> list[int]:
        return self.output.token_ids if self.output is not None else []

    @property
    def finish_reason(self) -> str | None:
        return self.output.finish_reason if self.output is not None else None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return self.output.logprobs

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None]:
        return self.output.prompt_logprobs

    def completion(self) -> Completion:
        return self.output.completion()


@dataclass
class Prefill:
    """One model call that writes prompt tokens: row b writes seqs[b].prompt[starts[b]:starts[b] + takes[b]].
    `carry`: running sequences whose next token rides in the same call. `scored`: one sequence alone, with logits
    at every position (its prompt log-probabilities). `forks[b]`: once row b's prompt is complete, the waiting
    sequences with its prompt, given slots that take a copy of its cache rows."""

    seqs: list[Sequence]
    starts: list[int]
    takes: list[int]
    carry: list[Sequence] = field(default_factory=list)
    scored: bool = False
    forks: list[list[Sequence]] = field(default_factory=list)

    def complete(self, b: int) -> bool:
        """Whether row b writes the last of its prompt (its sequence and forks then choose their first token)."""
        return self.starts[b] + self.takes[b] == len(self.seqs[b].prompt)


@dataclass
class Plan:
    """One step, in the order it runs: a slice of the scoring work (run by the work's owner, the server's model
    thread: serve/batcher.py), the prefill calls and a decode call (run by the step engine: steps.py)."""

    ended: list[Sequence] = field(default_factory=list)  # cancelled before the step, their slots free
    slice_tokens: int | None = None  # the token budget of one call of the work in progress (None: none runs)
    prefills: list[Prefill] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)  # less any that end in the prefills

    @property
    def calls(self) -> bool:
        """Whether the step calls the model for any sequence."""
        return bool(self.prefills or self.decode)

    @property
    def sequences(self) -> set[Sequence]:
        """The sequences the step runs: prompts written, tokens carried or decoded, forks started."""
        seqs = {s for p in self.prefills for s in [*p.seqs, *p.carry, *(f for forks in p.forks for f in forks)]}
        return seqs | set(self.decode)


class Queued(Protocol):
    """A request waiting to be admitted (serve/batcher.py's Job): its kind, rows, padded cost and arrival."""

    kind: str
    rows: list[list[int]]
    arrival: float

    def cost(self) -> int: ...


@dataclass
class Policy:
    """How requests are admitted. continuous: completions join the running steps when their rows fit the free
    slots; a scoring or classification batch runs `slice_tokens` padded tokens between two steps, larger calls
    (`idle_slice_tokens`, which run faster) while nothing generates. batch: run to completion: a batch of the
    oldest request's kind is taken only when nothing runs, waiting up to `wait_s` from that request's arrival
    for others to join, within `max_batch_size` rows and `max_batch_tokens` padded tokens."""

    mode: str = "continuous"
    max_batch_size: int = 32
    max_batch_tokens: int = 16384
    wait_s: float = 0.005
    slice_tokens: int = 2048
    idle_slice_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.mode not in SCHEDULERS:
            raise ValueError(f"scheduler = {self.mode!r}: expected one of {', '.join(SCHEDULERS)}")


@dataclass
class Admission:
    """What `admit` takes from the queue: completions whose sequences join now, a scoring or classification batch
    that becomes the slice work, or (batch policy) how long to wait for more to join before taking anything."""

    complete: list[Any] = field(default_factory=list)
    batch: list[Any] = field(default_factory=list)
    wait_s: float | None = None


class Scheduler:
    """The sequences over `slots` cache slots (waiting, prefilling, running), the slice work in progress, and
    the policy that admits requests. One thread calls it: the executor's."""

    def __init__(self, slots: int, prefill_chunk: int = 512, *, share_prefill: bool = True,
                 policy: Policy | None = None):
        if slots < 0 or prefill_chunk < 1:
            raise ValueError(f"slots = {slots}, prefill_chunk = {prefill_chunk}: expected integers >= 0 and >= 1")
        self.slots, self.prefill_chunk, self.share_prefill = slots, prefill_chunk, share_prefill
        self.policy = policy or Policy()
        self._free = list(range(slots))  # a heap: the lowest free slot first, so live slots stay one range
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # holding a slot, prompt not yet fully written
        self.running: list[Sequence] = []  # decoding
        self.work: Any = None  # a scoring or classification batch in progress, run a slice at a time

    @property
    def idle(self) -> bool:
        """No sequence is live."""
        return not (self.waiting or self.prefilling or self.running)

    @property
    def busy(self) -> bool:
        return not self.idle or self.work is not None

    @property
    def free_slots(self) -> int:
        return len(self._free)

    # ---- sequences ---------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a sequence (its output set up); it joins at the next step with a free slot, or ends at once if
        there is nothing to compute."""
        if seq.budget == 0 and seq.params.prompt_logprobs is None:
            seq.output.finish("length")
            return
        self.waiting.append(seq)

    def end(self, seq: Sequence, reason: str | None = None) -> None:
        """A sequence leaves (its output ended with `reason` if given, else already ended): its slot is free for
        the next step."""
        if reason is not None:
            seq.output.finish(reason)
        for queue in (self.waiting, self.prefilling, self.running):
            if seq in queue:
                queue.remove(seq)
        if seq.slot is not None:
            heapq.heappush(self._free, seq.slot)
            seq.slot = None

    def drop_sequences(self) -> list[Sequence]:
        """Forget every live sequence (after a failed step, whose cache is in an unknown state); those dropped."""
        dropped = [*self.waiting, *self.prefilling, *self.running]
        self.waiting.clear()
        self.prefilling.clear()
        self.running.clear()
        self._free = list(range(self.slots))
        return dropped

    # ---- a step ---------------------------------------------------------------------------------------------
    def schedule(self, rows_together: bool = True, graph_decode: bool = False) -> Plan:
        """The next step. `rows_together`: the runner takes rows of any lengths in one call (`step_rows`);
        `graph_decode`: it decodes on a compiled graph (asked each step: a graph that failed goes eager)."""
        plan = Plan(ended=self._cancel())
        if self.work is not None:
            plan.slice_tokens = self._slice_tokens()
        decoding = list(self.running)
        carry = rows_together and not graph_decode
        plan.prefills = self._prefills(decoding if carry else [], rows_together)
        if not any(p.carry for p in plan.prefills):
            # on the graph: the rows that were decoding when the step began; else every running row, those whose
            # prompt was completed in this step too (their second token)
            plan.decode = decoding if graph_decode else list(self.running)
        return plan

    def _cancel(self) -> list[Sequence]:
        live = [*self.waiting, *self.prefilling, *self.running]
        ended = [s for s in live if s.cancelled is not None and s.cancelled()]
        for seq in ended:
            self.end(seq, "cancelled")
        return ended

    def _slice_tokens(self) -> int:
        """Small calls between decode steps, so the streams beside a long scoring request keep their pace; larger
        ones, which run faster, while no sequence is generating (run to completion: always the largest)."""
        p = self.policy
        if p.mode == "batch":
            return p.max_batch_tokens
        return min(p.idle_slice_tokens, p.max_batch_tokens) if self.idle else p.slice_tokens

    def _prefills(self, decoding: list[Sequence], rows_together: bool) -> list[Prefill]:
        """The step's prefill calls, as many as the budget allows, the first carrying `decoding`'s next tokens."""
        budget = self.prefill_chunk if self.running else math.inf  # nothing to keep flowing: no need to chunk
        calls: list[Prefill] = []
        carried = False
        while budget > 0:
            self._admit_sequences(budget)
            if not self.prefilling:
                break
            group, takes = self._group(budget, rows_together)
            scored = group[0].params.prompt_logprobs is not None  # then alone: logits at every position
            call = Prefill(group, [s.prefilled for s in group], takes, [] if carried or scored else decoding, scored)
            carried = carried or bool(call.carry)
            budget -= sum(takes)
            for b, seq in enumerate(group):
                seq.prefilled += takes[b]
                forks = []
                if call.complete(b):
                    self.prefilling.remove(seq)
                    forks = self._forks(seq)
                    self.running += [f for f in [seq, *forks] if f.budget > 0]  # budget 0: scored, ends after it
                call.forks.append(forks)
            calls.append(call)
        return calls

    def _admit_sequences(self, budget: float) -> None:
        """Waiting sequences take free slots, in arrival order, while this step's prompt budget has room for
        them; one with the prompt of a sequence being prefilled waits to start from its copy (`_forks`)."""
        pending = sum(len(s.prompt) - s.prefilled for s in self.prefilling)
        for seq in list(self.waiting):
            if not self._free or pending >= budget:
                return
            if self.share_prefill and any(p.prompt == seq.prompt for p in self.prefilling):
                continue
            self.waiting.remove(seq)
            seq.slot = heapq.heappop(self._free)
            self.prefilling.append(seq)
            pending += len(seq.prompt)

    def _group(self, budget: float, rows_together: bool) -> tuple[list[Sequence], list[int]]:
        """The sequences prefilled in one model call and how many prompt tokens each writes: prefilling sequences
        in order, each as much of its prompt as the budget has left. A model call reads every expert's weights
        whatever its rows, so prompts arriving together share one read instead of each stalling every running
        stream for a read of its own. Rows that ask for prompt log-probabilities, or a runner that cannot write
        several slots at once, go alone."""
        head = self.prefilling[0]
        scored = head.params.prompt_logprobs is not None
        takes = [int(min(budget, len(head.prompt) - head.prefilled, self.prefill_chunk if scored else math.inf))]
        group = [head]
        if scored or not rows_together:
            return group, takes
        left = budget - takes[0]
        for seq in self.prefilling[1:]:
            if left <= 0:
                break
            if seq.params.prompt_logprobs is None:
                group.append(seq)
                takes.append(int(min(len(seq.prompt) - seq.prefilled, left)))
                left -= takes[-1]
        return group, takes

    def _forks(self, seq: Sequence) -> list[Sequence]:
        """Waiting sequences with seq's prompt (and prompt log-probabilities), given free slots: the executor
        copies seq's cache rows into them, and they join without a prefill of their own."""
        if not self.share_prefill:
            return []
        forks = []
        for w in list(self.waiting):
            if not self._free:
                break
            if w.prompt == seq.prompt and w.params.prompt_logprobs == seq.params.prompt_logprobs:
                self.waiting.remove(w)
                w.slot = heapq.heappop(self._free)
                w.prefilled = len(seq.prompt)
                forks.append(w)
        return forks

    # ---- requests ---------------------------------------------------------------------------------------
    def admit(self, queued: list[Queued], now: float) -> Admission:
        """Which queued requests (in arrival order) start now, by the policy."""
        if self.policy.mode == "batch":
            return self._admit_batch(queued, now)
        free = self.free_slots - len(self.waiting)  # slots that admitted rows do not wait for
        out, rows, cost = Admission(), 0, 0
        blocked = False  # a completion that does not fit keeps every later completion behind it: none overtakes
        for job in queued:
            if job.kind == "complete":
                if not blocked and (len(job.rows) <= free or self.idle and not out.complete):
                    out.complete.append(job)
                    free -= len(job.rows)
                else:
                    blocked = True
            elif self.work is None and (not out.batch or self._fits(job, out.batch[0].kind, rows, cost)):
                out.batch.append(job)  # one scoring or classification batch at a time
                rows, cost = rows + len(job.rows), cost + job.cost()
        return out

    def _admit_batch(self, queued: list[Queued], now: float) -> Admission:
        """Run to completion: nothing joins a running batch; the next is the oldest request's kind, in arrival
        order within the limits (the oldest always, even over a limit alone)."""
        if self.busy or not queued:
            return Admission()
        first = queued[0]
        same = sum(len(j.rows) for j in queued if j.kind == first.kind)
        left = first.arrival + self.policy.wait_s - now
        if same < self.policy.max_batch_size and left > 0:  # a lone request waits at most wait_s for others
            return Admission(wait_s=left)
        batch, rows, cost = [], 0, 0
        for job in queued:
            if job is first or self._fits(job, first.kind, rows, cost):
                batch.append(job)
                rows, cost = rows + len(job.rows), cost + job.cost()
        return Admission(complete=batch) if first.kind == "complete" else Admission(batch=batch)

    def _fits(self, job: Queued, kind: str, rows: int, cost: int) -> bool:
        p = self.policy
        return job.kind == kind and rows + len(job.rows) <= p.max_batch_size and cost + job.cost() <= p.max_batch_tokens
