"""The server's Prometheus series as Ray metrics, for `moeserve serve --ray`.

Under Ray Serve a replica's own /metrics is one replica's view, behind a proxy that picks the replica.
Ray collects every process's metrics at each node's metrics agent, which Prometheus scrapes (its
targets are the nodes' `MetricsExportPort`, or the file that Ray's dashboard writes for file_sd). So
each instrument of serve/metrics.py gets a `ray.serve.metrics` twin, recorded at the same moment
(`metrics.Tee`), and the series that are read at scrape time (the queue depth, the experts' load, the
expert-parallel ranks' series) are copied into theirs every `interval_s` by a thread of the replica.

What a scraper of Ray's export sees, against the single-process server's /metrics:
- names gain Ray's prefix: `moeserve_requests_total` is `ray_moeserve_requests_total`;
- every series gains Ray's tags (`application`, `deployment`, `replica`, `NodeAddress`, `WorkerId`, ...);
- a histogram's `_sum` is Ray's estimate from its buckets' midpoints (the buckets and counts are exact);
- the process series (`process_*`) are not copied: Ray exports its own per process.
"""

from __future__ import annotations

import math
import threading

from ray.serve import metrics as ray_metrics

from moeserve.serve.metrics import Metrics, Tee

KINDS = {"counter": ray_metrics.Counter, "gauge": ray_metrics.Gauge, "histogram": ray_metrics.Histogram}


def twin(kind: str, name: str, documentation: str, labels: tuple[str, ...], buckets=None):
    """A Ray metric standing for a prometheus_client one: same name (Ray adds `ray_` and, to a counter,
    `_total`), labels as tags."""
    if kind == "histogram":
        return ray_metrics.Histogram(name, documentation, boundaries=[float(b) for b in buckets if b != math.inf],
                                     tag_keys=labels)
    return KINDS[kind](name, documentation, tag_keys=labels)


class ScrapeTimeCopier:
    """Copies what /metrics computes when scraped (function gauges, collectors) into Ray twins, every
    `interval_s` on a daemon thread: a counter by its increase since the last copy, a gauge by its value.
    Gauges set by the server (`moeserve_ready`) are set again too: Ray's export drops a gauge's series that
    has not been set for a while (seen: `ray_moeserve_ready` gone some ten seconds after it was set)."""

    def __init__(self, metrics: Metrics, interval_s: float = 1.0):
        self.metrics, self.interval_s = metrics, interval_s
        self.twins: dict[str, object] = {}
        self.seen: dict[tuple, float] = {}  # counter sample -> the value copied so far
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="moeserve-ray-metrics", daemon=True)

    def start(self) -> "ScrapeTimeCopier":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()

    def _run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            self.copy()

    def copy(self) -> None:
        for tee in vars(self.metrics).values():
            if isinstance(tee, Tee) and (tee.function or tee.value is not None):
                tee.twin.set(float(tee.function()) if tee.function else tee.value)
        for collector in self.metrics.collectors:
            for family in collector.collect():
                if family.type == "histogram":
                    self._copy_histogram(family)
                    continue
                for sample in family.samples:
                    self._copy(family.type, family.name, family.documentation, sample)

    def _copy_histogram(self, family) -> None:
        """A scrape-time histogram (cumulative buckets, as moeserve_ep_all_to_all_seconds): each bucket's new
        observations observed again in its twin at the bucket's midpoint (past the last bound: twice it), so the
        twin's buckets and count are exact and its _sum is Ray's own kind of estimate."""
        series: dict[tuple, list[tuple[float, float]]] = {}
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                tags = tuple(sorted((k, str(v)) for k, v in sample.labels.items() if k != "le"))
                series.setdefault(tags, []).append((float(sample.labels["le"]), sample.value))
        for tags, buckets in series.items():
            buckets.sort()
            if family.name not in self.twins:
                self.twins[family.name] = twin("histogram", family.name, family.documentation,
                                               tuple(k for k, _ in tags), [le for le, _ in buckets])
            lower, below = 0.0, 0.0
            for le, cumulative in buckets:
                n, below = cumulative - below, cumulative
                key = (family.name, tags, le)
                delta = n - self.seen.get(key, 0.0)
                if delta < 0:  # the series started again from 0 (a restarted rank)
                    delta = n
                self.seen[key] = n
                value = (lower + le) / 2 if le != math.inf else 2 * lower
                for _ in range(int(delta)):
                    self.twins[family.name].observe(value, tags=dict(tags))
                lower = le

    def _copy(self, kind: str, family: str, documentation: str, sample) -> None:
        if kind not in ("counter", "gauge") or math.isnan(sample.value) or (
                kind == "counter" and not sample.name.endswith("_total")):
            return  # NaN: the imbalance before any traffic; Ray keeps no NaN
        labels = tuple(sorted(sample.labels))
        if family not in self.twins:
            self.twins[family] = twin(kind, family, documentation, labels)
        tags = {k: str(v) for k, v in sample.labels.items()}
        if kind == "gauge":
            self.twins[family].set(sample.value, tags=tags)
            return
        key = (family, tuple(sorted(tags.items())))
        delta = sample.value - self.seen.get(key, 0.0)
        if delta < 0:  # the series started again from 0 (a restarted rank): all of it is new
            delta = sample.value
            self.seen[key] = sample.value
        if delta > 0:
            self.twins[family].inc(delta, tags=tags)
            self.seen[key] = sample.value
