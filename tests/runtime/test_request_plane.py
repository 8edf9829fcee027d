"""The request planes (TCP and NATS, the same suite), in one process: streaming, stop/kill, errors, limits,
bad peers; then what only one of them has."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import pytest

from tandem.runtime import (
    Context,
    DistributedRuntime,
    EngineShutdown,
    InstanceUnreachableError,
    MessageTooLargeError,
    NoInstancesError,
    RemoteError,
    StreamIncompleteError,
)
from tandem.runtime.config import ConfigError
from tandem.runtime.request_plane import framed, tcp
from tandem.runtime.request_plane import nats as natsplane
from tests.support.runtimes import runtime_config, runtimes_on


@pytest.fixture(params=["tcp", "nats"])
def plane(request) -> str:
    return request.param


@pytest.fixture
def runtimes(runtimes, plane, request):
    """The conftest factory, on the plane under test."""
    return runtimes_on(runtimes, request, request_plane=plane)


tcp_only = pytest.mark.parametrize("plane", ["tcp"], indirect=True)
nats_only = pytest.mark.parametrize("plane", ["nats"], indirect=True)


def open_streams(runtime) -> int:
    """Streams the runtime's request-plane server still holds."""
    server = runtime.request_server
    if isinstance(server, tcp.TcpServer):
        return sum(len(conn.streams) for conn in server.connections)
    return len(server.streams)


async def serve(runtime, namespace, handler, name="generate", **options):
    endpoint = runtime.namespace(namespace).component("backend").endpoint(name)
    await endpoint.start_serving(handler, **options)
    return endpoint


async def counter(request, context):
    for i in range(request["n"]):
        if context.is_stopped():
            return
        yield {"i": i}
        if request.get("delay"):
            await asyncio.sleep(request["delay"])


def endless_until_killed():
    """A handler that streams until killed, and the event it sets when it saw the kill."""
    killed = asyncio.Event()

    async def forever(request, context):
        try:
            while True:
                yield {}
                await asyncio.sleep(0.01)
        finally:
            if context.is_killed():
                killed.set()

    return killed, forever


async def connect(runtimes, namespace, handler=counter, **server_overrides):
    server = await runtimes(**server_overrides)
    endpoint = await serve(server, namespace, handler)
    caller = await runtimes()
    client = await caller.endpoint(endpoint.path).client()
    await client.wait_for_instances(1, timeout=5)
    return server, caller, client


async def test_stream_arrives_complete_and_in_order(runtimes, namespace):
    _, _, client = await connect(runtimes, namespace)
    stream = await client.round_robin({"n": 1000})
    items = [item["i"] async for item in stream]
    assert items == list(range(1000))
    assert stream.completed


async def test_handler_without_context_parameter(runtimes, namespace):
    async def echo(request):
        yield request

    _, _, client = await connect(runtimes, namespace, echo)
    stream = await client.generate({"hello": [1, 2, 3]})
    assert [x async for x in stream] == [{"hello": [1, 2, 3]}]


async def test_concurrent_streams_share_one_connection(runtimes, namespace, plane):
    _, caller, client = await connect(runtimes, namespace)

    async def one(n):
        stream = await client.random({"n": n, "delay": 0.001})
        return [x["i"] async for x in stream]

    results = await asyncio.gather(*(one(n) for n in range(1, 40)))
    assert results == [list(range(n)) for n in range(1, 40)]
    if plane == "tcp":
        assert len(caller.request_client._conns) == 1


async def test_stop_reaches_handler_and_stream_ends_cleanly(runtimes, namespace):
    seen = asyncio.Event()

    async def slow(request, context):
        i = 0
        while not context.is_stopped():
            yield {"i": i}
            i += 1
            await asyncio.sleep(0.01)
        seen.set()
        yield {"final": True}

    _, _, client = await connect(runtimes, namespace, slow)
    context = Context()
    stream = await client.generate({}, context)
    items = []
    async for item in stream:
        items.append(item)
        if len(items) == 3:
            context.stop_generating()
    await asyncio.wait_for(seen.wait(), 5)
    assert items[-1] == {"final": True}  # stop is graceful: what the handler still yields arrives
    assert stream.completed


async def test_kill_reaches_handler(runtimes, namespace):
    observed: list[str] = []
    done = asyncio.Event()

    async def forever(request, context):
        try:
            while True:
                yield {"tick": True}
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            observed.append("killed" if context.is_killed() else "cancelled")
            done.set()
            raise

    server, _, client = await connect(runtimes, namespace, forever)
    context = Context()
    stream = await client.generate({}, context)
    await stream.__anext__()
    context.kill()
    await asyncio.wait_for(done.wait(), 5)
    assert observed == ["killed"]
    assert [x async for x in stream] == []  # a killed stream ends quietly on the caller's side
    path = f"{namespace}.backend.generate"
    for _ in range(100):
        if server.request_server.inflight(path) == 0:
            break
        await asyncio.sleep(0.01)
    assert server.request_server.inflight(path) == 0


async def test_linked_child_context_is_killed_with_parent(runtimes, namespace):
    killed, forever = endless_until_killed()
    _, _, client = await connect(runtimes, namespace, forever)
    parent, child = Context(), Context()
    parent.link_child(child)
    stream = await client.generate({}, child)
    await stream.__anext__()
    parent.kill()
    await asyncio.wait_for(killed.wait(), 5)


async def test_handler_error_becomes_remote_error_and_server_keeps_serving(runtimes, namespace):
    async def flaky(request):
        yield {"ok": 1}
        if request.get("fail"):
            raise ValueError("bad things")
        yield {"ok": 2}

    _, _, client = await connect(runtimes, namespace, flaky)
    stream = await client.generate({"fail": True})
    got = []
    with pytest.raises(RemoteError) as info:
        async for item in stream:
            got.append(item)
    assert got == [{"ok": 1}]
    assert info.value.code == 500 and "bad things" in str(info.value)
    stream = await client.generate({})
    assert [x async for x in stream] == [{"ok": 1}, {"ok": 2}]


async def test_typed_endpoint_answers_a_misshapen_request_with_400_naming_the_field(runtimes, namespace):
    """With `request_type`, the handler gets the Struct; a request that does not fit never reaches it."""
    import msgspec

    class Count(msgspec.Struct):
        n: int
        label: str = "i"

    seen = []

    async def typed(request: Count):
        seen.append(request)
        for i in range(request.n):
            yield {request.label: i}

    endpoint = await serve(await runtimes(), namespace, typed, request_type=Count)
    client = await (await runtimes()).endpoint(endpoint.path).client()
    await client.wait_for_instances(1, timeout=5)
    with pytest.raises(RemoteError) as info:
        async for _ in await client.generate({"n": "three"}):
            pass
    assert info.value.code == 400 and "invalid Count: Expected `int`, got `str` - at `$.n`" in str(info.value)
    assert seen == []
    assert [x async for x in await client.generate({"n": 2, "label": "k"})] == [{"k": 0}, {"k": 1}]
    assert seen == [Count(2, "k")]


async def test_items_decode_into_their_struct_and_a_misshapen_one_fails_the_stream(runtimes, namespace):
    """With `item_type`, the caller gets each item as that Struct; an item that does not fit ends the stream
    with the worker's error (500) and stops the handler, and the server goes on serving."""
    import msgspec

    class Item(msgspec.Struct):
        i: int

    stopped = asyncio.Event()

    async def items(request, context):
        try:
            yield {"i": 0}
            yield {"i": "one"} if request.get("bad") else {"i": 1}
            await asyncio.sleep(30)
            yield {"i": 2}
        finally:
            stopped.set()

    runtime = await runtimes()
    endpoint = await serve(runtime, namespace, items)
    client = await (await runtimes()).endpoint(endpoint.path).client()
    instance = (await client.wait_for_instances(1, timeout=5))[0]
    got = []
    with pytest.raises(RemoteError) as info:
        async for item in await client.direct({"bad": True}, instance, item_type=Item):
            got.append(item)
    assert got == [Item(0)]
    assert info.value.code == 500 and "not in the contract's shape" in str(info.value)
    await asyncio.wait_for(stopped.wait(), 5)  # the handler was killed, not left to run
    stream = await client.direct({"n": 1}, instance, item_type=Item)
    assert [await anext(stream), await anext(stream)] == [Item(0), Item(1)]
    await stream.aclose()


async def test_engine_shutdown_marks_stream_incomplete(runtimes, namespace):
    async def leaving(request):
        yield {"i": 0}
        raise EngineShutdown()

    _, _, client = await connect(runtimes, namespace, leaving)
    stream = await client.generate({})
    got = []
    with pytest.raises(StreamIncompleteError):
        async for item in stream:
            got.append(item)
    assert got == [{"i": 0}] and not stream.completed


async def test_unserved_endpoint_is_unreachable_not_hung(runtimes, namespace):
    server, caller, client = await connect(runtimes, namespace)
    await server.request_server.remove_endpoint(f"{namespace}.backend.generate")
    with pytest.raises(InstanceUnreachableError):
        await client.generate({"n": 1})


async def test_direct_to_unknown_instance(runtimes, namespace):
    _, _, client = await connect(runtimes, namespace)
    with pytest.raises(NoInstancesError):
        await client.direct({"n": 1}, 12345)


async def test_waiting_for_one_instance(runtimes, namespace):
    server, _, client = await connect(runtimes, namespace)
    await client.wait_for_instance(server.instance_id, 0)  # listed: no wait at all
    with pytest.raises(NoInstancesError, match="instance 3039 "):
        await client.wait_for_instance(12345, 0.2)


@tcp_only
async def test_connect_refused_is_unreachable(runtimes):
    caller = await runtimes()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(InstanceUnreachableError):
        await caller.request_client.open_stream({"tcp": f"127.0.0.1:{port}"}, "a.b.c", {}, Context())


async def test_oversized_request_is_refused_by_the_client(runtimes, namespace):
    _, _, client = await connect(runtimes, namespace)
    client._runtime.request_client.max_size = 4096
    with pytest.raises(MessageTooLargeError):
        await client.generate({"n": 1, "blob": "x" * 10_000})


async def test_oversized_response_item_is_an_error_not_a_crash(runtimes, namespace):
    async def big(request):
        yield {"blob": "x" * 5000}

    _, _, client = await connect(runtimes, namespace, big, tcp_max_message_size=4096)
    stream = await client.generate({})
    with pytest.raises(RemoteError) as info:
        async for _ in stream:
            pass
    assert info.value.code == 413


async def _raw_connection(server):
    host, port = server.request_server.transport["tcp"].rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


@tcp_only
async def test_garbage_bytes_are_rejected_and_others_keep_being_served(runtimes, namespace, caplog):
    server, _, client = await connect(runtimes, namespace)
    reader, writer = await _raw_connection(server)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
    writer.close()
    assert "not a tandem request-plane client" in caplog.text
    stream = await client.generate({"n": 3})
    assert [x["i"] async for x in stream] == [0, 1, 2]


@tcp_only
async def test_malformed_frame_closes_only_that_connection(runtimes, namespace, caplog):
    server, _, client = await connect(runtimes, namespace)
    reader, writer = await _raw_connection(server)
    writer.write(tcp.MAGIC + tcp.HEADER.pack(3, 99, 1) + b"abc")  # unknown frame kind
    assert await asyncio.wait_for(reader.read(), 5) == b""
    assert "malformed frame" in caplog.text
    stream = await client.generate({"n": 2})
    assert [x["i"] async for x in stream] == [0, 1]


@tcp_only
async def test_undecodable_request_gets_400_and_connection_survives(runtimes, namespace):
    server, _, _ = await connect(runtimes, namespace)
    reader, writer = await _raw_connection(server)
    writer.write(tcp.MAGIC + tcp.HEADER.pack(2, framed.REQUEST, 7) + b"\xc1\xc1")
    length, kind, stream_id = tcp.HEADER.unpack(await reader.readexactly(tcp.HEADER_SIZE))
    body = framed.decode(await reader.readexactly(length))
    assert (kind, stream_id, body["code"]) == (framed.ERROR, 7, 400)
    # the same connection still serves a valid request
    payload = framed.encode({"e": f"{namespace}.backend.generate", "id": "r1", "b": {"n": 1}})
    writer.write(tcp.HEADER.pack(len(payload), framed.REQUEST, 8) + payload)
    kinds = []
    while not kinds or kinds[-1] != framed.END:
        length, kind, _ = tcp.HEADER.unpack(await reader.readexactly(tcp.HEADER_SIZE))
        await reader.readexactly(length)
        kinds.append(kind)
    assert kinds == [framed.PROLOGUE, framed.DATA, framed.END]
    writer.close()


@tcp_only
async def test_oversized_frame_from_a_raw_peer_is_skipped_with_413(runtimes, namespace):
    server, _, client = await connect(runtimes, namespace, tcp_max_message_size=2048)
    reader, writer = await _raw_connection(server)
    writer.write(tcp.MAGIC + tcp.HEADER.pack(5000, framed.REQUEST, 1) + b"\x00" * 5000)
    length, kind, stream_id = tcp.HEADER.unpack(await reader.readexactly(tcp.HEADER_SIZE))
    body = framed.decode(await reader.readexactly(length))
    assert (kind, stream_id, body["code"]) == (framed.ERROR, 1, 413)
    writer.close()
    stream = await client.generate({"n": 2})
    assert [x["i"] async for x in stream] == [0, 1]


async def test_client_disconnect_kills_the_handler(runtimes, namespace):
    killed, forever = endless_until_killed()
    server, caller, client = await connect(runtimes, namespace, forever)
    stream = await client.generate({})
    await stream.__anext__()
    await caller.request_client.close()  # drop the connection
    await asyncio.wait_for(killed.wait(), 5)


async def test_frame_reader_handles_byte_by_byte_input():
    reader = tcp._FrameReader(1024, framed.SERVER_KINDS)
    data = tcp._frame(framed.DATA, 5, b"hello") + tcp._frame(framed.END, 5)
    frames = []
    for i in range(len(data)):
        frames += reader.feed(data[i : i + 1])
    assert frames == [(framed.DATA, 5, b"hello"), (framed.END, 5, b"")]


async def test_frame_reader_gives_the_same_frames_however_the_reads_are_cut():
    """Reads ending anywhere (inside a header, a payload, an oversized payload being skipped, or exactly on a
    frame's end): the frames of the whole stream, each once, and nothing held back after the last."""
    import random

    big = 100
    frames = [(framed.DATA, 1, b"x" * 7), (framed.DATA, 2, b""), (framed.DATA, 3, b"y" * big), (framed.END, 1, b""),
              (framed.DATA, 4, b"z" * 50), (framed.DATA, 5, bytes(range(40)))]
    data = b"".join(tcp._frame(*f) for f in frames)
    expected = [f if len(f[2]) <= 64 else (f[0], f[1], len(f[2])) for f in frames]
    rng = random.Random(7)
    for _ in range(300):
        reader = tcp._FrameReader(64, framed.SERVER_KINDS)
        cuts = sorted(rng.sample(range(1, len(data)), rng.randint(0, 12)))
        got = []
        for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True):
            got += reader.feed(data[a:b])
        assert got == expected, cuts
        assert not reader.buf and not reader.skip


async def test_context_killed_before_the_request_kills_it_on_arrival(runtimes, namespace):
    async def forever(request, context):
        while not context.is_killed():
            yield {}
            await asyncio.sleep(0.01)

    server, _, client = await connect(runtimes, namespace, forever)
    context = Context()
    context.kill()
    stream = await client.generate({}, context)
    assert [x async for x in stream] == []
    path = f"{namespace}.backend.generate"
    async with asyncio.timeout(5):  # the handler is cancelled before, or right after, it starts
        while server.request_server.inflight(path) or open_streams(server):
            await asyncio.sleep(0.01)


async def test_caller_cancelled_before_the_request_is_accepted_kills_it(runtimes, namespace):
    """The calling task is cancelled between sending the request and the worker accepting it (a client
    disconnect): the worker's handler must not keep running unseen."""
    async def forever(request, context):
        if request.get("marker"):
            yield {"marker": True}
            return
        while not context.is_killed():
            yield {}
            await asyncio.sleep(0.01)

    server, _, client = await connect(runtimes, namespace, forever)
    warm = Context()
    warm.kill()
    await client.generate({}, warm)  # the connection is up: the next call sends at once
    call = asyncio.create_task(client.generate({}, Context()))
    await asyncio.sleep(0)  # the request is sent; the worker has not seen it yet
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    path = f"{namespace}.backend.generate"
    # A request sent after it, answered: the worker has had the cancelled one (and its KILL) by now.
    assert [x async for x in await client.generate({"marker": 1})] == [{"marker": True}]
    async with asyncio.timeout(5):
        while server.request_server.inflight(path) or open_streams(server):
            await asyncio.sleep(0.01)


async def test_caller_cancelled_as_the_request_is_accepted_kills_it(runtimes, namespace, monkeypatch):
    """The worker's acceptance and the caller's cancellation land in the same turn of the loop (a client
    that disconnects just as the worker takes its request): the call must still end cancelled, and the
    handler be killed, rather than go on as if the caller were there."""
    started = asyncio.Event()

    async def forever(request, context):
        started.set()
        while not context.is_killed():
            yield {}
            await asyncio.sleep(0.01)

    server, _, client = await connect(runtimes, namespace, forever)
    call: asyncio.Task | None = None
    accept = framed.FramedResponseStream.on_frame

    def accepted_then_cancelled(stream, kind, payload):
        accept(stream, kind, payload)
        if kind == framed.PROLOGUE and call is not None:
            call.cancel()

    monkeypatch.setattr(framed.FramedResponseStream, "on_frame", accepted_then_cancelled)
    call = asyncio.create_task(client.generate({}, Context()))
    with pytest.raises(asyncio.CancelledError):
        await call
    assert started.is_set()  # the worker did take it
    path = f"{namespace}.backend.generate"
    async with asyncio.timeout(5):
        while server.request_server.inflight(path) or open_streams(server):
            await asyncio.sleep(0.01)


@tcp_only
async def test_a_caller_leaving_mid_connect_strands_no_other_caller(runtimes, monkeypatch):
    """Callers to one address share its connection attempt; the first one going away must not leave the
    others waiting forever on an attempt nobody finishes."""
    listener = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
    address = f"127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    caller = await runtimes()
    loop = asyncio.get_running_loop()
    connect, gate = loop.create_connection, asyncio.Event()

    async def slow_connect(*args, **kwargs):
        await gate.wait()
        return await connect(*args, **kwargs)

    monkeypatch.setattr(loop, "create_connection", slow_connect)
    plane = caller.request_client
    first = asyncio.create_task(plane._connection(address))
    second = asyncio.create_task(plane._connection(address))
    await asyncio.sleep(0.05)
    first.cancel()
    await asyncio.sleep(0)
    gate.set()
    async with asyncio.timeout(5):
        conn = await second
    assert not conn.closed and first.cancelled()
    listener.close()


# ------------------------------------------------------------------------------------------------
# NATS only: what a broker in the middle changes
# ------------------------------------------------------------------------------------------------


@nats_only
async def test_nats_instance_not_serving_is_unreachable_at_once(runtimes, namespace):
    """Nobody subscribed to the subject: NATS answers "no responders" (a wait for the 30-s request timeout
    would end "not accepted in time")."""
    caller = await runtimes(nats_request_timeout=30)
    with pytest.raises(InstanceUnreachableError, match="no responders"):
        await caller.request_client.open_stream({"nats": "123abc"}, f"{namespace}.backend.generate", {}, Context())


@nats_only
async def test_nats_uses_dynamos_subject_for_each_instance(runtimes, namespace):
    server, _, client = await connect(runtimes, namespace)
    instance = f"{server.instance_id:x}"
    assert client.transport_of(server.instance_id) == {"nats": instance}
    subject = natsplane.endpoint_subject(f"{namespace}.backend.generate", instance)
    assert subject == f"{namespace}_backend.generate-{instance}"
    assert natsplane.endpoint_subject("My.Comp-1.gen", "ff") == "my_comp-1.gen-ff"
    assert natsplane.endpoint_subject("ns.c.a>b*", "ff") == "ns_c.a_b_-ff"  # never a wildcard


@nats_only
async def test_nats_kill_that_overtakes_its_request_still_kills_it(runtimes, namespace):
    """A request and its KILL go on different subjects, whose callbacks NATS runs independently, so a
    caller that leaves at once can have its KILL handled first: the request must then never run."""
    seen = []

    async def record(request, context):
        seen.append(request["n"])
        yield {}

    server, caller, client = await connect(runtimes, namespace, record)
    instance = f"{server.instance_id:x}"
    path = f"{namespace}.backend.generate"
    nc = caller.request_client._connection.nc
    reply = f"{caller.request_client.prefix}.999999"
    await nc.publish(natsplane.control_subject(instance), framed.encode([framed.KILL, reply]))
    await nc.flush()
    await nc.publish(natsplane.endpoint_subject(path, instance), framed.encode({"e": path, "id": "gone", "b": {"n": 1}}),
                     reply=reply)
    # One subject's requests are handled in order: once the next one is served, the first was handled.
    assert [x async for x in await client.generate({"n": 2})] == [{}]
    assert seen == [2]
    assert not server.request_server.streams


@nats_only
async def test_nats_lost_frame_cuts_the_stream_instead_of_shortening_it(runtimes, namespace):
    server, _, client = await connect(runtimes, namespace)
    outbox = server.request_server._outbox
    put = outbox.put
    seen = 0

    def lossy(subject: str, data: bytes) -> None:
        nonlocal seen
        seen += 1
        if seen != 4:  # PROLOGUE, DATA 0, DATA 1, then DATA 2 vanishes
            put(subject, data)

    outbox.put = lossy
    stream = await client.generate({"n": 10})
    got = []
    with pytest.raises(StreamIncompleteError, match="lost"):
        async for item in stream:
            got.append(item["i"])
    assert got == [0, 1] and not stream.completed


@nats_only
async def test_nats_worker_gone_cuts_its_streams_within_seconds(runtimes, namespace):
    killed, forever = endless_until_killed()
    server, _, client = await connect(runtimes, namespace, forever)
    stream = await client.generate({})
    await stream.__anext__()
    server.request_server._pinger.cancel()
    await server.nats.nc.close()  # as if the worker's process died: its subscriptions are gone
    with pytest.raises(StreamIncompleteError):
        async with asyncio.timeout(10):
            async for _ in stream:
                pass


@nats_only
async def test_nats_request_over_the_servers_max_payload_is_a_clear_error(runtimes, namespace, tmp_path):
    from tests.support.servers import NatsServer

    small = NatsServer(tmp_path, max_payload=8192)
    small.start()
    try:
        server = await runtimes(nats_server=small.url)
        endpoint = await serve(server, namespace, counter)
        client = await (await runtimes(nats_server=small.url)).endpoint(endpoint.path).client()
        await client.wait_for_instances(1, timeout=5)
        with pytest.raises(MessageTooLargeError, match="max_payload in the NATS server"):
            await client.generate({"n": 1, "blob": "x" * 20_000})
        stream = await client.generate({"n": 2})
        assert [x["i"] async for x in stream] == [0, 1]
    finally:
        small.stop()


@nats_only
async def test_nats_restart_cuts_running_streams_and_new_ones_succeed(runtimes, namespace, nats):
    _, _, client = await connect(runtimes, namespace)
    streams = [await client.generate({"n": 100_000, "delay": 0.01}) for _ in range(4)]
    for stream in streams:
        await stream.__anext__()
    nats.stop(kill=True)
    nats.start()
    for stream in streams:  # each one ends: cut off (so the frontend migrates it), never hung
        with pytest.raises(StreamIncompleteError):
            async with asyncio.timeout(15):
                async for _ in stream:
                    pass
    async with asyncio.timeout(15):
        while True:
            try:
                stream = await client.generate({"n": 3})
                assert [x["i"] async for x in stream] == [0, 1, 2]
                break
            except InstanceUnreachableError:
                await asyncio.sleep(0.2)


async def test_nats_unreachable_is_a_clear_error_within_the_timeout():
    from tests.support.ports import free_port

    with pytest.raises(ConfigError, match=r"cannot reach NATS at nats://127\.0\.0\.1:\d+ \(NATS_SERVER\) within 1 s"):
        await DistributedRuntime.create(runtime_config(
            request_plane="nats", nats_server=f"nats://127.0.0.1:{free_port()}", nats_connect_timeout=1.0))


@nats_only
async def test_nats_user_and_password(runtimes, namespace, tmp_path):
    """NATS_AUTH_USERNAME / NATS_AUTH_PASSWORD reach a server that requires them; without them the refusal
    is a clear error, not a hang."""
    from tests.support.servers import NatsServer

    guarded = NatsServer(tmp_path, jetstream=False, user=("tandem", "s3cret"))
    guarded.start()
    try:
        login = {"nats_server": guarded.url, "nats_user": "tandem", "nats_password": "s3cret"}
        server = await runtimes(**login)
        endpoint = await serve(server, namespace, counter)
        client = await (await runtimes(**login)).endpoint(endpoint.path).client()
        await client.wait_for_instances(1, timeout=5)
        assert [x["i"] async for x in await client.generate({"n": 2})] == [0, 1]
        refused = rf"NATS at {guarded.url} \(NATS_SERVER\) refused the login"
        with pytest.raises(ConfigError, match=rf"{refused} without credentials .*: Authorization Violation$"):
            await runtimes(nats_server=guarded.url, nats_connect_timeout=0.5)
        with pytest.raises(ConfigError, match=rf"{refused} as user 'tandem' .*: Authorization Violation$"):
            await runtimes(nats_server=guarded.url, nats_user="tandem", nats_password="wrong", nats_connect_timeout=0.5)
    finally:
        guarded.stop()


async def test_nats_refusal_is_named_when_a_reset_follows_it(monkeypatch):
    """nats-server closes a connection it refuses, so nats-py sometimes reports a connection reset (from
    closing it) after the server's -ERR, on the last attempt too: the error still names the refusal. The
    client library stands in here because a real server gives that order only now and then."""
    import nats
    import nats.errors

    from tandem.runtime.natsconn import NatsConnection

    async def refused(servers, *, error_cb, **options):  # the order nats-py reports one refused attempt in
        await error_cb(nats.errors.Error("nats: 'Authorization Violation'"))
        await error_cb(ConnectionResetError(104, "Connection reset by peer"))
        raise nats.errors.NoServersError

    monkeypatch.setattr(nats, "connect", refused)
    connection = NatsConnection(runtime_config(nats_server="nats://127.0.0.1:4222", nats_user="tandem",
                                               nats_password="wrong"))
    with pytest.raises(ConfigError, match=r"^NATS at nats://127\.0\.0\.1:4222 \(NATS_SERVER\) refused the login as "
                                          r"user 'tandem' \(NATS_AUTH_USERNAME / NATS_AUTH_PASSWORD\): "
                                          r"Authorization Violation$"):
        await connection.start()


def test_nats_unreachable_worker_exits_nonzero(smollm2):
    from tests.support.ports import free_port

    done = subprocess.run([sys.executable, "-m", "tandem.mocker", "--model-path", smollm2, "--request-plane",
                           "nats"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "NATS_SERVER": f"nats://127.0.0.1:{free_port()}",
                               "DYN_NATS_CONNECT_TIMEOUT_SECS": "1"})
    assert done.returncode == 2
    assert "cannot reach NATS" in done.stderr and "Traceback" not in done.stderr
