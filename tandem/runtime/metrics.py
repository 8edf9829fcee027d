"""Per-endpoint request metrics with Dynamo's names (`dynamo_component_*`).

Counters are plain numbers updated once per finished request (no locks on the hot path) and turned
into Prometheus families when scraped. Each served endpoint carries the labels `dynamo_namespace`,
`dynamo_component`, `dynamo_endpoint` plus the extra `metrics_labels` it was served with.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from tandem.runtime.loop_metrics import HistogramValue

PREFIX = "dynamo_component"
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class EndpointStats:
    __slots__ = ("labels", "requests", "errors", "cancellations", "incomplete", "request_bytes",
                 "response_bytes", "duration", "inflight")

    def __init__(self, labels: dict[str, str], inflight: Callable[[], int]) -> None:
        self.labels = labels
        self.requests = 0
        self.errors = 0
        self.cancellations = 0
        self.incomplete = 0
        self.request_bytes = 0
        self.response_bytes = 0
        self.duration = HistogramValue(DURATION_BUCKETS)
        self.inflight = inflight

    def record(self, request_bytes: int, response_bytes: int, seconds: float, outcome: str) -> None:
        self.requests += 1
        self.request_bytes += request_bytes
        self.response_bytes += response_bytes
        self.duration.observe(seconds)
        if outcome == "error":
            self.errors += 1
        elif outcome == "cancelled":
            self.cancellations += 1
        elif outcome == "incomplete":
            self.incomplete += 1


class RuntimeCollector(Collector):
    """Exposes the stats of every endpoint this process serves, and its uptime."""

    def __init__(self, extra_labels: dict[str, str] | None = None) -> None:
        self.endpoints: list[EndpointStats] = []
        self.started = time.monotonic()
        self.extra_labels = extra_labels or {}

    def collect(self) -> Iterator[Metric]:
        uptime = GaugeMetricFamily(f"{PREFIX}_system_uptime_seconds", "Seconds since this process's runtime started")
        uptime.add_metric([], time.monotonic() - self.started)
        yield uptime
        if not self.endpoints:
            return
        families = {
            "requests": CounterMetricFamily(f"{PREFIX}_requests", "Requests handled by the endpoint"),
            "errors": CounterMetricFamily(f"{PREFIX}_errors", "Requests whose handler failed"),
            "cancellations": CounterMetricFamily(f"{PREFIX}_cancellation", "Requests stopped by kill or disconnect"),
            "incomplete": CounterMetricFamily(f"{PREFIX}_incomplete", "Streams ended early by the handler (EngineShutdown)"),
            "request_bytes": CounterMetricFamily(f"{PREFIX}_request_bytes", "Request bytes received"),
            "response_bytes": CounterMetricFamily(f"{PREFIX}_response_bytes", "Response bytes sent"),
        }
        inflight = GaugeMetricFamily(f"{PREFIX}_inflight_requests", "Requests being handled now")
        duration = HistogramMetricFamily(f"{PREFIX}_request_duration_seconds", "Time from request to end of stream")
        for stats in self.endpoints:
            labels = {**stats.labels}
            for attr, family in families.items():
                _add(family, labels, getattr(stats, attr))
            _add(inflight, labels, stats.inflight())
            buckets = stats.duration.cumulative()
            duration.samples.extend(
                Sample(f"{duration.name}_bucket", {**labels, "le": le}, value) for le, value in buckets
            )
            duration.samples.append(Sample(f"{duration.name}_count", labels, buckets[-1][1]))
            duration.samples.append(Sample(f"{duration.name}_sum", labels, stats.duration.sum))
        yield from families.values()
        yield inflight
        yield duration


def _add(family: Metric, labels: dict[str, str], value: float) -> None:
    suffix = "_total" if family.type == "counter" else ""
    family.samples.append(Sample(f"{family.name}{suffix}", labels, value))
