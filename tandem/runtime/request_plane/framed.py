"""What every request-plane transport shares: the message kinds, running one request's handler into
a stream of frames (server side), and the response stream that turns frames back into items (client
side). A transport only moves frames: TCP over one connection per peer, NATS over subjects.

client -> server: REQUEST {e: endpoint, id: request id, b: body}, STOP, KILL
server -> client: PROLOGUE (accepted), DATA (one item), END (complete), ERROR {message, code},
                  INCOMPLETE (handler gave up mid-stream: EngineShutdown)
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from collections.abc import Hashable
from typing import Any, Protocol

import msgspec

from tandem.runtime.context import Context
from tandem.runtime.errors import (
    EngineShutdown,
    InstanceUnreachableError,
    InvalidRequestError,
    MessageTooLargeError,
    RemoteError,
    StreamIncompleteError,
)
from tandem.runtime.request_plane import EndpointService, ResponseStream

log = logging.getLogger(__name__)

REQUEST, STOP, KILL = 1, 2, 3
PROLOGUE, DATA, END, ERROR, INCOMPLETE = 16, 17, 18, 19, 20
CLIENT_KINDS = frozenset((REQUEST, STOP, KILL))
SERVER_KINDS = frozenset((PROLOGUE, DATA, END, ERROR, INCOMPLETE))

encode = msgspec.msgpack.Encoder().encode
decode = msgspec.msgpack.Decoder().decode


@functools.cache
def items_decoder(item_type: type | None) -> msgspec.msgpack.Decoder[Any]:
    """The decoder of a stream's items: into `item_type` (a msgspec Struct) when the caller names one."""
    return msgspec.msgpack.Decoder(item_type) if item_type is not None else msgspec.msgpack.Decoder()


# ------------------------------------------------------------------------------------------------
# Server side
# ------------------------------------------------------------------------------------------------


class FrameSink(Protocol):
    """Where a served stream's frames go (one client connection, or a NATS reply subject)."""

    @property
    def closed(self) -> bool: ...

    @property
    def writable(self) -> asyncio.Event:
        """Cleared while the transport's buffer is full."""
        ...

    def send(self, kind: int, stream_id: Any, payload: bytes = b"") -> None: ...


def error_payload(message: str, code: int) -> bytes:
    return encode({"message": message, "code": code})


async def serve_stream(
    sink: FrameSink, stream_id: Any, endpoint: str, service: EndpointService, body: Any, context: Context,
    nbytes: int, max_size: int, inflight: dict[str, int], limit_hint: str,
) -> None:
    """Run `service` on one request and send its items as frames; ends with END, ERROR or INCOMPLETE
    (or nothing, when killed). The caller has already sent PROLOGUE."""
    sent = 0
    outcome = "error"
    started = time.perf_counter()
    inflight[endpoint] = inflight.get(endpoint, 0) + 1
    items: Any = None
    try:
        items = service.stream(body, context)
        async for item in items:
            if context.is_killed() or sink.closed:
                break
            data = encode(item)
            if len(data) > max_size:
                log.error("%s: response item of %d bytes exceeds the %d-byte limit", endpoint, len(data), max_size)
                sink.send(ERROR, stream_id, error_payload(str(MessageTooLargeError(len(data), max_size, limit_hint)), 413))
                return
            sink.send(DATA, stream_id, data)
            sent += len(data)
            if not sink.writable.is_set():
                await sink.writable.wait()
        if context.is_killed() or sink.closed:
            outcome = "cancelled"
        else:
            sink.send(END, stream_id)
            outcome = "ok"
    except InvalidRequestError as e:
        log.warning("%s: rejected request %s: %s", endpoint, context.id(), e)
        sink.send(ERROR, stream_id, error_payload(str(e), e.code))
    except EngineShutdown:
        sink.send(INCOMPLETE, stream_id)
        outcome = "incomplete"
    except asyncio.CancelledError:
        outcome = "cancelled"  # killed: nothing more goes to the client
    except Exception as e:
        log.exception("%s: handler failed on request %s", endpoint, context.id())
        sink.send(ERROR, stream_id, error_payload(f"{type(e).__name__}: {e}", 500))
    finally:
        if items is not None:
            await _close_quietly(items)
        inflight[endpoint] -= 1
        service.account(nbytes, sent, time.perf_counter() - started, outcome)


async def _close_quietly(items: Any) -> None:
    aclose = getattr(items, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except (Exception, asyncio.CancelledError):
            log.debug("error closing a handler's stream", exc_info=True)


# ------------------------------------------------------------------------------------------------
# Client side
# ------------------------------------------------------------------------------------------------


class FrameChannel(Protocol):
    """The client's way to one server: sends STOP/KILL for a stream, and holds its open streams."""

    streams: dict[Any, Any]  # stream id -> its FramedResponseStream (or a subclass)

    def send(self, kind: int, stream_id: Any, payload: bytes = b"") -> None: ...


_OPEN, _ENDED, _FAILED, _CUT, _KILLED = range(5)


class FramedResponseStream(ResponseStream):
    def __init__(self, channel: FrameChannel, stream_id: Hashable, context: Context, where: str,
                 item_type: type | None = None) -> None:
        self._channel = channel
        self._decoder = items_decoder(item_type)
        self._id = stream_id
        self._context = context
        self._where = where
        self._items: collections.deque[bytes] = collections.deque()
        self._state = _OPEN
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._unlink = context.on_signal(self._on_signal)

    @property
    def completed(self) -> bool:
        return self._state == _ENDED

    @property
    def buffered(self) -> bool:
        return bool(self._items)

    @property
    def open(self) -> bool:
        return self._state == _OPEN

    def _on_signal(self, killed: bool) -> None:
        if self._state != _OPEN:
            return
        if killed:
            self._channel.send(KILL, self._id)
            self.finish(_KILLED)
        else:
            self._channel.send(STOP, self._id)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def finish(self, state: int, error: BaseException | None = None) -> None:
        if self._state != _OPEN:
            return
        self._state = state
        self._error = error
        self._channel.streams.pop(self._id, None)
        self._unlink()
        if not self.accepted.done():
            if error is not None:
                self.accepted.set_exception(error)
            else:
                self.accepted.set_result(None)
        self._wake()

    def fail(self, error: BaseException) -> None:
        self.finish(_FAILED, error)

    def on_frame(self, kind: int, payload: bytes) -> None:
        if kind == DATA:
            self._items.append(payload)
            self._wake()
        elif kind == PROLOGUE:
            if not self.accepted.done():
                self.accepted.set_result(None)
        elif kind == END:
            self.finish(_ENDED)
        elif kind == ERROR:
            info = decode(payload)
            message, code = str(info.get("message")), int(info.get("code", 500))
            if code == 503 and not self.accepted.done():
                self.finish(_FAILED, InstanceUnreachableError(f"{self._where}: {message}"))
            else:
                self.finish(_FAILED, RemoteError(message, code))
        elif kind == INCOMPLETE:
            self.finish(_CUT, StreamIncompleteError(f"{self._where}: the worker ended the stream early"))

    def on_lost(self, reason: str) -> None:
        """The way to the server broke: unreachable if it had not accepted yet, else cut off."""
        if not self.accepted.done():
            self.finish(_FAILED, InstanceUnreachableError(f"{self._where}: {reason}"))
        else:
            self.finish(_CUT, StreamIncompleteError(f"{self._where}: stream cut off ({reason})"))

    def __aiter__(self) -> FramedResponseStream:
        return self

    async def __anext__(self) -> Any:
        while True:
            if self._items:
                try:
                    return self._decoder.decode(self._items.popleft())
                except msgspec.ValidationError as e:  # a worker out of the contract: its error, not a crash
                    error = RemoteError(f"{self._where}: an output not in the contract's shape ({e})", 500)
                    self._channel.send(KILL, self._id)
                    self.fail(error)
                    raise error from None
            state = self._state
            if state == _OPEN:
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
                continue
            if state == _ENDED or state == _KILLED:
                raise StopAsyncIteration
            assert self._error is not None
            raise self._error

    async def aclose(self) -> None:
        if self._state == _OPEN:
            self._channel.send(KILL, self._id)
            self.finish(_KILLED)

    async def wait_accepted(self, timeout: float) -> None:
        """Return once the server took the request; raise what refused it (unknown endpoint, too large,
        unreachable, not accepted within `timeout`) here rather than on iteration."""
        if self._context.is_stopped():  # signalled before the stream existed: forward it now
            self._on_signal(self._context.is_killed())
        if not self.accepted.done():
            # A timer rather than asyncio.timeout (a timer and a task-cancellation dance per request), and not
            # wait_for: on Python 3.11 it returns when the acceptance and the caller's cancellation arrive
            # together, and the request would go on running for a client that has left.
            timer = asyncio.get_running_loop().call_later(timeout, self._not_accepted)
            try:
                await asyncio.shield(self.accepted)
            except asyncio.CancelledError:  # the caller went away: the request must not run on unseen
                self._on_signal(True)
                raise
            finally:
                timer.cancel()
        self.accepted.result()

    def _not_accepted(self) -> None:
        if self._state == _OPEN and not self.accepted.done():
            self._channel.send(KILL, self._id)
            self.finish(_FAILED, InstanceUnreachableError(f"{self._where}: not accepted in time"))
