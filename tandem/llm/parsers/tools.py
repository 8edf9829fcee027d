"""Tool-call parsers for models that write calls as marked-up text: JSON between tags (`hermes`,
`default`), bare JSON (`llama3_json`), `[TOOL_CALLS]` (`mistral`), Python call lists (`pythonic`) and
XML (`qwen3_coder`).

One machine (`ToolCallStream`, in `call_stream.py`) serves them all. Outside a call, text streams at once, except an end of
it that may be the beginning of a start marker. From a start marker on, the family's `Cursor` reads
the call as it arrives. JSON calls stream: the call opens as soon as its name is known and its
arguments follow as they are written, held back only where a marker may be starting. Python and XML
calls are taken whole when they close. A call still open when the output ends is recovered where its
syntax can be closed (JSON brackets and strings, XML end tags); anything that does not parse as a call
is returned as text, never dropped.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from tandem.llm.parsers.base import (
    BracketScanner,
    CallPiece,
    ToolCall,
    bracket_end,
    dumps,
    json_call,
    loads,
    skip_ws,
)


class Advance(msgspec.Struct):
    """What a cursor made of the call text so far: `pieces` of calls; `consumed`, once the call text is
    over, how much of it was the call (None: more is needed); `text` to show as content instead (text
    that turned out not to be a call)."""

    pieces: list[CallPiece]
    consumed: int | None = None
    text: str = ""


class Cursor:
    """Reads one call text, which starts with its marker and grows at its end."""

    def advance(self, region: str, final: bool) -> Advance:
        """With `final` (the output ended) it must finish: `consumed` is then set."""
        raise NotImplementedError


class Arguments:
    """A call's arguments object as it is written: what of it is new since last time, and where it ends."""

    __slots__ = ("scan", "sent")

    def __init__(self, start: int) -> None:
        self.scan = BracketScanner(start)
        self.sent = start

    def advance(self, region: str, pieces: list[CallPiece]) -> int | None:
        """Adds the text written since the last call to `pieces`; the index past the object once it closed."""
        end = self.scan.advance(region)
        stop = len(region) if end is None else end
        if stop > self.sent:
            pieces.append(CallPiece(region[self.sent:stop]))
            self.sent = stop
        return end

    def cut_off(self, pieces: list[CallPiece]) -> None:
        """The output ended inside the object: what closes it (its open string and brackets)."""
        pieces.append(CallPiece(self.scan.closing()))


class CallSyntax:
    """A family's call syntax. `markers` open a call anywhere in the text; `leading` ones only where
    the output (or the text after a call) has shown nothing but `filler` characters."""

    markers: tuple[str, ...] = ()
    leading: tuple[str, ...] = ()
    filler = " \t\r\n"

    def __init__(self, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        self.tools = tools

    def cursor(self, region: str) -> Cursor:
        """The cursor for a call text opened by one of the markers (`region` starts with it)."""
        return WholeCalls(self)

    def take(self, region: str, final: bool) -> Taken | None:
        """For whole-call syntaxes: the call(s) at the start of `region`; None if more text is needed.
        With `final` it must decide."""
        raise NotImplementedError


class Taken(msgspec.Struct):
    """A whole-call syntax's answer: `calls`, the `consumed` length, and `text` to show instead (a
    malformed call)."""

    calls: list[ToolCall]
    consumed: int
    text: str = ""


def as_text(region: str) -> Taken:
    return Taken([], len(region), region)


class WholeCalls(Cursor):
    """A syntax whose calls are taken whole (`CallSyntax.take`), tried again only when text that can
    close a call arrives (a closing bracket or the end of a tag): a long call stays linear to read."""

    __slots__ = ("syntax", "seen")
    closers = frozenset("}])>")

    def __init__(self, syntax: CallSyntax) -> None:
        self.syntax = syntax
        self.seen = 0

    def advance(self, region: str, final: bool) -> Advance:
        new, self.seen = region[self.seen:], len(region)
        if not final and self.closers.isdisjoint(new):
            return Advance([])
        taken = self.syntax.take(region, final)
        if taken is None:
            return Advance([])
        return Advance([CallPiece.whole(c) for c in taken.calls], taken.consumed, taken.text)


# JsonCalls states
_VALUE, _HEAD, _ARGS, _REST, _WHOLE, _SEP, _AFTER = range(7)
_INCOMPLETE, _MISMATCH = -1, -2


class JsonCalls(Cursor):
    """Calls as JSON objects `{"name": ..., "arguments" | "parameters": {...}}` from `start` on: one, a
    list of them, or (with `seps`) several separated by `;`; then the `close` tag, if any.

    A call opens when its name and the start of its arguments object have arrived; the arguments then
    stream as written. An object of another shape (other keys first, arguments as a string) is taken
    whole when it closes; one that is not a call ends the call text (it is content)."""

    __slots__ = ("close", "seps", "state", "pos", "in_list", "obj", "args", "made")

    def __init__(self, start: int, *, close: str | None, seps: str = "") -> None:
        self.close = close
        self.seps = seps
        self.state = _VALUE
        self.pos = start
        self.in_list = False
        self.obj = start  # where the current call object starts
        self.args: Arguments | None = None
        self.made = False  # a call has begun in this call text

    def advance(self, region: str, final: bool) -> Advance:
        pieces: list[CallPiece] = []
        n = len(region)
        while True:
            state = self.state
            if state == _VALUE:
                i = skip_ws(region, self.pos)
                if i == n:
                    break
                c = region[i]
                if c == "[" and not self.in_list and not self.made:
                    self.in_list, self.pos = True, i + 1
                elif c == "]" and self.in_list:
                    self.in_list, self.pos, self.state = False, i + 1, _AFTER
                elif c == "{":
                    self.obj, self.state = i, _HEAD
                else:
                    return self._end(region, i, pieces)
            elif state == _HEAD:
                head = _call_head(region, self.obj)
                if head == _INCOMPLETE:
                    break
                if head == _MISMATCH:
                    self.state = _WHOLE
                    continue
                name, at = head  # type: ignore[misc]
                j = skip_ws(region, at)
                if j == n:
                    break
                if region[j] != "{":
                    self.state = _WHOLE
                    continue
                pieces.append(CallPiece("", name))
                self.made = True
                self.args, self.state = Arguments(j), _ARGS
            elif state == _ARGS:
                assert self.args is not None
                end = self.args.advance(region, pieces)
                if end is None:
                    break
                self.pos, self.state = end, _REST
            elif state in (_REST, _WHOLE):
                end = bracket_end(region, self.obj)
                if end is None:
                    break
                if state == _WHOLE:
                    call = json_call(loads(region[self.obj:end]))
                    if call is None:
                        return self._end(region, self.obj, pieces, end)
                    pieces.append(CallPiece.whole(call))
                    self.made = True
                self.pos, self.state = end, _SEP
            elif state == _SEP:
                i = skip_ws(region, self.pos)
                if i == n:
                    break
                c = region[i]
                if self.in_list and c in ",]":
                    self.pos = i + 1
                    if c == "]":
                        self.in_list, self.state = False, _AFTER
                    else:
                        self.state = _VALUE
                elif not self.in_list and c in self.seps:
                    self.pos, self.state = i + 1, _VALUE
                else:
                    self.pos, self.state = i, _AFTER
            else:  # _AFTER: the close tag, if the syntax has one
                if self.close is None:
                    return Advance(pieces, self.pos)
                i = skip_ws(region, self.pos)
                if region.startswith(self.close, i):
                    return Advance(pieces, i + len(self.close))
                if n - i < len(self.close) and self.close.startswith(region[i:]):
                    break
                return Advance(pieces, i)
        if not final:
            return Advance(pieces)
        return self._finish(region, pieces)

    def _end(self, region: str, at: int, pieces: list[CallPiece], text_end: int | None = None) -> Advance:
        """The call text ends at `at`: what follows is content. Without a call made, the text read so
        far (through `text_end`) is content too."""
        if self.made:
            return Advance(pieces, at)
        end = text_end if text_end is not None else at
        return Advance([], end, region[:end])

    def _finish(self, region: str, pieces: list[CallPiece]) -> Advance:
        """The output ended inside the call text. Arguments cut off are closed; an object cut off before
        its arguments began is a call only if it was cut outside a string (a name is never guessed)."""
        n = len(region)
        if self.state == _ARGS:
            assert self.args is not None
            self.args.cut_off(pieces)
        elif self.state in (_HEAD, _WHOLE):
            scan = BracketScanner(self.obj)
            scan.advance(region)
            call = None if scan.in_string else json_call(loads(region[self.obj:] + scan.closing()))
            if call is not None:
                pieces.append(CallPiece.whole(call))
            elif not self.made:
                return Advance([], n, region)
            else:
                return Advance(pieces, self.obj)
        elif not self.made:
            return Advance([], n, region)
        return Advance(pieces, n)


# `{"name": "<name>", "arguments"|"parameters": `: strings (None: the name itself) and punctuation.
_HEAD: tuple[tuple[str, tuple[str, ...] | None], ...] = (
    ("string", ("name",)), ("punct", (":",)), ("string", None), ("punct", (",",)),
    ("string", ("arguments", "parameters")), ("punct", (":",)))


def _call_head(text: str, at: int) -> tuple[str, int] | int:
    """The head of the call object at `at`: (name, index after it), _INCOMPLETE while it may still
    come, or _MISMATCH (another shape)."""
    i = at + 1
    name = ""
    for kind, expected in _HEAD:
        if kind == "punct":
            assert expected is not None
            i = _punct(text, i, expected[0])
            if i < 0:
                return i
            continue
        value, i = _string(text, i)
        if not isinstance(value, str):
            return value
        if expected is None:
            name = value
        elif value not in expected:
            return _MISMATCH
    return (name, i) if name else _MISMATCH


def _punct(text: str, i: int, char: str) -> int:
    i = skip_ws(text, i)
    if i == len(text):
        return _INCOMPLETE
    return i + 1 if text[i] == char else _MISMATCH


def _string(text: str, i: int) -> tuple[str | int, int]:
    """The JSON string at `i` (after blanks), decoded, and the index after it."""
    i = skip_ws(text, i)
    if i == len(text):
        return _INCOMPLETE, i
    if text[i] != '"':
        return _MISMATCH, i
    j = i + 1
    while True:
        j = text.find('"', j)
        if j < 0:
            return _INCOMPLETE, i
        backslashes = 0
        while text[j - 1 - backslashes] == "\\":
            backslashes += 1
        if backslashes % 2 == 0:
            break
        j += 1
    value = loads(text[i:j + 1])
    return (value, j + 1) if isinstance(value, str) else (_MISMATCH, i)


class TaggedJson(CallSyntax):
    """`<open>` JSON call (or list of calls) `<close>`; a `close` of None runs to the end of the JSON
    values (several may be separated by `;`). A leading marker is the call's own first character."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] = (), *, tags: tuple[tuple[str, str | None], ...],
                 leading: tuple[str, ...] = ()) -> None:
        super().__init__(tools)
        self.tags = dict(tags)
        self.markers = tuple(self.tags)
        self.leading = leading
        if leading:
            self.filler = " \t\r\n;"

    def cursor(self, region: str) -> Cursor:
        marker = next((m for m in self.markers if region.startswith(m)), "")
        close = self.tags.get(marker) if marker else None
        return JsonCalls(len(marker), close=close, seps="" if close else ";")


class MistralCalls(CallSyntax):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (older tokenizers) or
    `[TOOL_CALLS]name[ARGS]{...}` per call (newer ones; `[CALL_ID]id` may precede `[ARGS]`)."""

    markers = ("[TOOL_CALLS]",)

    def cursor(self, region: str) -> Cursor:
        return MistralCursor(len(self.markers[0]))


class MistralCursor(Cursor):
    __slots__ = ("start", "inner", "args")

    def __init__(self, start: int) -> None:
        self.start = start
        self.inner: JsonCalls | None = None  # the list form
        self.args: Arguments | None = None  # the name[ARGS] form, once its arguments began

    def advance(self, region: str, final: bool) -> Advance:
        if self.inner is not None:
            return self.inner.advance(region, final)
        n = len(region)
        if self.args is None:
            at = skip_ws(region, self.start)
            if at == n:
                return Advance([], n, region) if final else Advance([])
            if region[at] in "[{":
                self.inner = JsonCalls(at, close=None)
                return self.inner.advance(region, final)
            k = region.find("[ARGS]", at)
            j = skip_ws(region, k + len("[ARGS]")) if k >= 0 else n
            if j == n:
                return Advance([], n, region) if final else Advance([])
            name = region[at:k].split("[CALL_ID]")[0].strip()
            if not name or region[j] != "{":
                return Advance([], j, region[:j])
            self.args = Arguments(j)
            opened = [CallPiece("", name)]
        else:
            opened = []
        end = self.args.advance(region, opened)
        if end is not None:
            return Advance(opened, end)
        if final:
            self.args.cut_off(opened)
            return Advance(opened, n)
        return Advance(opened)


class SectionCalls(CallSyntax):
    """Calls as special-token sections: `section[0]` (may be missing), then per call `call[0]` HEAD
    `args_start` {JSON arguments} [`args_end`] `call[1]`, then `section[1]`. `name_of` reads the
    function's name from HEAD. DeepSeek V3 / V3.1 and Kimi K2 write their calls this way."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] = (), *, section: tuple[str, str], call: tuple[str, str],
                 args_start: str, name_of: Callable[[str], str | None], args_end: str = "",
                 id_of: Callable[[str], str | None] | None = None) -> None:
        super().__init__(tools)
        self.section, self.call, self.args_start, self.args_end = section, call, args_start, args_end
        self.name_of = name_of
        self.id_of = id_of  # the call's id, when the model writes one in HEAD
        self.markers = (section[0], call[0])

    def cursor(self, region: str) -> Cursor:
        start = len(self.section[0]) if region.startswith(self.section[0]) else 0
        return SectionCursor(self, start)


# SectionCursor states
_BETWEEN, _NAME, _TAIL = 10, 11, 12


class SectionCursor(Cursor):
    __slots__ = ("syntax", "state", "pos", "call_at", "args", "made")

    def __init__(self, syntax: SectionCalls, start: int) -> None:
        self.syntax = syntax
        self.state = _BETWEEN
        self.pos = start
        self.call_at = start  # where the current call's start marker is
        self.args: Arguments | None = None
        self.made = False

    def advance(self, region: str, final: bool) -> Advance:
        syntax = self.syntax
        (call_start, call_end), section_end = syntax.call, syntax.section[1]
        pieces: list[CallPiece] = []
        n = len(region)
        while True:
            if self.state == _BETWEEN:
                i = skip_ws(region, self.pos)
                if region.startswith(call_start, i):
                    self.call_at, self.pos, self.state = i, i + len(call_start), _NAME
                elif region.startswith(section_end, i):
                    return Advance(pieces, i + len(section_end))
                elif i == n or call_start.startswith(region[i:]) or section_end.startswith(region[i:]):
                    break
                else:
                    return self._end(region, i, pieces)
            elif self.state == _NAME:
                k = region.find(syntax.args_start, self.pos)
                j = skip_ws(region, k + len(syntax.args_start)) if k >= 0 else n
                if j == n:
                    break
                head = region[self.pos:k]
                name = syntax.name_of(head)
                if not name or region[j] != "{":  # not a call: from its start marker on, content
                    return self._end(region, self.call_at if self.made else j, pieces)
                pieces.append(CallPiece("", name, syntax.id_of(head) if syntax.id_of else None))
                self.made = True
                self.args, self.state = Arguments(j), _ARGS
            elif self.state == _ARGS:
                assert self.args is not None
                end = self.args.advance(region, pieces)
                if end is None:
                    break
                self.pos, self.state = end, _TAIL
            else:  # _TAIL: the optional end of the arguments, then the call's end
                i = skip_ws(region, self.pos)
                if syntax.args_end and region.startswith(syntax.args_end, i):
                    i = skip_ws(region, i + len(syntax.args_end))
                if region.startswith(call_end, i):
                    self.pos, self.state = i + len(call_end), _BETWEEN
                elif i == n or (n - i < len(call_end) + len(syntax.args_end)
                                and (call_end.startswith(region[i:]) or syntax.args_end.startswith(region[i:]))):
                    break
                else:
                    self.pos, self.state = i, _BETWEEN  # no end marker: take the call as it is
        if not final:
            return Advance(pieces)
        if self.state == _ARGS:
            assert self.args is not None
            self.args.cut_off(pieces)
        elif not self.made:
            return Advance([], n, region)
        elif self.state == _NAME:
            return Advance(pieces, self.call_at)  # a call cut off before its arguments: content
        return Advance(pieces, n)

    def _end(self, region: str, at: int, pieces: list[CallPiece]) -> Advance:
        """Not a call from `at` on: the rest is content (and, if no call was made, all of it)."""
        return Advance(pieces, at) if self.made else Advance([], at, region[:at])


class PythonicCalls(CallSyntax):
    """A Python list of calls with literal keyword arguments: `[get_weather(city="Paris"), now()]`, at
    the start of the output, or between `<|python_start|>` and `<|python_end|>` (Llama 4)."""

    markers = ("<|python_start|>",)
    leading = ("[",)

    def take(self, region: str, final: bool) -> Taken | None:
        start = len(self.markers[0]) if region.startswith(self.markers[0]) else 0
        rest = region[start:].lstrip()
        at = len(region) - len(rest)
        if not rest:
            return as_text(region) if final else None
        if rest[0] != "[":
            return as_text(region[:at])
        end = bracket_end(region, at, quotes="\"'")
        if end is None:
            return as_text(region) if final else None
        calls = _python_calls(region[at:end])
        if calls is None:
            return as_text(region[:end])
        consumed = end
        if start:
            tail = region[end:].lstrip()
            if tail.startswith("<|python_end|>"):
                consumed = len(region) - len(tail) + len("<|python_end|>")
            elif not final and len(tail) < len("<|python_end|>") and "<|python_end|>".startswith(tail):
                return None
        return Taken(calls, consumed)


def _python_calls(source: str) -> list[ToolCall] | None:
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _dotted(node.func)
        if name is None:
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except ValueError:
            return None
        if len(arguments) != len(node.keywords):
            return None
        calls.append(ToolCall(name, dumps(arguments)))
    return calls


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None
