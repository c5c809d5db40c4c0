"""The scheduler on its own, no model: the plan it emits for a step (prompt chunks, carried and decoded rows,
forks of one prefill, cancellation), and its two admission policies (continuous joins mid-flight; batch runs to
completion, waiting at most wait_s for a batch to form)."""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.runtime.output import OutputProcessor
from moeserve.runtime.sampling import SamplingParams
from moeserve.runtime.scheduler import Policy, Scheduler, Sequence


def seq(prompt: list[int], new: int = 4, **kw) -> Sequence:
    s = Sequence(prompt, SamplingParams(max_new_tokens=new), **kw)
    s.budget = new
    s.output = OutputProcessor(None, None, s.params, len(prompt), new)
    return s


def test_a_prompt_joining_running_rows_is_chunked_and_carries_their_tokens():
    sched = Scheduler(slots=2, prefill_chunk=4)
    a, b = seq(list(range(6))), seq(list(range(10, 20)))
    sched.add(a)
    plan = sched.schedule()
    [call] = plan.prefills
    assert (call.seqs, call.starts, call.takes, call.carry) == ([a], [0], [6], [])  # nothing runs: no chunking
    assert plan.decode == [a]  # its second token in the same step (no running row to ride on)
    a.output.accept(1, None)
    a.output.accept(2, None)
    sched.add(b)
    plan = sched.schedule()
    [call] = plan.prefills
    assert (call.seqs, call.starts, call.takes, call.carry, plan.decode) == ([b], [0], [4], [a], [])
    assert (b.slot, b.prefilled) == (1, 4)  # the scheduler's bookkeeping; the model has not run
    on_graph = sched.schedule(graph_decode=True)  # a compiled decode step: the running row takes the graph
    assert (on_graph.prefills[0].starts, on_graph.prefills[0].carry, on_graph.decode) == ([4], [], [a])
    alone = sched.schedule(rows_together=False)  # a runner without step_rows: the running row decodes after
    assert (alone.prefills[0].takes, alone.prefills[0].carry, alone.decode) == ([2], [], [a, b])


def test_n_choices_share_one_prefill_and_cancellation_frees_the_slot():
    flag = {"cancel": False}
    first, second = seq([1, 2, 3], cancelled=lambda: flag["cancel"]), seq([1, 2, 3])
    third = seq([7, 8])
    sched = Scheduler(slots=2)
    sched.add(first)
    sched.add(second)
    plan = sched.schedule()
    [call] = plan.prefills
    assert call.seqs == [first] and call.forks == [[second]] and second.slot == 1  # a copy, not a prefill
    sched.add(third)
    assert sched.running == [first, second] and sched.schedule().prefills == []  # no slot left: third waits
    flag["cancel"] = True
    plan = sched.schedule()
    assert plan.ended == [first] and first.finish_reason == "cancelled" and first.slot is None
    assert [c.seqs for c in plan.prefills] == [[third]] and third.slot == 0  # admitted in the same step


@dataclass(eq=False)
class Job:
    kind: str
    rows: list[list[int]]
    arrival: float = 0.0

    def cost(self) -> int:
        return len(self.rows) * max(len(r) for r in self.rows)


def test_continuous_admits_what_fits_in_order_and_one_slice_batch():
    sched = Scheduler(slots=2)
    big, small, score = Job("complete", [[1]] * 3), Job("complete", [[1]]), Job("score", [[1, 2]])
    got = sched.admit([small, big, Job("complete", [[2]]), score], now=0.0)
    assert got.complete == [small] and got.batch == [score]  # big does not fit: nothing overtakes it
    assert sched.admit([big], now=0.0).complete == [big]  # alone with nothing running, over the slots
    sched.add(seq([1]))
    assert sched.admit([big], now=0.0).complete == []


def test_run_to_completion_waits_for_a_batch_and_admits_nothing_mid_flight():
    sched = Scheduler(slots=4, policy=Policy("batch", max_batch_size=3, wait_s=0.5))
    a, b, c, d = (Job("complete", [[i]], arrival=0.0) for i in range(4))
    assert sched.admit([a], now=0.1).wait_s == 0.4  # a lone request waits at most wait_s for others
    assert sched.admit([a, Job("score", [[1]]), b], now=0.6).complete == [a, b]  # its kind, in order
    assert sched.admit([a, b, c, d], now=0.1).complete == [a, b, c]  # a full batch goes at once
    sched.add(seq([1]))
    assert sched.admit([a, b], now=9.0).complete == []  # nothing joins a running batch
