"""gpt-oss's harmony format, parsed from the token text (tool parser `harmony`, reasoning parser
`gpt_oss`).

An answer is a series of messages, each a header and a body:
`<|channel|>analysis<|message|>thinking<|end|>` then
`<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>`
or `...<|channel|>final<|message|>answer<|return|>`. The `analysis` channel is thinking, `final` (and
`commentary` without a recipient) is the answer, and a body addressed `to=functions.NAME` is a call.
`<|call|>` and `<|return|>` end the generation (they are the model's stop tokens), so a body may also
simply end with the output.

The `openai-harmony` package would parse the tokens themselves, but it fetches its vocabulary from the
internet on first use; parsing the text needs nothing but the tokenizer's special tokens kept in it.
"""

from __future__ import annotations

from enum import IntEnum

from tandem.llm.parsers.base import ToolCall, dumps, first_marker, held_suffix, loads

_MESSAGE = "<|message|>"
_BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>", "<|channel|>")
_HEADER_STARTS = ("<|start|>", "<|channel|>")


class Part(IntEnum):
    OUTSIDE = 0  # between messages (or plain text before any header)
    HEADER = 1
    BODY = 2


class HarmonyStream:
    """One request's stream: `feed(text)` -> (reasoning, content, complete calls)."""

    __slots__ = ("calls_enabled", "reasoning_enabled", "part", "thinking", "_buf", "_header", "_body", "_route")

    def __init__(self, *, calls: bool, reasoning: bool) -> None:
        self.calls_enabled = calls
        self.reasoning_enabled = reasoning
        self.part = Part.OUTSIDE
        self._buf = ""
        self._header = ""
        self._body = ""  # a call's body, held until it ends
        self._route = "content"  # where the current body goes: content, reasoning or call:NAME
        self.thinking = False  # inside an analysis body (for counting reasoning tokens)

    def feed(self, text: str) -> tuple[str, str, list[ToolCall]]:
        self._buf += text
        out = self._run(final=False)
        self.thinking = self.part is Part.BODY and self._route == "reasoning"
        return out

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        reasoning, content, calls = self._run(final=True)
        buf, self._buf = self._buf, ""
        if self.part is Part.BODY:
            r, c, call = self._emit(buf)
            reasoning, content = reasoning + r, content + c
            calls.extend(self._end_body(call_text=True))
        elif self.part is Part.HEADER:
            pass  # a header cut off: nothing of it is for the client
        else:
            content += buf
        return reasoning, content, calls

    def _run(self, final: bool) -> tuple[str, str, list[ToolCall]]:
        reasoning = content = ""
        calls: list[ToolCall] = []
        while self._buf:
            buf = self._buf
            if self.part is Part.HEADER:
                at = buf.find(_MESSAGE)
                if at < 0:
                    break
                self._open_body(self._header + buf[:at])
                self._buf = buf[at + len(_MESSAGE):]
                continue
            markers = _BODY_ENDS if self.part is Part.BODY else _HEADER_STARTS
            at, marker = first_marker(buf, markers)
            if at < 0:
                if final:
                    break
                hold = held_suffix(buf, markers)
                r, c, _ = self._emit(buf[: len(buf) - hold])
                reasoning, content = reasoning + r, content + c
                self._buf = buf[len(buf) - hold:] if hold else ""
                break
            r, c, _ = self._emit(buf[:at])
            reasoning, content = reasoning + r, content + c
            if self.part is Part.BODY:
                calls.extend(self._end_body(call_text=True))
            if marker in _HEADER_STARTS:
                self.part = Part.HEADER
                self._header = ""
                self._buf = buf[at + len(marker) if marker == "<|start|>" else at:]
            else:
                self.part = Part.OUTSIDE
                self._buf = buf[at + len(marker):]
        if self.part is Part.HEADER and self._buf and _MESSAGE not in self._buf:
            hold = held_suffix(self._buf, (_MESSAGE,))
            self._header += self._buf[: len(self._buf) - hold]
            self._buf = self._buf[len(self._buf) - hold:] if hold else ""
        return reasoning, content, calls

    def _open_body(self, header: str) -> None:
        self.part = Part.BODY
        self._header = ""
        self._body = ""
        channel = header.split("<|channel|>")[-1].split("<|")[0].split()
        name = channel[0] if channel else ""
        recipient = next((w[3:] for w in header.replace("<|", " <|").split() if w.startswith("to=")), "")
        if recipient.startswith("functions.") and self.calls_enabled:
            self._route = "call:" + recipient[len("functions."):]
        elif name == "analysis" and self.reasoning_enabled:
            self._route = "reasoning"
        else:
            self._route = "content"

    def _emit(self, text: str) -> tuple[str, str, None]:
        if not text or self.part is not Part.BODY:
            return "", text if self.part is Part.OUTSIDE else "", None
        if self._route == "reasoning":
            return text, "", None
        if self._route == "content":
            return "", text, None
        self._body += text
        return "", "", None

    def _end_body(self, call_text: bool) -> list[ToolCall]:
        route, body = self._route, self._body
        self._body = ""
        self._route = "content"
        if not route.startswith("call:") or not call_text:
            return []
        value = loads(body.strip())
        arguments = dumps(value) if isinstance(value, dict) else body.strip()
        return [ToolCall(route[5:], arguments or "{}")]
