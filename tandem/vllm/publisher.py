"""What a vLLM worker publishes for the KV router.

* `KvEventRelay` (Dynamo's `ZmqKvEventPublisher`): subscribes to vLLM's ZMQ KV-event socket,
  turns BlockStored / BlockRemoved / AllBlocksCleared into `RouterEvent`s (engine block hash +
  router local hash of the block's tokens), numbers them from 0, publishes them on the component's
  `kv-events` topic, and keeps the last `buffer_size` for the `worker_kv_indexer_query` endpoint
  (a router that sees a gap in event ids asks for the missing range).
* `StatLoggerFactory` / `KvMetricsStatLogger` (Dynamo's `DynamoStatLoggerPublisher`): a vLLM stat
  logger that publishes the worker's used KV blocks as `ActiveLoad` on `kv_metrics` and sets the
  `dynamo_component_kvstats_*` gauges.

vLLM wire format (see `vllm.distributed.kv_events`): each ZMQ message has 3 frames: topic, 8-byte
big-endian sequence number, msgpack `[ts, [events...], dp_rank]`. vLLM encodes events as maps with
`"type"`; other engines as arrays `["BlockStored", field...]` in declaration order. Both are read.

Engine block hashes arrive as ints (vLLM's default, `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, or
signed i64 from other engines) or as raw hash bytes. All are normalized to u64: ints modulo 2**64,
bytes as their *last* 8 bytes read big-endian, which is exactly vLLM's own int conversion
(`int.from_bytes(h, "big") & (2**64 - 1)`), so a worker reports the same ids in both modes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from tandem.router.hashing import U64_MASK, digest_hash, local_block_hashes, request_seed
from tandem.router.protocols import (
    KV_EVENT_TOPIC,
    WORKER_KV_INDEXER_BUFFER_SIZE,
    KvBlock,
    KvCacheEventData,
    KvRemoved,
    KvStored,
)
from tandem.router.publisher import KvEventPublisher, SupportsPublish
from tandem.runtime.event_plane import EventPublisher
from tandem.worker.load import KvMetricsStatLogger, PublisherProvider

log = logging.getLogger(__name__)

# Attention groups of hybrid models whose blocks the router does not index (sliding window, mamba, ...): it
# indexes full attention (full, MLA, sink full), and only group 0.
NON_MAIN_ATTENTION_KINDS = frozenset({
    "sliding_window", "sliding_window_mla", "mamba", "chunked_local_attention",
    "encoder_only_attention", "cross_attention", "unknown",
})

# Positional field order of the array form (vLLM's declaration order, which Dynamo's reader uses).
_ARRAY_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "kv_cache_spec_kind"),
    "AllBlocksCleared": (),
}

_decode_msgpack = msgspec.msgpack.Decoder().decode


def normalize_block_hash(value: Any) -> int:
    """An engine block hash as u64 (see the module docstring)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value & U64_MASK
    if isinstance(value, bytes | bytearray | memoryview):
        return int.from_bytes(bytes(value)[-8:], "big")
    raise TypeError(f"unsupported block hash {value!r}")


def storage_tier(medium: Any) -> str:
    """vLLM/Dynamo `medium` → router storage tier."""
    if medium is None:
        return "device"
    m = str(medium).upper()
    if m in ("GPU", "DEVICE", "HBM"):
        return "device"
    if m in ("CPU_TIER2", "DISK", "STORAGE", "SSD"):
        return "disk"
    if m.startswith("CPU"):
        return "host_pinned"
    return "external"


def _event_fields(raw: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise ValueError(f"event without a type: {raw!r:.200}")
        return tag, raw
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        tag = raw[0]
        return tag, dict(zip(_ARRAY_FIELDS.get(tag, ()), raw[1:], strict=False))
    raise ValueError(f"unrecognized event: {raw!r:.200}")


def _is_main_group(fields: dict[str, Any]) -> bool:
    group_idx = fields.get("group_idx")
    if group_idx is not None and group_idx != 0:
        return False
    return fields.get("kv_cache_spec_kind") not in NON_MAIN_ATTENTION_KINDS


def _mm_hashes(extra_keys: Any, n_blocks: int) -> list[list[int] | None] | None:
    """Per-block multimodal hashes from vLLM's untagged `extra_keys`: `(mm_identifier, offset)`
    pairs whose identifier is a hex digest give its `digest_hash`; LoRA names, cache
    salts and prompt-embedding digests (bare values) are not part of the token hash."""
    if not extra_keys:
        return None
    out: list[list[int] | None] = []
    found = False
    for keys in list(extra_keys)[:n_blocks]:
        hashes: list[int] = []
        for key in keys or ():
            if isinstance(key, list | tuple) and len(key) == 2 and isinstance(key[0], str) and len(key[0]) >= 16:
                try:
                    hashes.append(digest_hash(key[0]))
                except ValueError:
                    continue
        out.append(hashes or None)
        found = found or bool(hashes)
    return out if found else None


class KvEventRelay(KvEventPublisher):
    """Relay one vLLM engine's (one dp rank's) KV events onto the event plane.

    `component` is the worker's component (events go to its `kv-events` topic, kept in JetStream too when
    `durable`); `worker_id` is the worker's instance id. A `publisher` may be given instead of letting
    `start()` create one.
    """

    def __init__(
        self,
        component: Any,
        *,
        worker_id: int,
        kv_block_size: int,
        zmq_endpoint: str,
        dp_rank: int = 0,
        buffer_size: int = WORKER_KV_INDEXER_BUFFER_SIZE,
        zmq_topic: str = "",
        publisher: SupportsPublish | None = None,
        durable: bool = False,
    ) -> None:
        if kv_block_size <= 0:
            raise ValueError(f"kv_block_size must be positive, got {kv_block_size}")
        super().__init__(worker_id=worker_id, dp_rank=dp_rank, buffer_size=buffer_size, publisher=publisher)
        self.component = component
        self.kv_block_size = kv_block_size
        self.zmq_endpoint = zmq_endpoint.replace("*", "127.0.0.1")
        self.zmq_topic = zmq_topic
        self.durable = durable
        self._owned_publisher: EventPublisher | None = None
        self._last_seq: int | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._warned_block_size = False
        # counters, for logs and tests
        self.messages = 0
        self.malformed = 0
        self.missed_messages = 0
        self.skipped_events = 0

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> KvEventRelay:
        if self._task is not None:
            return self
        if self._publisher is None:
            self._owned_publisher = await self.component.event_publisher(KV_EVENT_TOPIC, self.durable)
            self._publisher = self._owned_publisher
        socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, 0)  # vLLM has its own HWM; do not drop here
        socket.setsockopt(zmq.SUBSCRIBE, self.zmq_topic.encode())
        socket.connect(self.zmq_endpoint)
        self._socket = socket
        self._task = asyncio.create_task(self._run(), name=f"kv-event-relay {self.zmq_endpoint}")
        log.info(
            "relaying KV events from %s (dp_rank %d, block size %d) for worker %x",
            self.zmq_endpoint, self.dp_rank, self.kv_block_size, self.worker_id,
        )
        return self

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._owned_publisher is not None:
            await self._owned_publisher.close()
            self._owned_publisher = self._publisher = None

    async def _run(self) -> None:
        assert self._socket is not None
        socket = self._socket
        while True:
            try:
                frames = await socket.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                if socket.closed:
                    return
                log.warning("KV event socket error on %s: %s", self.zmq_endpoint, e)
                await asyncio.sleep(0.1)
                continue
            try:
                self.handle_message(frames)
            except Exception as e:  # a bad message must never stop the relay
                self.malformed += 1
                log.warning("skipping malformed KV event message from %s: %s", self.zmq_endpoint, e)

    # -- translation -----------------------------------------------------------------------------
    def handle_message(self, frames: Sequence[bytes]) -> int:
        """Process one ZMQ message (`[topic, seq, payload]`); returns the number of events published."""
        if len(frames) == 3:
            seq_frame, payload = frames[1], frames[2]
            if len(seq_frame) != 8:
                raise ValueError(f"sequence frame of {len(seq_frame)} bytes")
            self._check_sequence(int.from_bytes(seq_frame, "big", signed=True))
        elif len(frames) == 2:
            payload = frames[1]
        else:
            raise ValueError(f"expected 3 frames, got {len(frames)}")
        self.messages += 1
        batch = _decode_msgpack(payload)
        if isinstance(batch, dict):
            events, dp_rank = batch.get("events"), batch.get("data_parallel_rank")
        elif isinstance(batch, list) and len(batch) >= 2:
            events, dp_rank = batch[1], (batch[2] if len(batch) > 2 else None)
        else:
            raise ValueError(f"unrecognized event batch: {batch!r:.200}")
        if not isinstance(events, list):
            raise ValueError(f"event batch without an event list: {batch!r:.200}")
        if not isinstance(dp_rank, int) or isinstance(dp_rank, bool):
            dp_rank = self.dp_rank
        published = 0
        for raw in events:
            try:
                published += self.handle_event(raw, dp_rank)
            except Exception as e:
                self.malformed += 1
                log.warning("skipping malformed KV event from %s: %s", self.zmq_endpoint, e)
        return published

    def _check_sequence(self, seq: int) -> None:
        last = self._last_seq
        if last is not None and seq > last + 1:
            self.missed_messages += seq - last - 1
            log.warning("missed %d KV event messages from %s (seq %d -> %d)", seq - last - 1, self.zmq_endpoint, last, seq)
        self._last_seq = seq

    def handle_event(self, raw: Any, dp_rank: int | None = None) -> int:
        """Translate and publish one engine event; returns 1 if published, 0 if filtered."""
        dp_rank = self.dp_rank if dp_rank is None else dp_rank
        tag, fields = _event_fields(raw)
        if tag == "BlockStored":
            return self._stored(fields, dp_rank)
        if tag == "BlockRemoved":
            if not _is_main_group(fields):
                self.skipped_events += 1
                return 0
            hashes = [normalize_block_hash(h) for h in fields["block_hashes"]]
            if not hashes:
                self.skipped_events += 1
                return 0
            self.emit(KvCacheEventData(removed=KvRemoved(hashes)), storage_tier(fields.get("medium")), dp_rank)
            return 1
        if tag == "AllBlocksCleared":
            self.emit("cleared", "device", dp_rank)
            return 1
        raise ValueError(f"unknown event type {tag!r}")

    def _stored(self, fields: dict[str, Any], dp_rank: int) -> int:
        if not _is_main_group(fields):
            self.skipped_events += 1
            return 0
        block_size = fields.get("block_size")
        if block_size != self.kv_block_size:
            if not self._warned_block_size:
                self._warned_block_size = True
                log.warning(
                    "ignoring stored blocks of size %s from %s: the router indexes blocks of %d tokens",
                    block_size, self.zmq_endpoint, self.kv_block_size,
                )
            self.skipped_events += 1
            return 0
        hashes = [normalize_block_hash(h) for h in fields["block_hashes"]]
        parent_raw = fields.get("parent_block_hash")
        parent = None if parent_raw is None else normalize_block_hash(parent_raw)
        token_ids = fields.get("token_ids") or []
        if token_ids and isinstance(token_ids[0], list | tuple):
            token_ids = [pair[0] for pair in token_ids]  # Eagle bigram stream: the tokens are the firsts
        tier = storage_tier(fields.get("medium"))
        n_blocks = min(len(hashes), len(token_ids) // block_size)
        if n_blocks < len(hashes):
            log.debug("stored event with %d hashes but %d tokens: keeping %d full blocks",
                      len(hashes), len(token_ids), n_blocks)
            hashes = hashes[:n_blocks]
        if not hashes:
            self.skipped_events += 1
            return 0
        if (parent is not None and parent in hashes) or len(set(hashes)) != len(hashes):
            # A self-referencing store would create a cycle in the router's tree: Dynamo replaces it
            # with an empty remove (which keeps the event ids contiguous).
            log.warning("self-referencing stored event from %s replaced by an empty remove", self.zmq_endpoint)
            self.emit(KvCacheEventData(removed=KvRemoved([])), tier, dp_rank)
            return 1
        seed = request_seed(fields.get("lora_name"))
        tokens_hashes = local_block_hashes(
            token_ids[: n_blocks * block_size], block_size, seed,
            mm_hashes=_mm_hashes(fields.get("extra_keys"), n_blocks),
        )
        blocks = [KvBlock(h, t) for h, t in zip(hashes, tokens_hashes, strict=True)]
        self.emit(KvCacheEventData(stored=KvStored(parent, blocks)), tier, dp_rank)
        return 1

# -- vLLM stat loggers ----------------------------------------------------------------------------
class NullStatLogger:
    """A stat logger that does nothing (for engines of other dp ranks)."""

    def __init__(self, vllm_config: Any = None, engine_index: int = 0) -> None:
        self.vllm_config = vllm_config
        self.engine_index = engine_index

    def record(self, scheduler_stats: Any, iteration_stats: Any = None, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int = 0, level: int = 0) -> None:
        pass


_registered_with_vllm = False


def _register_with_vllm() -> None:
    """Make our loggers `StatLoggerBase` (virtual) subclasses without importing vLLM at import time."""
    global _registered_with_vllm
    if _registered_with_vllm:
        return
    try:
        from vllm.v1.metrics.loggers import StatLoggerBase
    except ImportError:
        return
    StatLoggerBase.register(KvMetricsStatLogger)
    StatLoggerBase.register(NullStatLogger)
    _registered_with_vllm = True


class StatLoggerFactory:
    """Pass in `AsyncLLM.from_vllm_config(..., stat_loggers=[factory])`; vLLM calls
    `factory(vllm_config, engine_index)` once per engine it manages.

    With an int `dp_rank` the engine of that rank gets a `KvMetricsStatLogger` and any other gets
    a `NullStatLogger`; with `dp_rank=None` every engine gets one, labelled by its engine index.
    """

    def __init__(
        self,
        publisher_provider: PublisherProvider = None,
        worker_id: int = 0,
        registry: CollectorRegistry | None = None,
        dp_rank: int | None = 0,
        *,
        republish_interval: float | None = 10.0,
    ) -> None:
        self.publisher_provider = publisher_provider
        self.worker_id = worker_id
        self.registry = registry
        self.dp_rank = dp_rank
        self.republish_interval = republish_interval
        self.loggers: dict[int, KvMetricsStatLogger] = {}
        self._num_gpu_blocks: int | None = None

    def __call__(self, vllm_config: Any, engine_index: int = 0) -> KvMetricsStatLogger | NullStatLogger:
        _register_with_vllm()
        if self.dp_rank is not None and engine_index != self.dp_rank:
            return NullStatLogger(vllm_config, engine_index)
        rank = engine_index if self.dp_rank is None else self.dp_rank
        logger = KvMetricsStatLogger(
            vllm_config, engine_index, worker_id=self.worker_id, dp_rank=rank, registry=self.registry,
            publisher=self.publisher_provider, republish_interval=self.republish_interval,
        )
        if self._num_gpu_blocks is not None:
            logger.set_num_gpu_blocks(self._num_gpu_blocks)
        self.loggers[rank] = logger
        return logger

    def bind(self, worker_id: int, registry: CollectorRegistry) -> None:
        """The worker's id and metrics registry, before or after vLLM made the loggers (a checkpointed
        worker creates its engine before its runtime)."""
        self.worker_id, self.registry = worker_id, registry
        for logger in self.loggers.values():
            logger.bind(worker_id, registry)

    def set_publisher(self, publisher: PublisherProvider) -> None:
        self.publisher_provider = publisher
        for logger in self.loggers.values():
            logger.set_publisher(publisher)

    def set_num_gpu_blocks(self, num_gpu_blocks: int | None) -> None:
        """Call after the engine started, with `vllm_config.cache_config.num_gpu_blocks`."""
        self._num_gpu_blocks = int(num_gpu_blocks or 0)
        for logger in self.loggers.values():
            logger.set_num_gpu_blocks(num_gpu_blocks)

    def init_publish(self) -> None:
        for logger in self.loggers.values():
            logger.init_publish()
