"""Tool-call parsers for models that write calls as marked-up text: JSON between tags (`hermes`,
`default`), bare JSON (`llama3_json`), `[TOOL_CALLS]` (`mistral`), Python call lists (`pythonic`) and
XML (`qwen3_coder`).

One machine (`ToolCallStream`) serves them all. Outside a call, text streams at once, except an end of
it that may be the beginning of a start marker. From a start marker on, text is held until the family's
syntax (`CallSyntax.take`) finds the call complete; the call is then returned whole. A call still open
when the output ends is recovered where its syntax can be closed (JSON brackets, XML end tags);
anything that does not parse as a call is returned as text, never dropped.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from tandem.llm.parsers.base import (
    ToolCall,
    bracket_end,
    close_json,
    dumps,
    first_marker,
    held_suffix,
    json_calls,
    loads,
)


class Taken(msgspec.Struct):
    """What a syntax made of the text at a call's start: `calls`, the `consumed` length, and `text`
    to show as content instead (a malformed call)."""

    calls: list[ToolCall]
    consumed: int
    text: str = ""


class CallSyntax:
    """A family's call syntax. `markers` open a call anywhere in the text; `leading` ones only where
    the output (or the text after a call) has shown nothing but `filler` characters."""

    markers: tuple[str, ...] = ()
    leading: tuple[str, ...] = ()
    filler = " \t\r\n"
    # Only text with one of these can complete a call (closing brackets, the end of a closing tag): text
    # without them is not parsed again, which keeps a long call linear to parse.
    closers = "}])>"

    def __init__(self, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        self.tools = tools

    def take(self, region: str, final: bool) -> Taken | None:
        """The call(s) at the start of `region` (which begins with a marker); None if more text is
        needed. With `final` (the output ended) it must decide."""
        raise NotImplementedError

    @staticmethod
    def as_text(region: str) -> Taken:
        return Taken([], len(region), region)


class TaggedJson(CallSyntax):
    """`<open>` JSON call (or list of calls) `<close>`; a `close` of None runs to the end of the
    output (several calls there may be separated by `;`)."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] = (), *, tags: tuple[tuple[str, str | None], ...],
                 leading: tuple[str, ...] = ()) -> None:
        super().__init__(tools)
        self.tags = dict(tags)
        self.markers = tuple(self.tags)
        self.leading = leading  # a leading marker is the call's own first character (`{`)
        if leading:
            self.filler = " \t\r\n;"

    def take(self, region: str, final: bool) -> Taken | None:
        marker = next((m for m in self.markers if region.startswith(m)), "")
        close = self.tags.get(marker) if marker else None
        if close is not None:
            end = region.find(close, len(marker))
            if end < 0:
                return self._recover(region, len(marker)) if final else None
            calls = json_calls(loads(region[len(marker):end]))
            consumed = end + len(close)
            return Taken(calls, consumed) if calls else self.as_text(region[:consumed])
        return self._run(region, len(marker), final)

    def _run(self, region: str, start: int, final: bool) -> Taken | None:
        """JSON values one after another to the end of the output: taken all at once when it ends."""
        if not final:
            return None
        calls: list[ToolCall] = []
        i = start
        while True:
            while i < len(region) and region[i] in " \t\r\n;":
                i += 1
            if i == len(region):
                break
            if region[i] not in "{[":
                return self.as_text(region) if not calls else Taken(calls, i)
            end = bracket_end(region, i)
            found = json_calls(loads(region[i:end] if end else close_json(region[i:])))
            if found is None:
                return self.as_text(region) if not calls else Taken(calls, i)
            calls.extend(found)
            if end is None:
                break
            i = end
        return Taken(calls, len(region)) if calls else self.as_text(region)

    def _recover(self, region: str, start: int) -> Taken:
        calls = json_calls(loads(close_json(region[start:].strip())))
        return Taken(calls, len(region)) if calls else self.as_text(region)


class MistralCalls(CallSyntax):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (older tokenizers) or
    `[TOOL_CALLS]name[ARGS]{...}` per call (newer ones; `[CALL_ID]id` may precede `[ARGS]`)."""

    markers = ("[TOOL_CALLS]",)

    def take(self, region: str, final: bool) -> Taken | None:
        start = len(self.markers[0])
        rest = region[start:].lstrip()
        at = len(region) - len(rest)
        if not rest:
            return self.as_text(region) if final else None
        if rest[0] in "[{":
            end = bracket_end(region, at)
            if end is None:
                if not final:
                    return None
                calls = json_calls(loads(close_json(region[at:])))
                return Taken(calls, len(region)) if calls else self.as_text(region)
            calls = json_calls(loads(region[at:end]))
            return Taken(calls, end) if calls else self.as_text(region[:end])
        args = region.find("[ARGS]", at)
        if args < 0:
            return self.as_text(region) if final else None
        name = region[at:args].split("[CALL_ID]")[0].strip()
        body = region.find("{", args)
        end = bracket_end(region, body) if body >= 0 else None
        if body < 0 or end is None:
            if not final:
                return None
            value = loads(close_json(region[body:])) if body >= 0 else None
            end = len(region)
        else:
            value = loads(region[body:end])
        if not name or not isinstance(value, dict):
            return self.as_text(region[:end])
        return Taken([ToolCall(name, dumps(value))], end)


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
            return self.as_text(region) if final else None
        if rest[0] != "[":
            return self.as_text(region[:at])
        end = bracket_end(region, at, quotes="\"'")
        if end is None:
            return self.as_text(region) if final else None
        calls = _python_calls(region[at:end])
        if calls is None:
            return self.as_text(region[:end])
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


class XmlCalls(CallSyntax):
    """`<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>` (Qwen3-Coder;
    the `<tool_call>` wrapper may be missing). Values are text, converted to the type the tool's JSON
    schema gives the parameter."""

    markers = ("<tool_call>", "<function=")

    def take(self, region: str, final: bool) -> Taken | None:
        close = "</tool_call>" if region.startswith("<tool_call>") else "</function>"
        end = region.find(close)
        if end < 0 and not final:
            return None
        consumed = end + len(close) if end >= 0 else len(region)
        calls = self._calls(region[:consumed])
        return Taken(calls, consumed) if calls else self.as_text(region[:consumed])

    def _calls(self, text: str) -> list[ToolCall]:
        calls = []
        for block in text.split("<function=")[1:]:
            head, sep, body = block.partition(">")
            name = head.strip()
            if not sep or not name:
                return []
            body = body.split("</function>")[0]
            schema = self._schema(name)
            arguments: dict[str, Any] = {}
            for part in body.split("<parameter=")[1:]:
                key, sep, value = part.partition(">")
                if not sep:
                    return []
                value = value.split("</parameter>")[0]
                if value.startswith("\n"):
                    value = value[1:]
                if value.endswith("\n"):
                    value = value[:-1]
                arguments[key.strip()] = _typed(value, schema.get(key.strip()))
            calls.append(ToolCall(name, dumps(arguments)))
        return calls

    def _schema(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            function = tool.get("function") or {}
            if function.get("name") == name:
                properties = (function.get("parameters") or {}).get("properties")
                return properties if isinstance(properties, dict) else {}
        return {}


def _typed(value: str, schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
        return value
    parsed = loads(value.strip())
    if parsed is None and value.strip() != "null":
        if kind == "boolean" and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        return value
    return parsed


class ToolCallStream:
    """One request's stream through a `CallSyntax`: `feed(text)` -> (content, complete calls).

    Whitespace (the syntax's filler) at the end of the content is held until more content follows:
    around calls it is dropped, so an answer that is only calls has no content."""

    __slots__ = ("syntax", "_buf", "_in_call", "_lead", "_filler", "_any_call", "_markers", "_starts")

    def __init__(self, syntax: CallSyntax) -> None:
        self.syntax = syntax
        self._markers = syntax.markers
        self._starts = frozenset(m[0] for m in syntax.markers)  # text without these cannot hold a marker
        self._buf = ""
        self._in_call = False
        self._lead = True  # only filler since the output began or the last call ended
        self._filler = ""
        self._any_call = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self._in_call:
            self._buf += text
            if not any(c in text for c in self.syntax.closers):
                return "", []
        elif not self._buf and not (self._lead and self.syntax.leading) and self._starts.isdisjoint(text):
            return self._content(text), []  # the common case: plain text, nothing held
        else:
            self._buf += text
        return self._run(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = self._run(final=True)
        if self._buf:
            content += self._content(self._buf)
            self._buf = ""
        if self._filler and not self._any_call:
            content += self._filler
        self._filler = ""
        return content, calls

    def _run(self, final: bool) -> tuple[str, list[ToolCall]]:
        content = ""
        calls: list[ToolCall] = []
        syntax = self.syntax
        while self._buf:
            if self._in_call:
                taken = syntax.take(self._buf, final)
                if taken is None:
                    break
                self._buf = self._buf[taken.consumed:]
                self._in_call = False
                if taken.calls:
                    calls.extend(taken.calls)
                    self._any_call = True
                    self._filler = ""
                    self._lead = True
                else:
                    content += self._content(taken.text)
                continue
            buf = self._buf
            if self._lead and syntax.leading:
                body = buf.lstrip(syntax.filler)
                if not body:
                    self._filler += buf
                    self._buf = ""
                    break
                if body.startswith(syntax.leading):
                    self._filler = "" if self._any_call else self._filler + buf[: len(buf) - len(body)]
                    self._buf = body
                    self._in_call = True
                    continue
            at, _ = first_marker(buf, self._markers)
            if at >= 0:
                content += self._content(buf[:at])
                self._filler = ""
                self._buf = buf[at:]
                self._in_call = True
                continue
            if final:
                break
            hold = held_suffix(buf, self._markers)
            content += self._content(buf[: len(buf) - hold])
            self._buf = buf[len(buf) - hold:] if hold else ""
            break
        return content, calls

    def _content(self, text: str) -> str:
        if not text:
            return ""
        text = self._filler + text
        body = text.rstrip(self.syntax.filler)
        self._filler = text[len(body):]
        if body:
            self._lead = False
        return body
