"""The one machine every marked-up tool-call syntax runs on (`tools.py` has the syntaxes): outside a call,
text streams at once, except an end of it that may be the beginning of a start marker; from a start marker
on, the syntax's `Cursor` reads the call as it arrives."""

from __future__ import annotations

from tandem.llm.parsers.base import CallPiece, first_marker, held_suffix
from tandem.llm.parsers.tools import CallSyntax, Cursor


class ToolCallStream:
    """One request's stream through a `CallSyntax`: `feed(text)` -> (content, call pieces).

    Whitespace (the syntax's filler) at the end of the content is held until more content follows:
    around calls it is dropped, so an answer that is only calls has no content."""

    __slots__ = ("syntax", "_buf", "_cursor", "_lead", "_filler", "_any_call", "_markers", "_starts", "_leading")

    def __init__(self, syntax: CallSyntax) -> None:
        self.syntax = syntax
        self._markers = syntax.markers
        self._starts = frozenset(m[0] for m in syntax.markers)  # text without these cannot hold a marker
        self._leading = bool(syntax.leading)
        self._buf = ""
        self._cursor: Cursor | None = None  # inside a call text
        self._lead = True  # only filler since the output began or the last call ended
        self._filler = ""
        self._any_call = False

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        if self._cursor is None and not self._buf and not (self._lead and self._leading) \
                and self._starts.isdisjoint(text):
            return self._content(text), []  # the common case: plain text, nothing held
        self._buf += text
        return self._run(final=False)

    def finish(self) -> tuple[str, list[CallPiece]]:
        content, pieces = self._run(final=True)
        if self._buf:
            content += self._content(self._buf)
            self._buf = ""
        if self._filler and not self._any_call:
            content += self._filler
        self._filler = ""
        return content, pieces

    def _run(self, final: bool) -> tuple[str, list[CallPiece]]:
        content = ""
        pieces: list[CallPiece] = []
        syntax = self.syntax
        while self._buf:
            if self._cursor is not None:
                advance = self._cursor.advance(self._buf, final)
                if advance.pieces:
                    pieces.extend(advance.pieces)
                    self._any_call = True
                    self._filler = ""
                if advance.consumed is None:
                    break
                self._buf = self._buf[advance.consumed:]
                self._cursor = None
                if advance.text:
                    content += self._content(advance.text)
                else:
                    self._lead = True
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
                    self._cursor = syntax.cursor(body)
                    continue
            at, _ = first_marker(buf, self._markers)
            if at >= 0:
                content += self._content(buf[:at])
                self._filler = ""
                self._buf = buf[at:]
                self._cursor = syntax.cursor(self._buf)
                continue
            if final:
                break
            hold = held_suffix(buf, self._markers)
            content += self._content(buf[: len(buf) - hold])
            self._buf = buf[len(buf) - hold:] if hold else ""
            break
        return content, pieces

    def _content(self, text: str) -> str:
        if not text:
            return ""
        text = self._filler + text
        body = text.rstrip(self.syntax.filler)
        self._filler = text[len(body):]
        if body:
            self._lead = False
        return body
