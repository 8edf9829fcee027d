"""Router-side wire formats (Dynamo `lib/kv-router/src/protocols.rs`).

KV events, published by each worker on its component's `kv-events` topic::

    RouterEvent {worker_id, storage_tier: "device"|"host_pinned"|"disk"|"external", event: KvCacheEvent}
    KvCacheEvent {event_id, data, dp_rank}
    data = {"stored": {"parent_hash": u64|null, "blocks": [{"block_hash", "tokens_hash"}, ...]}}
         | {"removed": {"block_hashes": [u64, ...]}}
         | "cleared"

`block_hash` is the engine's (opaque) hash of the block, used for parent lookup and removal;
`tokens_hash` is the router's local hash of the block's tokens (`tandem.router.hashing`).

Load, published by each worker on `kv_metrics`: `ActiveLoad`.

Everything travels as msgpack. On the event plane, publish `to_builtins(obj)` and read events back
with `router_event_from_builtins` / `active_load_from_builtins`; `encode` / `decode_*` do the same
to and from bytes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

KV_EVENT_TOPIC = "kv-events"
KV_METRICS_TOPIC = "kv_metrics"
WORKER_KV_INDEXER_QUERY_ENDPOINT = "worker_kv_indexer_query"
WORKER_KV_INDEXER_BUFFER_SIZE = 1024

U64 = Annotated[int, msgspec.Meta(ge=0)]  # (msgspec cannot bound above int64; msgpack caps at u64)


class KvBlock(msgspec.Struct, omit_defaults=True):
    block_hash: U64
    """The engine's hash of the block (sequence-aware, opaque to the router)."""
    tokens_hash: U64
    """The router's local hash of the block's tokens (`local_block_hashes`)."""
    mm_extra_info: dict[str, Any] | None = None


class KvStored(msgspec.Struct, omit_defaults=True):
    parent_hash: U64 | None
    """Engine hash of the block preceding `blocks[0]`, None when they start the sequence."""
    blocks: list[KvBlock]
    start_position: int | None = None


class KvRemoved(msgspec.Struct):
    block_hashes: list[U64]


class KvCacheEventData(msgspec.Struct, omit_defaults=True):
    """`{"stored": {...}}` or `{"removed": {...}}` (exactly one field set); "cleared" is the bare string."""

    stored: KvStored | None = None
    removed: KvRemoved | None = None

    def __post_init__(self) -> None:
        if (self.stored is None) == (self.removed is None):
            raise ValueError("exactly one of 'stored' and 'removed' must be set")


class KvCacheEvent(msgspec.Struct):
    event_id: int
    data: KvCacheEventData | Literal["cleared"]
    dp_rank: int = 0

    @property
    def kind(self) -> Literal["stored", "removed", "cleared"]:
        if self.data == "cleared":
            return "cleared"
        assert isinstance(self.data, KvCacheEventData)
        return "stored" if self.data.stored is not None else "removed"

    @property
    def stored(self) -> KvStored | None:
        return self.data.stored if isinstance(self.data, KvCacheEventData) else None

    @property
    def removed(self) -> KvRemoved | None:
        return self.data.removed if isinstance(self.data, KvCacheEventData) else None


StorageTier = Literal["device", "host_pinned", "disk", "external"]
"""Where a worker holds the blocks of an event: its engine's pool, host memory, local disk, or a store
outside the worker."""


class RouterEvent(msgspec.Struct):
    worker_id: int
    event: KvCacheEvent
    storage_tier: StorageTier = "device"


class ActiveLoad(msgspec.Struct):
    """A worker's (or scheduler's) current load for one dp rank. Workers set `kv_used_blocks`
    (and `active_decode_blocks`); router schedulers set the others. None = not reported."""

    worker_id: int
    dp_rank: int = 0
    active_decode_blocks: int | None = None
    active_prefill_tokens: int | None = None
    kv_used_blocks: int | None = None


class KvEventsQuery(msgspec.Struct, omit_defaults=True):
    """A `worker_kv_indexer_query` request: the buffered events of one dp rank with
    `start_event_id <= event_id <= end_event_id` (None: from the oldest, to the newest, the first rank)."""

    start_event_id: int | None = None
    end_event_id: int | None = None
    dp_rank: int | None = None


class KvEventsAnswer(msgspec.Struct, omit_defaults=True):
    """Its answer; `complete` is False when part of the range has left the worker's ring buffer."""

    events: list[RouterEvent]
    complete: bool
    worker_id: int | None = None
    dp_rank: int | None = None
    last_event_id: int | None = None
    error: str | None = None


# -- constructors --------------------------------------------------------------------------------
def stored_event(
    event_id: int, parent_hash: int | None, blocks: list[KvBlock], dp_rank: int = 0
) -> KvCacheEvent:
    return KvCacheEvent(event_id, KvCacheEventData(stored=KvStored(parent_hash, blocks)), dp_rank)


def removed_event(event_id: int, block_hashes: list[int], dp_rank: int = 0) -> KvCacheEvent:
    return KvCacheEvent(event_id, KvCacheEventData(removed=KvRemoved(block_hashes)), dp_rank)


def cleared_event(event_id: int, dp_rank: int = 0) -> KvCacheEvent:
    return KvCacheEvent(event_id, "cleared", dp_rank)


# -- codecs --------------------------------------------------------------------------------------
def to_builtins(obj: msgspec.Struct) -> Any:
    """Plain dicts/lists/ints: what `EventPublisher.publish` takes."""
    return msgspec.to_builtins(obj)


def router_event_from_builtins(obj: Any) -> RouterEvent:
    """Validate an event received from the event plane (already msgpack-decoded)."""
    return msgspec.convert(obj, RouterEvent)


def active_load_from_builtins(obj: Any) -> ActiveLoad:
    return msgspec.convert(obj, ActiveLoad)
