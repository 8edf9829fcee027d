"""One request's output parsing: thinking first, then tool calls in what remains, or the calls that
`tool_choice` forced through guided decoding."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tandem.llm.parsers.base import CallPiece, ParsedDelta, ToolCallDelta, call_id
from tandem.llm.parsers.call_stream import ToolCallStream
from tandem.llm.parsers.harmony import HarmonyStream
from tandem.llm.parsers.reasoning import ThinkTags
from tandem.llm.parsers.tools import CallSyntax, Cursor, JsonCalls


class RequiredCalls(CallSyntax):
    """`tool_choice: required`: guided decoding makes the answer a JSON list of
    `{"name": ..., "parameters": {...}}`; its calls stream like any JSON calls."""

    leading = ("[",)

    def cursor(self, region: str) -> Cursor:
        return JsonCalls(0, close=None)


class NamedCall:
    """A named `tool_choice`: guided decoding makes the whole answer the function's arguments."""

    __slots__ = ("name", "_opened")

    def __init__(self, name: str) -> None:
        self.name = name
        self._opened = False

    def feed(self, text: str) -> list[CallPiece]:
        if not text:
            return []
        if self._opened:
            return [CallPiece(text)]
        self._opened = True
        return [CallPiece(text, self.name)]

    def finish(self) -> list[CallPiece]:
        return [] if self._opened else self.feed("{}")


class ChatParser:
    """`feed(text)` per detokenized delta -> `ParsedDelta`; `finish()` at the end of the output."""

    __slots__ = ("thinking_tags", "tools", "harmony", "named", "calls", "max_calls", "thinking", "_skipping")

    def __init__(self, *, thinking: ThinkTags | None = None, tools: ToolCallStream | None = None,
                 harmony: HarmonyStream | None = None, named: NamedCall | None = None,
                 max_calls: int | None = None) -> None:  # fmt: skip
        self.thinking_tags = thinking
        self.tools = tools
        self.harmony = harmony
        self.named = named
        self.calls = 0  # tool calls begun so far
        self.max_calls = max_calls  # parallel_tool_calls false: the first call only
        # The output is inside its thinking (for counting reasoning tokens); kept current by feed.
        self.thinking = bool(thinking and thinking.thinking)
        self._skipping = False  # the current call is beyond max_calls

    @property
    def calls_finish(self) -> bool:
        """Calls made end the answer with finish_reason tool_calls (a named tool_choice ends with stop,
        as OpenAI's does)."""
        return self.calls > 0 and self.named is None

    def feed(self, text: str) -> ParsedDelta:
        pieces: list[CallPiece] = []
        if self.harmony is not None:
            reasoning, content, pieces = self.harmony.feed(text)
            self.thinking = self.harmony.thinking
        elif self.thinking_tags is not None:
            tags = self.thinking_tags
            reasoning, content = tags.feed(text)
            self.thinking = tags.thinking
            if tags.over:
                self.thinking_tags = None  # no tag left to find: the rest is answer
        else:
            reasoning, content = "", text
        return self._answer(reasoning, content, pieces, final=False)

    def finish(self) -> ParsedDelta:
        pieces: list[CallPiece] = []
        if self.harmony is not None:
            reasoning, content, pieces = self.harmony.finish()
        else:
            reasoning, content = self.thinking_tags.finish() if self.thinking_tags else ("", "")
        return self._answer(reasoning, content, pieces, final=True)

    def _answer(self, reasoning: str, content: str, pieces: list[CallPiece], final: bool) -> ParsedDelta:
        """The answer part of a delta: tool calls found in its text (or the forced call), the rest content."""
        if self.named is not None:
            pieces = [*pieces, *self.named.feed(content)]
            content = ""
            if final:
                pieces += self.named.finish()
        elif self.tools is not None:
            if content:
                content, found = self.tools.feed(content)
                if found:
                    pieces = [*pieces, *found]
            if final:
                tail, more = self.tools.finish()
                content, pieces = content + tail, [*pieces, *more]
        out = ParsedDelta(content, reasoning)
        for piece in pieces:
            self._add(piece, out)
        return out

    def _add(self, piece: CallPiece, out: ParsedDelta) -> None:
        """A call's header (index, id, name), then its arguments as they come."""
        if piece.name is not None:
            self._skipping = self.max_calls is not None and self.calls >= self.max_calls
            if self._skipping:
                return
            self.calls += 1
            out.tool_calls.append(ToolCallDelta(self.calls - 1, "", piece.id or call_id(), piece.name))
        if piece.arguments and not self._skipping:
            out.tool_calls.append(ToolCallDelta(self.calls - 1, piece.arguments))


def required_calls(tools: Sequence[Mapping[str, Any]]) -> ToolCallStream:
    return ToolCallStream(RequiredCalls(tools))
