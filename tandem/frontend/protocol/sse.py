"""JSON bodies and server-sent events, as every route writes them."""

from __future__ import annotations

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
