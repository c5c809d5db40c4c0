"""Prometheus metrics of one server: requests, queue, batches, tokens, and the experts' load.

Each app has its own registry (two servers in one process, as in the tests, never share series).
Expert load is not pushed per request: the engine already counts tokens per (layer, expert) on
every forward, and a collector reads that counter when /metrics is scraped, so the series are exact
(they grow by the routed tokens, padding excluded) and cost nothing between scrapes.

Imbalance and dead experts are cumulative since the server started; a dashboard gets them over a
window from the counter, e.g. `max by (layer) (rate(moeserve_expert_routed_tokens_total[5m])) /
avg by (layer) (rate(moeserve_expert_routed_tokens_total[5m]))`.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from moeserve.runtime.engine import ExpertLoad

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Per-expert series above this many (layers x experts) are off unless asked for: a model with
# thousands of experts would otherwise swamp the scraper.
MAX_AUTO_EXPERT_SERIES = 4096
# A rejected request's status -> the reason label of moeserve_requests_rejected_total.
REJECT_REASONS = {400: "invalid", 401: "unauthorized", 404: "not_found", 405: "invalid", 413: "body_too_large",
                  415: "invalid", 422: "invalid", 429: "queue_full", 503: "unavailable", 504: "deadline"}


class ExpertLoadCollector(Collector):
    """moeserve_expert_routed_tokens_total{layer, expert} (optional), and per layer the load
    imbalance (max over mean) and the number of experts that have received no token."""

    def __init__(self, load: Callable[[], ExpertLoad | None], layer_ids: list[int], per_expert: bool):
        self.load, self.layer_ids, self.per_expert = load, layer_ids, per_expert

    def collect(self) -> Iterable[Metric]:
        load = self.load()
        if load is None:  # the model is still loading
            return
        counts_LE = load.snapshot()
        if self.per_expert:
            routed = CounterMetricFamily("moeserve_expert_routed_tokens", "Tokens routed to each expert of each MoE "
                                         "layer (each token counts once per expert it is sent to)",
                                         labels=["layer", "expert"])
            for layer, row in zip(self.layer_ids, counts_LE.tolist()):
                for e, n in enumerate(row):
                    routed.add_metric([str(layer), str(e)], n)
            yield routed
        imbalance = GaugeMetricFamily("moeserve_expert_load_imbalance", "Tokens of the busiest expert over the "
                                      "mean per expert, since start (1 = perfectly balanced; NaN before traffic)",
                                      labels=["layer"])
        dead = GaugeMetricFamily("moeserve_dead_experts", "Experts of the layer that have received no token since "
                                 "start", labels=["layer"])
        for layer, row in zip(self.layer_ids, counts_LE.double()):
            mean = float(row.mean())
            imbalance.add_metric([str(layer)], float(row.max()) / mean if mean > 0 else float("nan"))
            dead.add_metric([str(layer)], float((row == 0).sum()))
        yield imbalance
        yield dead


class PathTokensCollector(Collector):
    """moeserve_{kind}_tokens_total{path}: the decode steps' tokens, or the prompt chunks', by whether a compiled
    graph's replay ("graph") or an eager call ("eager": no compiled graph, or a call that could not take it) ran
    them, read from the engine's count when scraped."""

    def __init__(self, kind: str, counts: Callable[[], Mapping[str, int] | None]):
        self.kind, self.counts = kind, counts

    def collect(self) -> Iterable[Metric]:
        counts = self.counts()
        if counts is None:  # the model is still loading
            return
        what = "decoded" if self.kind == "decode" else "of prompts prefilled"
        family = CounterMetricFamily(f"moeserve_{self.kind}_tokens", f"Tokens {what}, by how their call ran: graph "
                                     "(a compiled step's replay) or eager", labels=["path"])
        for path in ("graph", "eager"):
            family.add_metric([path], counts.get(path, 0))
        yield family


class Metrics:
    """The server's instruments. With `twins` (serve/ray_metrics.py), each one is also recorded into a twin
    made by `twins(kind, name, documentation, labels, buckets)`, such as Ray's metrics under Ray Serve, where
    replicas are scraped through Ray's metrics export rather than one by one."""

    def __init__(self, twins: Callable[..., object] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.twins = twins
        self.collectors: list[Collector] = []  # scrape-time series (expert load), besides the process's own
        ProcessCollector(registry=self.registry)
        self.request_seconds = self._make(Histogram, "moeserve_request_duration_seconds", "Request latency, received "
                                          "to last byte sent (streams included)", ["endpoint", "status"],
                                          buckets=LATENCY_BUCKETS)
        self.requests = self._make(Counter, "moeserve_requests", "Requests answered", ["endpoint", "status"])
        self.rejected = self._make(Counter, "moeserve_requests_rejected", "Requests refused, by reason", ["reason"])
        self.queue_depth = self._make(Gauge, "moeserve_queue_depth", "Requests waiting for a batch")
        self.queue_seconds = self._make(Histogram, "moeserve_queue_wait_seconds", "Time from arrival to the start "
                                        "of the request's batch", buckets=LATENCY_BUCKETS)
        self.batch_size = self._make(Histogram, "moeserve_batch_size", "Rows (prompts or texts) per model batch",
                                     ["kind"], buckets=BATCH_BUCKETS)
        self.batch_seconds = self._make(Histogram, "moeserve_batch_duration_seconds", "Model time per batch",
                                        ["kind"], buckets=LATENCY_BUCKETS)
        self.ttft = self._make(Histogram, "moeserve_time_to_first_token_seconds", "Arrival to the first generated "
                               "token", buckets=LATENCY_BUCKETS)
        self.prompt_tokens = self._make(Counter, "moeserve_prompt_tokens", "Prompt (and scored / classified) "
                                        "tokens processed")
        self.generation_tokens = self._make(Counter, "moeserve_generation_tokens", "Tokens generated")
        self.ready = self._make(Gauge, "moeserve_ready", "1 once the model is loaded and warmed up")

    def _make(self, kind: type, name: str, documentation: str, labels: tuple[str, ...] | list[str] = (), **kw):
        local = kind(name, documentation, labels, registry=self.registry, **kw)
        if self.twins is None:
            return local
        return Tee(local, self.twins(kind.__name__.lower(), name, documentation, tuple(labels), kw.get("buckets")),
                   tuple(labels))

    def watch_experts(self, load: Callable[[], ExpertLoad | None], layer_ids: list[int], n_experts: int,
                      per_expert: bool | None) -> None:
        if per_expert is None:
            per_expert = len(layer_ids) * n_experts <= MAX_AUTO_EXPERT_SERIES
        collector = ExpertLoadCollector(load, layer_ids, per_expert)
        self.registry.register(collector)
        self.collectors.append(collector)

    def watch_collector(self, collector: Collector) -> None:
        """Series read when scraped (as the experts' load), from any collector: also copied to Ray's twins."""
        self.registry.register(collector)
        self.collectors.append(collector)

    def watch_paths(self, kind: str, counts: Callable[[], Mapping[str, int] | None]) -> None:
        """moeserve_{kind}_tokens_total{path} ("decode" or "prefill") from the engine's counts."""
        self.watch_collector(PathTokensCollector(kind, counts))

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.request_seconds.labels(endpoint, str(status)).observe(seconds)
        self.requests.labels(endpoint, str(status)).inc()
        if status in REJECT_REASONS:
            self.rejected.labels(REJECT_REASONS[status]).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Tee:
    """A prometheus_client instrument and its twin (a Ray metric), recorded together: `.labels(...)`,
    `.observe`, `.inc`, `.set` as on the instrument. A gauge's value or function is kept (`value`, `function`)
    for whoever keeps the twin to push again: a twin is pushed to, not scraped, and Ray drops a gauge's series
    that is not set again for a while."""

    def __init__(self, local, twin, labels: tuple[str, ...] = (), tags: dict[str, str] | None = None):
        self.local, self.twin, self.label_names, self.tags = local, twin, labels, tags or {}
        self.function: Callable[[], float] | None = None
        self.value: float | None = None  # the last set, of an unlabelled gauge

    def labels(self, *values) -> "Tee":
        return Tee(self.local.labels(*values), self.twin, (), dict(zip(self.label_names, map(str, values))))

    def observe(self, value: float) -> None:
        self.local.observe(value)
        self.twin.observe(float(value), tags=self.tags)

    def inc(self, amount: float = 1) -> None:
        self.local.inc(amount)
        if amount > 0:  # a Ray counter refuses 0
            self.twin.inc(float(amount), tags=self.tags)

    def set(self, value: float) -> None:
        self.local.set(value)
        self.value = float(value)
        self.twin.set(self.value, tags=self.tags)

    def set_function(self, f: Callable[[], float]) -> None:
        self.local.set_function(f)
        self.function = f
