"""The loop metrics expose what prometheus_client's own metrics would for the same updates."""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest

from tandem.runtime import loop_metrics

BUCKETS = (0.001, 0.01, 0.1, 1.0, 8, 131072)


def _page(ours: bool) -> list[str]:
    registry = CollectorRegistry()
    if ours:
        requests = loop_metrics.Counter("t_requests", "Requests", ("model", "status"), registry)
        gauge = loop_metrics.Gauge("t_inflight", "In flight", ("model",), registry)
        histogram = loop_metrics.Histogram("t_itl", "ITL", ("model",), registry, BUCKETS)
    else:
        requests = prometheus_client.Counter("t_requests", "Requests", ("model", "status"), registry=registry)
        gauge = prometheus_client.Gauge("t_inflight", "In flight", ("model",), registry=registry)
        histogram = prometheus_client.Histogram("t_itl", "ITL", ("model",), buckets=BUCKETS, registry=registry)
    requests.labels("a", "ok").inc()
    requests.labels("a", "ok").inc(2)
    requests.labels("b", "error").inc()
    gauge.labels("a").inc()
    gauge.labels("a").inc()
    gauge.labels("a").dec()
    gauge.labels("b").set(7)
    for value in (0.0005, 0.001, 0.05, 0.05, 3.0, 200000.0):
        histogram.labels("a").observe(value)
    histogram.labels("b").observe(0.5)
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_the_page_is_prometheus_clients_page() -> None:
    assert _page(ours=True) == _page(ours=False)


def test_a_burst_is_observed_as_that_many_samples() -> None:
    burst, one_by_one = (loop_metrics.Histogram("h", "h", ("m",), None, BUCKETS) for _ in range(2))
    burst.labels("x").observe(0.02, 3)
    for _ in range(3):
        one_by_one.labels("x").observe(0.02)
    assert burst.labels("x").counts == one_by_one.labels("x").counts == [0, 0, 3, 0, 0, 0, 0]
    assert abs(burst.labels("x").sum - one_by_one.labels("x").sum) < 1e-12


def test_label_values_must_match_the_label_names() -> None:
    counter = loop_metrics.Counter("c", "c", ("model", "status"), None)
    try:
        counter.labels("only-one")
    except ValueError as e:
        assert "2 label values" in str(e)
    else:
        raise AssertionError("a wrong number of label values was taken")
