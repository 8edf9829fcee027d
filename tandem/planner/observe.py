"""Observe: one adjustment interval of traffic, from the frontends' own Prometheus metrics.

Each frontend's `/metrics` is read at the start and end of the interval. The differences of the cumulative
series give the interval: requests (`dynamo_frontend_requests_total`), and the means of the prompt and
output lengths, TTFT, ITL and request duration (each histogram's `_sum` over its `_count`). Several
frontends add up. A series that went down restarted with its frontend: its new value is the difference, as
Prometheus' `increase()` counts it.

Requests are counted as they arrive: the requests finished in the interval (the counter counts a request
when it ends) plus the change in those in flight (`dynamo_frontend_inflight_requests`). While a backlog
builds, the finished ones are what the workers manage to serve, not what comes in, and sizing for those
would leave the backlog to grow.

The frontends also report the workers they route to (`dynamo_frontend_model_workers` and
`_model_prefill_workers`): what a planner that does not run the workers itself knows of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tandem.planner.sla import IntervalMetrics, Replicas

PREFIX = "dynamo_frontend_"
HISTOGRAMS = {"isl": "input_sequence_tokens", "osl": "output_sequence_tokens", "ttft": "time_to_first_token_seconds",
              "itl": "inter_token_latency_seconds", "duration": "request_duration_seconds"}


@dataclass(frozen=True)
class Totals:
    """The cumulative series of one scrape (or their increase over an interval)."""

    requests: float = 0.0
    isl_sum: float = 0.0
    isl_count: float = 0.0
    osl_sum: float = 0.0
    osl_count: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    itl_sum: float = 0.0
    itl_count: float = 0.0
    duration_sum: float = 0.0
    duration_count: float = 0.0

    def increase_since(self, earlier: Totals) -> Totals:
        return Totals(*(now if now < before else now - before
                        for now, before in ((getattr(self, f.name), getattr(earlier, f.name)) for f in fields(self))))

    def __add__(self, other: Totals) -> Totals:
        return Totals(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def interval(self, seconds: float) -> IntervalMetrics:
        """The interval these increases happened in, as the planner takes it (latencies in ms)."""
        def mean(name: str) -> float:
            count = getattr(self, f"{name}_count")
            return getattr(self, f"{name}_sum") / count if count > 0 else math.nan

        return IntervalMetrics(self.requests, mean("isl"), mean("osl"), mean("ttft") * 1000, mean("itl") * 1000,
                               mean("duration"), seconds)


def parse_totals(text: str, model: str | None = None) -> Totals:
    """The planner's series on a frontend's /metrics page (only `model`'s, when given)."""
    values: dict[str, float] = {}
    wanted = {f"{PREFIX}requests_total": "requests"}
    for short, name in HISTOGRAMS.items():
        wanted[f"{PREFIX}{name}_sum"] = f"{short}_sum"
        wanted[f"{PREFIX}{name}_count"] = f"{short}_count"
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field = wanted.get(sample.name)
            if field is not None and (model is None or sample.labels.get("model") == model):
                values[field] = values.get(field, 0.0) + sample.value
    return Totals(**values)


def parse_workers(text: str, model: str | None = None) -> Replicas:
    """The prefill and the other (decode or aggregated) workers a frontend routes `model`'s requests to."""
    counts = {f"{PREFIX}model_prefill_workers": 0.0, f"{PREFIX}model_workers": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in counts and (model is None or sample.labels.get("model") == model):
                counts[sample.name] += sample.value
    return Replicas(int(counts[f"{PREFIX}model_prefill_workers"]), int(counts[f"{PREFIX}model_workers"]))


def parse_inflight(text: str, model: str | None = None) -> float:
    """The requests a frontend is serving now (`model`'s only, when given)."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{PREFIX}inflight_requests" and (model is None or sample.labels.get("model") == model):
                total += sample.value
    return total


class FrontendObserver:
    """Reads the frontends at `urls` (their base URLs) once per interval."""

    def __init__(self, urls: list[str], model: str | None = None, timeout: float = 5.0) -> None:
        self.urls = [url.rstrip("/") for url in urls]
        self.model = model
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._last: dict[str, tuple[Totals, float]] = {}  # url -> its totals and requests in flight
        self.workers: Replicas | None = None  # as the frontends reported at the last sample (None: no answer)

    async def _scrape(self, session: aiohttp.ClientSession, url: str) -> tuple[Totals, float, Replicas] | None:
        try:
            async with session.get(f"{url}/metrics") as response:
                response.raise_for_status()
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError):
            return None
        return parse_totals(text, self.model), parse_inflight(text, self.model), parse_workers(text, self.model)

    async def sample(self, seconds: float) -> IntervalMetrics:
        """The traffic since the previous call (the first call only sets the starting point). A frontend that
        does not answer contributes nothing to this interval and starts over at the next."""
        total = Totals()
        arrived = 0.0
        workers: Replicas | None = None
        async with aiohttp.ClientSession(timeout=self.timeout) as session:
            for url in self.urls:
                scraped = await self._scrape(session, url)
                if scraped is None:
                    self._last.pop(url, None)
                    continue
                now, inflight, seen = scraped
                # Frontends see the same workers (one may not have caught up yet): the most any reports.
                workers = seen if workers is None else Replicas(max(workers.prefill, seen.prefill),
                                                                max(workers.decode, seen.decode))
                before = self._last.get(url)
                self._last[url] = (now, inflight)
                if before is not None:
                    increase = now.increase_since(before[0])
                    total = total + increase
                    restarted = now.requests < before[0].requests  # its requests in flight went with it
                    arrived += max(increase.requests + inflight - (0.0 if restarted else before[1]), 0.0)
        self.workers = workers
        return replace(total.interval(seconds), requests=arrived)
