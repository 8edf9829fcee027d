"""NATS event plane: a topic is a NATS subject, `namespace.{ns}[.component.{component}].{topic}`.

Publishers need no discovery entry (the server routes by subject) and never block: events queue for
one sending task and are dropped when the queue is full. Subscribers queue what arrives up to a
bound and drop beyond it.

Durable topics (`--durable-kv-events`) are also kept by a JetStream stream over the same subject. Their
publisher waits for JetStream's acknowledgement of each event and sends it again until it comes (a
message id makes the retry harmless), so events published while NATS restarts are not lost; live
subscribers see them as plain messages. A `DurableSubscriber` replays the stream from its first
message and, after a reconnect, from the last one it saw.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy, StreamConfig

from tandem.runtime.config import ConfigError
from tandem.runtime.event_plane import EventPublisher, EventSubscriber
from tandem.runtime.natsconn import NatsConnection, Outbox

log = logging.getLogger(__name__)

SEND_QUEUE = 100_000
RECV_QUEUE = 100_000
DURABLE_MAX_AGE = 3600.0  # seconds a durable event is kept (as Dynamo's JetStream KV events)

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode
_NOT_TOKEN = re.compile(r"[^A-Za-z0-9_-]")


def event_subject(scope: str, topic: str) -> str:
    """`ns` or `ns/component` and a topic -> the NATS subject (tokens cannot hold dots or spaces)."""
    namespace, _, component = scope.partition("/")
    parts = ["namespace", _NOT_TOKEN.sub("_", namespace)]
    if component:
        parts += ["component", _NOT_TOKEN.sub("_", component)]
    return ".".join([*parts, _NOT_TOKEN.sub("_", topic)])


def stream_name(subject: str) -> str:
    return "tandem_" + subject.replace(".", "_")


async def ensure_stream(connection: NatsConnection, subject: str) -> str:
    """The JetStream stream that keeps `subject` (created if missing); returns its name."""
    name = stream_name(subject)
    js = connection.nc.jetstream(timeout=5.0)
    try:
        await js.stream_info(name)
    except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError):
        raise ConfigError(f"durable KV events need JetStream, which the NATS server at {connection.config.nats_server} "
                          "does not offer (start it with -js)") from None
    except nats.js.errors.NotFoundError:
        try:
            await js.add_stream(StreamConfig(name=name, subjects=[subject], max_age=DURABLE_MAX_AGE))
        except nats.js.errors.BadRequestError as e:  # created by another process meanwhile
            if "already in use" not in str(e):
                raise
    return name


class NatsPublisher(EventPublisher):
    def __init__(self, connection: NatsConnection, scope: str, topic: str, outbox: Outbox | None = None) -> None:
        self.subject = event_subject(scope, topic)
        self._outbox = outbox if outbox is not None else Outbox(connection, SEND_QUEUE)
        self._full = 0
        self._closed = False

    @property
    def dropped(self) -> int:
        return self._full + self._outbox.failed

    def publish(self, event: Any) -> bool:
        if self._closed or len(self._outbox) >= SEND_QUEUE:
            self._full += 1
            return False
        self._outbox.put(self.subject, _encode(event))
        return True

    async def close(self) -> None:
        self._closed = True
        await self._outbox.close(linger=1.0)  # give what is queued a moment to leave


class _AcknowledgedOutbox(Outbox):
    """Each message is sent again until JetStream acknowledges it; a message id makes a repeat harmless."""

    RETRY_WAIT = 0.25

    def __init__(self, connection: NatsConnection, high: int) -> None:
        super().__init__(connection, high)
        self._js = connection.nc.jetstream(timeout=2.0)
        self._id = secrets.token_hex(8)
        self.sent = 0

    async def _send(self, subject: str, data: bytes) -> None:
        while True:
            try:
                await self._js.publish(subject, data, headers={"Nats-Msg-Id": f"{self._id}-{self.sent}"})
                self.sent += 1
                return
            except (nats.errors.Error, TimeoutError) as e:  # NATS or JetStream not (yet) back
                log.debug("durable event on %s not acknowledged (%s); sending it again", subject, e)
                await asyncio.sleep(self.RETRY_WAIT)


class DurablePublisher(NatsPublisher):
    def __init__(self, connection: NatsConnection, scope: str, topic: str) -> None:
        super().__init__(connection, scope, topic, _AcknowledgedOutbox(connection, SEND_QUEUE))


class NatsSubscriber(EventSubscriber):
    def __init__(self, connection: NatsConnection, scope: str, topic: str) -> None:
        self._connection = connection
        self.subject = event_subject(scope, topic)
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(RECV_QUEUE)
        self._subscription: Any = None
        self.dropped = 0

    async def start(self) -> None:
        self._subscription = await self._connection.nc.subscribe(
            self.subject, cb=self._on_message, pending_msgs_limit=0, pending_bytes_limit=0)
        await self._connection.nc.flush()  # the server has the subscription before start() returns

    async def _on_message(self, msg: Msg) -> None:
        try:
            self._queue.put_nowait(msg.data)
        except asyncio.QueueFull:
            self.dropped += 1

    def __aiter__(self) -> NatsSubscriber:
        return self

    async def __anext__(self) -> Any:
        data = await self._queue.get()
        if data is None:
            raise StopAsyncIteration
        return _decode(data)

    async def close(self) -> None:
        if self._subscription is not None:
            try:
                await self._subscription.unsubscribe()
            except nats.errors.Error:
                pass
        try:
            self._queue.put_nowait(None)
        except asyncio.QueueFull:
            pass


class DurableSubscriber(NatsSubscriber):
    """Reads a durable topic's JetStream stream from its first message, then live. An ordered consumer:
    the client tracks the last stream sequence it saw and, after a reconnect or a missed message,
    resumes right after it, so nothing is skipped or repeated. Nothing is stored per subscriber on the
    server: a new process replays the stream again (it rebuilds its state from it)."""

    async def start(self) -> None:
        await ensure_stream(self._connection, self.subject)
        js = self._connection.nc.jetstream()
        self._subscription = await js.subscribe(
            self.subject, cb=self._on_message, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL,
            idle_heartbeat=1.0, pending_msgs_limit=0, pending_bytes_limit=0)
