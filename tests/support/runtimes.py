"""In-process runtimes for tests: their configuration, other planes, and PUB/SUB probes."""

from __future__ import annotations

import asyncio

import pytest

from tandem.runtime import DistributedRuntime, RuntimeConfig


def runtime_config(**overrides: object) -> RuntimeConfig:
    """Loopback, no grace period: what an in-process test wants."""
    base = RuntimeConfig(
        discovery_backend="mem", tcp_host="127.0.0.1", system_host="127.0.0.1", graceful_shutdown_grace_period=0,
        graceful_shutdown_timeout=5,
    )
    return base.replace(**overrides)


def runtimes_on(runtimes, request: pytest.FixtureRequest, **settings: str):  # type: ignore[no-untyped-def]
    """The `runtimes` factory with `settings` (e.g. request_plane="nats") under any overrides; a NATS
    setting brings the session's real NATS server."""
    if "nats" in settings.values():
        settings = {**settings, "nats_server": request.getfixturevalue("nats").url}

    async def make(**overrides: object) -> DistributedRuntime:
        return await runtimes(**{**settings, **overrides})

    return make


async def publish_until_received(publisher, subscriber, probe) -> None:  # type: ignore[no-untyped-def]
    """PUB/SUB drops messages sent before the subscription reaches the publisher: retry a probe."""
    async with asyncio.timeout(10):
        while True:
            publisher.publish(probe)
            try:
                async with asyncio.timeout(0.1):
                    while (await subscriber.__anext__()) != probe:
                        pass
                return
            except TimeoutError:
                continue
