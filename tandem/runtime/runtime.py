"""DistributedRuntime: one per process. Owns discovery, the request plane, the event plane, the
system status server, metrics, and the graceful-shutdown sequence."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from tandem.runtime.component import Component, Endpoint, Namespace, ServedEndpoint
from tandem.runtime.config import WILDCARDS, ConfigError, RuntimeConfig, env_number
from tandem.runtime.discovery import KeyValueStore, make_store
from tandem.runtime.discovery.etcd import EtcdError, EtcdUnavailable
from tandem.runtime.event_plane import EventPublisher, EventSubscriber
from tandem.runtime.keys import parse_endpoint_path
from tandem.runtime.metrics import RuntimeCollector
from tandem.runtime.natsconn import NatsConnection
from tandem.runtime.request_plane import make_request_plane
from tandem.runtime.system_server import EngineRoute, JsonRoute, SystemHealth, SystemStatusServer

log = logging.getLogger(__name__)


class DistributedRuntime:
    """Create with `await DistributedRuntime.create(config)`; stop with `await runtime.shutdown()`
    (or SIGTERM/SIGINT after `install_signal_handlers()`)."""

    def __init__(self, config: RuntimeConfig | None = None) -> None:
        self.config = config or RuntimeConfig.from_env()
        self.config.validate()
        self.store: KeyValueStore = make_store(
            self.config.discovery_backend, file_root=self.config.file_kv_root, ttl=self.config.discovery_ttl
        )
        uses_nats = "nats" in (self.config.request_plane, self.config.event_plane)
        self.nats = NatsConnection(self.config) if uses_nats else None
        self.request_server, self.request_client = make_request_plane(
            self.config.request_plane, self.config, self.nats, lambda: self.instance_id)
        self.registry = CollectorRegistry(auto_describe=True)
        self.collector = RuntimeCollector()
        self.registry.register(self.collector)
        self.health = SystemHealth(self.config)
        self.system_server: SystemStatusServer | None = None
        self.config_inhibit_seconds = env_number("DYN_RUNTIME_INHIBITED_DURATION_SECS", 10.0)
        self._served: dict[str, ServedEndpoint] = {}
        self._registered_keys: dict[str, bytes] = {}
        self._in_discovery = True
        self._publishers: list[EventPublisher] = []
        self._subscribers: list[EventSubscriber] = []
        self._background: set[asyncio.Task[Any]] = set()
        self._closed = asyncio.Event()
        self._shutdown_task: asyncio.Task[None] | None = None
        self._shutdown_hooks: list[Callable[[], Awaitable[None]]] = []
        self._drains: list[Callable[[float], Awaitable[None]]] = []

    @classmethod
    async def create(cls, config: RuntimeConfig | None = None, **overrides: Any) -> DistributedRuntime:
        config = (config or RuntimeConfig.from_env()).replace(**overrides) if overrides else config
        runtime = cls(config)
        await runtime.start()
        return runtime

    async def start(self) -> None:
        try:
            await self.store.start()
        except EtcdUnavailable as e:  # the discovery server the user named: their setting, not a crash
            raise ConfigError(str(e)) from None
        try:
            if self.nats is not None:
                await self.nats.start()
            await self.request_server.start()
            if self.config.system_port is not None:
                self.system_server = SystemStatusServer(self.config, self.health, self.registry)
                await self.system_server.start()
        except BaseException:
            # e.g. the system port is taken: release what started so the process can exit cleanly
            await self.request_server.close()
            if self.nats is not None:
                await self.nats.close()
            await self.store.close()
            raise
        log.info(
            "runtime up: instance %x, discovery %s, request plane %s", self.instance_id,
            self.config.discovery_backend, self.request_server.transport,
        )

    # -- addressing ----------------------------------------------------------------------------
    @property
    def instance_id(self) -> int:
        """This process's id in discovery (its primary lease)."""
        return self.store.lease_id

    def namespace(self, name: str | None = None) -> Namespace:
        return Namespace(self, name or self.config.namespace)

    def endpoint(self, path: str) -> Endpoint:
        """`ns.component.endpoint` or `dyn://ns.component.endpoint`."""
        namespace, component, endpoint = parse_endpoint_path(path)
        return Component(self, namespace, component).endpoint(endpoint)

    # -- serving -------------------------------------------------------------------------------
    async def _serve(self, served: ServedEndpoint) -> None:
        if self.is_shutting_down:
            raise RuntimeError("the runtime is shutting down; cannot serve new endpoints")
        if served.path in self._served:
            raise ValueError(f"{served.path} is already served by this process")
        await self.request_server.add_endpoint(served.path, served)
        self.collector.endpoints.append(served.stats)
        self._served[served.path] = served
        await self.register_key(served.key, served.record())
        self.health.set_endpoint(served.endpoint.name, True)
        if self.config.health_check_enabled and served.health_check_payload is not None:
            self.spawn(served.run_health_checks(self.config.canary_wait_time, self.config.health_check_request_timeout))
        log.info("serving dyn://%s", served.path)

    async def register_key(self, key: str, value: bytes) -> None:
        """Write a leased discovery key that shutdown removes first (instances, model cards)."""
        if self._in_discovery:
            await self.store.put(key, value)
        self._registered_keys[key] = value

    async def unregister_key(self, key: str) -> None:
        self._registered_keys.pop(key, None)
        await self.store.delete(key)

    async def leave_discovery(self) -> None:
        """Withdraw every registration (routers stop sending here) but keep serving and remember them."""
        self._in_discovery = False
        for key in self._registered_keys:
            await self.store.delete(key)

    async def rejoin_discovery(self) -> None:
        """Publish again what `leave_discovery` withdrew, plus anything registered meanwhile."""
        self._in_discovery = True
        for key, value in self._registered_keys.items():
            await self.store.put(key, value)

    def register_engine_route(self, name: str, handler: EngineRoute) -> None:
        """Serve `handler` at `/engine/{name}` on the system status server (if enabled)."""
        if self.system_server is not None:
            self.system_server.register_engine_route(name, handler)

    def register_system_route(self, method: str, path: str, handler: JsonRoute) -> bool:
        """Serve `handler(json_body_or_None, path_params) -> (status, json)` at `method path` on the
        system status server (see `SystemStatusServer.register_route`). False when it is not enabled."""
        if self.system_server is None:
            return False
        self.system_server.register_route(method, path, handler)
        return True

    def set_ready(self, ready: bool = True) -> None:
        """Mark the process ready (or not) for the system status server's /health."""
        self.health.set_ready(ready)

    # -- events --------------------------------------------------------------------------------
    async def event_publisher(self, scope: str, topic: str, durable: bool = False) -> EventPublisher:
        publisher: EventPublisher
        if self.config.event_plane == "nats":
            from tandem.runtime.event_plane.nats import (
                DurablePublisher,
                NatsPublisher,
                ensure_stream,
                event_subject,
            )

            assert self.nats is not None
            if durable:
                await ensure_stream(self.nats, event_subject(scope, topic))
            publisher = (DurablePublisher if durable else NatsPublisher)(self.nats, scope, topic)
        else:
            from tandem.runtime.event_plane.zmq import ZmqPublisher

            self._refuse_durable(durable)
            bind = self.config.event_host or self.config.tcp_host or self.config.advertised_host()
            advertised = self.config.advertised_host() if bind in WILDCARDS else bind
            publisher = ZmqPublisher(self.store, scope, topic, bind, advertised)
            await publisher.register()
        self._publishers.append(publisher)
        return publisher

    async def subscribe(self, scope: str, topic: str, durable: bool = False) -> EventSubscriber:
        subscriber: EventSubscriber
        if self.config.event_plane == "nats":
            from tandem.runtime.event_plane.nats import DurableSubscriber, NatsSubscriber

            assert self.nats is not None
            subscriber = (DurableSubscriber if durable else NatsSubscriber)(self.nats, scope, topic)
            await subscriber.start()
        else:
            from tandem.runtime.event_plane.zmq import ZmqSubscriber

            self._refuse_durable(durable)
            subscriber = ZmqSubscriber(self.store, scope, topic)
            await subscriber.start()
        self._subscribers.append(subscriber)
        return subscriber

    def _refuse_durable(self, durable: bool) -> None:
        if durable:
            raise ConfigError("durable KV events (--durable-kv-events, --router-durable-kv-events) are kept in NATS "
                              "JetStream: they need --event-plane nats (DYN_EVENT_PLANE=nats)")

    # -- lifecycle -----------------------------------------------------------------------------
    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """Run a background task that shutdown cancels."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    @property
    def is_shutting_down(self) -> bool:
        return self._shutdown_task is not None

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def add_shutdown_hook(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run `hook()` during shutdown after the drain and before the planes close (at most 30 s):
        e.g. a worker aborting what still runs so those streams end as incomplete and migrate."""
        self._shutdown_hooks.append(hook)

    def add_drain(self, drain: Callable[[float], Awaitable[None]]) -> None:
        """Run `await drain(seconds_left)` during shutdown, with the served endpoints' drain and under the
        same bound (DYN_RUNTIME_GRACEFUL_SHUTDOWN_TIMEOUT_SECS), while the planes are still open: e.g. the
        frontend finishing its HTTP streams."""
        self._drains.append(drain)

    def install_signal_handlers(self) -> None:
        """First SIGTERM/SIGINT: graceful shutdown. A second one: exit at once."""
        install_signal_handlers([self])

    def begin_shutdown(self) -> asyncio.Task[None]:
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.create_task(self._shutdown(), name="tandem-shutdown")
        return self._shutdown_task

    async def shutdown(self) -> None:
        """Unregister, wait the grace period while still serving, stop accepting, drain, close."""
        await asyncio.shield(self.begin_shutdown())

    async def _shutdown(self) -> None:
        config = self.config
        try:
            # 1. Leave discovery so routers stop picking us. With the discovery server away (a cluster being
            # deleted stops etcd too) the keys expire with the lease instead: shutdown goes on regardless.
            try:
                for key in list(self._registered_keys):
                    await self.unregister_key(key)
            except (ConnectionError, EtcdError) as e:
                log.warning("could not leave discovery (%s); this process's keys expire with its lease", e)
            for served in self._served.values():
                self.health.set_endpoint(served.endpoint.name, False)
            # 2. Keep serving for the grace period: requests routed just before still arrive.
            if self._served and config.graceful_shutdown_grace_period > 0:
                await asyncio.sleep(config.graceful_shutdown_grace_period)
            # 3. Stop accepting.
            for path in self._served:
                await self.request_server.remove_endpoint(path)
            # 4. Drain in-flight streams of graceful endpoints, bounded.
            draining = [s for s in self._served.values() if s.graceful_shutdown]
            deadline = asyncio.get_running_loop().time() + config.graceful_shutdown_timeout
            for drain in self._drains:
                await drain(max(deadline - asyncio.get_running_loop().time(), 0.0))
            while any(self.request_server.inflight(s.path) for s in draining):
                if asyncio.get_running_loop().time() >= deadline:
                    log.warning("graceful shutdown timed out with streams still running")
                    break
                await asyncio.sleep(0.05)
            for hook in self._shutdown_hooks:
                try:
                    async with asyncio.timeout(30):
                        await hook()
                except Exception:
                    log.exception("shutdown hook failed")
        finally:
            # 5. Close everything: one part failing to close must not keep the others (and the process) up.
            for task in list(self._background):
                task.cancel()
            closers: list[Callable[[], Awaitable[None]]] = [s.close for s in self._subscribers]
            closers += [p.close for p in self._publishers]
            closers += [self.request_server.close, self.request_client.close]
            closers += [part.close for part in (self.nats, self.system_server) if part is not None]
            for close in [*closers, self.store.close]:
                try:
                    await close()
                except Exception as e:
                    log.warning("shutdown: %s failed: %s", getattr(close, "__qualname__", close), e)
            self._closed.set()
            log.info("runtime shut down")


def install_signal_handlers(runtimes: Sequence[DistributedRuntime]) -> None:
    """SIGTERM/SIGINT shut down every runtime of this process gracefully (e.g. the mocker's N
    engines); a second signal exits at once."""
    loop = asyncio.get_running_loop()
    received = 0

    def on_signal(sig: signal.Signals) -> None:
        nonlocal received
        received += 1
        if received > 1:
            log.warning("second %s: exiting now", sig.name)
            os._exit(1)
        log.info("%s received: shutting down gracefully (send it again to exit at once)", sig.name)
        for runtime in runtimes:
            runtime.begin_shutdown()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)


def _command_name() -> str:
    """`tandem frontend` for `python -m tandem.frontend`, else the program's own name."""
    name = os.path.basename(sys.argv[0])
    if name == "__main__.py":
        return f"tandem {os.path.basename(os.path.dirname(sys.argv[0]))}"
    return name


def run(main: Any) -> int:
    """Run `main()` (a coroutine function) on uvloop when available; returns an exit code."""
    runner: Callable[[Any], Any]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        result = runner(main())
    except KeyboardInterrupt:
        return 130
    except ConfigError as e:  # a setting the user gave: the message, not a traceback
        print(f"{_command_name()}: error: {e}", file=sys.stderr)
        return 2
    return int(result or 0)
