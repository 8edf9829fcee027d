"""The worker side of KV events: number a worker's KV cache events, publish them on its
component's `kv-events` topic and keep the newest ones for the `worker_kv_indexer_query` endpoint
(a router that sees a gap in event ids asks the worker for the missing range).

Engines feed it already-translated `KvCacheEventData`: the vLLM worker through
`tandem.vllm.publisher.KvEventRelay` (from vLLM's ZMQ socket), the mocker directly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from itertools import islice
from typing import Any, Protocol

import msgspec

from tandem.router.protocols import (
    WORKER_KV_INDEXER_BUFFER_SIZE,
    KvCacheEvent,
    KvCacheEventData,
    KvEventsQuery,
    RouterEvent,
)


class SupportsPublish(Protocol):
    """What KV event and load publishers need of the event plane (an `EventPublisher`)."""

    def publish(self, event: Any) -> bool: ...


class KvEventPublisher:
    """Events of one worker (one dp rank), numbered from 0, published to `publisher` (may be set
    later) and kept in a ring buffer of `buffer_size`."""

    def __init__(self, *, worker_id: int, dp_rank: int = 0, buffer_size: int = WORKER_KV_INDEXER_BUFFER_SIZE,
                 publisher: SupportsPublish | None = None) -> None:
        if buffer_size <= 0:
            raise ValueError(f"buffer_size must be positive, got {buffer_size}")
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.buffer_size = buffer_size
        self._publisher: SupportsPublish | None = publisher
        self._buffer: deque[dict[str, Any]] = deque(maxlen=buffer_size)
        self._next_event_id = 0

    @property
    def publisher(self) -> SupportsPublish | None:
        """Where events go (the component's `kv-events` publisher once set)."""
        return self._publisher

    def emit(self, data: KvCacheEventData | str, tier: str = "device", dp_rank: int | None = None) -> None:
        """Publish one event (`KvCacheEventData` or "cleared") with the next event id."""
        rank = self.dp_rank if dp_rank is None else dp_rank
        event = RouterEvent(self.worker_id, KvCacheEvent(self._next_event_id, data, rank), tier)  # type: ignore[arg-type]
        self._next_event_id += 1
        obj = msgspec.to_builtins(event)
        self._buffer.append(obj)
        if self._publisher is not None:
            self._publisher.publish(obj)

    # -- worker-local indexer --------------------------------------------------------------------
    @property
    def last_event_id(self) -> int | None:
        """Id of the newest event published, None before the first."""
        return self._next_event_id - 1 if self._next_event_id else None

    @property
    def oldest_buffered_event_id(self) -> int:
        return self._next_event_id - len(self._buffer)

    def query(self, start_event_id: int | None = None, end_event_id: int | None = None) -> tuple[list[dict[str, Any]], bool]:
        """Buffered events with `start_event_id <= event_id <= end_event_id` (None: from the first
        event ever / to the newest). Returns `(events, complete)`; `complete` is False when part of
        the range was evicted from the ring buffer (ids beyond the newest are not an error)."""
        oldest = self.oldest_buffered_event_id
        newest = self._next_event_id - 1
        start = 0 if start_event_id is None else max(0, int(start_event_id))
        end = newest if end_event_id is None else min(int(end_event_id), newest)
        if end < start:
            return [], True
        complete = start >= oldest
        lo = max(start, oldest) - oldest
        hi = end - oldest + 1
        return list(islice(self._buffer, lo, hi)), complete

    async def indexer_query(self, request: Any, context: Any = None) -> AsyncIterator[dict[str, Any]]:
        """`worker_kv_indexer_query` handler of this publisher alone (see `indexer_query_handler`)."""
        async for answer in indexer_query_handler([self])(request):
            yield answer

    def answer(self, query: KvEventsQuery) -> dict[str, Any]:
        """The events `query` asks for, as a `KvEventsAnswer` map (the buffer holds them as sent)."""
        events, complete = self.query(query.start_event_id, query.end_event_id)
        return {
            "events": events,
            "complete": complete,
            "worker_id": self.worker_id,
            "dp_rank": self.dp_rank,
            "last_event_id": self.last_event_id,
        }


def indexer_query_handler(publishers: Sequence[KvEventPublisher]) -> Callable[..., AsyncIterator[dict[str, Any]]]:
    """One `worker_kv_indexer_query` handler for a worker with several dp ranks: the request's
    `dp_rank` (default: the first publisher's) picks the publisher."""
    by_rank = {publisher.dp_rank: publisher for publisher in publishers}
    default = publishers[0] if publishers else None

    async def handler(request: Any, context: Any = None) -> AsyncIterator[dict[str, Any]]:
        try:
            query = msgspec.convert(request, KvEventsQuery)
        except msgspec.ValidationError as e:
            yield {"events": [], "complete": False, "error": f"bad query: {e}"}
            return
        publisher = default if query.dp_rank is None else by_rank.get(query.dp_rank)
        if publisher is None:
            yield {"events": [], "complete": False, "error": f"no KV event publisher for dp_rank {query.dp_rank}"}
            return
        yield publisher.answer(query)

    return handler
