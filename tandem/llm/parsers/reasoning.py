"""Reasoning parsers for models that think between tags (`<think>` ... `</think>`, `[THINK]` ...
`[/THINK]`, Granite's "Here is my thought process:" ... "Here is my response:").

Unforced parsers treat the output as thinking only when it opens with a start tag; forced ones
(`deepseek_r1` and the others whose templates open the block in the prompt) take everything before
the end tag as thinking, with or without an opening tag. A prompt that itself ends with a start tag
starts every parser inside the block.
"""

from __future__ import annotations

from enum import IntEnum

from tandem.llm.parsers.base import first_marker, held_suffix


class Phase(IntEnum):
    BEFORE = 0  # the output may still open with the start tag
    THINKING = 1
    ANSWER = 2


class ThinkTags:
    """One request's stream: `feed(text)` -> (reasoning, content). `starts` / `ends`: the tags that
    open / close the block (some families have two spellings)."""

    __slots__ = ("starts", "ends", "phase", "thinking", "_buf", "_lead", "_trim", "_end_chars")

    def __init__(self, starts: tuple[str, ...], ends: tuple[str, ...], *, forced: bool, prompt: str = "") -> None:
        self.starts = starts
        self.ends = ends
        self._end_chars = frozenset(e[0] for e in ends)  # text without these cannot hold an end tag
        opened = forced or prompt.rstrip().endswith(starts)
        self.phase = Phase.THINKING if opened else Phase.BEFORE
        self.thinking = opened  # inside the block (for counting reasoning tokens)
        self._buf = ""
        self._lead = True  # nothing but whitespace yet: a start tag here opens (or repeats) the block
        self._trim = False  # the block just closed: whitespace before the answer is dropped

    def feed(self, text: str) -> tuple[str, str]:
        if self.phase is Phase.ANSWER:
            return "", self._answer(text)
        if not self._lead and not self._buf and self._end_chars.isdisjoint(text):
            return text, ""  # the common case: thinking text, no tag can be starting
        buf = self._buf + text
        if self._lead:
            stripped = buf.lstrip()
            if any(len(stripped) < len(s) and s.startswith(stripped) for s in self.starts):
                self._buf = buf  # a start tag may be arriving
                return "", ""
            self._lead = False
            start = next((s for s in self.starts if stripped.startswith(s)), None)
            if start is not None:
                self.phase = Phase.THINKING
                self.thinking = True
                buf = stripped[len(start):]
            elif self.phase is Phase.BEFORE:
                self.phase = Phase.ANSWER
                self._buf = ""
                return "", buf
        i, end = first_marker(buf, self.ends)
        if i >= 0:
            self.phase = Phase.ANSWER
            self.thinking = False
            self._buf = ""
            self._trim = True
            return buf[:i], self._answer(buf[i + len(end):])
        hold = held_suffix(buf, self.ends)
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
