"""Counters, gauges and histograms for code that runs on one event loop, with prometheus_client's call shape
(`family.labels(*values).inc()`).

prometheus_client takes a lock on every update (a histogram observation takes two), which a frontend pays per
token; these are plain numbers, turned into Prometheus families only when the page is scraped. They are not
safe to update from several threads: the frontend updates them from its event loop only.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

_INF = float("inf")


class CounterValue:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class GaugeValue(CounterValue):
    __slots__ = ()

    def dec(self, amount: float = 1) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class HistogramValue:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """`count` observations of `value` (a burst of tokens that arrived together: one call)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, observations up to it) per bucket, +Inf last: the exposition's buckets."""
        total, out = 0, []
        for le, count in zip((*(floatToGoString(b) for b in self.bounds), "+Inf"), self.counts, strict=True):
            total += count
            out.append((le, total))
        return out


V = TypeVar("V", CounterValue, GaugeValue, HistogramValue)
S = TypeVar("S", CounterValue, GaugeValue)


class _Family(Collector, Generic[V]):
    def __init__(self, name: str, doc: str, labelnames: tuple[str, ...], registry: CollectorRegistry | None) -> None:
        self.name = name
        self.doc = doc
        self.labelnames = labelnames
        self.children: dict[tuple[str, ...], V] = {}
        if registry is not None:
            registry.register(self)

    def _new(self) -> V:
        raise NotImplementedError

    def labels(self, *values: str) -> V:
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: {len(self.labelnames)} label values wanted, got {values!r}")
            child = self.children[values] = self._new()
        return child

    def describe(self) -> Iterable[Metric]:  # the registry refuses a second family of the same name
        return self.collect()


class _Scalar(_Family[S]):
    _exposed: type[CounterMetricFamily] | type[GaugeMetricFamily]

    def collect(self) -> Iterator[Metric]:
        family = self._exposed(self.name, self.doc, labels=self.labelnames)
        for values, child in self.children.items():
            family.add_metric(values, child.value)
        yield family


class Counter(_Scalar[CounterValue]):
    """Exposed as `<name>_total`."""

    _exposed = CounterMetricFamily

    def _new(self) -> CounterValue:
        return CounterValue()


class Gauge(_Scalar[GaugeValue]):
    _exposed = GaugeMetricFamily

    def _new(self) -> GaugeValue:
        return GaugeValue()


class Histogram(_Family[HistogramValue]):
    def __init__(self, name: str, doc: str, labelnames: tuple[str, ...], registry: CollectorRegistry | None,
                 buckets: tuple[float, ...]) -> None:
        self.bounds = tuple(b for b in buckets if b != _INF)
        super().__init__(name, doc, labelnames, registry)

    def _new(self) -> HistogramValue:
        return HistogramValue(self.bounds)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        for values, child in self.children.items():
            family.add_metric(values, child.cumulative(), child.sum)
        yield family
