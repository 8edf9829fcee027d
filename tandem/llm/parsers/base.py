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


_CLOSERS = {"{": "}", "[": "]", "(": ")"}


def bracket_end(text: str, start: int, quotes: str = '"') -> int | None:
    """Index just past the bracket that closes the one at `text[start]`, skipping quoted strings
    (with backslash escapes); None while it is still open."""
    stack: list[str] = []
    quote = ""
    escaped = False
    for i in range(start, len(text)):
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
                return i + 1
    return None


def close_json(text: str) -> str:
    """`text` with its open strings and brackets closed: recovers a call cut off at the end of output."""
    stack: list[str] = []
    in_string = escaped = False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            stack.append("}" if c == "{" else "]")
        elif c in "}]" and stack:
            stack.pop()
    tail = ('\\' if escaped else "") + ('"' if in_string else "")
    return text + tail + "".join(reversed(stack))


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


def json_calls(value: Any) -> list[ToolCall] | None:
    """One call object or a list of them; None if any item is not a call."""
    items = value if isinstance(value, list) else [value]
    calls = [json_call(item) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]
