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


# Series of a /metrics page -> the Page value they add to.
_SERIES = {f"{PREFIX}requests_total": "requests", f"{PREFIX}inflight_requests": "inflight",
           f"{PREFIX}model_prefill_workers": "prefill_workers", f"{PREFIX}model_workers": "workers"}
for _short, _name in HISTOGRAMS.items():
    _SERIES[f"{PREFIX}{_name}_sum"] = f"{_short}_sum"
    _SERIES[f"{PREFIX}{_name}_count"] = f"{_short}_count"


@dataclass(frozen=True)
class Page:
    """What the planner reads on one frontend's /metrics page."""

    totals: Totals  # the cumulative series
    inflight: float  # requests being served now
    workers: Replicas  # the prefill and the other (decode or aggregated) workers requests are routed to


def parse_page(text: str, model: str | None = None) -> Page:
    """The planner's series on a frontend's /metrics page (only `model`'s, when given), read in one pass."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field = _SERIES.get(sample.name)
            if field is not None and (model is None or sample.labels.get("model") == model):
                values[field] = values.get(field, 0.0) + sample.value
    inflight = values.pop("inflight", 0.0)
    workers = Replicas(int(values.pop("prefill_workers", 0)), int(values.pop("workers", 0)))
    return Page(Totals(**values), inflight, workers)


class FrontendObserver:
    """Reads the frontends at `urls` (their base URLs) once per interval."""

    def __init__(self, urls: list[str], model: str | None = None, timeout: float = 5.0) -> None:
        self.urls = [url.rstrip("/") for url in urls]
        self.model = model
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._last: dict[str, Page] = {}
        self.workers: Replicas | None = None  # as the frontends reported at the last sample (None: no answer)

    async def _scrape(self, session: aiohttp.ClientSession, url: str) -> Page | None:
        try:
            async with session.get(f"{url}/metrics") as response:
                response.raise_for_status()
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError):
            return None
        return parse_page(text, self.model)

    async def sample(self, seconds: float) -> IntervalMetrics:
        """The traffic since the previous call (the first call only sets the starting point). A frontend that
        does not answer contributes nothing to this interval and starts over at the next."""
        total = Totals()
        arrived = 0.0
        workers: Replicas | None = None
        async with aiohttp.ClientSession(timeout=self.timeout) as session:
            for url in self.urls:
                page = await self._scrape(session, url)
                if page is None:
                    self._last.pop(url, None)
                    continue
                # Frontends see the same workers (one may not have caught up yet): the most any reports.
                seen = page.workers
                workers = seen if workers is None else Replicas(max(workers.prefill, seen.prefill),
                                                                max(workers.decode, seen.decode))
                before = self._last.get(url)
                self._last[url] = page
                if before is not None:
                    increase = page.totals.increase_since(before.totals)
                    total = total + increase
                    # A restarted frontend's requests in flight went with it: all those in flight are new.
                    restarted = page.totals.requests < before.totals.requests
                    arrived += max(increase.requests + page.inflight - (0.0 if restarted else before.inflight), 0.0)
        self.workers = workers
        return replace(total.interval(seconds), requests=arrived)
