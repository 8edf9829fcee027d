"""The discovery interface: a key-value store with one primary lease per process, prefix queries
and prefix watches. `mem`, `file` and (later) `etcd` implement it; everything above uses only this.
"""

from __future__ import annotations

import asyncio
import secrets
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """`put` carries the key's new value (create or update); `delete` means the key is gone,
    whether deleted, expired with its lease, or removed by a peer's crash clean-up."""

    kind: Literal["put", "delete"]
    key: str
    value: bytes | None = None


def new_lease_id() -> int:
    """A random non-zero 63-bit id, printable as hex and safe in JSON and msgpack."""
    return secrets.randbits(63) or 1


class Watch:
    """An async iterator of WatchEvents for one prefix. It first replays the current keys as `put`
    events, then streams changes. `close()` ends it; iteration then stops. `replayed` counts the keys the
    replay held, so a reader can tell when it has caught up with the store."""

    def __init__(self, prefix: str, on_close: Callable[[Watch], None] | None = None) -> None:
        self.prefix = prefix
        self._queue: asyncio.Queue[WatchEvent | None] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._on_close = on_close
        self._closed = False
        self.replayed = 0

    def _replay(self, key: str, value: bytes) -> None:
        """One current key, as a `put`, before any change is pushed."""
        self.replayed += 1
        self._push(WatchEvent("put", key, value))

    def _push(self, event: WatchEvent) -> None:
        """Thread-safe: backends may deliver from their own threads."""
        if not self._closed:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._on_close is not None:
            self._on_close(self)
        self._loop.call_soon_threadsafe(self._queue.put_nowait, None)

    def __aiter__(self) -> AsyncIterator[WatchEvent]:
        return self

    async def __anext__(self) -> WatchEvent:
        event = await self._queue.get()
        if event is None:
            raise StopAsyncIteration
        return event


class KeyValueStore(ABC):
    """A discovery backend.

    Keys are `/`-separated strings (`v1/instances/{ns}/{component}/{endpoint}/{id:x}`). Every key
    written with `leased=True` (the default) is tied to this store's primary lease: it disappears
    when `close()` is called, or within the TTL when the process dies without calling it.
    """

    lease_id: int
    ttl: float

    @abstractmethod
    async def start(self) -> None:
        """Connect and start keep-alive. Must be called before any other method."""

    @abstractmethod
    async def put(self, key: str, value: bytes, *, leased: bool = True) -> None:
        """Create or overwrite `key`."""

    @abstractmethod
    async def create(self, key: str, value: bytes, *, leased: bool = True) -> bool:
        """Create `key` only if absent; False if it already exists."""

    @abstractmethod
    async def get(self, key: str) -> bytes | None: ...

    @abstractmethod
    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every live key starting with `prefix`, with its value."""

    @abstractmethod
    async def delete(self, key: str) -> None:
        """Delete `key` (no error if absent)."""

    @abstractmethod
    async def watch_prefix(self, prefix: str) -> Watch:
        """A Watch that replays the keys under `prefix`, then reports puts and deletes."""

    @abstractmethod
    async def close(self) -> None:
        """Revoke the lease: delete this store's leased keys, stop keep-alive, end its watches."""
