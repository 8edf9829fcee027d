"""Observe: one adjustment interval of traffic, asked of a Prometheus server that scrapes the frontends.

The same interval `FrontendObserver` reads off the frontends' own /metrics, from Prometheus' HTTP API
(`/api/v1/query`) instead, as Dynamo's planner does (`--metric-pulling-prometheus-endpoint`, env
`PROMETHEUS_ENDPOINT`). The planner then needs no address of any frontend, and Prometheus adds the frontends
up and follows their restarts (a counter that went down counts from zero in `increase()`).

For a window W of the interval's length, ending now, summed over every frontend (only `model`'s series when
a model is given):
- requests, counted as they arrive: `increase(dynamo_frontend_requests_total[W])` (those that ended) plus the
  change in `dynamo_frontend_inflight_requests` over W (the backlog that built up), at least 0;
- the means of the prompt and output lengths, TTFT, ITL and request duration: each histogram's
  `increase(_sum[W]) / increase(_count[W])` (NaN without requests);
- the workers: `dynamo_frontend_model_prefill_workers` and `_model_workers`, the most any frontend reports.

All queries of an interval are evaluated at one instant (the `time` parameter), so that a histogram's sum and
its count cover the same scrapes. `increase()` extrapolates the samples it has to the window's edges, so with
scrapes every S seconds a count can come out up to about W / (W - S) times too high; a mean divides two
increases of the same scrapes and is not affected. A series the frontend only creates with its first request
(the counters and histograms are labelled by model) is not known to Prometheus before its first scrape: that
scrape's requests are not counted, as Prometheus counts a new series' increase from its first sample.

When Prometheus cannot be asked (unreachable, an error answer), the interval has no traffic and the workers
are unknown (None): the planner then changes nothing, and the planning loop goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from dataclasses import dataclass

import aiohttp
import msgspec

from tandem.planner.observe import HISTOGRAMS, PREFIX
from tandem.planner.sla import IntervalMetrics, Replicas

log = logging.getLogger(__name__)

# Environment variables, as Dynamo's planner names them.
ENDPOINT_ENV = "PROMETHEUS_ENDPOINT"
TOKEN_ENV = "PROMETHEUS_TOKEN"  # a bearer token, for a Prometheus behind an authenticating proxy


class _Sample(msgspec.Struct):
    metric: dict[str, str]
    value: tuple[float, str]  # (evaluation time, the value as text: "NaN" and "+Inf" included)


class _Vector(msgspec.Struct):
    resultType: str
    result: list[_Sample]


class _Answer(msgspec.Struct):
    """An /api/v1/query response, success or error."""

    status: str
    data: _Vector | None = None
    errorType: str = ""
    error: str = ""


class PrometheusError(Exception):
    """Prometheus could not answer a query."""


def selector(name: str, model: str | None) -> str:
    """The PromQL selector of the series `name`, only `model`'s when given. The model is quoted as a JSON
    string: PromQL string literals take Go's escapes, of which JSON's (\\", \\\\, \\n, \\uXXXX...) are a subset."""
    return name if model is None else f"{name}{{model={json.dumps(model, ensure_ascii=False)}}}"


@dataclass(frozen=True)
class Queries:
    """The PromQL of one interval of `window` whole seconds."""

    requests: str
    means: dict[str, str]  # IntervalMetrics quantity (observe.HISTOGRAMS' short names) -> query
    prefill_workers: str
    workers: str

    @classmethod
    def build(cls, window: int, model: str | None) -> Queries:
        def s(name: str) -> str:
            return selector(f"{PREFIX}{name}", model)

        w = f"{window}s"
        # `or vector(0)`: a sum over no series is empty, not 0 (e.g. no inflight sample yet W ago), and an
        # empty operand would make the whole expression empty.
        ended = f"(sum(increase({s('requests_total')}[{w}])) or vector(0))"
        inflight_now = f"(sum({s('inflight_requests')}) or vector(0))"
        inflight_before = f"(sum({s('inflight_requests')} offset {w}) or vector(0))"
        means = {short: f"sum(increase({s(name + '_sum')}[{w}])) / sum(increase({s(name + '_count')}[{w}]))"
                 for short, name in HISTOGRAMS.items()}

        # Per frontend, its models' workers added up (as FrontendObserver reads a page); then the most any
        # frontend reports, since all of them route to the same workers and one may lag behind.
        def most(name: str) -> str:
            return f"max(sum without (model) ({s(name)}))"

        return cls(f"clamp_min({ended} + {inflight_now} - {inflight_before}, 0)", means,
                   most("model_prefill_workers"), most("model_workers"))


def no_traffic(seconds: float) -> IntervalMetrics:
    return IntervalMetrics(0.0, math.nan, math.nan, math.nan, math.nan, math.nan, seconds)


class PrometheusObserver:
    """Asks the Prometheus server at `endpoint` (its base URL, e.g. http://prometheus:9090) once per interval;
    the same interface as `FrontendObserver`."""

    def __init__(self, endpoint: str, model: str | None = None, timeout: float = 5.0) -> None:
        self.url = f"{endpoint.rstrip('/')}/api/v1/query"
        self.model = model
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        token = os.environ.get(TOKEN_ENV)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.workers: Replicas | None = None  # as Prometheus last reported them (None: it did not answer)

    async def _query(self, session: aiohttp.ClientSession, query: str, at: float) -> float | None:
        """The single value of an instant query at time `at` (None: no series matched)."""
        try:
            async with session.post(self.url, data={"query": query, "time": f"{at:.3f}"}) as response:
                body = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as e:
            raise PrometheusError(f"{type(e).__name__}: {e}") from e
        try:
            answer = msgspec.json.decode(body, type=_Answer)
        except msgspec.DecodeError as e:  # not the API's JSON (a proxy's page, say)
            raise PrometheusError(f"HTTP {status}: {body[:200]!r}") from e
        if status != 200 or answer.status != "success" or answer.data is None:
            raise PrometheusError(f"HTTP {status}: {answer.errorType} {answer.error}".strip())
        if answer.data.resultType != "vector":
            raise PrometheusError(f"expected a vector from {query!r}, got a {answer.data.resultType}")
        # Every query aggregates with sum or max without `by`: at most one sample.
        return float(answer.data.result[0].value[1]) if answer.data.result else None

    async def _ask(self, queries: list[str]) -> list[float | None]:
        at = time.time()  # one instant for all: a mean's sum and count then cover the same scrapes
        async with aiohttp.ClientSession(timeout=self.timeout, headers=self.headers) as session:
            return list(await asyncio.gather(*(self._query(session, q, at) for q in queries)))

    async def sample(self, seconds: float) -> IntervalMetrics:
        """The traffic of the `seconds` (rounded up to whole seconds, at least 1) that end now. With 0 (the
        starting point of the planning loop), only the workers are read. Never raises: when Prometheus does
        not answer, the interval has no traffic and `workers` is None."""
        window = max(1, math.ceil(seconds))
        queries = Queries.build(window, self.model)
        asked = [queries.prefill_workers, queries.workers]
        if seconds > 0:
            asked += [queries.requests, *queries.means.values()]
        try:
            values = await self._ask(asked)
        except PrometheusError as e:
            log.warning("planner: Prometheus at %s did not answer (%s); no traffic observed this interval",
                        self.url, e)
            self.workers = None
            return no_traffic(seconds)
        prefill, decode = (int(v) if v is not None and math.isfinite(v) else 0 for v in values[:2])
        self.workers = Replicas(prefill, decode)
        if seconds <= 0:
            return no_traffic(seconds)
        requests = values[2] if values[2] is not None else 0.0
        mean = dict(zip(queries.means, (math.nan if v is None else v for v in values[3:]), strict=True))
        return IntervalMetrics(requests, mean["isl"], mean["osl"], mean["ttft"] * 1000, mean["itl"] * 1000,
                               mean["duration"], seconds)
