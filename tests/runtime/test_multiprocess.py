"""Two processes over the file discovery backend and the TCP request plane."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from tandem.runtime import Context, StreamIncompleteError


async def wait_for_report(path: Path, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().split()
        await asyncio.sleep(0.02)
    return []


@pytest.fixture
async def caller(runtimes, file_kv):
    return await runtimes(discovery_backend="file", file_kv_root=file_kv, discovery_ttl=2.0)


async def echo_client(caller, namespace):
    client = await caller.endpoint(f"{namespace}.echo.generate").client()
    await client.wait_for_instances(1, timeout=10)
    return client


async def test_processes_find_each_other_and_10000_messages_arrive_in_order(workers, caller, namespace):
    worker = workers()
    client = await echo_client(caller, namespace)
    assert client.instance_ids() == [worker.instance_id]
    stream = await client.generate({"n": 10_000})
    received = [item["i"] async for item in stream]
    assert received == list(range(10_000))
    assert stream.completed


async def test_stop_and_kill_reach_the_remote_handler(workers, caller, namespace, tmp_path):
    workers()
    client = await echo_client(caller, namespace)
    for action in ("stopped", "killed"):
        report = tmp_path / f"{action}.txt"
        context = Context()
        stream = await client.generate({"n": 100_000, "delay": 0.01, "report": str(report)}, context)
        await stream.__anext__()
        context.stop_generating() if action == "stopped" else context.kill()
        async for _ in stream:
            pass
        assert await wait_for_report(report) == [action]
        if action == "stopped":
            assert stream.completed  # a stopped stream still ends properly


async def test_kill_9_gives_incomplete_stream_not_a_hang(workers, caller, namespace):
    worker = workers()
    client = await echo_client(caller, namespace)
    stream = await client.generate({"n": 100_000, "delay": 0.01})
    await stream.__anext__()
    worker.proc.send_signal(signal.SIGKILL)
    with pytest.raises(StreamIncompleteError):
        async with asyncio.timeout(10):
            async for _ in stream:
                pass


async def test_dead_instance_leaves_discovery_within_ttl(workers, caller, namespace):
    ttl = "2"
    dead = workers(env={"DYN_DISCOVERY_TTL_SECS": ttl})
    alive = workers(env={"DYN_DISCOVERY_TTL_SECS": ttl})
    client = await echo_client(caller, namespace)
    await client.wait_for_instances(2, timeout=10)
    dead.proc.send_signal(signal.SIGKILL)
    dead.proc.wait()
    async with asyncio.timeout(3 * float(ttl)):
        while dead.instance_id in client.instance_ids():
            await asyncio.sleep(0.05)
    assert client.instance_ids() == [alive.instance_id]
    stream = await client.generate({"n": 3})
    assert [x["i"] async for x in stream] == [0, 1, 2]


async def test_sigterm_drains_the_in_flight_stream_then_exits_0(workers, caller, namespace, tmp_path):
    worker = workers(env={"DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0.2"})
    client = await echo_client(caller, namespace)
    report = tmp_path / "report.txt"
    stream = await client.generate({"n": 150, "delay": 0.01, "report": str(report)})
    first = await stream.__anext__()
    worker.proc.send_signal(signal.SIGTERM)
    rest = [item["i"] async for item in stream]
    assert [first["i"], *rest] == list(range(150))
    assert stream.completed
    assert await asyncio.to_thread(worker.proc.wait, 30) == 0
    assert await wait_for_report(report) == ["done"]
    # it unregistered itself on the way out: no stale entry is left for the TTL to clean up
    assert await caller.store.get_prefix(f"v1/instances/{namespace}/echo/") == {}


async def test_second_signal_exits_at_once(workers, caller, namespace):
    worker = workers(env={"DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "60"})
    client = await echo_client(caller, namespace)
    stream = await client.generate({"n": 100_000, "delay": 0.01})
    await stream.__anext__()
    worker.proc.send_signal(signal.SIGTERM)
    async with asyncio.timeout(10):  # it has the first signal (and a minute of grace before it exits)
        while not any("SIGTERM received: shutting down gracefully" in line for line in worker.stderr_lines):
            await asyncio.sleep(0.01)
    await stream.__anext__()  # and still streams after it: in its grace period
    await stream.__anext__()
    assert worker.proc.poll() is None
    worker.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(worker.proc.wait, 10) != 0


async def test_bad_peers_are_rejected_and_the_worker_keeps_serving(workers, caller, namespace):
    from tandem.runtime.request_plane import framed, tcp

    worker = workers()
    client = await echo_client(caller, namespace)
    host, port = client.transport_of(worker.instance_id)["tcp"].rsplit(":", 1)
    stream = await client.generate({"n": 10_000, "delay": 0.001})  # a stream in flight throughout
    first = await stream.__anext__()

    async def send_raw(data: bytes) -> bytes:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(10):
            reply = await reader.read()
        writer.close()
        return reply

    assert await send_raw(b"\x16\x03\x01 garbage, e.g. a TLS hello") == b""
    assert await send_raw(tcp.MAGIC + tcp.HEADER.pack(0, 77, 1)) == b""  # unknown frame kind
    # an oversized request is refused on its stream (413) without buffering it
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(tcp.MAGIC + tcp.HEADER.pack(64 * 1024 * 1024, framed.REQUEST, 5))
    length, kind, stream_id = tcp.HEADER.unpack(await reader.readexactly(tcp.HEADER_SIZE))
    assert (kind, stream_id, framed.decode(await reader.readexactly(length))["code"]) == (framed.ERROR, 5, 413)
    writer.close()

    rest = [item["i"] async for item in stream]
    assert [first["i"], *rest] == list(range(10_000))  # the other client was never disturbed
    fresh = await client.generate({"n": 3})
    assert [x["i"] async for x in fresh] == [0, 1, 2]
    assert worker.proc.poll() is None
