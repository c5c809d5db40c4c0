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

from typing import Callable, Iterable

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


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        self.request_seconds = Histogram("moeserve_request_duration_seconds", "Request latency, received to last "
                                         "byte sent (streams included)", ["endpoint", "status"],
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("moeserve_requests", "Requests answered", ["endpoint", "status"], registry=r)
        self.rejected = Counter("moeserve_requests_rejected", "Requests refused, by reason", ["reason"], registry=r)
        self.queue_depth = Gauge("moeserve_queue_depth", "Requests waiting for a batch", registry=r)
        self.queue_seconds = Histogram("moeserve_queue_wait_seconds", "Time from arrival to the start of the "
                                       "request's batch", buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("moeserve_batch_size", "Rows (prompts or texts) per model batch", ["kind"],
                                    buckets=BATCH_BUCKETS, registry=r)
        self.batch_seconds = Histogram("moeserve_batch_duration_seconds", "Model time per batch", ["kind"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("moeserve_time_to_first_token_seconds", "Arrival to the first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("moeserve_prompt_tokens", "Prompt (and scored / classified) tokens processed",
                                     registry=r)
        self.generation_tokens = Counter("moeserve_generation_tokens", "Tokens generated", registry=r)
        self.ready = Gauge("moeserve_ready", "1 once the model is loaded and warmed up", registry=r)

    def watch_experts(self, load: Callable[[], ExpertLoad | None], layer_ids: list[int], n_experts: int,
                      per_expert: bool | None) -> None:
        if per_expert is None:
            per_expert = len(layer_ids) * n_experts <= MAX_AUTO_EXPERT_SERIES
        self.registry.register(ExpertLoadCollector(load, layer_ids, per_expert))

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.request_seconds.labels(endpoint, str(status)).observe(seconds)
        self.requests.labels(endpoint, str(status)).inc()
        if status in REJECT_REASONS:
            self.rejected.labels(REJECT_REASONS[status]).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
