"""NATS request plane: requests and their response streams travel as NATS messages.

Subjects:
- `{slug(namespace_component)}.{endpoint}-{instance:x}`: requests to one instance's endpoint (the
  subject layout Dynamo uses); the message's reply subject is the caller's stream subject.
- `tandem-rp.c.{client}.{stream}`: the frames of one response stream, sent by the worker.
- `tandem-rp.{instance:x}`: STOP/KILL for the instance's streams, and liveness pings.
- `tandem-rp.c.{client}.ping`: liveness pings to a caller.

Every frame is `kind u8, sequence u32` (big-endian) + msgpack payload. Core NATS delivers at most once,
so the caller checks the sequence: a frame missing means the stream is cut off, never silently short.
Each side pings the peers it has streams with once a second; a peer that is gone ("no responders",
or no answer in time), or a lost connection to NATS, cuts those streams (the worker kills them, the
caller sees them incomplete, so the frontend migrates them), as a dropped TCP connection does.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import secrets
import struct
import time
from collections.abc import Callable
from typing import Any

import msgspec
import nats.errors
from nats.aio.msg import Msg

from tandem.runtime.config import RuntimeConfig
from tandem.runtime.context import Context
from tandem.runtime.errors import InstanceUnreachableError, MessageTooLargeError
from tandem.runtime.keys import parse_endpoint_path
from tandem.runtime.natsconn import NatsConnection, Outbox
from tandem.runtime.request_plane import (
    EndpointService,
    RequestPlaneClient,
    RequestPlaneServer,
    ResponseStream,
)
from tandem.runtime.request_plane.framed import (
    ERROR,
    KILL,
    PROLOGUE,
    SERVER_KINDS,
    STOP,
    FramedResponseStream,
    decode,
    encode,
    error_payload,
    serve_stream,
)

log = logging.getLogger(__name__)

FRAME = struct.Struct(">BI")
PING = 0  # control message kind besides STOP and KILL
PING_INTERVAL = 1.0
PING_TIMEOUT = 5.0
RESUBSCRIBE_GRACE = 3.0  # seconds after a reconnect during which "no responders" is asked again
OUTBOX_LIMIT = 4096  # frames queued for NATS before handlers wait (backpressure)
EARLY_KILLS_KEPT = 4096  # KILLs of streams not seen yet, remembered for when their request arrives...
EARLY_KILL_SECS = 60.0  # ...for at most this long
_NOT_SLUG = re.compile(r"[^a-z0-9_-]")
_NOT_TOKEN = re.compile(r"[^A-Za-z0-9_-]")
_STATUS = "Status"
_NO_RESPONDERS = "503"


def endpoint_subject(path: str, instance: str) -> str:
    """Dynamo's subject for one instance of `namespace.component.endpoint` (`instance` in hex)."""
    namespace, component, endpoint = parse_endpoint_path(path)
    service = _NOT_SLUG.sub("_", f"{namespace}_{component}".lower()).lstrip("_")
    return f"{service}.{_NOT_TOKEN.sub('_', endpoint)}-{instance}"  # no wildcard or separator in a name


def control_subject(instance: str) -> str:
    return f"tandem-rp.{instance}"


def limit_of(connection: NatsConnection, configured: int) -> tuple[int, str]:
    """The message size limit (the lower of DYN_TCP_MAX_MESSAGE_SIZE and the server's max_payload),
    and what raises it."""
    server = connection.max_payload
    if server < configured:
        return server, "raise max_payload in the NATS server's configuration"
    return configured, "raise DYN_TCP_MAX_MESSAGE_SIZE"


async def _alive(connection: NatsConnection, subject: str) -> bool:
    """Whether someone answers a ping on `subject`. True while NATS itself is unreachable: the
    disconnect handling covers that case."""
    try:
        await connection.nc.request(subject, encode([PING, ""]), timeout=PING_TIMEOUT)
        return True
    except nats.errors.NoRespondersError:
        return False
    except (nats.errors.TimeoutError, TimeoutError):
        return not connection.connected
    except nats.errors.Error:
        return True


async def ping_peers(
    connection: NatsConnection, peers: Callable[[], set[str]], subject_of: Callable[[str], str],
    gone: Callable[[str], None],
) -> None:
    """Every PING_INTERVAL, ping each peer this side has streams with; call `gone(peer)` for those that
    do not answer."""
    while True:
        await asyncio.sleep(PING_INTERVAL)
        current = peers()
        if not current or not connection.connected:
            continue
        alive = await asyncio.gather(*(_alive(connection, subject_of(peer)) for peer in current))
        for peer, ok in zip(current, alive, strict=True):
            if not ok:
                gone(peer)


# ------------------------------------------------------------------------------------------------
# Server (worker side)
# ------------------------------------------------------------------------------------------------


class _Served:
    __slots__ = ("context", "task", "seq", "caller")

    def __init__(self, context: Context, caller: str) -> None:
        self.context = context
        self.task: asyncio.Task[None] | None = None
        self.seq = 0
        self.caller = caller


class NatsServer(RequestPlaneServer):
    def __init__(self, config: RuntimeConfig, connection: NatsConnection, instance_id: Any) -> None:
        """`instance_id()`: this process's instance id, known once discovery has started."""
        self._connection = connection
        self._instance_id = instance_id
        self.max_size = config.tcp_max_message_size
        self.endpoints: dict[str, tuple[EndpointService, Any]] = {}
        self.inflight_counts: dict[str, int] = {}
        self.streams: dict[str, _Served] = {}  # reply subject -> stream
        # A request and its KILL travel on different subjects, whose callbacks NATS runs independently:
        # the KILL of a caller that left at once can arrive first. Reply subject -> when it arrived.
        self._early_kills: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.closed = False
        self._outbox: Outbox | None = None
        self._control: Any = None
        self._pinger: asyncio.Task[None] | None = None

    @property
    def writable(self) -> asyncio.Event:
        assert self._outbox is not None
        return self._outbox.writable

    @property
    def instance(self) -> str:
        return f"{self._instance_id():x}"

    @property
    def transport(self) -> dict[str, str]:
        return {"nats": self.instance}

    async def start(self) -> None:
        await self._connection.start()
        self._outbox = Outbox(self._connection, OUTBOX_LIMIT)
        self._control = await self._connection.nc.subscribe(control_subject(self.instance), cb=self._on_control)
        self._connection.on_disconnect(self._kill_all)
        self._pinger = asyncio.get_running_loop().create_task(ping_peers(
            self._connection, lambda: {served.caller for served in self.streams.values()}, lambda c: f"{c}.ping",
            self._caller_gone), name="nats-rp-server-ping")
        log.debug("request plane on NATS as instance %s", self.instance)

    async def add_endpoint(self, path: str, service: EndpointService) -> None:
        subject = endpoint_subject(path, self.instance)

        async def on_request(msg: Msg) -> None:
            self._on_request(path, service, msg)

        self.endpoints[path] = (service, await self._connection.nc.subscribe(subject, cb=on_request))

    async def remove_endpoint(self, path: str) -> None:
        entry = self.endpoints.pop(path, None)
        if entry is not None:
            try:
                await entry[1].unsubscribe()
            except nats.errors.Error:
                pass

    def inflight(self, path: str) -> int:
        return self.inflight_counts.get(path, 0)

    def send(self, kind: int, stream_id: str, payload: bytes = b"") -> None:
        served = self.streams.get(stream_id)
        seq = 0
        if served is not None:
            seq = served.seq
            served.seq += 1
        assert self._outbox is not None
        self._outbox.put(stream_id, FRAME.pack(kind, seq) + payload)

    def _on_request(self, path: str, service: EndpointService, msg: Msg) -> None:
        reply = msg.reply
        if not reply or reply in self.streams:
            log.warning("dropped a request on %s without a usable reply subject", msg.subject)
            return
        if self._early_kills.pop(reply, None) is not None:
            return  # its caller has gone already
        caller = reply.rpartition(".")[0]
        if len(msg.data) > self.max_size:
            limit, hint = limit_of(self._connection, self.max_size)
            self.send(ERROR, reply, error_payload(str(MessageTooLargeError(len(msg.data), limit, hint)), 413))
            return
        try:
            message = decode(msg.data)
            request_id, body = message.get("id"), message.get("b")
        except (msgspec.DecodeError, AttributeError) as e:
            log.warning("rejected a malformed request on %s: %s", msg.subject, e)
            self.send(ERROR, reply, error_payload(f"malformed request: {e}", 400))
            return
        served = _Served(Context(request_id if isinstance(request_id, str) else None), caller)
        self.streams[reply] = served
        self.send(PROLOGUE, reply)
        task = asyncio.get_running_loop().create_task(serve_stream(
            self, reply, path, service, body, served.context, len(msg.data), self.max_size, self.inflight_counts,
            limit_of(self._connection, self.max_size)[1]))
        served.task = task
        task.add_done_callback(lambda _: self.streams.pop(reply, None))

    async def _on_control(self, msg: Msg) -> None:
        try:
            kind, reply = decode(msg.data)
        except (msgspec.DecodeError, ValueError, TypeError):
            log.warning("ignoring a malformed control message on %s", msg.subject)
            return
        if kind == PING:
            if msg.reply:
                await self._connection.nc.publish(msg.reply, b"")
            return
        served = self.streams.get(reply)
        if served is None:
            if kind == KILL:
                self._remember_early_kill(reply)
            return
        if kind == KILL:
            self._kill(served)
        elif kind == STOP:
            served.context.stop_generating()

    def _remember_early_kill(self, reply: str) -> None:
        now = time.monotonic()
        kills = self._early_kills
        kills[reply] = now
        while len(kills) > EARLY_KILLS_KEPT or next(iter(kills.values())) < now - EARLY_KILL_SECS:
            kills.popitem(last=False)

    @staticmethod
    def _kill(served: _Served) -> None:
        served.context.kill()
        if served.task is not None:
            served.task.cancel()

    def _kill_all(self) -> None:
        for served in list(self.streams.values()):
            self._kill(served)

    def _caller_gone(self, caller: str) -> None:
        log.warning("caller %s is gone: killing its streams", caller)
        for served in [s for s in self.streams.values() if s.caller == caller]:
            self._kill(served)

    async def close(self) -> None:
        self.closed = True
        for path in list(self.endpoints):
            await self.remove_endpoint(path)
        self._kill_all()
        if self._pinger is not None:
            self._pinger.cancel()
        if self._control is not None:
            try:
                await self._control.unsubscribe()
            except nats.errors.Error:
                pass
        if self._outbox is not None:
            await asyncio.sleep(0)  # let the outbox publish what the killed streams sent last
            await self._outbox.close()


# ------------------------------------------------------------------------------------------------
# Client (caller side)
# ------------------------------------------------------------------------------------------------


class NatsResponseStream(FramedResponseStream):
    def __init__(self, client: NatsClient, stream_id: int, instance: str, context: Context, where: str,
                 item_type: type | None) -> None:
        super().__init__(client, stream_id, context, where, item_type)
        self.instance = instance
        self.seq = 0  # of the next frame


class NatsClient(RequestPlaneClient):
    def __init__(self, config: RuntimeConfig, connection: NatsConnection) -> None:
        self._connection = connection
        self.max_size = config.tcp_max_message_size
        self.request_timeout = config.nats_request_timeout
        self.prefix = f"tandem-rp.c.{secrets.token_hex(8)}"
        self.streams: dict[int, NatsResponseStream] = {}
        self._next_id = 1
        self._subjects: dict[tuple[str, str], str] = {}
        self._started: asyncio.Future[None] | None = None
        self._outbox: Outbox | None = None
        self._inbox: Any = None
        self._pinger: asyncio.Task[None] | None = None

    async def _start(self) -> None:
        await self._connection.start()
        self._outbox = Outbox(self._connection, OUTBOX_LIMIT)
        self._inbox = await self._connection.nc.subscribe(
            f"{self.prefix}.*", cb=self._on_reply, pending_msgs_limit=0, pending_bytes_limit=0)
        self._connection.on_disconnect(lambda: self._cut_all("the connection to NATS was lost"))
        self._pinger = asyncio.get_running_loop().create_task(ping_peers(
            self._connection, lambda: {stream.instance for stream in self.streams.values()}, control_subject,
            lambda i: self._cut_all(f"instance {i} stopped answering on NATS", i)), name="nats-rp-client-ping")

    def send(self, kind: int, stream_id: int, payload: bytes = b"") -> None:
        stream = self.streams.get(stream_id)
        if stream is not None and self._outbox is not None:
            self._outbox.put(control_subject(stream.instance), encode([kind, f"{self.prefix}.{stream_id}"]))

    async def open_stream(
        self, transport: dict[str, str], endpoint: str, request: Any, context: Context, item_type: type | None = None
    ) -> ResponseStream:
        instance = transport.get("nats")
        if instance is None:
            raise InstanceUnreachableError(f"instance has no nats subject: {transport}")
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        await asyncio.shield(self._started)
        subject = self._subjects.get((endpoint, instance))
        if subject is None:
            subject = self._subjects[(endpoint, instance)] = endpoint_subject(endpoint, instance)
        payload = encode({"e": endpoint, "id": context.id(), "b": request})
        limit, hint = limit_of(self._connection, self.max_size)
        if len(payload) > limit:
            raise MessageTooLargeError(len(payload), limit, hint)
        deadline = time.monotonic() + self.request_timeout
        while True:
            if not await self._connection.wait_connected(max(deadline - time.monotonic(), 0.0)):
                raise InstanceUnreachableError(f"{subject}: NATS at {self._connection.servers} is unreachable")
            stream = await self._send_request(subject, instance, endpoint, payload, context, item_type)
            try:
                await stream.wait_accepted(max(deadline - time.monotonic(), 0.1))
                return stream
            except InstanceUnreachableError:
                # Just after NATS came back the instance may not have subscribed again yet: "no responders"
                # then is not an answer. Ask again for a moment.
                if time.monotonic() - self._connection.reconnected_at > RESUBSCRIBE_GRACE or \
                        time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(0.1)

    async def _send_request(
        self, subject: str, instance: str, endpoint: str, payload: bytes, context: Context, item_type: type | None
    ) -> NatsResponseStream:
        stream_id = self._next_id
        self._next_id += 1
        stream = NatsResponseStream(self, stream_id, instance, context, f"{endpoint}@nats:{subject}", item_type)
        self.streams[stream_id] = stream
        try:
            await self._connection.nc.publish(subject, payload, reply=f"{self.prefix}.{stream_id}")
        except nats.errors.Error as e:
            stream.fail(InstanceUnreachableError(f"{subject}: cannot publish the request: {type(e).__name__} {e}"))
        return stream

    async def _on_reply(self, msg: Msg) -> None:
        token = msg.subject.rpartition(".")[2]
        if token == "ping":
            if msg.reply:
                await self._connection.nc.publish(msg.reply, b"")
            return
        try:
            stream = self.streams.get(int(token))
        except ValueError:
            return
        if stream is None:
            return
        if msg.headers and msg.headers.get(_STATUS) == _NO_RESPONDERS:
            stream.on_lost("no responders: the instance does not serve this endpoint")
            return
        data = msg.data
        if len(data) < FRAME.size:
            stream.on_lost("malformed frame")
            return
        kind, seq = FRAME.unpack_from(data)
        if kind not in SERVER_KINDS:
            stream.on_lost(f"unknown frame kind {kind}")
        elif seq != stream.seq:
            stream.on_lost(f"frame {stream.seq} was lost in NATS")
        else:
            stream.seq += 1
            stream.on_frame(kind, data[FRAME.size:])

    def _cut_all(self, reason: str, instance: str | None = None) -> None:
        for stream in list(self.streams.values()):
            if instance is None or stream.instance == instance:
                stream.on_lost(reason)

    async def close(self) -> None:
        self._cut_all("the client closed")
        if self._pinger is not None:
            self._pinger.cancel()
        if self._outbox is not None:
            await self._outbox.close()
        if self._inbox is not None:
            try:
                await self._inbox.unsubscribe()
            except nats.errors.Error:
                pass
