"""How a streamed answer is cut into sends: the headers with the first events, a finished stream's last events
with its closing ones and the end of the body, the headers alone before a wait for the worker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import aiohttp
from aiohttp import web

from tandem.frontend.pipeline import Attempt
from tandem.frontend.protocol.answer import Outcome
from tandem.frontend.serving import EventStream, Serving


class _Sends:
    """A response that records each send."""

    def __init__(self) -> None:
        self.sends: list[tuple[str, bytes]] = []

    async def write(self, data: bytes) -> None:
        self.sends.append(("write", data))

    async def write_eof(self, data: bytes = b"") -> None:
        self.sends.append(("eof", data))


class _Answer:
    """Events named after what made them: `open`, one per delta's text, `close`."""

    def __init__(self, opening: bool = True) -> None:
        self.has_opening = opening

    def opening(self) -> list[bytes]:
        return [b"open;"] if self.has_opening else []

    def delta(self, delta: Any, parsed: Any) -> list[bytes]:
        return [delta.text.encode() + b";"] if delta.text else []

    def closing(self, outcome: Outcome, ending: Any) -> list[bytes]:
        return [b"close;"]


class _Ready:
    def __init__(self, ready: bool) -> None:
        self.buffered = ready


def _serve(texts: list[str], *, ready: bool, opening: bool = True) -> list[tuple[str, bytes]]:
    """The sends of a stream whose worker gives one output per text (the last finishes it); `ready`: the
    worker's next output is always already here."""
    serving = Serving.__new__(Serving)
    attempt = Attempt(stream=_Ready(ready))  # type: ignore[arg-type]
    tracked = SimpleNamespace(outcome=Outcome(), attempt=attempt, request_id="r", prompt_tokens=3)
    exchange = SimpleNamespace(tracked=tracked, answer=_Answer(opening), parser=None, images=False, extra_fields=[],
                               processor=SimpleNamespace(stop_reason=None))

    async def deltas(_: Any) -> AsyncIterator[tuple[Any, None]]:
        for i, text in enumerate(texts):
            if i == len(texts) - 1:
                tracked.outcome.finish_reason = "length"
            yield SimpleNamespace(text=text), None

    serving._deltas = deltas  # type: ignore[method-assign]
    response = _Sends()
    assert asyncio.run(serving._stream(response, exchange))  # type: ignore[arg-type]
    return response.sends


def test_a_stream_of_one_output_is_one_send() -> None:
    assert _serve(["a"], ready=False) == [("eof", b"open;a;close;")]


def test_the_first_events_go_at_once_and_the_last_with_the_end() -> None:
    assert _serve(["a", "b", "c"], ready=False) == [("write", b"open;a;"), ("write", b"b;"), ("eof", b"c;close;")]


def test_a_burst_already_here_waits_for_one_send() -> None:
    assert _serve(["a", "b", "c", "d"], ready=True) == [("write", b"open;a;"), ("eof", b"b;c;d;close;")]


def test_the_headers_go_alone_before_a_wait_when_no_event_has() -> None:
    # A completion has no opening event, and a first output may make none (text held back by a stop string).
    assert _serve(["", "", "b", "c"], ready=False, opening=False) == [
        ("write", b""), ("write", b""), ("write", b"b;"), ("eof", b"c;close;")]


def test_an_event_stream_sends_its_headers_with_its_first_write_or_alone() -> None:
    """Against a real aiohttp server: a response whose handler has written nothing has not sent its status
    line; a write of b"" sends it; the events follow."""

    async def go() -> None:
        released = asyncio.Event()
        stages: list[str] = []

        async def handler(request: web.Request) -> web.StreamResponse:
            response = EventStream(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            if request.query.get("headers") == "alone":
                await response.write(b"")
            stages.append("prepared")
            await released.wait()
            await response.write_eof(b"data: x\n\n")
            return response

        app = web.Application()
        app.router.add_get("/", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with aiohttp.ClientSession() as session:
                # Held: no status line while the handler waits with nothing written.
                held = asyncio.ensure_future(session.get(f"http://127.0.0.1:{port}/"))
                while not stages:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.2)
                assert not held.done()
                released.set()
                async with await held as response:
                    assert response.status == 200 and await response.read() == b"data: x\n\n"
                # Alone: the status line arrives while the handler still waits.
                released.clear()
                async with await asyncio.wait_for(session.get(f"http://127.0.0.1:{port}/?headers=alone"), 10) as response:
                    assert response.status == 200
                    released.set()
                    assert await response.read() == b"data: x\n\n"
        finally:
            await runner.cleanup()

    asyncio.run(go())
