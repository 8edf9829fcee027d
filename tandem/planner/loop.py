"""The planning loop: every adjustment interval, observe the frontends, decide, and hand the decision to a
connector, which changes the deployment (the local one: `tandem run`'s own workers).

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
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from tandem.planner.observe import FrontendObserver
from tandem.planner.sla import Decision, Replicas, SlaPlanner

log = logging.getLogger(__name__)


class Connector(Protocol):
    """How decisions reach the deployment."""

    def replicas(self) -> Replicas:
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

        self.decisions = Counter("tandem_planner_decisions", "Decisions taken, by what followed: scaled, unchanged, "
                                 "observe_only (no_operation)", ("action",),
                                 registry=registry)
        self.idle = Counter("tandem_planner_idle_intervals", "Intervals without traffic (nothing decided)",
                            registry=registry)
        self.predicted = gauge("predicted", "The forecast for the next interval", ("quantity",))
        self.correction = gauge("correction", "Observed over profiled latency", ("pool",))
        self.target = gauge("target_replicas", "Workers each pool should have", ("pool",))
        self.replicas = gauge("replicas", "Workers each pool has", ("pool",))

    def record(self, decision: Decision, current: Replicas) -> None:
        f = decision.forecast
        for quantity, value in (("requests", f.requests), ("isl", f.isl), ("osl", f.osl)):
            self.predicted.labels(quantity).set(value)
        self.correction.labels("prefill").set(decision.prefill_correction)
        self.correction.labels("decode").set(decision.decode_correction)
        for pool in ("prefill", "decode"):
            self.target.labels(pool).set(getattr(decision.target, pool))
            self.replicas.labels(pool).set(getattr(current, pool))


class PlannerLoop:
    def __init__(self, planner: SlaPlanner, observer: FrontendObserver, connector: Connector,
                 registry: CollectorRegistry | None = None) -> None:
        self.planner = planner
        self.observer = observer
        self.connector = connector
        self.metrics = PlannerMetrics(registry) if registry is not None else None
        self._scaling: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop` is set; the first interval starts now."""
        interval = self.planner.config.adjustment_interval
        await self.observer.sample(0.0)  # the starting point
        last = time.monotonic()
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(last + interval - time.monotonic(), 0.0))
                    return
                now = time.monotonic()
                await self.step(now - last)
                last = now
        finally:
            await asyncio.gather(*self._scaling, return_exceptions=True)

    async def step(self, elapsed: float) -> Decision | None:
        """One interval of `elapsed` seconds: observe, decide, act."""
        observed = await self.observer.sample(elapsed)
        current = self.connector.replicas()
        if not self.planner.observe(observed, current):
            log.info("planner: no traffic in the last %.0f s; keeping prefill %d, decode %d", elapsed,
                     current.prefill, current.decode)
            if self.metrics is not None:
                self.metrics.idle.inc()
            return None
        startup = self.planner.config.worker_startup_time
        if startup is None:
            startup = self.connector.startup_seconds() or 0.0
        decision = self.planner.decide(current, elapsed, startup)
        action = self._act(decision, current)
        log.info("planner: %s (%s)", decision.describe(current), action)
        if self.metrics is not None:
            self.metrics.record(decision, current)
            self.metrics.decisions.labels(action).inc()
        return decision

    def _act(self, decision: Decision, current: Replicas) -> str:
        if decision.target == current:
            return "unchanged"
        if self.planner.config.no_operation:
            return "observe_only"
        task = asyncio.create_task(self._scale(decision.target), name="planner-scale")
        self._scaling.add(task)
        task.add_done_callback(self._scaling.discard)
        return "scaled"

    async def _scale(self, target: Replicas) -> None:
        try:
            await self.connector.scale(target)
        except Exception:  # the next interval decides again
            log.exception("planner: scaling to prefill %d, decode %d failed", target.prefill, target.decode)
