"""GroupSupervisor's restarts (serve/ep_groups.py) with a stub group in place of Ray's: the back-off between starts,
a streak of failed starts given up (and the health check failing then), a group that served restarted at once, and
the router's ranks replaced by the new group's. The real teardown and restart run in test_ep_faults.py."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")

from moeserve.runtime.ep_rank import RankOptions  # noqa: E402
from moeserve.serve import ep_groups  # noqa: E402
from moeserve.serve.config import ExpertParallelOptions  # noqa: E402
from moeserve.serve.ep_groups import GroupSupervisor, _Place  # noqa: E402


class StubGroup:
    """What the supervisor uses of ep_ranks.RankGroup; `starts` says whether each new one comes up."""

    starts: list[bool] = []
    made: list["StubGroup"] = []

    def __init__(self, index, checkpoint=None, options=None, rank_options=None):
        self.index, self.actors, self.healthy, self.error, self.up_at, self.on_fail = index, ["a0", "a1"], False, \
            None, None, None
        self.stopped = False
        StubGroup.made.append(self)

    def begin(self):
        if not (StubGroup.starts.pop(0) if StubGroup.starts else True):
            raise RuntimeError("the checkpoint cannot load")

    def finish(self, deadline):
        self.healthy, self.up_at = True, time.monotonic()

    def fail(self, why):
        if self.healthy:
            self.healthy, self.error = False, why
            self.on_fail(self)

    def stop(self):
        self.healthy, self.stopped = False, True


def supervisor(monkeypatch, **options) -> tuple[GroupSupervisor, StubGroup]:
    monkeypatch.setattr(ep_groups, "RankGroup", StubGroup)
    StubGroup.starts, StubGroup.made = [], []
    o = ExpertParallelOptions(**{"restart_backoff_s": 0.01, "restart_backoff_max_s": 0.04, **options})
    sup = GroupSupervisor("ckpt", o, RankOptions())
    first = StubGroup(0)
    first.finish(0)
    first.on_fail = sup.failed
    sup.places = [_Place(first)]
    return sup, first


def wait(until, timeout_s=5.0):
    t0 = time.monotonic()
    while not until():
        assert time.monotonic() - t0 < timeout_s
        time.sleep(0.005)


def test_the_back_off_doubles_to_its_cap():
    sup = GroupSupervisor("ckpt", ExpertParallelOptions(), RankOptions())
    assert [sup._delay(k) for k in range(1, 10)] == [0, 2, 4, 8, 16, 32, 60, 60, 60]


def test_a_group_that_fails_is_torn_down_and_replaced(monkeypatch):
    sup, first = supervisor(monkeypatch)
    replaced = []
    sup.on_up = replaced.append
    first.fail("rank 1: ActorDiedError")
    wait(lambda: replaced)
    new = replaced[0]
    assert first.stopped and new is sup.groups[0] and new.healthy and new.on_fail == sup.failed
    assert sup.health() == [{"group": 0, "state": "serving", "restarts": 1, "last_error": "rank 1: ActorDiedError",
                             "last_restart_s": pytest.approx(0, abs=1)}]
    first.fail("again")  # a replaced group's failure is nobody's business
    assert sup.groups[0] is new and len(StubGroup.made) == 2
    assert sup.book.snapshot()[2] == {0: 1}  # moeserve_ep_group_restarts_total: one teardown, counted once
    sup.check()


def test_a_checkpoint_that_cannot_load_is_given_up_after_its_attempts(monkeypatch):
    sup, first = supervisor(monkeypatch, restart_attempts=3)
    StubGroup.starts = [False] * 10
    t0 = time.monotonic()
    first.fail("rank 0: step failed")
    wait(lambda: sup.health()[0]["state"] == "given up")
    # streak 1 starts at once; then 0.01, 0.02, (0.04 capped): three failed starts, with back-off between them
    assert len(StubGroup.made) == 1 + 3 and time.monotonic() - t0 >= 0.03
    assert all(g.stopped for g in StubGroup.made)
    with pytest.raises(RuntimeError, match="given up.*cannot load"):
        sup.check()


def test_a_stable_group_restarts_at_once_and_a_flapping_one_backs_off(monkeypatch):
    sup, first = supervisor(monkeypatch, restart_stable_s=0.5, restart_backoff_s=0.3, restart_backoff_max_s=0.3)
    first.up_at -= 1.0  # it served longer than restart_stable_s
    first.fail("x")
    wait(lambda: sup.groups[0] is not first)
    assert sup.places[0].streak == 0
    second = sup.groups[0]
    t0 = time.monotonic()
    second.fail("y")  # at once after coming up: the streak grows, but its first restart is immediate
    wait(lambda: sup.groups[0] is not second)
    third = sup.groups[0]
    third.fail("z")  # again: now it waits restart_backoff_s
    wait(lambda: sup.groups[0] is not third)
    assert sup.places[0].streak == 2 and time.monotonic() - t0 >= 0.3
