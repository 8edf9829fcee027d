"""`tandem run --planner sla`: the SLA planner sizing this run's own worker groups (the local connector)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, start_http_server

from tandem.launch.supervisor import Deployment
from tandem.planner.loop import PlannerLoop
from tandem.planner.observe import FrontendObserver
from tandem.planner.sla import Replicas, SlaPlanner


class LocalConnector:
    """Scales the worker groups of this `tandem run`: new workers start on free cores; the workers stopped
    are the newest, each draining its streams before it exits (the frontend migrates what is left)."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.aggregated = "agg" in deployment.groups

    def replicas(self) -> Replicas:
        workers = self.deployment.workers
        if self.aggregated:
            return Replicas(0, len(workers["agg"]))
        return Replicas(len(workers["prefill"]), len(workers["decode"]))

    def startup_seconds(self) -> float | None:
        return self.deployment.startup_seconds()

    async def scale(self, target: Replicas) -> None:
        if self.aggregated:
            await self.deployment.scale("agg", target.decode)
        else:
            await asyncio.gather(self.deployment.scale("prefill", target.prefill),
                                 self.deployment.scale("decode", target.decode))


class _ToMux(logging.Handler):
    def __init__(self, say: Callable[[str], None]) -> None:
        super().__init__(logging.INFO)
        self.say = say

    def emit(self, record: logging.LogRecord) -> None:
        self.say(record.getMessage().removeprefix("planner: "))


async def run_planner(planner: SlaPlanner, deployment: Deployment, frontend_url: str, model: str,
                      stop: asyncio.Event, say: Callable[[str], None], metrics_port: int | None = None) -> None:
    """Plan until `stop`; the planner's lines go to `say`, its metrics to `metrics_port` (if given)."""
    registry = CollectorRegistry()
    if metrics_port is not None:
        start_http_server(metrics_port, registry=registry)
        say(f"planner metrics on http://0.0.0.0:{metrics_port}/metrics")
    logger = logging.getLogger("tandem.planner")
    handler = _ToMux(say)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        loop = PlannerLoop(planner, FrontendObserver([frontend_url], model), LocalConnector(deployment), registry)
        config = planner.config
        say(f"SLA planner ({config.mode.value}): TTFT {config.ttft:g} ms, ITL {config.itl:g} ms, every "
            f"{config.adjustment_interval:g} s, {config.load_predictor.value} predictor")
        await loop.run(stop)
    finally:
        logger.removeHandler(handler)
