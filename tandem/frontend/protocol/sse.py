"""JSON bodies and server-sent events, as every route writes them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

_encoder = msgspec.json.Encoder()
SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}


def dumps(obj: Any) -> bytes:
    """Compact JSON (for non-streaming bodies)."""
    return _encoder.encode(obj)


def sse(obj: Any) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


def named_sse(event: str, obj: Any) -> bytes:
    """An SSE event with its type on an `event:` line (the Responses and Anthropic streams)."""
    return b"event: " + event.encode() + b"\ndata: " + _encoder.encode(obj) + b"\n\n"


class TextEvents:
    """The events of one chunk shape whose only part that changes is a text (a stream's plain content deltas):
    the parts around the text are encoded once, the text per event; byte for byte what `sse` writes."""

    __slots__ = ("head", "tail")
    _MARK = "\ue000tandem-text\ue000"

    def __init__(self, chunk: Callable[[str], Any]) -> None:
        head, mark, tail = sse(chunk(self._MARK)).partition(_encoder.encode(self._MARK))
        if not mark or self._MARK.encode() in tail:
            raise ValueError("the chunk must hold its text exactly once")
        self.head, self.tail = head, tail

    def __call__(self, text: str) -> bytes:
        return self.head + _encoder.encode(text) + self.tail
