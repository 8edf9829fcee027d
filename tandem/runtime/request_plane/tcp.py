"""TCP request plane.

One connection per (client process, server) carries many concurrent streams. After an 8-byte magic
that identifies the protocol, every message is a frame: a 13-byte header (payload length u32,
kind u8, stream id u64, big-endian) and a msgpack payload.

The frame kinds and their meaning are in `framed`.

A stream that stops without END/ERROR/INCOMPLETE because the connection dropped is incomplete too;
the server treats a dropped connection as KILL of all its streams. Server writes are coalesced per
event-loop tick, so a unary reply (PROLOGUE, DATA, END) leaves in one syscall.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from typing import Any

import msgspec

from tandem.runtime.config import RuntimeConfig
from tandem.runtime.context import Context
from tandem.runtime.errors import InstanceUnreachableError, MessageTooLargeError, RemoteError
from tandem.runtime.request_plane import (
    EndpointService,
    RequestPlaneClient,
    RequestPlaneServer,
    ResponseStream,
)
from tandem.runtime.request_plane.framed import (
    CLIENT_KINDS,
    ERROR,
    KILL,
    PROLOGUE,
    REQUEST,
    SERVER_KINDS,
    STOP,
    FramedResponseStream,
    decode,
    encode,
    error_payload,
    serve_stream,
)

log = logging.getLogger(__name__)

MAGIC = b"TNDMRP01"
HEADER = struct.Struct(">IBQ")
HEADER_SIZE = HEADER.size
_LIMIT_HINT = "raise DYN_TCP_MAX_MESSAGE_SIZE"

_FLUSH_AT = 256 * 1024  # write out the coalescing buffer early once it holds this much

def _frame(kind: int, stream_id: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload), kind, stream_id) + payload


def watch_peer(transport: asyncio.BaseTransport, timeout: float) -> None:
    """Have the kernel give up on a peer that stops answering (a cut link, a frozen host) after about
    `timeout` seconds: keep-alive probes while the connection is idle, TCP_USER_TIMEOUT while sent data
    waits for its acknowledgement. The connection then closes: the caller's streams end cut off (and
    migrate), the worker's are killed. Without it a silent peer holds its streams until TCP's own
    retransmissions give up, many minutes later. 0 leaves the kernel's defaults."""
    sock = transport.get_extra_info("socket")
    if sock is None or timeout <= 0:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, int(timeout / 3))
    probes = 3
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", max(1, int((timeout - idle) / probes))),
                        ("TCP_KEEPCNT", probes), ("TCP_USER_TIMEOUT", int(timeout * 1000))):
        option = getattr(socket, name, None)  # Linux names; other systems keep their defaults
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


class _FrameReader:
    """Incremental frame parser shared by both ends. Oversized frames are skipped, not buffered."""

    def __init__(self, max_size: int, kinds: frozenset[int]) -> None:
        self.max_size = max_size
        self.kinds = kinds
        self.buf = bytearray()
        self.skip = 0  # bytes of an oversized payload still to drop

    def feed(self, data: bytes) -> list[tuple[int, int, bytes | int]]:
        """Frames completed by `data`: (kind, stream id, payload), or (kind, stream id, size) for an
        oversized frame whose payload was dropped. Raises ValueError on an unknown frame kind."""
        # The usual read holds whole frames and nothing is buffered: the payloads are sliced straight out of it.
        held = self.buf
        buffered = bool(held)
        if buffered:
            held += data
        buf: bytes | bytearray = held if buffered else data
        frames: list[tuple[int, int, bytes | int]] = []
        pos = 0
        end = len(buf)
        while True:
            if self.skip:
                n = min(self.skip, end - pos)
                pos += n
                self.skip -= n
                if self.skip:
                    break
            if end - pos < HEADER_SIZE:
                break
            length, kind, stream_id = HEADER.unpack_from(buf, pos)
            if kind not in self.kinds:
                raise ValueError(f"unknown frame kind {kind}")
            if length > self.max_size:
                pos += HEADER_SIZE
                self.skip = length
                frames.append((kind, stream_id, length))
                continue
            if end - pos - HEADER_SIZE < length:
                break
            start = pos + HEADER_SIZE
            pos = start + length
            frames.append((kind, stream_id, bytes(buf[start:pos])))
        if buffered:
            del held[:pos]
        elif pos < end:
            held += memoryview(data)[pos:]
        return frames


# ------------------------------------------------------------------------------------------------
# Server
# ------------------------------------------------------------------------------------------------


class _ServerConnection(asyncio.Protocol):
    def __init__(self, server: TcpServer) -> None:
        self.server = server
        self.reader = _FrameReader(server.max_size, CLIENT_KINDS)
        self.greeted = False
        self.head = b""
        self.streams: dict[int, tuple[Context, asyncio.Task[None]]] = {}
        self.out = bytearray()
        self.flush_pending = False
        self.writable = asyncio.Event()
        self.writable.set()
        self.closed = False
        self.transport: asyncio.Transport | None = None
        self.peer = "?"

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.server.connections.add(self)
        watch_peer(transport, self.server.peer_timeout)

    def data_received(self, data: bytes) -> None:
        if not self.greeted:
            self.head += data
            if len(self.head) < len(MAGIC):
                if not MAGIC.startswith(self.head):
                    self._reject("not a tandem request-plane client")
                return
            if not self.head.startswith(MAGIC):
                self._reject("not a tandem request-plane client")
                return
            self.greeted = True
            data, self.head = self.head[len(MAGIC) :], b""
        try:
            frames = self.reader.feed(data)
        except ValueError as e:
            self._reject(f"malformed frame: {e}")
            return
        for kind, stream_id, payload in frames:
            if kind == REQUEST:
                self._on_request(stream_id, payload)
            elif kind == STOP or kind == KILL:
                entry = self.streams.get(stream_id)
                if entry is not None:
                    context, task = entry
                    if kind == KILL:
                        context.kill()
                        task.cancel()
                    else:
                        context.stop_generating()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.writable.set()
        self.server.connections.discard(self)
        for context, task in list(self.streams.values()):
            context.kill()  # a dropped connection counts as kill
            task.cancel()

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    # -- frames ------------------------------------------------------------------------------
    def _reject(self, why: str) -> None:
        log.warning("closing request-plane connection from %s: %s", self.peer, why)
        if self.transport is not None:
            self.transport.abort()

    def send(self, kind: int, stream_id: int, payload: bytes = b"") -> None:
        if self.closed:
            return
        self.out += HEADER.pack(len(payload), kind, stream_id)
        self.out += payload
        if len(self.out) >= _FLUSH_AT:
            self.flush()
        elif not self.flush_pending:
            self.flush_pending = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self.flush_pending = False
        if self.out and not self.closed and self.transport is not None:
            data, self.out = self.out, bytearray()
            self.transport.write(data)

    def send_error(self, stream_id: int, message: str, code: int) -> None:
        self.send(ERROR, stream_id, error_payload(message, code))

    def _on_request(self, stream_id: int, payload: bytes | int) -> None:
        if isinstance(payload, int):
            log.warning("rejected request of %d bytes from %s: over the %d-byte limit", payload, self.peer,
                        self.server.max_size)
            self.send_error(stream_id, str(MessageTooLargeError(payload, self.server.max_size)), 413)
            return
        try:
            message = decode(payload)
            endpoint, request_id, body = message["e"], message.get("id"), message.get("b")
        except (msgspec.DecodeError, KeyError, TypeError) as e:
            log.warning("rejected malformed request from %s: %s", self.peer, e)
            self.send_error(stream_id, f"malformed request: {e}", 400)
            return
        service = self.server.endpoints.get(endpoint)
        if service is None:
            self.send_error(stream_id, f"endpoint {endpoint!r} is not served by this instance", 503)
            return
        context = Context(request_id if isinstance(request_id, str) else None)
        self.send(PROLOGUE, stream_id)
        task = asyncio.get_running_loop().create_task(
            serve_stream(self, stream_id, endpoint, service, body, context, len(payload), self.server.max_size,
                         self.server.inflight_counts, _LIMIT_HINT)
        )
        self.streams[stream_id] = (context, task)
        # on done, not in _run's finally: a task killed before it ever ran has no finally
        task.add_done_callback(lambda _: self.streams.pop(stream_id, None))

class TcpServer(RequestPlaneServer):
    def __init__(self, config: RuntimeConfig) -> None:
        self.advertised = config.advertised_host()
        self.host = config.tcp_host or self.advertised  # where it listens
        self.port = config.tcp_port
        self.peer_timeout = config.tcp_peer_timeout
        self.max_size = config.tcp_max_message_size
        self.endpoints: dict[str, EndpointService] = {}
        self.inflight_counts: dict[str, int] = {}
        self.connections: set[_ServerConnection] = set()
        self._server: asyncio.base_events.Server | None = None

    @property
    def transport(self) -> dict[str, str]:
        return {"tcp": f"{self.advertised}:{self.port}"}

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ServerConnection(self), self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        log.debug("request plane listening on %s:%d", self.host, self.port)

    async def add_endpoint(self, path: str, service: EndpointService) -> None:
        self.endpoints[path] = service

    async def remove_endpoint(self, path: str) -> None:
        self.endpoints.pop(path, None)

    def inflight(self, path: str) -> int:
        return self.inflight_counts.get(path, 0)

    async def close(self) -> None:
        self.endpoints.clear()
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.flush()
            if conn.transport is not None:
                conn.transport.close()
        if self._server is not None:
            await self._server.wait_closed()


# ------------------------------------------------------------------------------------------------
# Client
# ------------------------------------------------------------------------------------------------

class _ClientConnection(asyncio.Protocol):
    def __init__(self, client: TcpClient, address: str) -> None:
        self.client = client
        self.address = address
        self.reader = _FrameReader(client.max_size, SERVER_KINDS)
        self.streams: dict[int, FramedResponseStream] = {}
        self.next_id = 1
        self.transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        watch_peer(transport, self.client.peer_timeout)
        transport.write(MAGIC)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.reader.feed(data)
        except ValueError as e:
            log.error("closing connection to %s: %s", self.address, e)
            assert self.transport is not None
            self.transport.abort()
            return
        for kind, stream_id, payload in frames:
            stream = self.streams.get(stream_id)
            if stream is None:
                continue
            if isinstance(payload, int):
                stream.fail(RemoteError(str(MessageTooLargeError(payload, self.reader.max_size)), 413))
            else:
                stream.on_frame(kind, payload)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.client._forget(self)
        reason = f"connection lost: {exc}" if exc else "connection closed by the worker"
        for stream in list(self.streams.values()):
            stream.on_lost(reason)

    def send(self, kind: int, stream_id: int, payload: bytes = b"") -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(_frame(kind, stream_id, payload))


class TcpClient(RequestPlaneClient):
    def __init__(self, config: RuntimeConfig) -> None:
        self.max_size = config.tcp_max_message_size
        self.connect_timeout = config.tcp_connect_timeout
        self.request_timeout = config.tcp_request_timeout
        self.peer_timeout = config.tcp_peer_timeout
        self._conns: dict[str, _ClientConnection] = {}
        self._connecting: dict[str, asyncio.Future[_ClientConnection]] = {}

    def _forget(self, conn: _ClientConnection) -> None:
        if self._conns.get(conn.address) is conn:
            del self._conns[conn.address]

    async def _connection(self, address: str) -> _ClientConnection:
        conn = self._conns.get(address)
        if conn is not None and not conn.closed:
            return conn
        pending = self._connecting.get(address)
        if pending is None:
            # The attempt is a task of its own: a caller that goes away must not strand the others waiting on it.
            pending = self._connecting[address] = asyncio.ensure_future(self._connect(address))
        return await asyncio.shield(pending)

    async def _connect(self, address: str) -> _ClientConnection:
        host, _, port = address.rpartition(":")
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connected = await asyncio.get_running_loop().create_connection(
                    lambda: _ClientConnection(self, address), host, int(port))
        except (TimeoutError, OSError) as e:
            raise InstanceUnreachableError(f"cannot connect to {address}: {e or 'timed out'}") from None
        finally:
            self._connecting.pop(address, None)
        self._conns[address] = connected
        return connected

    async def open_stream(
        self, transport: dict[str, str], endpoint: str, request: Any, context: Context, item_type: type | None = None
    ) -> ResponseStream:
        address = transport.get("tcp")
        if address is None:
            raise InstanceUnreachableError(f"instance has no tcp address: {transport}")
        payload = encode({"e": endpoint, "id": context.id(), "b": request})
        if len(payload) > self.max_size:
            raise MessageTooLargeError(len(payload), self.max_size)
        conn = await self._connection(address)
        stream_id = conn.next_id
        conn.next_id += 1
        stream = FramedResponseStream(conn, stream_id, context, f"{endpoint}@{address}", item_type)
        conn.streams[stream_id] = stream
        conn.send(REQUEST, stream_id, payload)
        await stream.wait_accepted(self.request_timeout)
        return stream

    async def close(self) -> None:
        for attempt in self._connecting.values():
            attempt.cancel()
        self._connecting.clear()
        for conn in list(self._conns.values()):
            if conn.transport is not None:
                conn.transport.close()
        self._conns.clear()
