"""ZMQ event plane: discovery-registered publishers, late joiners, topic scoping, lossy publish."""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import publish_until_received


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
    await publish_until_received(publisher, kv, {"probe": True})
    noise.publish({"metrics": 1})
    publisher.publish({"event": 1})
    assert await receive(kv, 1) == [{"event": 1}]
    with pytest.raises(TimeoutError):
        await receive(other_component, 1, timeout=0.3)


async def test_publisher_never_blocks_without_subscribers_or_when_flooded(runtimes, namespace):
    rt = await runtimes()
    publisher = await rt.namespace(namespace).component("backend").event_publisher("flood")
    sent = sum(publisher.publish({"i": i, "pad": "x" * 100}) for i in range(300_000))
    assert sent + publisher.dropped == 300_000  # every call returned at once, dropped or queued


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
