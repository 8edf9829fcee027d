"""Tool-call parsers for calls written as markup, each taken whole when it closes: parameters are text
between tags, typed by the tool's JSON schema (or, in DSML, by the tag's `string` attribute).

- `qwen3_coder` / `nemotron_nano`: `<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`
- `minimax_m2`: `<minimax:tool_call><invoke name="NAME"><parameter name="P">value</parameter></invoke></minimax:tool_call>`
- `deepseek_v3_2` / `deepseek_v4` (DSML): `<｜DSML｜function_calls>` (V4: `<｜DSML｜tool_calls>`) around
  `<｜DSML｜invoke name="NAME"><｜DSML｜parameter name="P" string="true|false">value</｜DSML｜parameter></｜DSML｜invoke>`
- `glm45` / `glm47`: `<tool_call>NAME<arg_key>P</arg_key><arg_value>value</arg_value></tool_call>`
- `gemma4`: `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:42,nested:{...}}<tool_call|>`
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from tandem.llm.parsers.base import ToolCall, dumps, loads
from tandem.llm.parsers.tools import CallSyntax, Taken, as_text


class MarkupCalls(CallSyntax):
    """Calls between `open` and `close` tags (several pairs may be given), parsed by `calls(text)`
    once the close tag has arrived; at the end of the output an unclosed call is parsed as it stands."""

    tags: tuple[tuple[str, str], ...] = ()

    def __init__(self, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        super().__init__(tools)
        self.markers = tuple(open_ for open_, _ in self.tags)

    def take(self, region: str, final: bool) -> Taken | None:
        close = next(c for o, c in self.tags if region.startswith(o))
        end = region.find(close)
        if end < 0 and not final:
            return None
        consumed = end + len(close) if end >= 0 else len(region)
        calls = self.calls(region[:consumed])
        return Taken(calls, consumed) if calls else as_text(region[:consumed])

    def calls(self, text: str) -> list[ToolCall]:
        raise NotImplementedError

    def schema(self, name: str) -> dict[str, Any]:
        """The JSON-schema properties of tool `name` ({} when unknown)."""
        for tool in self.tools:
            function = tool.get("function") or {}
            if function.get("name") == name:
                properties = (function.get("parameters") or {}).get("properties")
                return properties if isinstance(properties, dict) else {}
        return {}

    def call(self, name: str, params: list[tuple[str, str]]) -> ToolCall:
        """A call from its parameters' text, each typed by the tool's schema."""
        schema = self.schema(name)
        return ToolCall(name, dumps({key: typed(_trim_newline(value), schema.get(key)) for key, value in params}))


def typed(value: str, schema: Any) -> Any:
    """A parameter's text as the type its JSON schema gives (text that does not parse stays text)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
        return value
    text = value.strip()
    parsed = loads(text)
    if parsed is None and text != "null":
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        return value
    return parsed


def _trim_newline(value: str) -> str:
    """Templates put each value on its own line: one newline on each side is layout, not value."""
    if value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value


class Qwen3CoderCalls(MarkupCalls):
    tags = (("<tool_call>", "</tool_call>"), ("<function=", "</function>"))

    def calls(self, text: str) -> list[ToolCall]:
        calls = []
        for block in text.split("<function=")[1:]:
            head, sep, body = block.partition(">")
            name = head.strip()
            if not sep or not name:
                return []
            params = []
            for part in body.split("</function>")[0].split("<parameter=")[1:]:
                key, sep, value = part.partition(">")
                if not sep:
                    return []
                params.append((key.strip(), value.split("</parameter>")[0]))
            calls.append(self.call(name, params))
        return calls


_ATTR = r"""\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s>]+))"""


class InvokeCalls(MarkupCalls):
    """`<invoke name="NAME"><parameter name="P">value</parameter></invoke>`, with a prefix on every
    tag name (DSML's `｜DSML｜`); `typed_by_attr`: a parameter's `string="false"` attribute says its value
    is JSON (DSML), instead of the tool's schema."""

    prefix = ""
    typed_by_attr = False

    def __init__(self, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        super().__init__(tools)
        p = re.escape(self.prefix)
        self._invoke = re.compile(rf"<{p}invoke\s+name{_ATTR}\s*>(.*?)(?:</{p}invoke>|(?=<{p}invoke\s)|$)", re.S)
        self._param = re.compile(rf"<{p}parameter\s+name{_ATTR}((?:\s+\w+{_ATTR})*)\s*>(.*?)(?:</{p}parameter>|$)",
                                 re.S)
        self._string_attr = re.compile(rf"string{_ATTR}")

    def calls(self, text: str) -> list[ToolCall]:
        calls = []
        for m in self._invoke.finditer(text):
            name = next(g for g in m.groups()[:3] if g is not None).strip()
            if not name:
                return []
            params: list[tuple[str, str]] = []
            values: dict[str, Any] = {}
            for p in self._param.finditer(m.group(4)):
                key = next(g for g in p.groups()[:3] if g is not None)
                value = p.groups()[-1]
                string = self._string_attr.search(p.group(4) or "")
                if self.typed_by_attr and string is not None:
                    flag = next(g for g in string.groups() if g is not None)
                    values[key] = value if flag == "true" else _json_or_text(value)
                else:
                    params.append((key, value))
            call = self.call(name, params)
            if values:
                call = ToolCall(name, dumps({**(loads(call.arguments) or {}), **values}))
            calls.append(call)
        return calls


def _json_or_text(value: str) -> Any:
    parsed = loads(value.strip())
    return value if parsed is None and value.strip() != "null" else parsed


class MinimaxCalls(InvokeCalls):
    tags = (("<minimax:tool_call>", "</minimax:tool_call>"),)


class DsmlCalls(InvokeCalls):
    prefix = "｜DSML｜"
    typed_by_attr = True
    tags = (("<｜DSML｜function_calls>", "</｜DSML｜function_calls>"),)


class DsmlV4Calls(DsmlCalls):
    tags = (("<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"),)


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|$)", re.S)


class GlmCalls(MarkupCalls):
    tags = (("<tool_call>", "</tool_call>"),)

    def calls(self, text: str) -> list[ToolCall]:
        calls = []
        for block in text.split("<tool_call>")[1:]:
            block = block.split("</tool_call>")[0]
            name = block.split("<arg_key>")[0].strip()
            if not name or "<" in name:
                return []
            calls.append(self.call(name, [(k.strip(), v) for k, v in _GLM_ARG.findall(block)]))
        return calls


_GEMMA_QUOTE = '<|"|>'


class Gemma4Calls(MarkupCalls):
    tags = (("<|tool_call>", "<tool_call|>"),)

    def calls(self, text: str) -> list[ToolCall]:
        calls = []
        for block in text.split("<|tool_call>")[1:]:
            body = block.split("<tool_call|>")[0].strip()
            body = body.removeprefix("call").lstrip(":").strip()
            brace = body.find("{")
            name = body[:brace].strip() if brace >= 0 else body
            if not name or brace < 0:
                return []
            arguments = _gemma_value(body[brace:])
            if not isinstance(arguments, dict):
                return []
            calls.append(ToolCall(name, dumps(arguments)))
        return calls


def _gemma_value(text: str) -> Any:
    """Gemma 4's argument notation (bare keys, strings between `<|"|>` marks) as JSON data; None if it
    does not read. Strings are lifted out first, so marks inside them cannot confuse the rest."""
    strings: list[str] = []

    def lift(m: re.Match[str]) -> str:
        strings.append(m.group(1))
        return f'"\\u0000{len(strings) - 1}"'

    shaped = re.sub(re.escape(_GEMMA_QUOTE) + "(.*?)" + re.escape(_GEMMA_QUOTE), lift, text, flags=re.S)
    if _GEMMA_QUOTE in shaped:  # an unclosed string: cut off
        shaped = shaped.split(_GEMMA_QUOTE)[0]
    shaped = re.sub(r'([{,]\s*)([A-Za-z_][\w.\-]*)\s*:', r'\1"\2":', shaped)  # bare keys
    value = loads(shaped)
    if value is None:
        return None

    def restore(v: Any) -> Any:
        if isinstance(v, str) and v.startswith("\u0000"):
            return strings[int(v[1:])]
        if isinstance(v, dict):
            return {k: restore(x) for k, x in v.items()}
        if isinstance(v, list):
            return [restore(x) for x in v]
        return v

    return restore(value)
