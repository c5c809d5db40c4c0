"""The expert-parallel ranks' metrics (serve/ep_metrics.py) on synthetic counters: the imbalance over a probe
window, a restarted group's counters, the series at /metrics with their group and rank labels, and the copy of the
scrape-time histogram into Ray's twins (serve/ray_metrics.py)."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from moeserve.runtime.expert_parallel import A2A_BUCKETS
from moeserve.serve.ep_metrics import RankBook, RankCollector, window_imbalance


def counters(computed: int, routed: int = 0, buckets: dict[int, int] | None = None, a2a_s: float = 0.0,
             queued: int = 0, running: int = 0) -> dict:
    """One rank's EPRank.counters, made up."""
    b = [0] * (len(A2A_BUCKETS) + 1)
    for i, n in (buckets or {}).items():
        b[i] = n
    return {"calls": sum(b), "all_to_all_s": a2a_s, "all_to_all_buckets": b, "rows_sent": computed // 2,
            "rows_received": computed // 3, "rows_computed": computed, "rows_routed": routed, "queued": queued,
            "running": running}


def test_window_imbalance_is_the_busiest_rank_over_the_mean_of_the_window():
    assert window_imbalance(None, [30, 10]) == 1.5  # since 0
    assert window_imbalance([30, 10], [60, 20]) == 1.5  # 30 and 10 in the window
    assert window_imbalance([10, 10], [30, 30]) == 1.0
    assert window_imbalance([0, 0, 0, 0], [8, 0, 0, 0]) == 4.0  # one rank of four does everything
    assert window_imbalance([30, 10], [30, 10]) is None  # an idle window says nothing
    assert window_imbalance([100, 10], [20, 30]) == 1.0  # rank 0 started again from 0: 20 and 20
    assert window_imbalance([1, 2, 3], [5, 5]) == pytest.approx(5 / 5)  # another group's shape: since 0


def test_the_book_keeps_the_last_window_with_rows_and_starts_a_restarted_group_afresh():
    book = RankBook()
    book.update(0, [counters(30), counters(10)], identity="g0")
    assert book.snapshot()[1] == {0: 1.5}
    book.update(0, [counters(40), counters(40)], identity="g0")  # 10 and 30 in the window
    assert book.snapshot()[1] == {0: 1.5}
    book.update(0, [counters(50), counters(50)], identity="g0")  # 10 and 10
    assert book.snapshot()[1] == {0: 1.0}
    book.update(0, [counters(50), counters(50)], identity="g0")  # idle: the last window with rows stays
    assert book.snapshot()[1] == {0: 1.0}
    book.update(1, [counters(4), counters(0)], identity="g1")
    assert book.snapshot()[1] == {0: 1.0, 1: 2.0}
    book.update(0, [counters(50), counters(50)], identity="g0-restarted")  # a new group in place 0: from 0
    assert book.snapshot()[1] == {0: 1.0, 1: 2.0}
    book.update(0, [counters(60), counters(50)], identity="g0-restarted")
    assert book.snapshot()[1] == {0: 2.0, 1: 2.0}
    book.restarted(1)  # torn down to start again: no series of it until it serves, one restart more
    ranks, imbalance, restarts = book.snapshot()
    assert list(ranks) == [0] and imbalance == {0: 2.0} and restarts == {1: 1}


def scrape(book: RankBook) -> dict[tuple, float]:
    registry = CollectorRegistry()
    registry.register(RankCollector(book))
    return {(s.name, *sorted(s.labels.items())): s.value
            for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}


def test_the_series_carry_group_and_rank_labels():
    book = RankBook()
    book.update(0, [counters(30, routed=25, buckets={2: 3, 5: 1}, a2a_s=0.02, queued=2, running=1),
                    counters(10, routed=15, buckets={2: 4}, a2a_s=0.003)], identity="g0")
    got = scrape(book)
    r0, r1 = (("group", "0"), ("rank", "0")), (("group", "0"), ("rank", "1"))
    assert got[("moeserve_ep_routed_rows_total", *r0)] == 25 and got[("moeserve_ep_routed_rows_total", *r1)] == 15
    assert got[("moeserve_ep_computed_rows_total", *r0)] == 30
    assert got[("moeserve_ep_computed_rows_total", *r1)] == 10
    assert got[("moeserve_ep_exchanged_rows_total", ("direction", "sent"), *r0)] == 15
    assert got[("moeserve_ep_exchanged_rows_total", ("direction", "received"), *r0)] == 10
    assert got[("moeserve_ep_queue_depth", *r0)] == 2 and got[("moeserve_ep_running_sequences", *r0)] == 1
    assert got[("moeserve_ep_expert_imbalance", ("group", "0"))] == 1.5
    # cumulative buckets: 3 calls in the third bucket, 1 in the sixth
    le = [str(b) for b in A2A_BUCKETS]
    assert [got[("moeserve_ep_all_to_all_seconds_bucket", *r0[:1], ("le", b), *r0[1:])] for b in le[:6]] == \
        [0, 0, 3, 3, 3, 4]
    assert got[("moeserve_ep_all_to_all_seconds_bucket", *r0[:1], ("le", "+Inf"), *r0[1:])] == 4
    assert got[("moeserve_ep_all_to_all_seconds_count", *r0)] == 4
    assert got[("moeserve_ep_all_to_all_seconds_sum", *r1)] == pytest.approx(0.003)
    assert not any(k[0] == "moeserve_ep_group_restarts_total" for k in got)  # no place known yet
    book.places(2)  # each place's restart counter from the start, at 0
    book.update(1, [counters(3), counters(2)], identity="g1")
    assert [scrape(book)[("moeserve_ep_group_restarts_total", ("group", g))] for g in "01"] == [0, 0]
    book.restarted(1)
    got = scrape(book)
    assert [got[("moeserve_ep_group_restarts_total", ("group", g))] for g in "01"] == [0, 1]
    assert not [k for k in got if ("group", "1") in k and k[0] != "moeserve_ep_group_restarts_total"]  # until it serves
    assert scrape(RankBook()) == {}  # no group yet: no series


def test_the_histogram_and_counters_reach_rays_twins(monkeypatch):
    pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    from moeserve.serve import ray_metrics

    class Twin:
        def __init__(self, kind, name, doc, labels, buckets=None):
            self.kind, self.name, self.labels, self.buckets, self.got = kind, name, labels, buckets, []

        def observe(self, value, tags):
            self.got.append(("observe", value, tags))

        def inc(self, value, tags):
            self.got.append(("inc", value, tags))

        def set(self, value, tags):
            self.got.append(("set", value, tags))

    made: dict[str, Twin] = {}
    monkeypatch.setattr(ray_metrics, "twin", lambda *a: made.setdefault(a[1], Twin(*a)))
    book = RankBook()
    metrics = type("M", (), {"collectors": [RankCollector(book)]})()
    copier = ray_metrics.ScrapeTimeCopier(metrics)
    book.update(0, [counters(30, routed=25, buckets={2: 2}), counters(10, routed=15)], identity="g0")
    copier.copy()
    h = made["moeserve_ep_all_to_all_seconds"]
    assert h.kind == "histogram" and h.labels == ("group", "rank") and h.buckets[:-1] == list(A2A_BUCKETS)
    mid = (A2A_BUCKETS[1] + A2A_BUCKETS[2]) / 2
    assert h.got == [("observe", mid, {"group": "0", "rank": "0"})] * 2
    book.update(0, [counters(40, routed=30, buckets={2: 3, 12: 1}), counters(10, routed=15)], identity="g0")
    copier.copy()  # only the new calls: one more in bucket 2, one past the last bound
    assert h.got[2:] == [("observe", mid, {"group": "0", "rank": "0"}),
                         ("observe", 2 * A2A_BUCKETS[-1], {"group": "0", "rank": "0"})]
    routed = made["moeserve_ep_routed_rows"].got
    assert routed == [("inc", 25, {"group": "0", "rank": "0"}), ("inc", 15, {"group": "0", "rank": "1"}),
                      ("inc", 5, {"group": "0", "rank": "0"})]
    book.update(0, [counters(4, routed=3), counters(1, routed=2)], identity="g0-restarted")
    copier.copy()  # a restarted group's counters start again from 0: all of theirs is new
    assert routed[3:] == [("inc", 3, {"group": "0", "rank": "0"}), ("inc", 2, {"group": "0", "rank": "1"})]
    assert ("set", 1.5, {"group": "0"}) in made["moeserve_ep_expert_imbalance"].got
    assert not math.isnan(made["moeserve_ep_expert_imbalance"].got[-1][1])
