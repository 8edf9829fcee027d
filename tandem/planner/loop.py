"""The planning loop: every adjustment interval, observe the traffic (the frontends, or Prometheus), decide, and
hand the decision to a connector, which changes the deployment (`tandem run`'s own workers, a cluster's
Deployments, or an external orchestrator); every load adjustment interval, the same from the engines'
forward-pass metrics (`load.py`).

One log line per decision. The decisions are also metrics (`tandem_planner_*`) on the registry given. A
scaling change runs in the background, since starting a worker takes a while and stopping one waits for its
streams. The next decision does not wait for it: it starts from the replicas the connector has now, those
still starting or being stopped already counted as they will be (as Dynamo's planner sets replicas without
blocking).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from tandem.planner.config import PlannerConfig
from tandem.planner.limits import Replicas, within_limits
from tandem.planner.load import LoadDecision, LoadPlanner, Verdict
from tandem.planner.sla import Decision, IntervalMetrics, SlaPlanner
from tandem.runtime.config import ConfigError

log = logging.getLogger(__name__)


class Connector(Protocol):
    """How decisions reach the deployment."""

    async def replicas(self) -> Replicas:
        """The workers each pool has now (those still starting included)."""
        ...

    async def scale(self, target: Replicas) -> None:
        """Start or stop workers until the pools are `target`; a stopped worker drains its streams first."""
        ...

    def startup_seconds(self) -> float | None:
        """How long a new worker takes to serve, as measured on this deployment (None: not known yet)."""
        ...


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(f"tandem_planner_{name}", doc, labels, registry=registry)

        self.decisions = Counter("tandem_planner_decisions", "Throughput-based decisions taken, by what followed: "
                                 "scaled, unchanged, observe_only (no_operation)", ("action",),
                                 registry=registry)
        self.idle = Counter("tandem_planner_idle_intervals", "Intervals without traffic (nothing decided)",
                            registry=registry)
        self.predicted = gauge("predicted", "The forecast for the next interval", ("quantity",))
        self.correction = gauge("correction", "Observed over profiled latency", ("pool",))
        self.target = gauge("target_replicas", "Workers each pool should have", ("pool",))
        self.replicas = gauge("replicas", "Workers each pool has", ("pool",))
        self.floor = gauge("throughput_floor_replicas", "With load scaling on too: the throughput-based decision, "
                           "under which load scaling does not go", ("pool",))
        self.load_decisions = Counter("tandem_planner_load_decisions", "Load-based verdicts per pool: up, down, hold, "
                                      "not_ready, waiting (workers still starting)", ("pool", "verdict"),
                                      registry=registry)
        self.estimated_ttft = gauge("estimated_ttft_ms", "TTFT a request sent now would see, by the step-time fit: "
                                    "the lowest and highest over the pool's engines", ("pool", "stat"))
        self.estimated_itl = gauge("estimated_itl_ms", "ITL a request sent now would see, by the step-time fit",
                                   ("pool", "stat"))

    def record(self, decision: Decision, current: Replicas) -> None:
        f = decision.forecast
        for quantity, value in (("requests", f.requests), ("isl", f.isl), ("osl", f.osl)):
            self.predicted.labels(quantity).set(value)
        self.correction.labels("prefill").set(decision.prefill_correction)
        self.correction.labels("decode").set(decision.decode_correction)
        self.record_target(decision.target, current)

    def record_target(self, target: Replicas, current: Replicas) -> None:
        for pool in ("prefill", "decode"):
            self.target.labels(pool).set(getattr(target, pool))
            self.replicas.labels(pool).set(getattr(current, pool))

    def record_load(self, decision: LoadDecision, current: Replicas) -> None:
        for pool, estimate in decision.estimates.items():
            self.load_decisions.labels(pool, estimate.verdict.value).inc()
            for gauge, values in ((self.estimated_ttft, estimate.ttft_ms), (self.estimated_itl, estimate.itl_ms)):
                if values:
                    gauge.labels(pool, "min").set(min(values))
                    gauge.labels(pool, "max").set(max(values))
        self.record_target(decision.target, current)


class Observer(Protocol):
    async def sample(self, seconds: float) -> IntervalMetrics:
        """The traffic since the previous call (the first call only sets the starting point)."""
        ...


class PlannerLoop:
    """Throughput-based scaling every `adjustment_interval` (with `sla` and `observer`), load-based scaling every
    `load_adjustment_interval` (with `load`), or both: then the throughput decision is a floor for the load
    decisions, and raises the pools to it at once."""

    def __init__(self, config: PlannerConfig, connector: Connector, *, sla: SlaPlanner | None = None,
                 observer: Observer | None = None, load: LoadPlanner | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        if (sla is None) != (observer is None) or (sla is None and load is None):
            raise ValueError("a planner loop needs an SLA planner with its observer, a load planner, or both")
        self.config = config
        self.sla = sla
        self.observer = observer
        self.load = load
        self.connector = connector
        self.metrics = PlannerMetrics(registry) if registry is not None else None
        self.floor: Replicas | None = None  # the throughput decision, when load scaling runs too
        self._last_verdicts: tuple[Verdict, ...] = ()
        self._scaling: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop` is set; the first intervals start now."""
        cadences = []
        if self.sla is not None:
            assert self.observer is not None
            await self.observer.sample(0.0)  # the starting point
            cadences.append(self._every(self.config.adjustment_interval, self.step, stop))
        if self.load is not None:
            cadences.append(self._every(self.config.load_adjustment_interval, self._load_step, stop))
        try:
            await asyncio.gather(*cadences)
        finally:
            await asyncio.gather(*self._scaling, return_exceptions=True)

    @staticmethod
    async def _every(interval: float, step: Callable[[float], Awaitable[object]], stop: asyncio.Event) -> None:
        last = time.monotonic()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(last + interval - time.monotonic(), 0.0)):
                    await stop.wait()
                return
            now = time.monotonic()
            try:
                await step(now - last)
            except ConfigError:  # a setting it cannot plan with (a frontend address shared by processes): stop
                raise
            except Exception:  # one bad interval must not end planning
                log.exception("planner: the decision failed; trying again next interval")
            last = now

    async def step(self, elapsed: float) -> Decision | None:
        """One throughput interval of `elapsed` seconds: observe, decide, act."""
        assert self.sla is not None and self.observer is not None
        observed = await self.observer.sample(elapsed)
        current = await self.connector.replicas()
        # Fitting the predictors (ARIMA tries many models) takes up to seconds of CPU: off the event loop, which
        # also runs the load-based decisions, the connector and, in `tandem run`, the supervisor.
        if not await asyncio.to_thread(self.sla.observe, observed, current):
            log.info("planner: no traffic in the last %.0f s; keeping prefill %d, decode %d", elapsed,
                     current.prefill, current.decode)
            if self.metrics is not None:
                self.metrics.idle.inc()
            return None
        startup = self.config.worker_startup_time
        if startup is None:
            startup = self.connector.startup_seconds() or 0.0
        decision = await asyncio.to_thread(self.sla.decide, current, elapsed, startup)
        target = decision.target
        if self.load is not None:  # a floor: raise the pools to it now, load scaling moves above it
            self.floor = target
            target = Replicas(max(current.prefill, target.prefill), max(current.decode, target.decode))
            if self.metrics is not None:
                for pool in ("prefill", "decode"):
                    self.metrics.floor.labels(pool).set(getattr(decision.target, pool))
        action = self._act(target, current)
        log.info("planner: %s (%s)", decision.describe(current), action)
        if self.metrics is not None:
            self.metrics.record(decision, current)
            self.metrics.decisions.labels(action).inc()
        return decision

    async def _load_step(self, elapsed: float) -> LoadDecision:
        return await self.load_step()

    async def load_step(self) -> LoadDecision:
        """One load-based decision from the engines' latest reports."""
        assert self.load is not None
        current = await self.connector.replicas()
        decision = self.load.decide(current, self.floor)
        target = within_limits(decision.target, self.config) if decision.target != current else current
        decision = replace(decision, target=target)
        action = self._act(target, current)
        verdicts = tuple(e.verdict for e in decision.estimates.values())
        if action != "unchanged" or verdicts != self._last_verdicts:  # a line per change, not per second
            log.info("planner: %s (%s)", decision.describe(current), action)
            self._last_verdicts = verdicts
        if self.metrics is not None:
            self.metrics.record_load(decision, current)
        return decision

    def _act(self, target: Replicas, current: Replicas) -> str:
        if target == current:
            return "unchanged"
        if self.config.no_operation:
            return "observe_only"
        task = asyncio.create_task(self._scale(target), name="planner-scale")
        self._scaling.add(task)
        task.add_done_callback(self._scaling.discard)
        return "scaled"

    async def _scale(self, target: Replicas) -> None:
        try:
            await self.connector.scale(target)
        except Exception:  # the next interval decides again
            log.exception("planner: scaling to prefill %d, decode %d failed", target.prefill, target.decode)
