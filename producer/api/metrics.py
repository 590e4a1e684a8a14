"""Prometheus metrics: queue depth per shard, request latency, results by kind and outcome."""

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily


class QueueDepthCollector:
    def __init__(self, depths: Callable[[], list[int]]) -> None:
        self.depths = depths

    def collect(self):
        family = GaugeMetricFamily("tinkerq_queue_depth", "Jobs waiting in each shard queue", labels=["shard"])
        for shard, depth in enumerate(self.depths()):
            family.add_metric([str(shard)], depth)
        yield family


class Metrics:
    def __init__(self, depths: Callable[[], list[int]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(QueueDepthCollector(depths))
        self.latency = Histogram("tinkerq_http_request_seconds", "HTTP request latency",
                                 ["route", "method", "status"], registry=self.registry)
        self.results = Counter("tinkerq_results_total", "Results delivered by retrieve_future",
                               ["kind", "outcome"], registry=self.registry)
