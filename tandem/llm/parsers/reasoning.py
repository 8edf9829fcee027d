"""Reasoning parsers for models that think between tags (`<think>` ... `</think>`).

`basic` and `qwen3` treat the output as thinking only when it opens with the start tag; `deepseek_r1`
forces it: everything before the end tag is thinking, with or without an opening tag (its chat
template puts the opening tag in the prompt). A prompt that itself ends with the start tag (a template
that opens the thinking block) starts every parser inside it.
"""

from __future__ import annotations

from enum import IntEnum

from tandem.llm.parsers.base import held_suffix


class Phase(IntEnum):
    BEFORE = 0  # the output may still open with the start tag
    THINKING = 1
    ANSWER = 2


class ThinkTags:
    """One request's stream: `feed(text)` -> (reasoning, content)."""

    __slots__ = ("start", "end", "phase", "thinking", "_buf", "_lead", "_trim")

    def __init__(self, start: str, end: str, *, forced: bool, prompt: str = "") -> None:
        self.start = start
        self.end = end
        opened = forced or prompt.rstrip().endswith(start)
        self.phase = Phase.THINKING if opened else Phase.BEFORE
        self.thinking = opened  # inside the block (for counting reasoning tokens)
        self._buf = ""
        self._lead = True  # nothing but whitespace yet: a start tag here opens (or repeats) the block
        self._trim = False  # the block just closed: whitespace before the answer is dropped

    def feed(self, text: str) -> tuple[str, str]:
        if self.phase is Phase.ANSWER:
            return "", self._answer(text)
        if not self._lead and not self._buf and self.end[0] not in text:
            return text, ""  # the common case: thinking text, no tag can be starting
        buf = self._buf + text
        if self._lead:
            stripped = buf.lstrip()
            if len(stripped) < len(self.start) and self.start.startswith(stripped):
                self._buf = buf  # the start tag may be arriving
                return "", ""
            self._lead = False
            if stripped.startswith(self.start):
                self.phase = Phase.THINKING
                self.thinking = True
                buf = stripped[len(self.start):]
            elif self.phase is Phase.BEFORE:
                self.phase = Phase.ANSWER
                self._buf = ""
                return "", buf
        i = buf.find(self.end)
        if i >= 0:
            self.phase = Phase.ANSWER
            self.thinking = False
            self._buf = ""
            self._trim = True
            return buf[:i], self._answer(buf[i + len(self.end):])
        hold = held_suffix(buf, (self.end,))
        self._buf = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], ""

    @property
    def over(self) -> bool:
        """The answer has begun and nothing is held: the rest of the output is answer as it is."""
        return self.phase is Phase.ANSWER and not self._trim

    def _answer(self, text: str) -> str:
        if self._trim:
            text = text.lstrip()
            self._trim = not text
        return text

    def finish(self) -> tuple[str, str]:
        """End of output: text held for a possible tag is what it was (thinking, or answer)."""
        buf, self._buf = self._buf, ""
        if self.phase is Phase.THINKING:
            return buf, ""
        return "", buf
