"""A plain text delta's event, built from the envelope encoded once, is the event `sse` writes for its chunk."""

from __future__ import annotations

import pytest

from tandem.frontend.api.openai.protocol import ChatStream, CompletionStream
from tandem.frontend.protocol.sse import TextEvents, sse

TEXTS = ["", "Hello", ' "quoted" \\ back', "line\nbreak\ttab", "café ☕ 日本", "\u2028\x00\x1f", "}]}"]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_chat_content_events(text: str, include_usage: bool) -> None:
    chunks = ChatStream('m "quoted"', include_usage=include_usage)
    assert chunks.text_event(text) == sse(chunks.content(text))


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_completion_text_events(text: str, include_usage: bool) -> None:
    chunks = CompletionStream("m", include_usage=include_usage)
    assert chunks.text_event(text) == sse(chunks.text(text))


def test_a_chunk_without_its_text_is_refused() -> None:
    with pytest.raises(ValueError, match="exactly once"):
        TextEvents(lambda text: {"content": "fixed"})
