"""ZMQ event plane: each publisher binds a PUB socket and records its address in discovery under
`v1/event_channels/{scope}/topic/{topic}/{publisher}`; subscribers watch that prefix and connect to
every publisher. Message = [scoped topic + NUL, msgpack payload]; the NUL stops ZMQ's prefix
matching from mixing `kv` with `kv_metrics`."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tandem.runtime import keys
from tandem.runtime.config import WILDCARDS
from tandem.runtime.discovery import KeyValueStore
from tandem.runtime.event_plane import EventPublisher, EventSubscriber

log = logging.getLogger(__name__)

SEND_HWM = 100_000
RECV_HWM = 100_000

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


def _wire_topic(scope: str, topic: str) -> bytes:
    return f"{scope}/{topic}".encode() + b"\0"


class ZmqPublisher(EventPublisher):
    def __init__(self, store: KeyValueStore, scope: str, topic: str, host: str, advertised: str) -> None:
        """Binds on `host`; subscribers are told `advertised` (the same, unless `host` is a wildcard)."""
        self._store = store
        self._topic = _wire_topic(scope, topic)
        self._key = keys.event_channel_key(scope, topic, f"{store.lease_id:x}-{secrets.token_hex(4)}")
        self._socket: zmq.Socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._socket.setsockopt(zmq.LINGER, 0)
        port: int = self._socket.bind_to_random_port(f"tcp://{'*' if host in WILDCARDS else host}")
        self.address = f"tcp://{advertised}:{port}"
        self.dropped = 0

    async def register(self) -> None:
        await self._store.put(self._key, json.dumps({"address": self.address}).encode())

    def publish(self, event: Any) -> bool:
        if self._socket.closed:  # the process is shutting down; what it still emits has no one to reach
            self.dropped += 1
            return False
        try:
            self._socket.send_multipart((self._topic, _encode(event)), flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            self.dropped += 1
            return False

    async def close(self) -> None:
        try:
            await self._store.delete(self._key)
        finally:
            self._socket.close(linger=0)


class ZmqSubscriber(EventSubscriber):
    def __init__(self, store: KeyValueStore, scope: str, topic: str) -> None:
        self._store = store
        self._prefix = keys.event_channel_prefix(scope, topic)
        self._topic = _wire_topic(scope, topic)
        self._socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.RCVHWM, RECV_HWM)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._connected: dict[str, str] = {}  # discovery key -> address
        self._watcher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        watch = await self._store.watch_prefix(self._prefix)
        # Connect to the publishers that exist now before returning, so early events are not lost.
        for key, value in (await self._store.get_prefix(self._prefix)).items():
            self._connect(key, value)
        self._watcher = asyncio.create_task(self._follow(watch), name=f"zmq-sub {self._prefix}")

    def _connect(self, key: str, value: bytes) -> None:
        try:
            address = json.loads(value)["address"]
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring malformed event channel entry %s", key)
            return
        previous = self._connected.get(key)
        if previous == address:
            return
        if previous is not None:
            self._socket.disconnect(previous)
        self._socket.connect(address)
        self._connected[key] = address
        log.debug("event subscriber connected to %s", address)

    async def _follow(self, watch: Any) -> None:
        try:
            async for event in watch:
                if event.kind == "put":
                    self._connect(event.key, event.value)
                else:
                    address = self._connected.pop(event.key, None)
                    if address is not None:
                        try:
                            self._socket.disconnect(address)
                        except zmq.ZMQError:
                            pass
        finally:
            watch.close()

    @property
    def publishers(self) -> list[str]:
        return sorted(self._connected.values())

    def __aiter__(self) -> ZmqSubscriber:
        return self

    async def __anext__(self) -> Any:
        try:
            frames = await self._socket.recv_multipart(copy=False)
        except zmq.ZMQError as e:
            if e.errno == zmq.ENOTSOCK:
                raise StopAsyncIteration from None
            raise
        return _decode(frames[-1].buffer)

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        self._socket.close(linger=0)
