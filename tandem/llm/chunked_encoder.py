"""Prompt tokenization that reuses the tokens of text seen before.

Multi-turn chats and agents resend the same long prefix every turn; tokenizing 7k tokens costs tens of
milliseconds of CPU here. Byte-level BPE tokenizers (GPT-2 style regex pre-tokenizer, no normalizer)
never let a pre-token run from a non-space character into a following space, nor from an ASCII letter
into a digit or back, and their regexes look neither behind nor past the next character. So at any
*safe boundary* (a space preceded by a non-whitespace character, or a switch between an ASCII letter
and an ASCII digit) the text can be cut and both sides tokenized alone with the same result.

`ChunkedEncoder` cuts the text at the first safe boundary after every `chunk_chars` characters. The cuts
depend only on the text before them, so two prompts sharing a prefix share its chunks; each chunk's ids
are cached (LRU), and only the new tail is tokenized. It is enabled only for tokenizers of that family,
and only after a self-check on tricky text gives exactly the plain encoding.
"""

from __future__ import annotations

import re
import sys
import threading
from array import array
from collections import OrderedDict

from tokenizers import Tokenizer as _HFTokenizer

from tandem.llm.piece_encoder import PieceEncoder, component_state

# Text that stresses the boundary rule: runs of mixed whitespace, punctuation, digits, contractions,
# non-Latin scripts, emoji, and text glued to special tokens.
_SELF_CHECK_UNITS = (
    "Hello", " world", "  two  spaces", "\n\nnew paragraph", " \t tab", "it's", " don't", " 12345", " 3.14159",
    "!?", " (paren)", ' "quoted"', " naïve café", " 東京タワー", " Привет", " 🙂🙃", " a\r\nb", " x\n \ny",
    " end.", "    indented", " ---", " /path/to/file.py", " user@example.com", " $100",
    "abc123", "x1y2z3", " v2.0", "I'm3", "'s9d", "COVID19vaccine", "½1a", "٣4b", "0xFF00aa", "QmFzZTY0IGJsb2I=",
)
# Where a text may be cut: a space after a non-space, or a switch between an ASCII letter and digit.
_BOUNDARY = re.compile(r"(?<=\S) |(?<=[A-Za-z])(?=[0-9])|(?<=[0-9])(?=[A-Za-z])")


def _uses_safe_pre_tokenizer(tokenizer: _HFTokenizer) -> bool:
    """ByteLevel pre-tokenization (its own GPT-2 regex, or a Split regex before it), no normalizer, and
    no added token that strips neighbouring whitespace or contains any."""
    if tokenizer.normalizer is not None or tokenizer.pre_tokenizer is None:
        return False
    state = component_state(tokenizer.pre_tokenizer)
    if state is None:
        return False
    parts = state.get("pretokenizers", [state]) if state.get("type") == "Sequence" else [state]
    types = [p.get("type") for p in parts]
    if types[-1:] != ["ByteLevel"] or any(t not in ("ByteLevel", "Split") for t in types):
        return False
    if any(p.get("add_prefix_space") for p in parts if p.get("type") == "ByteLevel"):
        return False
    for token in tokenizer.get_added_tokens_decoder().values():
        if token.lstrip or token.rstrip or token.single_word or any(c.isspace() for c in token.content):
            return False
    return True


class TooManyTokens(ValueError):
    """The text has more tokens than the caller's limit; encoding stopped once that was certain."""

    def __init__(self, limit: int, at_least: int) -> None:
        super().__init__(f"more than {limit} tokens (at least {at_least})")
        self.limit = limit
        self.at_least = at_least


def _check_limit(count: int, limit: int | None) -> None:
    if limit is not None and count > limit:
        raise TooManyTokens(limit, count)


class ChunkedEncoder:
    """`encode(text)` equals `tokenizer.encode(text, add_special_tokens=False).ids`; long texts reuse
    cached chunks and stop early past a token limit. Thread-safe (the frontend tokenizes long prompts off
    the event loop).

    Memory: encoding costs a few hundred bytes per token, so a long text is encoded a group of chunks at a
    time, and a text over the limit is refused after the first group that crosses it. The cache is bounded
    in bytes; a chunk far longer than `chunk_chars` (a run with no safe boundary) is never cached."""

    GROUP_CHUNKS = 8  # chunks encoded per batch: bounds the memory of one step to ~8 x chunk_chars of text

    def __init__(self, tokenizer: _HFTokenizer, *, chunk_chars: int = 2048,
                 capacity_bytes: int = 64 * 1024 * 1024) -> None:  # fmt: skip
        self._tok = tokenizer
        self.chunk_chars = chunk_chars
        self.capacity_bytes = capacity_bytes
        self.cached_bytes = 0
        self._cache: OrderedDict[str, array[int]] = OrderedDict()
        self._lock = threading.Lock()
        # None until the first long text: the self-check costs tens of milliseconds
        self.enabled: bool | None = None if _uses_safe_pre_tokenizer(tokenizer) else False
        self.hits = 0
        self.misses = 0
        self._pieces = PieceEncoder.for_tokenizer(tokenizer)

    def _encode_many(self, texts: list[str]) -> list[list[int]]:
        if self._pieces is not None:
            return [self._pieces.encode(text) for text in texts]
        # encode_batch_fast skips offsets: the same ids for about half the memory.
        fast = getattr(self._tok, "encode_batch_fast", None) or self._tok.encode_batch
        return [e.ids for e in fast(texts, add_special_tokens=False)]

    def _plain(self, text: str) -> list[int]:
        return self._encode_many([text])[0]

    def _self_check(self) -> bool:
        added = [t.content for t in self._tok.get_added_tokens_decoder().values()][:4]
        units = [*_SELF_CHECK_UNITS, *added, *(f" {t}" for t in added)]
        text = "".join(units[(i * 7) % len(units)] for i in range(len(units) * 3))
        safe = [m.start() for m in _BOUNDARY.finditer(text, 1)]
        expected = self._plain(text)
        return all(self._plain(text[:p]) + self._plain(text[p:]) == expected for p in safe[::max(len(safe) // 48, 1)])

    def chunks(self, text: str) -> list[str]:
        """`text` cut at the first safe boundary after every `chunk_chars` characters."""
        out = []
        start = 0
        while len(text) - start > self.chunk_chars:
            boundary = _BOUNDARY.search(text, start + self.chunk_chars)
            if boundary is None:
                break
            cut = boundary.start()
            out.append(text[start:cut])
            start = cut
        out.append(text[start:])
        return out

    def encode(self, text: str, limit: int | None = None) -> list[int]:
        """The ids of `text`; raises TooManyTokens once it is certain there are more than `limit`."""
        if self.enabled is None and len(text) > 2 * self.chunk_chars:
            with self._lock:
                if self.enabled is None:
                    self.enabled = self._self_check()
        if not self.enabled or len(text) <= 2 * self.chunk_chars:
            ids = self._plain(text)
            _check_limit(len(ids), limit)
            return ids
        pieces = self.chunks(text)
        out: list[int] = []
        for first in range(0, len(pieces), self.GROUP_CHUNKS):
            group = pieces[first:first + self.GROUP_CHUNKS]
            last_group = first + self.GROUP_CHUNKS >= len(pieces)
            out.extend(self._encode_group(group, cache_last=not last_group))
            _check_limit(len(out), limit)
        return out

    def _encode_group(self, group: list[str], *, cache_last: bool) -> list[int]:
        """The ids of consecutive chunks, from the cache where it has them. The text's final chunk is not
        cached: it is where the next turn of a conversation differs."""
        cacheable = group if cache_last else group[:-1]
        with self._lock:
            found = {c: self._cache.get(c) for c in cacheable}
            for chunk, ids in found.items():
                if ids is not None:
                    self._cache.move_to_end(chunk)
        missing = [c for c in group if found.get(c) is None]
        new = dict(zip(missing, self._encode_many(missing), strict=True))
        with self._lock:
            fresh = [c for c in cacheable if found[c] is None]
            self.hits += len(cacheable) - len(fresh)
            self.misses += len(fresh)
            for chunk in fresh:
                self._store(chunk, array("I", new[chunk]))
        out: list[int] = []
        for chunk in group:
            cached = found.get(chunk)
            out.extend(cached if cached is not None else new[chunk])
        return out

    def _store(self, chunk: str, ids: array[int]) -> None:
        """Cache one chunk's ids (the lock is held), evicting the least recently used past the byte bound."""
        if chunk in self._cache or len(chunk) > 8 * self.chunk_chars:
            return
        self._cache[chunk] = ids
        self.cached_bytes += _size(chunk, ids)
        while self.cached_bytes > self.capacity_bytes and self._cache:
            old, old_ids = self._cache.popitem(last=False)
            self.cached_bytes -= _size(old, old_ids)


def _size(chunk: str, ids: array[int]) -> int:
    return sys.getsizeof(chunk) + ids.itemsize * len(ids)
