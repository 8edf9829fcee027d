"""The records every parser speaks, and the text helpers they share.

A parser sees a model's output as text deltas, in order, and returns what each delta means for the
client: answer text (`content`), thinking (`reasoning`) and tool calls. Parsing the whole output at
once is the same machine fed one delta, so streamed and unary answers agree by construction.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec


class ToolCall(msgspec.Struct):
    """One complete call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


class CallPiece(msgspec.Struct):
    """What a tool-call parser found: with a `name`, a new call begins (`arguments` holds the start of
    its arguments, maybe all of them, maybe nothing yet); without, more of the current call's arguments."""

    arguments: str
    name: str | None = None
    id: str | None = None  # the model's own id for the call (Kimi K2 writes one); else tandem makes one

    @classmethod
    def whole(cls, call: ToolCall) -> CallPiece:
        return cls(call.arguments, call.name)


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """A piece of the `index`-th call of the answer, in OpenAI's streaming shape: the first piece of a
    call carries its id and name, the following ones fragments of its arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


class ParsedDelta(msgspec.Struct):
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = msgspec.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class UnknownParserError(ValueError):
    """A parser name that is not built; the message lists the known ones."""


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that begins one of `markers` (a marker may be arriving)."""
    best = 0
    n = len(text)
    for marker in markers:
        # The leftmost start of the marker within its reach of the end is the longest candidate.
        i = text.find(marker[0], max(n - len(marker) + 1, 0))
        while 0 <= i and n - i > best:
            if marker.startswith(text[i:]):
                best = n - i
                break
            i = text.find(marker[0], i + 1)
    return best


def first_marker(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """(position, marker) of the earliest marker in `text[start:]`, or (-1, "")."""
    found, which = -1, ""
    for marker in markers:
        i = text.find(marker, start)
        if i >= 0 and (found < 0 or i < found):
            found, which = i, marker
    return found, which


def bracket_end(text: str, start: int, quotes: str = '"') -> int | None:
    """Index just past the bracket that closes the one at `text[start]`, skipping quoted strings
    (with backslash escapes); None while it is still open."""
    return BracketScanner(start, quotes).advance(text)


def skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    return i


_CLOSERS = {"{": "}", "[": "]", "(": ")"}


class BracketScanner:
    """Finds, as text arrives, where the bracketed value that starts at `start` ends (a JSON object or
    list; with `quotes="\"'"` a Python list), skipping quoted strings with backslash escapes."""

    __slots__ = ("pos", "stack", "quotes", "quote", "escaped")

    def __init__(self, start: int, quotes: str = '"') -> None:
        self.pos = start
        self.stack: list[str] = []
        self.quotes = quotes
        self.quote = ""  # the open string's quote
        self.escaped = False

    @property
    def in_string(self) -> bool:
        return bool(self.quote)

    def advance(self, text: str) -> int | None:
        """Index just past the value's end, or None while it is open (`text` only grows)."""
        stack, quotes = self.stack, self.quotes
        quote, escaped = self.quote, self.escaped
        for i in range(self.pos, len(text)):
            c = text[i]
            if quote:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == quote:
                    quote = ""
            elif c in quotes:
                quote = c
            elif c in _CLOSERS:
                stack.append(_CLOSERS[c])
            elif stack and c == stack[-1]:
                stack.pop()
                if not stack:
                    self.pos = i + 1
                    return i + 1
        self.pos = len(text)
        self.quote, self.escaped = quote, escaped
        return None

    def closing(self) -> str:
        """What closes the value as it stands (its open string and brackets): recovers a cut-off call."""
        return ("\\" if self.escaped else "") + self.quote + "".join(reversed(self.stack))


def loads(text: str) -> Any:
    """JSON, or None when `text` is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def json_call(value: Any) -> ToolCall | None:
    """`{"name": ..., "arguments" | "parameters": {...}}` as a call; None for anything else. Arguments
    given as a JSON string are kept as that string."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        return ToolCall(value["name"], args) if isinstance(loads(args), dict) else None
    if not isinstance(args, dict):
        return None
    return ToolCall(value["name"], dumps(args))
