"""`tandem run --planner sla|load`: the planner sizing this run's own worker groups (the local connector)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, start_http_server

from tandem.launch.plan import Plan
from tandem.launch.supervisor import Supervisor
from tandem.planner.config import PlannerConfig
from tandem.planner.engines import EngineFollower
from tandem.planner.load import LoadPlanner
from tandem.planner.loop import PlannerLoop
from tandem.planner.observe import FrontendObserver
from tandem.planner.sla import Replicas, SlaPlanner
from tandem.runtime import DistributedRuntime, RuntimeConfig


class LocalConnector:
    """Scales the worker groups of this `tandem run`: new workers start on free cores; the workers stopped
    are the newest, each draining its streams before it exits (the frontend migrates what is left)."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self.aggregated = "agg" in supervisor.groups

    async def replicas(self) -> Replicas:
        workers = self.supervisor.workers
        if self.aggregated:
            return Replicas(0, len(workers["agg"]))
        return Replicas(len(workers["prefill"]), len(workers["decode"]))

    def startup_seconds(self) -> float | None:
        return self.supervisor.startup_seconds()

    async def scale(self, target: Replicas) -> None:
        if self.aggregated:
            await self.supervisor.scale("agg", target.decode)
        else:
            await asyncio.gather(self.supervisor.scale("prefill", target.prefill),
                                 self.supervisor.scale("decode", target.decode))


class _ToMux(logging.Handler):
    def __init__(self, say: Callable[[str], None]) -> None:
        super().__init__(logging.INFO)
        self.say = say

    def emit(self, record: logging.LogRecord) -> None:
        self.say(record.getMessage().removeprefix("planner: "))


def runtime_config(plan: Plan) -> RuntimeConfig:
    """This run's discovery and event plane, for the planner to follow the engines' forward-pass metrics."""
    env = plan.common_env
    return RuntimeConfig.from_env().replace(
        namespace=plan.spec.namespace, discovery_backend=plan.spec.discovery_backend,
        request_plane=plan.spec.request_plane, event_plane=plan.spec.event_plane, file_kv_root=env["DYN_FILE_KV"],
        system_port=None)


async def run_planner(config: PlannerConfig, sla: SlaPlanner | None, supervisor: Supervisor, frontend_url: str,
                      stop: asyncio.Event, say: Callable[[str], None], metrics_port: int | None = None) -> None:
    """Plan until `stop`: throughput-based with `sla` (observing the frontend), load-based when the config enables
    it (following the engines on this run's event plane). The planner's lines go to `say`, its metrics to
    `metrics_port` (if given)."""
    registry = CollectorRegistry()
    if metrics_port is not None:
        start_http_server(metrics_port, registry=registry)
        say(f"planner metrics on http://0.0.0.0:{metrics_port}/metrics")
    logger = logging.getLogger("tandem.planner")
    handler = _ToMux(say)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    runtime: DistributedRuntime | None = None
    follower: EngineFollower | None = None
    try:
        load = None
        if config.enable_load_scaling:
            runtime = await DistributedRuntime.create(runtime_config(supervisor.plan))
            load = LoadPlanner(config)
            follower = EngineFollower(runtime, supervisor.plan.spec.namespace, load)
            await follower.start()
        observer = FrontendObserver([frontend_url], supervisor.plan.served_name) if sla is not None else None
        loop = PlannerLoop(config, LocalConnector(supervisor), sla=sla, observer=observer, load=load,
                           registry=registry)
        say(config.describe())
        await loop.run(stop)
    finally:
        if follower is not None:
            await follower.close()
        if runtime is not None:
            await runtime.shutdown()
        logger.removeHandler(handler)
