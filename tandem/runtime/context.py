"""Per-request context: identity plus graceful `stop` and hard `kill`, linked parent -> children."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable


class Context:
    """The `AsyncEngineContext` of a request stream.

    `stop_generating()` asks the producer to finish early but keep what is already in the stream;
    `kill()` asks it to stop at once and drop the rest. Both are one-way and idempotent. Linked
    children (e.g. a prefill sub-request) get the same signal, in link order.
    """

    __slots__ = ("_id", "_stopped", "_killed", "_stop_event", "_children", "_callbacks", "metadata")

    def __init__(self, request_id: str | None = None) -> None:
        self._id = request_id or os.urandom(16).hex()
        self._stopped = False
        self._killed = False
        self._stop_event: asyncio.Event | None = None
        self._children: list[Context] = []
        self._callbacks: list[Callable[[bool], None]] = []
        self.metadata: dict[str, object] = {}

    def id(self) -> str:
        return self._id

    def is_stopped(self) -> bool:
        """True once stop or kill was requested."""
        return self._stopped

    def is_killed(self) -> bool:
        return self._killed

    def stop_generating(self) -> None:
        self._signal(kill=False)

    stop = stop_generating

    def kill(self) -> None:
        self._signal(kill=True)

    def _signal(self, kill: bool) -> None:
        if self._killed or (self._stopped and not kill):
            return
        self._stopped = True
        self._killed = self._killed or kill
        if self._stop_event is not None:
            self._stop_event.set()
        for callback in list(self._callbacks):
            callback(kill)
        for child in self._children:
            child._signal(kill)

    async def stopped(self) -> None:
        """Wait until stop or kill is requested."""
        if self._stopped:
            return
        if self._stop_event is None:
            self._stop_event = asyncio.Event()
        await self._stop_event.wait()

    async_killed_or_stopped = stopped

    async def killed(self) -> None:
        while not self._killed:
            if self._stop_event is None:
                self._stop_event = asyncio.Event()
            await self._stop_event.wait()
            if not self._killed:
                # A stop came first; wait for a kill that may follow.
                self._stop_event = asyncio.Event()

    def link_child(self, child: Context) -> None:
        """Propagate this context's stop/kill to `child` (already-signalled state applies at once)."""
        self._children.append(child)
        if self._killed:
            child.kill()
        elif self._stopped:
            child.stop_generating()

    def on_signal(self, callback: Callable[[bool], None]) -> Callable[[], None]:
        """Call `callback(killed)` on each stop/kill; returns a function that unregisters it."""
        self._callbacks.append(callback)
        return lambda: self._callbacks.remove(callback) if callback in self._callbacks else None

    def __repr__(self) -> str:
        state = "killed" if self._killed else "stopped" if self._stopped else "live"
        return f"Context({self._id}, {state})"
