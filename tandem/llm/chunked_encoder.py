"""Prompt tokenization that reuses the tokens of text seen before.

Multi-turn chats and agents resend the same long prefix every turn; tokenizing 7k tokens costs tens of
milliseconds of CPU here. Byte-level BPE tokenizers (GPT-2 style regex pre-tokenizer, no normalizer)
never let a pre-token run from a non-space character into a following space, and their regexes look
neither behind nor past the next character. So at any *safe boundary* (a space preceded by a
non-whitespace character) the text can be cut and both sides tokenized alone with the same result.

`ChunkedEncoder` cuts the text at the first safe boundary after every `chunk_chars` characters. The cuts
depend only on the text before them, so two prompts sharing a prefix share its chunks; each chunk's ids
are cached (LRU), and only the new tail is tokenized. It is enabled only for tokenizers of that family,
and only after a self-check on tricky text gives exactly the plain encoding.
"""

from __future__ import annotations

import json
import threading
from array import array
from collections import OrderedDict
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

# Text that stresses the boundary rule: runs of mixed whitespace, punctuation, digits, contractions,
# non-Latin scripts, emoji, and text glued to special tokens.
_SELF_CHECK_UNITS = (
    "Hello", " world", "  two  spaces", "\n\nnew paragraph", " \t tab", "it's", " don't", " 12345", " 3.14159",
    "!?", " (paren)", ' "quoted"', " naïve café", " 東京タワー", " Привет", " 🙂🙃", " a\r\nb", " x\n \ny",
    " end.", "    indented", " ---", " /path/to/file.py", " user@example.com", " $100",
)


def _uses_safe_pre_tokenizer(tokenizer: _HFTokenizer) -> bool:
    """ByteLevel pre-tokenization (its own GPT-2 regex, or a Split regex before it), no normalizer, and
    no added token that strips neighbouring whitespace or contains any."""
    if tokenizer.normalizer is not None or tokenizer.pre_tokenizer is None:
        return False
    try:
        state = json.loads(tokenizer.pre_tokenizer.__getstate__())
    except (AttributeError, TypeError, ValueError):
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


class ChunkedEncoder:
    """`encode(text)` equals `tokenizer.encode(text, add_special_tokens=False).ids`; long texts reuse
    cached chunks. Thread-safe (the frontend tokenizes long prompts off the event loop)."""

    def __init__(self, tokenizer: _HFTokenizer, *, chunk_chars: int = 2048, capacity: int = 4096) -> None:
        self._tok = tokenizer
        self.chunk_chars = chunk_chars
        self.capacity = capacity
        self._cache: OrderedDict[str, array[int]] = OrderedDict()
        self._lock = threading.Lock()
        # None until the first long text: the self-check costs tens of milliseconds
        self.enabled: bool | None = None if _uses_safe_pre_tokenizer(tokenizer) else False
        self.hits = 0
        self.misses = 0

    def _plain(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def _self_check(self) -> bool:
        added = [t.content for t in self._tok.get_added_tokens_decoder().values()][:4]
        units = [*_SELF_CHECK_UNITS, *added, *(f" {t}" for t in added)]
        text = "".join(units[(i * 7) % len(units)] for i in range(len(units) * 3))
        safe = [p for p in range(1, len(text)) if text[p] == " " and not text[p - 1].isspace()]
        expected = self._plain(text)
        return all(self._plain(text[:p]) + self._plain(text[p:]) == expected for p in safe[::max(len(safe) // 48, 1)])

    def chunks(self, text: str) -> list[str]:
        """`text` cut at the first safe boundary after every `chunk_chars` characters."""
        out = []
        start = 0
        while len(text) - start > self.chunk_chars:
            cut = text.find(" ", start + self.chunk_chars)
            while cut > 0 and text[cut - 1].isspace():
                cut = text.find(" ", cut + 1)
            if cut <= 0:
                break
            out.append(text[start:cut])
            start = cut
        out.append(text[start:])
        return out

    def encode(self, text: str) -> list[int]:
        if self.enabled is False or len(text) <= 2 * self.chunk_chars:
            return self._plain(text)
        if self.enabled is None:
            with self._lock:
                if self.enabled is None:
                    self.enabled = self._self_check()
            if not self.enabled:
                return self._plain(text)
        *prefix, tail = self.chunks(text)
        with self._lock:
            found = {c: self._cache.get(c) for c in prefix}
            for chunk, ids in found.items():
                if ids is not None:
                    self._cache.move_to_end(chunk)
        missing = [c for c, ids in found.items() if ids is None]
        encoded: list[Any] = self._tok.encode_batch([*missing, tail], add_special_tokens=False)
        new = {c: array("I", e.ids) for c, e in zip(missing, encoded, strict=False)}
        with self._lock:
            self.hits += len(found) - len(missing)
            self.misses += len(missing)
            for chunk, ids in new.items():
                self._cache[chunk] = ids
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        out: list[int] = []
        for chunk in prefix:
            out.extend(found[chunk] or new[chunk])
        out.extend(encoded[-1].ids)
        return out
