"""Event plane: lossy topic pub/sub between processes (KV events, load metrics, router sync).

Publishers never block: under overload messages are dropped, not queued without bound. Topics are
scoped (`namespace` or `namespace/component`), and subscribers find publishers that appear later.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any


class EventPublisher(ABC):
    @abstractmethod
    def publish(self, event: Any) -> bool:
        """Send `event` (msgpack-able). Never blocks; False if it was dropped (overload, or closed)."""

    @abstractmethod
    async def close(self) -> None: ...


class EventSubscriber(ABC):
    @abstractmethod
    def __aiter__(self) -> AsyncIterator[Any]: ...

    @abstractmethod
    async def __anext__(self) -> Any: ...

    @abstractmethod
    async def close(self) -> None: ...
