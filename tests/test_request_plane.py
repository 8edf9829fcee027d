"""The TCP request plane, in one process: streaming, stop/kill, errors, limits, bad peers."""

from __future__ import annotations

import asyncio
import socket

import pytest

from tandem.runtime import (
    Context,
    EngineShutdown,
    InstanceUnreachableError,
    MessageTooLargeError,
    NoInstancesError,
    RemoteError,
    StreamIncompleteError,
)
from tandem.runtime.request_plane import tcp


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


async def test_concurrent_streams_share_one_connection(runtimes, namespace):
    _, caller, client = await connect(runtimes, namespace)

    async def one(n):
        stream = await client.random({"n": n, "delay": 0.001})
        return [x["i"] async for x in stream]

    results = await asyncio.gather(*(one(n) for n in range(1, 40)))
    assert results == [list(range(n)) for n in range(1, 40)]
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
    server.request_server.remove_endpoint(f"{namespace}.backend.generate")
    with pytest.raises(InstanceUnreachableError):
        await client.generate({"n": 1})


async def test_direct_to_unknown_instance(runtimes, namespace):
    _, _, client = await connect(runtimes, namespace)
    with pytest.raises(NoInstancesError):
        await client.direct({"n": 1}, 12345)


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


async def test_malformed_frame_closes_only_that_connection(runtimes, namespace, caplog):
    server, _, client = await connect(runtimes, namespace)
    reader, writer = await _raw_connection(server)
    writer.write(tcp.MAGIC + tcp.HEADER.pack(3, 99, 1) + b"abc")  # unknown frame kind
    assert await asyncio.wait_for(reader.read(), 5) == b""
    assert "malformed frame" in caplog.text
    stream = await client.generate({"n": 2})
    assert [x["i"] async for x in stream] == [0, 1]


async def test_undecodable_request_gets_400_and_connection_survives(runtimes, namespace):
    server, _, _ = await connect(runtimes, namespace)
    reader, writer = await _raw_connection(server)
    writer.write(tcp.MAGIC + tcp.HEADER.pack(2, tcp.REQUEST, 7) + b"\xc1\xc1")
    length, kind, stream_id = tcp.HEADER.unpack(await reader.readexactly(tcp.HEADER_SIZE))
    body = tcp._decode(await reader.readexactly(length))
    assert (kind, stream_id, body["code"]) == (tcp.ERROR, 7, 400)
    # the same connection still serves a valid request
    payload = tcp._encode({"e": f"{namespace}.backend.generate", "id": "r1", "b": {"n": 1}})
    writer.write(tcp.HEADER.pack(len(payload), tcp.REQUEST, 8) + payload)
    kinds = []
    while not kinds or kinds[-1] != tcp.END:
        length, kind, _ = tcp.HEADER.unpack(await reader.readexactly(tcp.HEADER_SIZE))
        await reader.readexactly(length)
        kinds.append(kind)
    assert kinds == [tcp.PROLOGUE, tcp.DATA, tcp.END]
    writer.close()


async def test_oversized_frame_from_a_raw_peer_is_skipped_with_413(runtimes, namespace):
    server, _, client = await connect(runtimes, namespace, tcp_max_message_size=2048)
    reader, writer = await _raw_connection(server)
    writer.write(tcp.MAGIC + tcp.HEADER.pack(5000, tcp.REQUEST, 1) + b"\x00" * 5000)
    length, kind, stream_id = tcp.HEADER.unpack(await reader.readexactly(tcp.HEADER_SIZE))
    body = tcp._decode(await reader.readexactly(length))
    assert (kind, stream_id, body["code"]) == (tcp.ERROR, 1, 413)
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
    reader = tcp._FrameReader(1024, tcp._SERVER_KINDS)
    data = tcp._frame(tcp.DATA, 5, b"hello") + tcp._frame(tcp.END, 5)
    frames = []
    for i in range(len(data)):
        frames += reader.feed(data[i : i + 1])
    assert frames == [(tcp.DATA, 5, b"hello"), (tcp.END, 5, b"")]


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
        while server.request_server.inflight(path) or any(
            conn.streams for conn in server.request_server.connections
        ):
            await asyncio.sleep(0.01)


async def test_caller_cancelled_before_the_request_is_accepted_kills_it(runtimes, namespace):
    """The calling task is cancelled between sending the request and the worker accepting it (a client
    disconnect): the worker's handler must not keep running unseen."""
    async def forever(request, context):
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
    await asyncio.sleep(0.2)
    async with asyncio.timeout(5):
        while server.request_server.inflight(path) or any(
            conn.streams for conn in server.request_server.connections
        ):
            await asyncio.sleep(0.01)
