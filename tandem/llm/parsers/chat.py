"""One request's output parsing: thinking first, then tool calls in what remains, or the calls that
`tool_choice` forced through guided decoding."""

from __future__ import annotations

from tandem.llm.parsers.base import ParsedDelta, ToolCall, ToolCallDelta, call_id, json_call, loads
from tandem.llm.parsers.harmony import HarmonyStream
from tandem.llm.parsers.reasoning import ThinkTags
from tandem.llm.parsers.tools import ToolCallStream


class ForcedCalls:
    """Output constrained by `tool_choice`. A named function: the whole output is its arguments (the
    call's header goes first, then the text as argument fragments). `required`: the output is a JSON
    list of `{"name", "parameters"}`, taken when the output ends."""

    __slots__ = ("name", "_buf", "_opened")

    def __init__(self, name: str | None) -> None:
        self.name = name
        self._buf = ""
        self._opened = False

    def feed(self, text: str, out: ParsedDelta, parser: ChatParser) -> None:
        if self.name is None:
            self._buf += text
            return
        if not self._opened and text:
            self._opened = True
            parser.add_call(ToolCall(self.name, ""), out)
        if text:
            out.tool_calls.append(ToolCallDelta(parser.calls - 1, text))

    def finish(self, out: ParsedDelta, parser: ChatParser) -> None:
        if self.name is not None:
            if not self._opened:
                self._opened = True
                parser.add_call(ToolCall(self.name, "{}"), out)
            return
        value = loads(self._buf)
        calls = [json_call(item) for item in value] if isinstance(value, list) else [None]
        if not calls or any(c is None for c in calls):
            out.content += self._buf  # not what the schema allows (cut off by max_tokens): as text
            return
        for call in calls:
            parser.add_call(call, out)  # type: ignore[arg-type]


class ChatParser:
    """`feed(text)` per detokenized delta -> `ParsedDelta`; `finish()` at the end of the output."""

    __slots__ = ("thinking_tags", "tools", "harmony", "forced", "calls", "max_calls", "thinking")

    def __init__(self, *, thinking: ThinkTags | None = None, tools: ToolCallStream | None = None,
                 harmony: HarmonyStream | None = None, forced: ForcedCalls | None = None,
                 max_calls: int | None = None) -> None:  # fmt: skip
        self.thinking_tags = thinking
        self.tools = tools
        self.harmony = harmony
        self.forced = forced
        self.calls = 0  # tool calls begun so far
        self.max_calls = max_calls  # parallel_tool_calls false: the first call only
        # The output is inside its thinking (for counting reasoning tokens); kept current by feed.
        self.thinking = bool(thinking and thinking.thinking)

    @property
    def calls_finish(self) -> bool:
        """Calls made end the answer with finish_reason tool_calls (a named tool_choice ends with stop,
        as OpenAI's does)."""
        return self.calls > 0 and not (self.forced is not None and self.forced.name is not None)

    def add_call(self, call: ToolCall, out: ParsedDelta) -> None:
        """A call's header, then its arguments as one fragment (when it has any yet)."""
        if self.max_calls is not None and self.calls >= self.max_calls:
            return
        index = self.calls
        self.calls += 1
        out.tool_calls.append(ToolCallDelta(index, "", call_id(), call.name))
        if call.arguments:
            out.tool_calls.append(ToolCallDelta(index, call.arguments))

    def feed(self, text: str) -> ParsedDelta:
        if self.harmony is not None:
            reasoning, content, calls = self.harmony.feed(text)
            self.thinking = self.harmony.thinking
        elif self.thinking_tags is not None:
            reasoning, content = self.thinking_tags.feed(text)
            self.thinking = self.thinking_tags.thinking
            calls = []
        else:
            reasoning, content, calls = "", text, []
        if not content and not calls:
            return ParsedDelta(reasoning=reasoning)
        return self._parsed(reasoning, content, calls, final=False)

    def finish(self) -> ParsedDelta:
        if self.harmony is not None:
            reasoning, content, calls = self.harmony.finish()
        else:
            reasoning, content = self.thinking_tags.finish() if self.thinking_tags else ("", "")
            calls = []
        return self._parsed(reasoning, content, calls, final=True)

    def _parsed(self, reasoning: str, content: str, calls: list[ToolCall], final: bool) -> ParsedDelta:
        out = ParsedDelta(reasoning=reasoning)
        if self.forced is not None:
            self.forced.feed(content, out, self)
            if final:
                self.forced.finish(out, self)
            return out
        if self.tools is not None:
            content, found = self.tools.feed(content) if content else ("", [])
            calls = calls + found
            if final:
                tail, more = self.tools.finish()
                content, calls = content + tail, calls + more
        out.content = content
        for call in calls:
            self.add_call(call, out)
        return out
