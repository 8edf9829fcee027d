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

Each frontend process must be read on its own: one address may be served by several processes (frontend
pods behind a Service, `tandem frontend --num-processes`), and a scrape reaches one of them, whose counters
would then be taken for another's. By default the planner reads every frontend process of the namespace at
the address it registered in discovery (`DiscoveredFrontends`: its own port, a replica's system port). Given
addresses (`--frontend-url`) must each be one process: every page names the process that wrote it
(`tandem_frontend_instance_info`) and its age (`dynamo_component_system_uptime_seconds`), so a process other
than the last one answering is a restart when it started since the last scrape, and otherwise proof that
several processes share the address, which stops the planner (`SharedAddressError`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, fields, replace
from typing import Protocol

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tandem.planner.sla import IntervalMetrics, Replicas
from tandem.runtime.config import ConfigError
from tandem.runtime.discovery import KeyValueStore
from tandem.runtime.keys import frontends_prefix

log = logging.getLogger(__name__)

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
INSTANCE = "tandem_frontend_instance_info"  # its `instance` label: the process that wrote the page
UPTIME = "dynamo_component_system_uptime_seconds"


@dataclass(frozen=True)
class Page:
    """What the planner reads on one frontend's /metrics page."""

    totals: Totals  # the cumulative series
    inflight: float  # requests being served now
    workers: Replicas  # the prefill and the other (decode or aggregated) workers requests are routed to
    process: str | None = None  # the frontend process that wrote it (None: the page does not say)
    uptime: float | None = None  # seconds since that process started


def parse_page(text: str, model: str | None = None) -> Page:
    """The planner's series on a frontend's /metrics page (only `model`'s, when given), read in one pass."""
    values: dict[str, float] = {}
    process: str | None = None
    uptime: float | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == INSTANCE:
                process = sample.labels.get("instance")
            elif sample.name == UPTIME:
                uptime = sample.value
            elif (field := _SERIES.get(sample.name)) is not None and (model is None or sample.labels.get("model") == model):
                values[field] = values.get(field, 0.0) + sample.value
    inflight = values.pop("inflight", 0.0)
    workers = Replicas(int(values.pop("prefill_workers", 0)), int(values.pop("workers", 0)))
    return Page(Totals(**values), inflight, workers, process, uptime)


class SharedAddressError(ConfigError):
    """A frontend address the planner was given is served by several processes: it cannot measure them there."""


def shared_address(url: str, processes: set[str]) -> SharedAddressError:
    return SharedAddressError(
        f"the frontend at {url} is served by several processes ({', '.join(sorted(processes))}): frontend pods "
        "behind one Service, or tandem frontend --num-processes. A scrape reaches one of them, so the planner cannot "
        "count the traffic there. Leave out --frontend-url (the planner then reads every frontend process at the "
        "address it registered in discovery: give it the deployment's --namespace and discovery settings), or "
        "give each process's own address")


class Frontends(Protocol):
    """Where the frontend processes are."""

    async def processes(self) -> dict[str, str]:
        """Each frontend process (a key that stays the process's) -> the URL of its /metrics."""
        ...


@dataclass(frozen=True)
class GivenFrontends:
    """`--frontend-url`: addresses given by the user, each one process."""

    urls: tuple[str, ...]

    async def processes(self) -> dict[str, str]:
        return {url: f"{url}/metrics" for url in self.urls}


@dataclass(frozen=True)
class DiscoveredFrontends:
    """Every frontend process of `namespace`, at the /metrics address it registered in discovery."""

    store: KeyValueStore
    namespace: str

    async def processes(self) -> dict[str, str]:
        prefix = frontends_prefix(self.namespace)
        found = {key.removeprefix(prefix): value.decode() for key, value in (await self.store.get_prefix(prefix)).items()}
        if not found:
            log.warning("planner: no frontend process is registered in namespace %s; no traffic observed",
                        self.namespace)
        return found


@dataclass(frozen=True)
class _Scraped:
    page: Page
    sent: float  # time.monotonic() when the scrape was sent


PROBES = 16  # scrapes of a given address, each on a new connection, before planning: one process answering?


class FrontendObserver:
    """Reads every frontend process once per interval: at the given base URLs (`--frontend-url`, each one process)
    or wherever `frontends` says they are."""

    def __init__(self, frontends: list[str] | Frontends, model: str | None = None, timeout: float = 5.0) -> None:
        self.frontends = GivenFrontends(tuple(url.rstrip("/") for url in frontends)) if isinstance(
            frontends, list) else frontends
        self.model = model
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._last: dict[str, _Scraped] = {}
        self._previous: float | None = None  # time.monotonic() of the previous sample
        self.workers: Replicas | None = None  # as the frontends reported at the last sample (None: no answer)

    async def _scrape(self, session: aiohttp.ClientSession, url: str) -> Page | None:
        try:
            async with session.get(url) as response:
                response.raise_for_status()
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError):
            return None
        return parse_page(text, self.model)

    async def check(self) -> None:
        """Refuse (SharedAddressError) a given address that several processes answer, before planning on it."""
        if not isinstance(self.frontends, GivenFrontends):
            return
        for url, metrics in (await self.frontends.processes()).items():
            seen: set[str] = set()
            for _ in range(PROBES):  # a new connection each time: the kernel or the Service picks a process anew
                async with aiohttp.ClientSession(timeout=self.timeout,
                                                 connector=aiohttp.TCPConnector(force_close=True)) as session:
                    page = await self._scrape(session, metrics)
                if page is not None and page.process is not None:
                    seen.add(page.process)
            if len(seen) > 1:
                raise shared_address(url, seen)

    async def sample(self, seconds: float) -> IntervalMetrics:
        """The traffic since the previous call (the first call only sets the starting point). A frontend that
        does not answer contributes nothing to this interval and starts over at the next; one that started since
        the previous call counts from zero."""
        total = Totals()
        arrived = 0.0
        workers: Replicas | None = None
        processes = await self.frontends.processes()
        async with aiohttp.ClientSession(timeout=self.timeout) as session:
            for key, url in processes.items():
                sent = time.monotonic()
                page = await self._scrape(session, url)
                if page is None:
                    self._last.pop(key, None)
                    continue
                # Frontends see the same workers (one may not have caught up yet): the most any reports.
                seen = page.workers
                workers = seen if workers is None else Replicas(max(workers.prefill, seen.prefill),
                                                                max(workers.decode, seen.decode))
                before = self._last.get(key)
                self._last[key] = _Scraped(page, sent)
                since = before.sent if before is not None else self._previous
                started_since = since is not None and page.uptime is not None and page.uptime < time.monotonic() - since
                other = before is None or page.process != before.page.process
                # `left`: the requests in flight at the last read that are still counted as in flight (a restarted
                # frontend's went with it: all those in flight now are new).
                if started_since and other:  # everything this process counted is this interval's
                    increase, left = page.totals, 0.0
                elif before is None:
                    continue  # the starting point of a frontend seen for the first time
                elif page.process is not None and before.page.process is not None and page.process != before.page.process:
                    # another process, already running at the last read: both answer at this address
                    raise shared_address(url.removesuffix("/metrics"), {page.process, before.page.process})
                else:
                    increase = page.totals.increase_since(before.page.totals)
                    # A page that does not name its process: a counter that went down restarted with its frontend.
                    left = 0.0 if page.totals.requests < before.page.totals.requests else before.page.inflight
                total = total + increase
                arrived += max(increase.requests + page.inflight - left, 0.0)
        for gone in self._last.keys() - processes.keys():
            del self._last[gone]
        self._previous = time.monotonic()
        self.workers = workers
        return replace(total.interval(seconds), requests=arrived)
