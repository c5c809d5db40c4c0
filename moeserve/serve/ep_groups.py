"""The life of the expert-parallel groups behind one ingress: started together, watched, and each torn down and
started again as a unit when one of its ranks fails.

    start: every group placed, joined and loaded (ep_ranks.start_groups) -> serving
    watch (a thread): every probe_every_s, each rank of each serving group is asked RankActor.check_health (a dead
           actor answers at once with its death; a failed step, an ended loop or a loop stalled with work raise);
           a healthy rank answers with its counters, kept in `book` for the per-rank metrics (ep_metrics.py)
    a failure (the watch's, or the router's: a rank that failed a request as a group) -> RankGroup.fail: the group
           takes no more requests at once, one more of its restarts is counted (`book`: the
           moeserve_ep_group_restarts_total metric), and a thread of its own:
      -> tear down: kill its actors and remove its placement group; the requests still on its ranks end there (their
         streams raise the actors' death: 503, or an error event mid-stream, in the router)
      -> wait the back-off (below), then a new group in the same place: a new placement group, a new rendezvous,
         loading and warm-up -> the router's ranks of that group replaced (`on_up`) -> serving again

Bounded restarts. A group that served for restart_stable_s or more is restarted at once. A start that fails, or a
group that fails sooner than restart_stable_s after coming up, counts in a streak; the next start waits
restart_backoff_s * 2^(streak - 2) (none for the first), at most restart_backoff_max_s; after restart_attempts of them
in a row the group is given up: `check` raises, so Serve's health check fails and Serve replaces the ingress (with its
own back-off). A checkpoint that cannot load therefore tries about eight times over some three minutes, not hot.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import ray

from moeserve.runtime.ep_rank import RankOptions
from moeserve.serve.config import ExpertParallelOptions
from moeserve.serve.ep_metrics import RankBook
from moeserve.serve.ep_ranks import RankGroup, start_groups

__all__ = ["GroupSupervisor"]

log = logging.getLogger("moeserve.serve")
PROBE_TIMEOUT_S = 10.0  # a rank whose actor does not answer its health check in this long is unhealthy


class _Place:
    """One group's place (its index): the group now there, and its restarts."""

    def __init__(self, group: RankGroup):
        self.group = group
        self.state = "serving"  # serving | restarting | given up
        self.streak = 0  # failures in a row: failed starts, and groups that failed soon after coming up
        self.restarts = 0  # groups started here after the first
        self.last_error: str | None = None
        self.down_at: float | None = None  # when the last failure was seen
        self.restart_s: float | None = None  # the last restart's time, from the failure to serving again


class GroupSupervisor:
    """The groups of one ingress (module docstring). `on_up(group)` is called from a restart's thread with each new
    group once it serves (the router replaces that place's ranks)."""

    def __init__(self, checkpoint: str, options: ExpertParallelOptions, rank_options: RankOptions):
        self.checkpoint, self.options, self.rank_options = checkpoint, options, rank_options
        self.on_up: Callable[[RankGroup], None] | None = None
        self.places: list[_Place] = []
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._watch: threading.Thread | None = None
        self.book = RankBook()  # every serving rank's counters, from the probe (ep_metrics.py)

    @property
    def groups(self) -> list[RankGroup]:
        return [p.group for p in self.places]

    def start(self) -> list[RankGroup]:
        """Every group up (or the error that stopped one, every group torn down); the watch started."""
        groups = start_groups(self.checkpoint, self.options, self.rank_options)
        self.places = [_Place(g) for g in groups]
        self.book.places(len(groups))
        for g in groups:
            g.on_fail = self.failed
        self._watch = threading.Thread(target=self._watching, name="moeserve-ep-watch", daemon=True)
        self._watch.start()
        return groups

    # ---- failures ------------------------------------------------------------------------------------------------
    def failed(self, group: RankGroup) -> None:
        """RankGroup.fail's hook, once per group: its teardown and restart, on a thread of their own."""
        with self._lock:
            place = self.places[group.index]
            if place.group is not group or self._stopped.is_set():
                return  # an earlier group of this place, already replaced; or shutting down
            place.state, place.last_error, place.down_at = "restarting", group.error, time.monotonic()
            self.book.restarted(group.index)  # moeserve_ep_group_restarts_total; its rank series gone until it serves
            stable = group.up_at is not None and place.down_at - group.up_at >= self.options.restart_stable_s
            place.streak = 0 if stable else place.streak + 1
        log.warning("expert-parallel group %d failed (%s): tearing it down and restarting it", group.index, group.error)
        threading.Thread(target=self._restart, args=(place, group), name=f"moeserve-ep-restart-{group.index}",
                         daemon=True).start()

    def _delay(self, streak: int) -> float:
        o = self.options
        return 0.0 if streak <= 1 else min(o.restart_backoff_max_s, o.restart_backoff_s * 2 ** (streak - 2))

    def _restart(self, place: _Place, old: RankGroup) -> None:
        old.stop()  # its ranks' requests end now: their streams raise the actors' death
        o = self.options
        while not self._stopped.is_set():
            if place.streak > o.restart_attempts:
                with self._lock:
                    place.state = "given up"
                log.error("expert-parallel group %d given up after %d failed restarts in a row: %s", old.index,
                          place.streak - 1, place.last_error)
                return
            if self._stopped.wait(self._delay(place.streak)):
                return
            group = RankGroup(old.index, self.checkpoint, o, self.rank_options)
            try:
                group.begin()
                group.finish(time.monotonic() + o.ready_timeout_s)
            except Exception as e:
                group.stop()
                with self._lock:
                    place.streak += 1
                    place.last_error = f"restart failed: {type(e).__name__}: {e}"
                log.warning("expert-parallel group %d did not start again (%s)", old.index, place.last_error)
                continue
            with self._lock:
                if self._stopped.is_set():
                    group.stop()
                    return
                group.on_fail = self.failed
                place.group, place.state = group, "serving"
                place.restarts += 1
                place.restart_s = time.monotonic() - place.down_at
            log.warning("expert-parallel group %d serves again, %.1f s after its failure", old.index, place.restart_s)
            if self.on_up is not None:
                self.on_up(group)
            return

    # ---- the watch -----------------------------------------------------------------------------------------------
    def _watching(self) -> None:
        while not self._stopped.wait(self.options.probe_every_s):
            try:
                self.probe()
            except Exception:  # the watch must outlive any one probe
                log.exception("expert-parallel health probe failed")

    def probe(self) -> None:
        """Ask every rank of every serving group whether it is healthy; fail the groups of those that are not."""
        asked = [(g, r, a.check_health.remote(self.options.stall_s)) for g in self.groups if g.healthy
                 for r, a in enumerate(g.actors)]
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        answers: dict[RankGroup, list] = {}
        for group, rank, ref in asked:
            if not group.healthy:
                continue
            try:
                answers.setdefault(group, []).append(ray.get(ref, timeout=max(0.01, deadline - time.monotonic())))
            except Exception as e:
                group.fail(f"rank {rank}: {type(e).__name__}: {_last_line(e)}")
        for group, counters in answers.items():  # each healthy rank's counters: the per-rank metrics
            if group.healthy and len(counters) == len(group.actors) and all(isinstance(c, dict) for c in counters):
                self.book.update(group.index, counters, identity=getattr(group, "name", None))

    # ---- reports -------------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Raises where a group has been given up or the watch has stopped (the ingress's health check)."""
        given_up = [p for p in self.places if p.state == "given up"]
        if given_up:
            raise RuntimeError("expert-parallel group(s) given up after repeated failed restarts: "
                               + "; ".join(f"group {p.group.index}: {p.last_error}" for p in given_up))
        if self._watch is not None and not self._watch.is_alive() and not self._stopped.is_set():
            raise RuntimeError("the expert-parallel groups' health watch has stopped")

    def health(self) -> list[dict]:
        """Each group's state, restarts and last error (for /readyz)."""
        with self._lock:
            return [{"group": i, "state": p.state, "restarts": p.restarts, "last_error": p.last_error,
                     "last_restart_s": p.restart_s} for i, p in enumerate(self.places)]

    def stop(self) -> None:
        """Stop watching and restarting, and tear every group down."""
        self._stopped.set()
        for p in self.places:
            p.group.stop()


def _last_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[-1] if text else ""
