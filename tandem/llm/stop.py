"""Stop strings over streamed text, with Dynamo's "jail".

Text that could be the start of a stop string is held back until it either completes a stop
string (the stream stops there) or can no longer match (it is released). The first stop string to
*complete* wins (for two ending at the same place, the longer one), so the result does not depend on
how the text was split into pieces.
"""

from __future__ import annotations


class StopStringMatcher:
    __slots__ = ("stops", "include", "_prefixes", "_last_chars", "_max_hold", "_held", "_frozen", "matched")

    def __init__(self, stops: list[str] | tuple[str, ...], include_stop_str_in_output: bool = False) -> None:
        # Longest first, so that among stops ending at the same place the longer one wins.
        self.stops: tuple[str, ...] = tuple(sorted({s for s in stops if s}, key=len, reverse=True))
        self.include = include_stop_str_in_output
        # Every proper prefix of every stop string: the held-back suffix must be one of them.
        self._prefixes = frozenset(s[:i] for s in self.stops for i in range(1, len(s)))
        self._last_chars = frozenset(p[-1] for p in self._prefixes)
        self._max_hold = max((len(s) - 1 for s in self.stops), default=0)
        self._held = ""
        # How many leading characters of the held text arrived with detect=False: a stop string
        # must end after them (a stop that was complete before min_tokens does not count).
        self._frozen = 0
        self.matched: str | None = None

    @property
    def held(self) -> str:
        """Text held back because it may be the start of a stop string."""
        return self._held

    def feed(self, text: str, detect: bool = True) -> tuple[str, str | None]:
        """Add text; return (text safe to emit now, the stop string matched or None).

        With `detect=False` (e.g. before min_tokens) complete stop strings are not acted on, but a
        trailing partial one is still held so that it can complete once detection is on.
        """
        if self.matched is not None:
            return "", self.matched
        if not self.stops:
            return text, None
        s = self._held + text if self._held else text
        if not s:
            return "", None
        frozen = self._frozen
        if detect:
            best_end = -1
            best_stop = ""
            for stop in self.stops:
                i = s.find(stop, max(0, frozen - len(stop) + 1)) if frozen else s.find(stop)
                if i >= 0:
                    end = i + len(stop)
                    if best_end < 0 or end < best_end:
                        best_end, best_stop = end, stop
            if best_end >= 0:
                self._held = ""
                self.matched = best_stop
                return (s[:best_end] if self.include else s[: best_end - len(best_stop)]), best_stop
        # Hold back the longest suffix that is a proper prefix of some stop string.
        hold = 0
        if s[-1] in self._last_chars:
            prefixes = self._prefixes
            for k in range(min(len(s), self._max_hold), 0, -1):
                if s[-k:] in prefixes:
                    hold = k
                    break
        if hold:
            self._held = s[-hold:]
            if not detect:
                self._frozen = hold
            elif frozen:
                self._frozen = max(0, frozen - (len(s) - hold))
            return s[:-hold], None
        self._held = ""
        self._frozen = 0
        return s, None

    def flush(self) -> str:
        """End of stream: release the held-back text (nothing after a match)."""
        held = self._held
        self._held = ""
        self._frozen = 0
        return "" if self.matched is not None else held
