"""Namespace / component / endpoint: the addressing model, and serving an endpoint."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from tandem.runtime import keys
from tandem.runtime.client import Client
from tandem.runtime.context import Context
from tandem.runtime.errors import InvalidRequestError
from tandem.runtime.event_plane import EventPublisher, EventSubscriber
from tandem.runtime.metrics import EndpointStats

if TYPE_CHECKING:
    from tandem.runtime.runtime import DistributedRuntime

log = logging.getLogger(__name__)

Handler = Callable[..., AsyncIterator[Any]]


class Namespace:
    def __init__(self, runtime: DistributedRuntime, name: str) -> None:
        self.runtime = runtime
        self.name = name

    def component(self, name: str) -> Component:
        return Component(self.runtime, self.name, name)

    async def event_publisher(self, topic: str) -> EventPublisher:
        """Publish on `topic` scoped to this namespace."""
        return await self.runtime.event_publisher(self.name, topic)

    async def subscribe(self, topic: str) -> EventSubscriber:
        return await self.runtime.subscribe(self.name, topic)


class Component:
    def __init__(self, runtime: DistributedRuntime, namespace: str, name: str) -> None:
        self.runtime = runtime
        self.namespace = namespace
        self.name = name

    @property
    def scope(self) -> str:
        return f"{self.namespace}/{self.name}"

    def endpoint(self, name: str) -> Endpoint:
        return Endpoint(self.runtime, self.namespace, self.name, name)

    async def event_publisher(self, topic: str, durable: bool = False) -> EventPublisher:
        """Publish on `topic` scoped to this component (e.g. `kv-events`, `kv_metrics`); `durable` keeps
        the events in a JetStream stream too (NATS event plane only)."""
        return await self.runtime.event_publisher(self.scope, topic, durable)

    async def subscribe(self, topic: str, durable: bool = False) -> EventSubscriber:
        """`durable`: replay the topic's JetStream stream first, then follow it live."""
        return await self.runtime.subscribe(self.scope, topic, durable)


class Endpoint:
    def __init__(self, runtime: DistributedRuntime, namespace: str, component: str, name: str) -> None:
        self.runtime = runtime
        self.namespace = namespace
        self.component = component
        self.name = name

    @property
    def path(self) -> str:
        """`namespace.component.endpoint`, the address used on the request plane."""
        return f"{self.namespace}.{self.component}.{self.name}"

    def __repr__(self) -> str:
        return f"Endpoint(dyn://{self.path})"

    async def start_serving(
        self,
        handler: Handler,
        *,
        graceful_shutdown: bool = True,
        metrics_labels: list[tuple[str, str]] | dict[str, str] | None = None,
        health_check_payload: Any = None,
        request_type: type | None = None,
    ) -> ServedEndpoint:
        """Serve `handler` and register this instance in discovery; returns at once.

        `handler(request)` or `handler(request, context)` must be an async generator of
        msgpack-able items (msgspec Structs included). With `request_type` (a msgspec Struct), the
        request is decoded into it first; one that does not fit is answered with a 400 naming the field,
        and the handler never sees it. With `graceful_shutdown`, shutdown waits for its in-flight streams.
        """
        served = ServedEndpoint(self, handler, graceful_shutdown, dict(metrics_labels or {}), health_check_payload,
                                request_type)
        await self.runtime._serve(served)
        return served

    async def serve(self, handler: Handler, **options: Any) -> None:
        """Serve until the runtime shuts down (Dynamo's `serve_endpoint`)."""
        await self.start_serving(handler, **options)
        await self.runtime.wait_closed()

    serve_endpoint = serve

    async def client(self, inhibit_seconds: float | None = None) -> Client:
        """A client that follows this endpoint's instances."""
        if inhibit_seconds is None:
            inhibit_seconds = self.runtime.config_inhibit_seconds
        return await Client(self, inhibit_seconds).start()


class ServedEndpoint:
    """One endpoint served by this process: the request plane calls `stream` and `account`."""

    def __init__(
        self,
        endpoint: Endpoint,
        handler: Handler,
        graceful_shutdown: bool,
        metrics_labels: dict[str, str],
        health_check_payload: Any,
        request_type: type | None = None,
    ) -> None:
        if not (inspect.isasyncgenfunction(handler) or inspect.isasyncgenfunction(type(handler).__call__)):
            raise TypeError(f"handler for {endpoint.path} must be an async generator function, got {handler!r}")
        self.endpoint = endpoint
        self.path = endpoint.path
        self.graceful_shutdown = graceful_shutdown
        self.health_check_payload = health_check_payload
        params = [
            p for p in inspect.signature(handler).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        self._wants_context = len(params) >= 2
        self._handler = handler
        self._request_type = request_type
        self.key = keys.instance_key(endpoint.namespace, endpoint.component, endpoint.name, endpoint.runtime.instance_id)
        labels = {
            "dynamo_namespace": endpoint.namespace,
            "dynamo_component": endpoint.component,
            "dynamo_endpoint": endpoint.name,
            **metrics_labels,
        }
        server = endpoint.runtime.request_server
        self.stats = EndpointStats(labels, lambda: server.inflight(self.path))
        self.last_activity = time.monotonic()

    def stream(self, request: Any, context: Context) -> AsyncIterator[Any]:
        """The handler's stream for `request`; raises InvalidRequestError when it is not a `request_type`."""
        self.last_activity = time.monotonic()
        if self._request_type is not None:
            try:
                request = msgspec.convert(request, self._request_type)
            except msgspec.ValidationError as e:
                raise InvalidRequestError(f"invalid {self._request_type.__name__}: {e}") from None
        if self._wants_context:
            return self._handler(request, context)
        return self._handler(request)

    def account(self, request_bytes: int, response_bytes: int, seconds: float, outcome: str) -> None:
        self.last_activity = time.monotonic()
        self.stats.record(request_bytes, response_bytes, seconds, outcome)

    def record(self) -> bytes:
        """This instance's discovery entry."""
        runtime = self.endpoint.runtime
        return json.dumps({
            "type": "Endpoint",
            "namespace": self.endpoint.namespace,
            "component": self.endpoint.component,
            "endpoint": self.endpoint.name,
            "instance_id": runtime.instance_id,
            "transport": runtime.request_server.transport,
        }).encode()

    async def run_health_checks(self, every: float, timeout: float) -> None:
        """Canary: when idle for `every` seconds, send the health payload through the request plane
        to ourselves; the endpoint is ready while those answer."""
        runtime = self.endpoint.runtime
        health = runtime.health
        while True:
            await asyncio.sleep(max(0.0, self.last_activity + every - time.monotonic()))
            if time.monotonic() - self.last_activity < every:
                continue
            ok = False
            try:
                async def probe() -> bool:
                    stream = await runtime.request_client.open_stream(
                        runtime.request_server.transport, self.path, self.health_check_payload, Context()
                    )
                    try:
                        async for _ in stream:
                            return True
                        return False
                    finally:
                        await stream.aclose()  # also on timeout: the probe must not linger in the handler

                async with asyncio.timeout(timeout):
                    ok = await probe()
            except Exception as e:  # any failure of the probe marks the endpoint unhealthy
                log.warning("health check of %s failed: %s", self.path, e)
            if not ok:
                log.warning("health check of %s got no response", self.path)
            health.set_endpoint(self.endpoint.name, ok)
            self.last_activity = time.monotonic()
