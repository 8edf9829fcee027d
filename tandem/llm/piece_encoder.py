"""Prompt tokenization for GPT-2-style byte-level BPE tokenizers, piece by piece, in Python.

`tokenizers` spends most of a short prompt's encoding in its pre-tokenizer's regex (Oniguruma, with
Unicode classes): ~75 µs for a 40-token chat prompt on this project's CPU machine, ~0.4 µs a character
for long ones. Byte-level BPE cuts the text into pieces with that one regex and runs BPE on every piece
alone, so a piece's ids never depend on its neighbours. For ASCII text the regex needs no Unicode class,
and Python's `re` cuts it into the same pieces; each piece's ids come from the tokenizer's own BPE model
(`model.tokenize`) and are remembered per piece, so a prompt costs one `re` scan and a dict lookup a piece.

Added tokens (`<|im_start|>`, ...) are cut out first, as `tokenizers` does; text between them that is
not ASCII is handed to `tokenizers` whole, which encodes it exactly as it would inside the prompt.
Used only for tokenizers of exactly that shape (ByteLevel pre-tokenizer with its own regex, no
normalizer, BPE without dropout, added tokens that strip nothing) and after a self-check.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models

# The byte-level pre-tokenizer's pattern ('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|
# \s+(?!\S)|\s+) over ASCII: letters [A-Za-z], digits [0-9], and Unicode White_Space, which in ASCII is
# tab to carriage return and space (not \x1c-\x1f, which Python's \s would take).
_WS = r"\t\n\x0b\x0c\r "
_ASCII_PIECES = re.compile(
    rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+|[{_WS}]+(?![^{_WS}])|[{_WS}]+")
# Pieces longer than this are encoded each time, not remembered (a long run of digits or symbols).
_MAX_CACHED_CHARS = 64
_MAX_CACHED_PIECES = 1 << 17
# BPE of a new piece alone costs ~1.5x what `tokenizers` spends per piece of a whole text: a text whose
# pieces are mostly new, past this many, goes to `tokenizers` whole and is not remembered.
_NEW_PIECES_ALONE = 64

_SELF_CHECK = ("<|im_start|>system\nYou are terse.<|im_end|>\n it's  two  spaces\t\ttabs \n\n  x\r\ny's 'S"
               " don't I'll we've 1234567 3.14 v2.0 x1y2 $100 (a) [b] {c} \"q\" a--b ... !!! ?? \x00\x1c\x1f\x7f"
               " /path/to/file.py user@example.com    end   \n")


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the printable character that stands for it."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()
_ASCII_TO_BYTE_LEVEL = {b: c for b, c in BYTE_LEVEL_ALPHABET.items() if b < 128}


def component_state(component: Any) -> dict[str, Any] | None:
    """A tokenizer component's settings (its JSON state), or None if it has none to read."""
    try:
        state = json.loads(component.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def _splitter(contents: list[str]) -> re.Pattern[str] | None:
    """Cuts a text at these added tokens, leftmost and longest first (as `tokenizers` matches them), keeping
    each token as its own item between the texts."""
    if not contents:
        return None
    return re.compile("(" + "|".join(re.escape(c) for c in sorted(contents, key=len, reverse=True)) + ")")


class PieceEncoder:
    """`encode(text)` equals `tokenizer.encode(text, add_special_tokens=False).ids`. Thread-safe."""

    def __init__(self, tokenizer: _HFTokenizer) -> None:
        self._tok = tokenizer
        bpe = _HFTokenizer(tokenizer.model)
        # encode_batch_fast skips offsets (tokenizers >= 0.21)
        self._bpe_fast = getattr(bpe, "encode_batch_fast", None) or bpe.encode_batch
        added = tokenizer.get_added_tokens_decoder()
        self._added_ids = {token.content: token_id for token_id, token in added.items()}
        # `tokenizers` cuts at the added tokens matched on the raw text first, then at those matched on the
        # normalized text (the same text here: there is no normalizer).
        self._splitters = [s for s in (_splitter([t.content for t in added.values() if not t.normalized]),
                                       _splitter([t.content for t in added.values() if t.normalized])) if s]
        self._pieces: dict[str, list[int]] = {}

    @classmethod
    def for_tokenizer(cls, tokenizer: _HFTokenizer) -> PieceEncoder | None:
        """A PieceEncoder if the tokenizer has the shape it reproduces and the self-check agrees, else None."""
        pre = component_state(tokenizer.pre_tokenizer) if tokenizer.pre_tokenizer is not None else None
        if pre is not None and pre.get("type") == "Sequence" and len(pre.get("pretokenizers") or ()) == 1:
            pre = pre["pretokenizers"][0]
        model = tokenizer.model  # (its state would be the whole vocabulary as JSON: its attributes instead)
        if (tokenizer.normalizer is not None or pre is None
                or pre.get("type") != "ByteLevel" or pre.get("add_prefix_space") or not pre.get("use_regex", True)
                or not isinstance(model, models.BPE) or model.dropout is not None
                or getattr(tokenizer, "encode_special_tokens", False)):
            return None
        if any(t.lstrip or t.rstrip or t.single_word for t in tokenizer.get_added_tokens_decoder().values()):
            return None
        encoder = cls(tokenizer)
        added = list(encoder._added_ids)[:4]
        check = _SELF_CHECK + "".join(f"{a} x{a}\n{a}" for a in added)
        if encoder.encode(check) != tokenizer.encode(check, add_special_tokens=False).ids:
            return None
        return encoder

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        self._encode_into(text, 0, out)
        return out

    def _encode_into(self, text: str, level: int, out: list[int]) -> None:
        if level < len(self._splitters):
            parts = self._splitters[level].split(text)
            for i, part in enumerate(parts):
                if i & 1:  # an added token
                    out.append(self._added_ids[part])
                elif part:
                    self._encode_into(part, level + 1, out)
            return
        if not text.isascii():
            out.extend(self._tok.encode(text, add_special_tokens=False).ids)
            return
        pieces = _ASCII_PIECES.findall(text)
        known = self._pieces
        start = len(out)
        try:
            for piece in pieces:
                out.extend(known[piece])
        except KeyError:  # new pieces: encoded together, then the text again
            del out[start:]
            missing = list(dict.fromkeys(p for p in pieces if p not in known))
            if len(missing) > _NEW_PIECES_ALONE and 2 * len(missing) > len(pieces):
                # mostly unseen pieces (random identifiers, encoded data): `tokenizers` does it cheaper whole
                out.extend(self._tok.encode(text, add_special_tokens=False).ids)
                return
            new = self._encode_new(missing)
            for piece in pieces:
                ids = known.get(piece)
                out.extend(ids if ids is not None else new[piece])

    def _encode_new(self, missing: list[str]) -> dict[str, list[int]]:
        """The ids of new pieces, by BPE alone (a tokenizer of the same model without pre-tokenizer, so each
        piece is one word), in one call that releases the GIL; remembers them."""
        encodings = self._bpe_fast([p.translate(_ASCII_TO_BYTE_LEVEL) for p in missing], add_special_tokens=False)
        new = {piece: encoding.ids for piece, encoding in zip(missing, encodings, strict=True)}
        if len(self._pieces) + len(new) > _MAX_CACHED_PIECES:
            self._pieces = {}  # start over: the common pieces come back within a few prompts
        known = self._pieces
        for piece, ids in new.items():
            if len(piece) <= _MAX_CACHED_CHARS:
                known[piece] = ids
        return new
