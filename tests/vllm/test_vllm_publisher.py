"""KV event relay (vLLM ZMQ events → RouterEvents on the event plane) and the KV metrics stat logger."""

from __future__ import annotations

import asyncio
import itertools
import socket
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from tandem.router.hashing import local_block_hashes, request_seed
from tandem.router.protocols import (
    KV_EVENT_TOPIC,
    KV_METRICS_TOPIC,
    ActiveLoad,
    active_load_from_builtins,
    router_event_from_builtins,
)
from tandem.router.publisher import indexer_query_handler
from tandem.runtime.event_plane import EventPublisher
from tandem.vllm.publisher import (
    KvEventRelay,
    NullStatLogger,
    StatLoggerFactory,
    normalize_block_hash,
    storage_tier,
)
from tandem.worker.load import KvMetricsStatLogger
from tests.support.runtimes import publish_until_received

BS = 4
pack = msgspec.msgpack.encode


class EnginePub:
    """Stands in for vLLM's ZmqEventPublisher: PUB socket, 3-frame messages."""

    def __init__(self) -> None:
        self.socket: zmq.Socket = zmq.Context.instance().socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        port: int = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.seq = itertools.count()

    def send(self, events: list[Any], dp_rank: int | None = None) -> None:
        self.raw([b"", next(self.seq).to_bytes(8, "big"), pack([1.5, events, dp_rank])])

    def raw(self, frames: list[bytes]) -> None:
        self.socket.send_multipart(frames)

    def close(self) -> None:
        self.socket.close(linger=0)


class FakePublisher(EventPublisher):
    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.closed = False

    def publish(self, event: Any) -> bool:
        self.sent.append(event)
        return True

    async def close(self) -> None:
        self.closed = True


def stored_map(hashes, parent, tokens, **extra):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": extra.pop("block_size", BS), "lora_id": None, "medium": extra.pop("medium", "GPU"),
            "lora_name": extra.pop("lora_name", None), **extra}


async def receive(subscriber, count, timeout=5.0):
    out = []
    async with asyncio.timeout(timeout):
        while len(out) < count:
            item = await subscriber.__anext__()
            if "probe" not in item:
                out.append(item)
    return out


async def connect_relay(engine: EnginePub, relay: KvEventRelay, subscriber=None) -> None:
    """PUB/SUB drops messages sent before the subscription arrives: probe both hops until they
    deliver. Probes are filtered events (non-main group) and direct publishes: they use no ids."""
    probe = stored_map([1], None, [0] * BS, group_idx=7)
    async with asyncio.timeout(10):
        while relay.messages == 0:
            engine.send([probe])
            await asyncio.sleep(0.02)
        if subscriber is None:
            return
        assert relay.publisher is not None
        await publish_until_received(relay.publisher, subscriber, {"probe": True})


@pytest.fixture
def engine():
    pub = EnginePub()
    yield pub
    pub.close()


async def test_relay_translates_vllm_events_onto_the_event_plane(runtimes, namespace, engine) -> None:
    rt = await runtimes()
    component = rt.namespace(namespace).component("backend")
    subscriber = await component.subscribe(KV_EVENT_TOPIC)
    relay = await KvEventRelay(
        component, worker_id=rt.instance_id, kv_block_size=BS, zmq_endpoint=engine.endpoint, dp_rank=0
    ).start()
    try:
        await connect_relay(engine, relay, subscriber)
        toks = list(range(100, 120))
        h = [11, 12, 13, 14, 15]
        # map form (what vLLM sends): a chain of stored blocks, one with a LoRA
        engine.send([
            stored_map([h[0], h[1]], None, toks[:8], group_idx=0, kv_cache_spec_kind="full_attention"),
            stored_map([h[2]], h[1], toks[8:12], lora_name="my-lora"),
            stored_map([99], None, toks[:4], kv_cache_spec_kind="sliding_window"),  # filtered
        ])
        # array form (Dynamo's positional order), bytes and negative int hashes
        byte_hash = bytes(range(32))
        engine.send([
            ["BlockStored", [byte_hash], h[2], toks[12:16], BS, None, "GPU", None, None, 0, "full_attention"],
            ["BlockStored", [-5], byte_hash, toks[16:20] + [1, 2], BS, None, "GPU"],  # + a partial tail
            ["BlockStored", [98], None, toks[:4], BS, None, "GPU", None, None, 1, "full_attention"],  # group 1
            ["BlockRemoved", [h[0]], "GPU"],
        ], dp_rank=0)
        engine.raw([b"", (99).to_bytes(8, "big"), b"\xc1 not msgpack"])  # malformed payload
        engine.raw([b"only one frame"])  # malformed framing
        engine.send([{"type": "NoSuchEvent"}, "garbage", stored_map([97], None, [1, 2], block_size=16)])
        engine.send([
            {"type": "BlockRemoved", "block_hashes": [h[1]], "medium": "GPU", "group_idx": 1},  # filtered
            {"type": "BlockRemoved", "block_hashes": [h[2]], "medium": "CPU"},
            {"type": "AllBlocksCleared"},
        ])
        got = await receive(subscriber, 7)
        events = [router_event_from_builtins(e) for e in got]
        assert [e.event.event_id for e in events] == list(range(7))
        assert {e.worker_id for e in events} == {rt.instance_id}
        assert all(e.event.dp_rank == 0 for e in events)
        kinds = [e.event.kind for e in events]
        assert kinds == ["stored", "stored", "stored", "stored", "removed", "removed", "cleared"]

        s0, s1, s2, s3 = (e.event.stored for e in events[:4])
        assert s0 is not None and s1 is not None and s2 is not None and s3 is not None
        assert s0.parent_hash is None and [b.block_hash for b in s0.blocks] == [11, 12]
        assert [b.tokens_hash for b in s0.blocks] == local_block_hashes(toks[:8], BS)
        assert s1.parent_hash == 12 and [b.block_hash for b in s1.blocks] == [13]
        assert [b.tokens_hash for b in s1.blocks] == local_block_hashes(toks[8:12], BS, request_seed("my-lora"))
        assert s1.blocks[0].tokens_hash != local_block_hashes(toks[8:12], BS)[0]
        byte_u64 = int.from_bytes(byte_hash[-8:], "big")
        assert s2.parent_hash == 13 and [b.block_hash for b in s2.blocks] == [byte_u64]
        assert [b.tokens_hash for b in s2.blocks] == local_block_hashes(toks[12:16], BS)
        assert s3.parent_hash == byte_u64 and [b.block_hash for b in s3.blocks] == [2**64 - 5]
        assert [b.tokens_hash for b in s3.blocks] == local_block_hashes(toks[16:20], BS)
        removed = events[4].event.removed
        assert removed is not None and removed.block_hashes == [11] and events[4].storage_tier == "device"
        removed_cpu = events[5].event.removed
        assert removed_cpu is not None and removed_cpu.block_hashes == [13] and events[5].storage_tier == "host_pinned"
        assert relay.malformed == 4  # bad payload, bad framing, unknown type, non-event

        # the worker-local indexer serves the same events
        assert relay.query(0, None) == (got, True)
        answer = [a async for a in relay.indexer_query({"start_event_id": 2, "end_event_id": 4}, None)]
        assert answer == [{"events": got[2:5], "complete": True, "worker_id": rt.instance_id, "dp_rank": 0,
                           "last_event_id": 6}]

        # nothing else was published: anything would have come before this marker, and taken its id
        engine.send([stored_map([200], None, toks[:4])])
        [marker] = [router_event_from_builtins(e) for e in await receive(subscriber, 1)]
        assert marker.event.event_id == 7 and marker.event.stored is not None
        assert [b.block_hash for b in marker.event.stored.blocks] == [200]
    finally:
        await relay.close()


async def test_relay_real_vllm_publisher(runtimes, namespace) -> None:
    """vLLM's own ZmqEventPublisher and event classes (map-encoded, bytes or int hashes)."""
    import vllm.distributed.kv_events as kv_events
    rt = await runtimes()
    component = rt.namespace(namespace).component("backend")
    subscriber = await component.subscribe(KV_EVENT_TOPIC)
    vllm_pub = None
    for _ in range(20):  # a free port, which another process may take before vLLM binds it: retry
        # A plain socket releases its port when closed; a ZMQ socket does so later, in its I/O thread.
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port: int = probe.getsockname()[1]
        try:
            vllm_pub = kv_events.ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://*:{port}")
            break
        except zmq.ZMQError:
            await asyncio.sleep(0.05)
    assert vllm_pub is not None, "vLLM's publisher could not bind a free port"
    relay = await KvEventRelay(
        component, worker_id=rt.instance_id, kv_block_size=BS, zmq_endpoint=f"tcp://*:{port}"
    ).start()
    try:
        def batch(*events):
            return kv_events.KVEventBatch(ts=1.0, events=list(events))

        def stored(hashes, parent, tokens, **kw):
            return kv_events.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                                         block_size=BS, lora_id=None, medium="GPU", lora_name=None, **kw)

        async with asyncio.timeout(10):
            while relay.messages == 0:
                vllm_pub.publish(batch(stored([1], None, [0] * BS, group_idx=3)))
                await asyncio.sleep(0.05)
            assert relay.publisher is not None
            await publish_until_received(relay.publisher, subscriber, {"probe": True})
        sha = bytes([7] * 32)
        vllm_pub.publish(batch(
            stored([2**64 - 1, sha], None, list(range(8)), group_idx=0, kv_cache_spec_kind="full_attention"),
            kv_events.BlockRemoved(block_hashes=[sha], medium="GPU"),
            kv_events.AllBlocksCleared(),
        ))
        events = [router_event_from_builtins(e) for e in await receive(subscriber, 3)]
        assert [e.event.event_id for e in events] == [0, 1, 2]
        stored_ev = events[0].event.stored
        assert stored_ev is not None
        assert [b.block_hash for b in stored_ev.blocks] == [2**64 - 1, int.from_bytes(sha[-8:], "big")]
        assert [b.tokens_hash for b in stored_ev.blocks] == local_block_hashes(list(range(8)), BS)
        assert events[1].event.removed is not None
        assert events[1].event.removed.block_hashes == [int.from_bytes(sha, "big") & (2**64 - 1)]
        assert events[2].event.kind == "cleared"
    finally:
        await relay.close()
        vllm_pub.shutdown()


async def test_ring_buffer_eviction_and_query_completeness() -> None:
    publisher = FakePublisher()
    relay = KvEventRelay(None, worker_id=7, kv_block_size=BS, zmq_endpoint="tcp://127.0.0.1:1",
                         buffer_size=4, publisher=publisher)
    assert relay.query() == ([], True) and relay.last_event_id is None
    for i in range(10):
        assert relay.handle_event(stored_map([1000 + i], 999 + i if i else None, [i] * BS)) == 1
    assert relay.handle_event(stored_map([5], None, [1] * BS, group_idx=2)) == 0  # filtered: no id used
    assert [e["event"]["event_id"] for e in publisher.sent] == list(range(10))
    assert relay.last_event_id == 9 and relay.oldest_buffered_event_id == 6

    events, complete = relay.query(6, 9)
    assert complete and [e["event"]["event_id"] for e in events] == [6, 7, 8, 9]
    assert events == publisher.sent[6:]
    events, complete = relay.query(7, 8)
    assert complete and [e["event"]["event_id"] for e in events] == [7, 8]
    events, complete = relay.query(3, 7)  # 3..5 were evicted
    assert not complete and [e["event"]["event_id"] for e in events] == [6, 7]
    events, complete = relay.query(8, 100)  # beyond the newest: what exists
    assert complete and [e["event"]["event_id"] for e in events] == [8, 9]
    assert relay.query(12, 20) == ([], True)
    events, complete = relay.query()  # everything since 0: no longer possible
    assert not complete and len(events) == 4

    async def ask(handler, request):
        return [a async for a in handler(request, None)]

    [answer] = await ask(relay.indexer_query, {"start_event_id": 0, "end_event_id": 9})
    assert answer["complete"] is False and [e["event"]["event_id"] for e in answer["events"]] == [6, 7, 8, 9]
    [answer] = await ask(relay.indexer_query, {"start_event_id": 9})
    assert answer["complete"] is True and len(answer["events"]) == 1 and answer["last_event_id"] == 9
    [answer] = await ask(relay.indexer_query, {"start_event_id": "x"})
    assert answer["complete"] is False and "error" in answer

    other = KvEventRelay(None, worker_id=7, kv_block_size=BS, zmq_endpoint="tcp://127.0.0.1:1", dp_rank=1,
                         publisher=FakePublisher())
    other.handle_event({"type": "AllBlocksCleared"})
    handler = indexer_query_handler([relay, other])
    [answer] = await ask(handler, {"start_event_id": 0, "dp_rank": 1})
    assert answer["complete"] and answer["dp_rank"] == 1 and answer["events"][0]["event"]["data"] == "cleared"
    [answer] = await ask(handler, {"start_event_id": 9})
    assert answer["dp_rank"] == 0 and len(answer["events"]) == 1
    [answer] = await ask(handler, {"dp_rank": 5})
    assert answer["complete"] is False and "error" in answer


def test_self_referencing_store_becomes_empty_remove() -> None:
    publisher = FakePublisher()
    relay = KvEventRelay(None, worker_id=1, kv_block_size=BS, zmq_endpoint="tcp://127.0.0.1:1", publisher=publisher)
    relay.handle_event(stored_map([5, 6], 6, [0] * 8))
    relay.handle_event(stored_map([5, 5], None, [0] * 8))
    assert [e["event"]["data"] for e in publisher.sent] == [{"removed": {"block_hashes": []}}] * 2


def test_hash_normalization_and_tiers() -> None:
    assert normalize_block_hash(5) == 5
    assert normalize_block_hash(-1) == 2**64 - 1
    assert normalize_block_hash(2**64 + 3) == 3
    assert normalize_block_hash(b"\x00" * 24 + (42).to_bytes(8, "big")) == 42
    assert normalize_block_hash(b"\x01\x02") == 0x0102
    with pytest.raises(TypeError):
        normalize_block_hash("abc")
    assert [storage_tier(m) for m in (None, "GPU", "CPU", "CPU_TIER1", "CPU_PINNED", "CPU_TIER2", "DISK", "S3")] == [
        "device", "device", "host_pinned", "host_pinned", "host_pinned", "disk", "disk", "external"]


def test_multimodal_extra_keys_enter_the_tokens_hash() -> None:
    publisher = FakePublisher()
    relay = KvEventRelay(None, worker_id=1, kv_block_size=BS, zmq_endpoint="tcp://127.0.0.1:1", publisher=publisher)
    mm_id = "ab" * 32
    relay.handle_event(stored_map([1, 2], None, list(range(8)), lora_name="l",
                                  extra_keys=[["l", [mm_id, 0]], ["l", "salt"]]))
    blocks = publisher.sent[0]["event"]["data"]["stored"]["blocks"]
    seed = request_seed("l")
    expected = local_block_hashes(list(range(8)), BS, seed, mm_hashes=[[int(mm_id[:16], 16)], None])
    assert [b["tokens_hash"] for b in blocks] == expected
    assert expected[1] == local_block_hashes(list(range(4, 8)), BS, seed)[0]


async def test_relay_close_releases_the_publisher(runtimes, namespace, engine) -> None:
    rt = await runtimes()
    component = rt.namespace(namespace).component("backend")
    relay = await KvEventRelay(component, worker_id=1, kv_block_size=BS, zmq_endpoint=engine.endpoint).start()
    await connect_relay(engine, relay)
    assert await rt.store.get_prefix("v1/event_channels/")  # the relay's publisher is registered
    await relay.close()
    assert await rt.store.get_prefix("v1/event_channels/") == {}  # ... and gone: subscribers drop it
    await relay.close()  # idempotent; runtime shutdown closing the publisher again is harmless too


# -- stat logger --------------------------------------------------------------------------------
def gauge(registry: CollectorRegistry, name: str, dp_rank: int) -> float | None:
    return registry.get_sample_value(name, {"dp_rank": str(dp_rank)})


TOTAL = "dynamo_component_kvstats_total_blocks"
USAGE = "dynamo_component_kvstats_gpu_cache_usage_percent"


async def test_stat_logger_publishes_active_load_on_the_event_plane(runtimes, namespace) -> None:
    rt = await runtimes()
    component = rt.namespace(namespace).component("backend")
    subscriber = await component.subscribe(KV_METRICS_TOPIC)
    publisher = await component.event_publisher(KV_METRICS_TOPIC)
    await publish_until_received(publisher, subscriber, {"probe": True})  # slow joiner

    factory = StatLoggerFactory(None, worker_id=rt.instance_id, registry=rt.registry, dp_rank=0)
    config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=1000))
    logger = factory(config, 0)
    assert isinstance(logger, KvMetricsStatLogger)
    assert isinstance(factory(config, 1), NullStatLogger)  # another dp rank's engine
    logger.log_engine_initialized()  # picks the block count from the config
    assert logger.num_gpu_blocks == 1000 and gauge(rt.registry, TOTAL, 0) == 1000

    logger.record(scheduler_stats=SimpleNamespace(kv_cache_usage=0.25), iteration_stats=None)
    assert gauge(rt.registry, USAGE, 0) == 0.25
    factory.set_publisher(publisher)  # arrives late: the current value goes out at once
    logger.record(SimpleNamespace(kv_cache_usage=0.5), None, mm_cache_stats=None, engine_idx=0)
    logger.record(None, SimpleNamespace())  # iteration-only update: ignored
    got = [active_load_from_builtins(x) for x in await receive(subscriber, 2)]
    assert got == [
        ActiveLoad(worker_id=rt.instance_id, dp_rank=0, active_decode_blocks=250, kv_used_blocks=250),
        ActiveLoad(worker_id=rt.instance_id, dp_rank=0, active_decode_blocks=500, kv_used_blocks=500),
    ]
    assert gauge(rt.registry, USAGE, 0) == 0.5 and gauge(rt.registry, TOTAL, 0) == 1000


def test_stat_logger_debounces_and_init_publish() -> None:
    registry = CollectorRegistry()
    publisher = FakePublisher()
    factory = StatLoggerFactory(publisher, worker_id=3, registry=registry, dp_rank=2, republish_interval=None)
    logger = factory(None, 2)
    assert isinstance(logger, KvMetricsStatLogger) and isinstance(factory(None, 0), NullStatLogger)
    factory.init_publish()
    assert publisher.sent == [msgspec.to_builtins(ActiveLoad(3, 2, 0, None, 0))]
    assert gauge(registry, TOTAL, 2) == 0 and gauge(registry, USAGE, 2) == 0
    factory.set_num_gpu_blocks(64)
    assert gauge(registry, TOTAL, 2) == 64
    for usage in (0.5, 0.5, 0.51, 0.25, 0.25):  # 0.51 * 64 = 32.6 -> 32, unchanged
        logger.record(SimpleNamespace(kv_cache_usage=usage), None)
    assert [p["kv_used_blocks"] for p in publisher.sent] == [0, 32, 16]
    assert all(p["active_decode_blocks"] == p["kv_used_blocks"] for p in publisher.sent)
    assert gauge(registry, USAGE, 2) == 0.25

    # republish while unchanged once the interval has passed
    logger.republish_interval = 0.0
    logger.record(SimpleNamespace(kv_cache_usage=0.25), None)
    assert [p["kv_used_blocks"] for p in publisher.sent] == [0, 32, 16, 16]


def test_gauges_are_registered_once_per_registry() -> None:
    registry = CollectorRegistry()
    a = StatLoggerFactory(FakePublisher(), worker_id=1, registry=registry, dp_rank=0)(None, 0)
    b = StatLoggerFactory(FakePublisher(), worker_id=1, registry=registry, dp_rank=1)(None, 1)
    assert isinstance(a, KvMetricsStatLogger) and isinstance(b, KvMetricsStatLogger)
    a.set_num_gpu_blocks(10)
    b.set_num_gpu_blocks(20)
    assert gauge(registry, TOTAL, 0) == 10 and gauge(registry, TOTAL, 1) == 20
    # a second registry gets its own gauges
    other = CollectorRegistry()
    c = StatLoggerFactory(None, worker_id=1, registry=other)(None, 0)
    assert isinstance(c, KvMetricsStatLogger)
    c.set_num_gpu_blocks(5)
    assert gauge(other, TOTAL, 0) == 5 and gauge(registry, TOTAL, 0) == 10


def test_factory_plugs_into_vllm_stat_logger_manager() -> None:
    """vLLM 0.32's per-engine adapter calls `factory(vllm_config, engine_index)` and
    `record(scheduler_stats, iteration_stats, mm_cache_stats=..., engine_idx=...)`."""
    import vllm.v1.metrics.loggers as loggers
    import vllm.v1.metrics.stats as stats
    publisher = FakePublisher()
    factory = StatLoggerFactory(publisher, worker_id=9, registry=CollectorRegistry(), dp_rank=None)
    adapter = loggers.PerEngineStatLoggerAdapter(
        vllm_config=SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=200)),
        engine_indexes=[0, 1], per_engine_stat_logger_factory=factory,
    )
    assert sorted(factory.loggers) == [0, 1]
    assert all(isinstance(lg, loggers.StatLoggerBase) for lg in adapter.per_engine_stat_loggers.values())
    adapter.log_engine_initialized()
    adapter.record(stats.SchedulerStats(kv_cache_usage=0.1), None, engine_idx=1)
    adapter.log()
    assert publisher.sent == [msgspec.to_builtins(ActiveLoad(9, 1, 20, None, 20))]
