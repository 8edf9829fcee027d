"""Client of one endpoint: follows its live instances in discovery and streams requests to them."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tandem.runtime import keys
from tandem.runtime.context import Context
from tandem.runtime.discovery import Watch
from tandem.runtime.errors import InstanceUnreachableError, NoInstancesError
from tandem.runtime.request_plane import ResponseStream

if TYPE_CHECKING:
    from tandem.runtime.component import Endpoint

log = logging.getLogger(__name__)


class Client:
    """Routes with `random` (the default of `generate`), `round_robin` or `direct(instance_id)`.

    An instance that could not be reached is skipped for `inhibit_seconds` (it is usually dead and
    about to leave discovery), unless every instance is skipped.
    """

    def __init__(self, endpoint: Endpoint, inhibit_seconds: float = 10.0) -> None:
        self.endpoint = endpoint
        self._runtime = endpoint.runtime
        self._prefix = keys.endpoint_prefix(endpoint.namespace, endpoint.component, endpoint.name)
        self._instances: dict[int, dict[str, str]] = {}
        self._ids: list[int] = []
        self._inhibited: dict[int, float] = {}
        self._inhibit_seconds = inhibit_seconds
        self._rr = 0
        self._changed = asyncio.Event()
        self._watch: Watch | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> Client:
        store = self._runtime.store
        self._watch = await store.watch_prefix(self._prefix)
        for key, value in (await store.get_prefix(self._prefix)).items():
            self._apply_put(key, value)
        self._task = asyncio.create_task(self._follow(self._watch), name=f"client {self.endpoint.path}")
        return self

    def _apply_put(self, key: str, value: bytes | None) -> None:
        try:
            record = json.loads(value or b"")
            instance_id = int(record["instance_id"])
            transport = dict(record["transport"])
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring malformed instance record at %s", key)
            return
        if self._instances.get(instance_id) != transport:
            self._instances[instance_id] = transport
            self._inhibited.pop(instance_id, None)
            self._refresh()

    def _refresh(self) -> None:
        self._ids = sorted(self._instances)
        self._changed.set()
        self._changed = asyncio.Event()

    async def _follow(self, watch: Watch) -> None:
        async for event in watch:
            if event.kind == "put":
                self._apply_put(event.key, event.value)
            else:
                try:
                    instance_id = int(event.key.rsplit("/", 1)[-1], 16)
                except ValueError:
                    continue
                if self._instances.pop(instance_id, None) is not None:
                    self._inhibited.pop(instance_id, None)
                    self._refresh()

    def instance_ids(self) -> list[int]:
        """Live instance ids, sorted."""
        return list(self._ids)

    def transport_of(self, instance_id: int) -> dict[str, str] | None:
        return self._instances.get(instance_id)

    def is_usable(self, instance_id: int) -> bool:
        """Live in discovery and not skipped after a recent failure to reach it."""
        if instance_id not in self._instances:
            return False
        until = self._inhibited.get(instance_id)
        return until is None or until <= time.monotonic()

    async def wait_for_instances(self, count: int = 1, timeout: float | None = None) -> list[int]:
        """Wait until at least `count` instances are live; returns their ids."""
        await self._wait_until(lambda: len(self._ids) >= count, timeout,
                               lambda: f"{len(self._ids)} instance(s) after {timeout}s, wanted {count}")
        return self.instance_ids()

    async def wait_for_instance(self, instance_id: int, timeout: float) -> None:
        """Wait until instance `instance_id` is live (0: only check that it is)."""
        await self._wait_until(lambda: instance_id in self._instances, timeout,
                               lambda: f"instance {instance_id:x} not listed after {timeout}s")

    async def _wait_until(self, listed: Callable[[], bool], timeout: float | None, missing: Callable[[], str]) -> None:
        """Until `listed()` holds after a discovery change, or NoInstancesError naming what is `missing`."""
        async def wait() -> None:
            while not listed():
                await self._changed.wait()

        if listed():
            return
        try:
            async with asyncio.timeout(timeout):
                await wait()
        except TimeoutError:
            raise NoInstancesError(f"{self.endpoint.path}: {missing()}") from None

    def report_instance_down(self, instance_id: int) -> None:
        """Skip `instance_id` for a while (called when it could not be reached)."""
        if self._inhibit_seconds > 0 and instance_id in self._instances:
            self._inhibited[instance_id] = time.monotonic() + self._inhibit_seconds

    def _candidates(self) -> list[int]:
        ids = self._ids
        if not ids:
            raise NoInstancesError(f"no instances of {self.endpoint.path} are live")
        if self._inhibited:
            now = time.monotonic()
            for instance_id, until in list(self._inhibited.items()):
                if until <= now:
                    del self._inhibited[instance_id]
            usable = [i for i in ids if i not in self._inhibited]
            return usable or ids
        return ids

    async def generate(self, request: Any, context: Context | None = None) -> ResponseStream:
        return await self.random(request, context)

    async def random(self, request: Any, context: Context | None = None) -> ResponseStream:
        return await self.direct(request, random.choice(self._candidates()), context)

    async def round_robin(self, request: Any, context: Context | None = None) -> ResponseStream:
        candidates = self._candidates()
        self._rr += 1
        return await self.direct(request, candidates[self._rr % len(candidates)], context)

    async def direct(self, request: Any, instance_id: int, context: Context | None = None, *,
                     item_type: type | None = None) -> ResponseStream:
        """Send to one given instance; its answer's items are decoded into `item_type` (a msgspec Struct)."""
        transport = self._instances.get(instance_id)
        if transport is None:
            raise NoInstancesError(f"instance {instance_id:x} of {self.endpoint.path} is not live")
        try:
            return await self._runtime.request_client.open_stream(
                transport, self.endpoint.path, request, context or Context(), item_type
            )
        except InstanceUnreachableError:
            self.report_instance_down(instance_id)
            raise

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
        if self._task is not None:
            self._task.cancel()
