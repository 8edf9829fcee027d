"""The event planes (ZMQ and NATS, the same suite): late joiners, topic scoping, lossy publish; then
ZMQ's discovery entries and NATS's durable (JetStream) topics."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.runtimes import publish_until_received, runtimes_on


@pytest.fixture(params=["zmq", "nats"])
def plane(request) -> str:
    return request.param


@pytest.fixture
def runtimes(runtimes, plane, request):
    """The conftest factory, on the plane under test."""
    return runtimes_on(runtimes, request, event_plane=plane)


async def receive(subscriber, count, timeout=5.0):
    out = []
    async with asyncio.timeout(timeout):
        while len(out) < count:
            out.append(await subscriber.__anext__())
    return out


async def test_subscriber_receives_from_publishers_that_appear_later(runtimes, namespace):
    sub_rt = await runtimes()
    subscriber = await sub_rt.namespace(namespace).component("backend").subscribe("kv-events")
    pubs = []
    for n in range(2):
        pub_rt = await runtimes()
        publisher = await pub_rt.namespace(namespace).component("backend").event_publisher("kv-events")
        await publish_until_received(publisher, subscriber, {"probe": n})
        pubs.append(publisher)
    for n, publisher in enumerate(pubs):
        for i in range(100):
            publisher.publish({"worker": n, "i": i})
    events = await receive(subscriber, 200)
    for n in range(2):
        assert [e["i"] for e in events if e.get("worker") == n] == list(range(100))  # per-publisher order


async def test_topics_and_components_are_scoped(runtimes, namespace):
    rt = await runtimes()
    component = rt.namespace(namespace).component("backend")
    kv = await component.subscribe("kv")
    other_component = await rt.namespace(namespace).component("prefill").subscribe("kv")
    publisher = await component.event_publisher("kv")
    noise = await component.event_publisher("kv_metrics")  # shares the prefix "kv" on the wire
    marker = await rt.namespace(namespace).component("prefill").event_publisher("kv")
    await publish_until_received(publisher, kv, {"probe": True})
    await publish_until_received(marker, other_component, {"probe": True})
    noise.publish({"metrics": 1})
    publisher.publish({"event": 1})
    assert await receive(kv, 1) == [{"event": 1}]
    marker.publish({"marker": 1})  # published after the event arrived elsewhere: the event would be in first
    before_marker = []
    async with asyncio.timeout(5):
        while (event := await other_component.__anext__()) != {"marker": 1}:
            before_marker.append(event)
    assert [e for e in before_marker if e != {"probe": True}] == []


async def test_publisher_never_blocks_without_subscribers_or_when_flooded(runtimes, namespace):
    rt = await runtimes()
    publisher = await rt.namespace(namespace).component("backend").event_publisher("flood")
    sent = sum(publisher.publish({"i": i, "pad": "x" * 100}) for i in range(300_000))
    assert sent + publisher.dropped == 300_000  # every call returned at once, dropped or queued


async def test_a_closed_publisher_drops_what_is_published_after_without_raising(runtimes, namespace):
    """A worker's engine may still emit an event while its runtime shuts down."""
    rt = await runtimes()
    publisher = await rt.namespace(namespace).component("backend").event_publisher("late")
    await rt.shutdown()
    dropped = publisher.dropped
    assert publisher.publish({"after": "close"}) is False
    assert publisher.dropped == dropped + 1


@pytest.mark.parametrize("plane", ["zmq"], indirect=True)
async def test_closed_publisher_leaves_discovery(runtimes, namespace):
    sub_rt, pub_rt = await runtimes(), await runtimes()
    subscriber = await sub_rt.namespace(namespace).component("backend").subscribe("t")
    await pub_rt.namespace(namespace).component("backend").event_publisher("t")
    async with asyncio.timeout(5):
        while len(subscriber.publishers) != 1:
            await asyncio.sleep(0.01)
    await pub_rt.shutdown()
    async with asyncio.timeout(5):
        while subscriber.publishers:
            await asyncio.sleep(0.01)


nats_only = pytest.mark.parametrize("plane", ["nats"], indirect=True)


@nats_only
async def test_durable_topic_replays_what_came_before_a_late_subscriber(runtimes, namespace):
    pub_rt = await runtimes()
    publisher = await pub_rt.namespace(namespace).component("backend").event_publisher("kv-events", durable=True)
    live = await pub_rt.namespace(namespace).component("backend").subscribe("kv-events")  # a plain one too
    for i in range(200):
        publisher.publish({"i": i})
    assert [e["i"] for e in await receive(live, 200)] == list(range(200))
    late = await (await runtimes()).namespace(namespace).component("backend").subscribe("kv-events", durable=True)
    assert [e["i"] for e in await receive(late, 200)] == list(range(200))
    publisher.publish({"i": 200})
    assert await receive(late, 1) == [{"i": 200}]


@nats_only
async def test_durable_subscriber_resumes_after_a_nats_restart_without_gaps_or_repeats(runtimes, namespace, nats):
    pub_rt, sub_rt = await runtimes(), await runtimes()
    publisher = await pub_rt.namespace(namespace).component("backend").event_publisher("kv-events", durable=True)
    subscriber = await sub_rt.namespace(namespace).component("backend").subscribe("kv-events", durable=True)
    for i in range(100):
        publisher.publish({"i": i})
    assert [e["i"] for e in await receive(subscriber, 100)] == list(range(100))
    nats.stop(kill=True)
    nats.start()
    async with asyncio.timeout(15):
        while not (pub_rt.nats.connected and sub_rt.nats.connected):
            await asyncio.sleep(0.05)
    for i in range(100, 200):
        publisher.publish({"i": i})
    assert [e["i"] for e in await receive(subscriber, 100, timeout=20)] == list(range(100, 200))
    publisher.publish({"i": 200})  # and nothing twice: a repeat would come before this one
    assert await receive(subscriber, 1) == [{"i": 200}]


@nats_only
async def test_durable_topic_without_jetstream_is_a_clear_error(runtimes, namespace, tmp_path):
    from tandem.runtime.config import ConfigError
    from tests.support.servers import NatsServer

    plain = NatsServer(tmp_path, jetstream=False)
    plain.start()
    try:
        rt = await runtimes(nats_server=plain.url)
        with pytest.raises(ConfigError, match="need JetStream, which the NATS server at .* does not offer"):
            await rt.namespace(namespace).component("backend").event_publisher("kv-events", durable=True)
    finally:
        plain.stop()


@pytest.mark.parametrize("plane", ["zmq"], indirect=True)
async def test_durable_topic_on_zmq_is_refused_with_what_it_needs(runtimes, namespace):
    from tandem.runtime.config import ConfigError

    rt = await runtimes()
    with pytest.raises(ConfigError, match="--event-plane nats"):
        await rt.namespace(namespace).component("backend").event_publisher("kv-events", durable=True)
