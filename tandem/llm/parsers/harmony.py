"""gpt-oss's harmony format, parsed from the token text (tool parser `harmony`, reasoning parser
`gpt_oss`).

An answer is a series of messages, each a header and a body:
`<|channel|>analysis<|message|>thinking<|end|>` then
`<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>`
or `...<|channel|>final<|message|>answer<|return|>`. The `analysis` channel is thinking, `final` (and
`commentary` without a recipient) is the answer, and a body addressed `to=functions.NAME` is a call.
`<|call|>` and `<|return|>` end the generation (they are the model's stop tokens), so a body may also
simply end with the output. A call opens when its header ends; its body streams as its arguments.

The `openai-harmony` package would parse the tokens themselves, but it fetches its vocabulary from the
internet on first use; parsing the text needs nothing but the tokenizer's special tokens kept in it.
"""

from __future__ import annotations

from enum import IntEnum

from tandem.llm.parsers.base import CallPiece, first_marker, held_suffix

_MESSAGE = "<|message|>"
_BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>", "<|channel|>")
_HEADER_STARTS = ("<|start|>", "<|channel|>")


class Part(IntEnum):
    OUTSIDE = 0  # between messages (or plain text before any header)
    HEADER = 1
    BODY = 2


class HarmonyStream:
    """One request's stream: `feed(text)` -> (reasoning, content, complete calls)."""

    __slots__ = ("calls_enabled", "reasoning_enabled", "part", "thinking", "_buf", "_header", "_route", "_args")

    def __init__(self, *, calls: bool, reasoning: bool) -> None:
        self.calls_enabled = calls
        self.reasoning_enabled = reasoning
        self.part = Part.OUTSIDE
        self._buf = ""
        self._header = ""
        self._route = "content"  # where the current body goes: content, reasoning or call
        self._args = False  # the current call's body has shown arguments
        self.thinking = False  # inside an analysis body (for counting reasoning tokens)

    def feed(self, text: str) -> tuple[str, str, list[CallPiece]]:
        self._buf += text
        out = self._run(final=False)
        self.thinking = self.part is Part.BODY and self._route == "reasoning"
        return out

    def finish(self) -> tuple[str, str, list[CallPiece]]:
        reasoning, content, calls = self._run(final=True)
        buf, self._buf = self._buf, ""
        if self.part is Part.BODY:
            r, c = self._emit(buf, calls)
            reasoning, content = reasoning + r, content + c
            self._end_body(calls)
        elif self.part is Part.HEADER:
            pass  # a header cut off: nothing of it is for the client
        else:
            content += buf
        return reasoning, content, calls

    def _run(self, final: bool) -> tuple[str, str, list[CallPiece]]:
        reasoning = content = ""
        calls: list[CallPiece] = []
        while self._buf:
            buf = self._buf
            if self.part is Part.HEADER:
                at = buf.find(_MESSAGE)
                if at < 0:
                    break
                self._open_body(self._header + buf[:at], calls)
                self._buf = buf[at + len(_MESSAGE):]
                continue
            markers = _BODY_ENDS if self.part is Part.BODY else _HEADER_STARTS
            at, marker = first_marker(buf, markers)
            if at < 0:
                if final:
                    break
                hold = held_suffix(buf, markers)
                r, c = self._emit(buf[: len(buf) - hold], calls)
                reasoning, content = reasoning + r, content + c
                self._buf = buf[len(buf) - hold:] if hold else ""
                break
            r, c = self._emit(buf[:at], calls)
            reasoning, content = reasoning + r, content + c
            if self.part is Part.BODY:
                self._end_body(calls)
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

    def _open_body(self, header: str, calls: list[CallPiece]) -> None:
        self.part = Part.BODY
        self._header = ""
        channel = header.split("<|channel|>")[-1].split("<|")[0].split()
        name = channel[0] if channel else ""
        recipient = next((w[3:] for w in header.replace("<|", " <|").split() if w.startswith("to=")), "")
        if recipient.startswith("functions.") and self.calls_enabled:
            self._route = "call"
            self._args = False
            calls.append(CallPiece("", recipient[len("functions."):]))
        elif name == "analysis" and self.reasoning_enabled:
            self._route = "reasoning"
        else:
            self._route = "content"

    def _emit(self, text: str, calls: list[CallPiece]) -> tuple[str, str]:
        """`text` of the current part: (reasoning, content); a call's body goes to `calls`."""
        if not text or self.part is not Part.BODY:
            return "", text if self.part is Part.OUTSIDE else ""
        if self._route == "reasoning":
            return text, ""
        if self._route == "content":
            return "", text
        if not self._args:
            text = text.lstrip()
            self._args = bool(text)
        if text:
            calls.append(CallPiece(text))
        return "", ""

    def _end_body(self, calls: list[CallPiece]) -> None:
        if self._route == "call" and not self._args:
            calls.append(CallPiece("{}"))  # a call without arguments
        self._route = "content"
