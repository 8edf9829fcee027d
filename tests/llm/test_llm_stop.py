"""tandem.llm.stop.StopStringMatcher: jailing partial stop strings over streamed text."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.llm.stop import StopStringMatcher


def run(matcher: StopStringMatcher, pieces: list[str]) -> tuple[list[str], str | None]:
    out: list[str] = []
    matched = None
    for piece in pieces:
        text, m = matcher.feed(piece)
        out.append(text)
        if m is not None:
            matched = m
    out.append(matcher.flush())
    return out, matched


def test_no_stops_passes_through() -> None:
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", None)
    assert m.flush() == ""
    m = StopStringMatcher(["", ""])  # empty stop strings are ignored
    assert m.stops == ()
    assert m.feed("abc") == ("abc", None)


def test_stop_across_feeds() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("Hello S") == ("Hello ", None)
    assert m.held == "S"
    assert m.feed("T") == ("", None)
    assert m.feed("O") == ("", None)
    assert m.feed("P and more") == ("", "STOP")
    assert m.feed("ignored") == ("", "STOP")
    assert m.flush() == ""


def test_stop_across_feeds_included() -> None:
    m = StopStringMatcher(["STOP"], include_stop_str_in_output=True)
    assert m.feed("Hello ST") == ("Hello ", None)
    assert m.feed("OP!!") == ("STOP", "STOP")
    assert m.feed("x") == ("", "STOP")


def test_partial_prefix_released() -> None:
    m = StopStringMatcher(["\n\nUser:"])
    assert m.feed("line\n") == ("line", None)
    assert m.feed("\nUs") == ("", None)
    assert m.held == "\n\nUs"
    assert m.feed("ually") == ("\n\nUsually", None)
    assert m.held == ""
    # Released only as far as it cannot match: a new partial start stays held.
    assert m.feed("ok\n\n") == ("ok", None)
    assert m.feed("\n") == ("\n", None)  # "\n\n\n": the first newline can no longer start a match
    assert m.held == "\n\n"
    assert m.flush() == "\n\n"


def test_overlapping_self_prefix() -> None:
    m = StopStringMatcher(["aab"])
    assert m.feed("a") == ("", None)
    assert m.feed("a") == ("", None)
    assert m.feed("a") == ("a", None)  # "aaa": the first "a" can no longer start "aab"
    assert m.feed("b") == ("", "aab")


def test_one_stop_prefix_of_another() -> None:
    # "ab" completes before "abc" could: the first stop to complete wins.
    m = StopStringMatcher(["abc", "ab"])
    assert m.feed("xa") == ("x", None)
    assert m.feed("bc") == ("", "ab")
    m = StopStringMatcher(["abc", "ab"])
    assert m.feed("xabc") == ("x", "ab")
    # Two stops ending at the same place: the longer one.
    m = StopStringMatcher(["bc", "abc"], include_stop_str_in_output=True)
    assert m.feed("xab") == ("x", None)
    assert m.feed("cd") == ("abc", "abc")
    # A short stop inside a long one: it completes first.
    m = StopStringMatcher(["hello world", "lo"])
    assert run(m, ["hel", "lo world"]) == (["", "hel", ""], "lo")


def test_multiple_stops_earliest_wins() -> None:
    m = StopStringMatcher(["END", "###"])
    assert m.feed("a ### b END") == ("a ", "###")


def test_unicode() -> None:
    m = StopStringMatcher(["世界"])
    assert m.feed("你好世") == ("你好", None)
    assert m.feed("界!") == ("", "世界")


def test_detect_false_holds_but_does_not_match() -> None:
    m = StopStringMatcher(["ab"])
    assert m.feed("xab", detect=False) == ("xab", None)  # complete before detection: not a stop
    assert m.feed("a", detect=False) == ("", None)  # a partial one is held...
    assert m.feed("b") == ("", "ab")  # ...and completes once detection is on
    # A stop that was completely inside held text before detection does not count.
    m = StopStringMatcher(["abc", "b"])
    assert m.feed("ab", detect=False) == ("", None)
    assert m.feed("x") == ("abx", None)
    assert m.feed("b") == ("", "b")


def reference(text: str, stops: list[str], include: bool, detect_from: int = 0) -> str:
    """The text cut where the first stop string completes (the longer one on a tie), only counting
    stops that end after `detect_from` characters."""
    stops = [s for s in stops if s]
    for end in range(detect_from + 1, len(text) + 1):
        hits = [s for s in stops if text.endswith(s, 0, end)]
        if hits:
            stop = max(hits, key=len)
            return text[:end] if include else text[: end - len(stop)]
    return text


alphabet = st.sampled_from("ab c\n世")


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet, max_size=40),
    stops=st.lists(st.text(alphabet, max_size=5), max_size=4),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=12),
    include=st.booleans(),
)
def test_property_matches_reference(text: str, stops: list[str], cuts: list[int], include: bool) -> None:
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[i:j] for i, j in zip([0, *points], [*points, len(text)], strict=True)]
    m = StopStringMatcher(stops, include_stop_str_in_output=include)
    longest = max((len(s) for s in stops), default=0)
    out = []
    for piece in pieces:
        out.append(m.feed(piece)[0])
        assert len(m.held) < max(longest, 1)  # never holds more than a stop string's worth
    out.append(m.flush())
    assert "".join(out) == reference(text, stops, include)


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet, max_size=40),
    stops=st.lists(st.text(alphabet, max_size=5), max_size=4),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=12),
    suppressed=st.integers(min_value=0, max_value=13),
    include=st.booleans(),
)
def test_property_detection_switched_on_later(
    text: str, stops: list[str], cuts: list[int], suppressed: int, include: bool
) -> None:
    """The first `suppressed` pieces are fed with detect=False (before min_tokens)."""
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[i:j] for i, j in zip([0, *points], [*points, len(text)], strict=True)]
    m = StopStringMatcher(stops, include_stop_str_in_output=include)
    out = [m.feed(piece, detect=i >= suppressed)[0] for i, piece in enumerate(pieces)]
    out.append(m.flush())
    detect_from = sum(len(p) for p in pieces[:suppressed])
    assert "".join(out) == reference(text, stops, include, detect_from)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet, max_size=30),
    stops=st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_property_char_by_char_equals_one_feed(text: str, stops: list[str]) -> None:
    a, ma = run(StopStringMatcher(stops), list(text))
    b, mb = run(StopStringMatcher(stops), [text])
    assert "".join(a) == "".join(b)
    assert ma == mb
