"""Prometheus metrics: queue depth per shard, request latency, results by kind and outcome."""

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class QueueDepthCollector:
    def __init__(self, depths: Callable[[], list[int]]) -> None:
        self.depths = depths

    def collect(self) -> Iterator[GaugeMetricFamily]:
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


class ObserveLatency:
    """Pure ASGI (Starlette's BaseHTTPMiddleware costs a task and a stream per request)."""

    def __init__(self, app: ASGIApp, histogram: Histogram) -> None:
        self.app = app
        self.histogram = histogram

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), "500"

        async def remember_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, remember_status)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.histogram.labels(route, scope["method"], status).observe(time.perf_counter() - started)
