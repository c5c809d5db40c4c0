"""Per-rank and per-group metrics of `--expert-parallel` serving, from the counters each rank returns to the
supervisor's health probe (RankActor.check_health -> EPRank.counters), so they cost no call of their own.

    GroupSupervisor.probe, every probe_every_s -> RankBook.update(group, [counters of each rank]) -> the last
    snapshot per (group, rank), and the group's imbalance over the probe window -> RankCollector at /metrics

Series, labelled `group` and `rank` (the imbalance: `group`):
- moeserve_ep_all_to_all_seconds (histogram): per MoE layer call, the rank's time in the exchange's three
  all-to-alls (the expert compute between them excluded); on NCCL the launches only (ExchangeStats);
- moeserve_ep_routed_rows_total: rows this rank's tokens sent to experts (a token counts once per expert);
- moeserve_ep_computed_rows_total: rows this rank's experts (and copies of others') computed; over a group
  they add up to its routed rows;
- moeserve_ep_exchanged_rows_total{direction = sent | received}: rows that crossed to or from another rank;
- moeserve_ep_queue_depth, moeserve_ep_running_sequences: waiting for a slot or step, and holding a slot;
- moeserve_ep_expert_imbalance{group}: the busiest rank's computed rows over the mean across the group's ranks,
  over the last probe window in which the group computed any (1: balanced, N: one rank does everything; kept
  through idle windows; absent before the first). Over any window, from the counter:
  `max by (group) (rate(moeserve_ep_computed_rows_total[5m])) / avg by (group) (rate(...[5m]))`;
- moeserve_ep_group_restarts_total{group}: times the supervisor tore the group down after a failure (a rank's
  failed step, stalled loop or death) to start it again (ep_groups.py); 0 from the start, kept while the group is
  down, so an alert on its increase sees a group that flaps.

A restarted group's counters start again from 0 (a counter reset, which rate() handles); a group that is down
has no series until it serves again. The snapshot is as old as the last probe (half a second by default).
"""

from __future__ import annotations

import threading
from typing import Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from moeserve.runtime.expert_parallel import A2A_BUCKETS

__all__ = ["RankBook", "RankCollector", "window_imbalance"]


def window_imbalance(before: Sequence[int] | None, after: Sequence[int]) -> float | None:
    """The busiest rank's rows over the mean, of the rows each rank computed between two snapshots of its
    counter (`before` None: since 0); None when no rank computed any in the window. A counter that went down
    (a restarted rank) counts from 0."""
    if before is None or len(before) != len(after):
        before = [0] * len(after)
    rows = [a - b if a >= b else a for a, b in zip(after, before)]
    total = sum(rows)
    return None if total <= 0 else max(rows) * len(rows) / total


class RankBook:
    """The last counters of every rank of every serving group, and each group's imbalance (module docstring).
    Written by the supervisor's watch thread, read by /metrics scrapes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ranks: dict[int, tuple[object, list[dict]]] = {}  # group index -> (its group's identity, per rank)
        self.imbalance: dict[int, float] = {}  # group index -> the last window's with rows
        self.restarts: dict[int, int] = {}  # group index -> its teardowns for a restart (GroupSupervisor.failed)

    def places(self, groups: int) -> None:
        """The groups' places, each with no restart yet (their counters' series from the start)."""
        with self._lock:
            for g in range(groups):
                self.restarts.setdefault(g, 0)

    def restarted(self, group: int) -> None:
        """The supervisor tears group `group` down to start it again: one more restart, and no rank series of it
        until it serves again."""
        with self._lock:
            self.restarts[group] = self.restarts.get(group, 0) + 1
            self.ranks.pop(group, None)
            self.imbalance.pop(group, None)

    def update(self, group: int, counters: list[dict], identity: object = None) -> None:
        """Every rank's counters of group `group` from one probe. `identity` tells a restarted group (a new
        one in the same place) from the one before, whose counters this one's do not continue."""
        with self._lock:
            last = self.ranks.get(group)
            before = None
            if last is not None and last[0] == identity:
                before = [c["rows_computed"] for c in last[1]]
            elif last is not None:
                self.imbalance.pop(group, None)
            w = window_imbalance(before, [c["rows_computed"] for c in counters])
            if w is not None:
                self.imbalance[group] = w
            self.ranks[group] = (identity, counters)

    def snapshot(self) -> tuple[dict[int, list[dict]], dict[int, float], dict[int, int]]:
        with self._lock:
            return ({g: list(c) for g, (_, c) in sorted(self.ranks.items())}, dict(self.imbalance),
                    dict(sorted(self.restarts.items())))


class RankCollector(Collector):
    """The series of the module docstring, from a RankBook when scraped."""

    def __init__(self, book: RankBook):
        self.book = book

    def collect(self) -> Iterable[Metric]:
        ranks, imbalance, restarts = self.book.snapshot()
        labels = ["group", "rank"]
        a2a = HistogramMetricFamily("moeserve_ep_all_to_all_seconds", "Per MoE layer call, the rank's time in the "
                                    "exchange's all-to-alls (counts, rows out, rows back; expert compute excluded)",
                                    labels=labels)
        routed = CounterMetricFamily("moeserve_ep_routed_rows", "Rows this rank's tokens sent to experts, its own "
                                     "included (a token counts once per expert)", labels=labels)
        computed = CounterMetricFamily("moeserve_ep_computed_rows", "Rows this rank's experts and expert copies "
                                       "computed, for every rank of its group", labels=labels)
        exchanged = CounterMetricFamily("moeserve_ep_exchanged_rows", "Rows sent to or received from the group's "
                                        "other ranks", labels=[*labels, "direction"])
        queued = GaugeMetricFamily("moeserve_ep_queue_depth", "Sequences and scoring jobs waiting on the rank for "
                                   "a cache slot or a step", labels=labels)
        running = GaugeMetricFamily("moeserve_ep_running_sequences", "Sequences holding one of the rank's cache "
                                    "slots (prefilling or decoding)", labels=labels)
        for g, counters in ranks.items():
            for r, c in enumerate(counters):
                ids = [str(g), str(r)]
                cumulative, buckets = 0, []
                for bound, n in zip([*map(str, A2A_BUCKETS), "+Inf"], c["all_to_all_buckets"]):
                    cumulative += n
                    buckets.append((bound, cumulative))
                a2a.add_metric(ids, buckets, c["all_to_all_s"])
                routed.add_metric(ids, c["rows_routed"])
                computed.add_metric(ids, c["rows_computed"])
                exchanged.add_metric([*ids, "sent"], c["rows_sent"])
                exchanged.add_metric([*ids, "received"], c["rows_received"])
                queued.add_metric(ids, c["queued"])
                running.add_metric(ids, c["running"])
        gauge = GaugeMetricFamily("moeserve_ep_expert_imbalance", "The busiest rank's computed rows over the mean "
                                  "across the group's ranks, over the last probe window with any (1 = balanced)",
                                  labels=["group"])
        for g, value in sorted(imbalance.items()):
            gauge.add_metric([str(g)], value)
        restarted = CounterMetricFamily("moeserve_ep_group_restarts", "Times the group was torn down after a failure "
                                        "(a rank's failed step, stalled loop or death) to be started again",
                                        labels=["group"])
        for g, n in restarts.items():
            restarted.add_metric([str(g)], n)
        yield from (a2a, routed, computed, exchanged, queued, running, gauge, restarted)
