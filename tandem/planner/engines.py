"""The engines' forward-pass metrics, followed on the event plane for load-based scaling.

Workers publish them on their component's `forward_pass_metrics` topic: prefill workers on the `prefill`
component, decode and aggregated workers on `backend` (the components tandem's and Dynamo's vLLM workers
register by default; others with `--prefill-component` / `--decode-component`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec

from tandem.llm.forward_pass import FORWARD_PASS_TOPIC, forward_pass_metrics_from_builtins
from tandem.planner.load import LoadPlanner
from tandem.runtime import DistributedRuntime
from tandem.runtime.client import Client

log = logging.getLogger(__name__)

DEFAULT_COMPONENTS = {"prefill": "prefill", "decode": "backend"}
GENERATE_ENDPOINT = "generate"


class EngineFollower:
    """Feeds each pool's reports into `planner` until closed, and tells it which workers each pool has in
    discovery (the instances of the component's `generate` endpoint)."""

    def __init__(self, runtime: DistributedRuntime, namespace: str, planner: LoadPlanner,
                 components: dict[str, str] | None = None) -> None:
        self.runtime = runtime
        self.namespace = namespace
        self.planner = planner
        self.components = {**DEFAULT_COMPONENTS, **(components or {})}
        self._tasks: list[asyncio.Task[None]] = []
        self._clients: dict[str, Client] = {}

    async def start(self) -> None:
        for pool in self.planner.config.pools:
            component = self.runtime.namespace(self.namespace).component(self.components[pool])
            self._clients[pool] = await component.endpoint(GENERATE_ENDPOINT).client()
            subscriber = await component.subscribe(FORWARD_PASS_TOPIC)
            self._tasks.append(asyncio.create_task(self._follow(pool, subscriber), name=f"follow-{pool}-engines"))
        self.planner.members = self.members

    def members(self, pool: str) -> set[int] | None:
        client = self._clients.get(pool)
        return set(client.instance_ids()) if client is not None else None

    async def _follow(self, pool: str, subscriber: object) -> None:
        bad = 0
        async for event in subscriber:  # type: ignore[attr-defined]
            try:
                report = forward_pass_metrics_from_builtins(event)
            except msgspec.ValidationError as e:  # another version's worker: say so once, keep going
                bad += 1
                if bad == 1:
                    log.warning("planner: ignoring a %s report that is not forward-pass metrics: %s", pool, e)
                continue
            self.planner.ingest(pool, report)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
