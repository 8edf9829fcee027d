"""The frontend's tokenizer: a thin wrapper over HF `tokenizers` (no transformers, no torch).

`Tokenizer.from_folder` reads a Hugging Face model folder (tokenizer.json, tokenizer_config.json,
generation_config.json, config.json, chat_template.jinja). `decode_stream` gives an incremental
detokenizer for generated tokens: each `step` returns the text a token makes complete, never a
half character.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders as _decoders

from tandem.llm.chunked_encoder import ChunkedEncoder, TooManyTokens
from tandem.llm.piece_encoder import BYTE_LEVEL_ALPHABET

# tokenizers >= 0.21 has a Rust DecodeStream (seedable with prompt ids since 0.22); else PyDecodeStream.
_NativeDecodeStream: Any = getattr(_decoders, "DecodeStream", None)

REPLACEMENT_CHAR = "\ufffd"
# How many prompt tokens seed a decode stream: enough for leading-space handling (Metaspace/SentencePiece
# decoders strip the first token's space) and for a character split over up to 4 byte tokens. Seeding
# with the whole prompt would make the first step cost O(prompt).
SEED_TOKENS = 6
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class TokenizerError(ValueError):
    """The model folder has no usable tokenizer."""


# GPT-2's byte-level alphabet, inverted: printable stand-in character -> the byte it encodes.
_BYTE_DECODER = {c: b for b, c in BYTE_LEVEL_ALPHABET.items()}
_NO_IDS: frozenset[int] = frozenset()


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise TokenizerError(f"cannot read {path}: {e}") from e
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a plain string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _decoder_types(decoder_state: dict[str, Any]) -> set[str]:
    types = {str(decoder_state.get("type"))}
    for sub in decoder_state.get("decoders") or ():
        if isinstance(sub, dict):
            types |= _decoder_types(sub)
    return types


class Tokenizer:
    """A HF `tokenizers.Tokenizer` plus the model's special tokens, EOS ids and chat template."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        chat_templates: dict[str, str] | None = None,
        special_tokens_map: dict[str, str] | None = None,
    ) -> None:
        self._tok = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_ids: list[int] = list(eos_token_ids)
        self.chat_template = chat_template
        # Named templates (tokenizer_config "chat_template" given as a list), e.g. {"default", "tool_use"}.
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        # bos/eos/unk/pad token strings: chat templates see them as variables (like HF's apply_chat_template).
        self.special_tokens_map: dict[str, str] = dict(special_tokens_map or {})
        if bos_token is not None:
            self.special_tokens_map.setdefault("bos_token", bos_token)
        if eos_token is not None:
            self.special_tokens_map.setdefault("eos_token", eos_token)
        added = tokenizer.get_added_tokens_decoder()
        self._added: dict[int, str] = {i: t.content for i, t in added.items()}
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        decoder = tokenizer.decoder
        types: set[str] = set()
        if decoder is not None:
            try:
                types = _decoder_types(json.loads(decoder.__getstate__()))
            except (AttributeError, TypeError, ValueError):  # pragma: no cover - exotic decoders
                types = set()
        self._byte_level = "ByteLevel" in types
        self._byte_fallback = "ByteFallback" in types
        # A decoder that is byte-level alone: streams decode in Python from each token's bytes.
        self._byte_level_pieces: ByteLevelPieces | None = (
            ByteLevelPieces(tokenizer, self.special_token_ids) if types == {"ByteLevel"} else None)
        self._text_cache: dict[int, str] = {}
        self._bytes_cache: dict[int, list[int]] = {}
        self._chunked = ChunkedEncoder(tokenizer)

    # -- loading ---------------------------------------------------------------------------------

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> Tokenizer:
        folder = os.fspath(folder)
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise TokenizerError(f"no tokenizer.json in {folder}")
        try:
            tok = _HFTokenizer.from_file(path)
        except Exception as e:  # the Rust side raises plain Exception
            raise TokenizerError(f"cannot load {path}: {e}") from e
        config = _read_json(os.path.join(folder, "tokenizer_config.json"))
        generation = _read_json(os.path.join(folder, "generation_config.json"))
        model_config = _read_json(os.path.join(folder, "config.json"))

        special: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            content = _token_content(config.get(key))
            if content is not None:
                special[key] = content
        bos, eos = special.get("bos_token"), special.get("eos_token")

        # Chat template: like transformers, chat_template.jinja (written by recent save_pretrained) wins
        # over tokenizer_config's; a list of {name, template} gives named templates.
        templates: dict[str, str] = {}
        raw = config.get("chat_template")
        if isinstance(raw, str):
            templates["default"] = raw
        elif isinstance(raw, list):
            for item in raw:
                if isinstance(item, dict) and isinstance(item.get("template"), str):
                    templates[str(item.get("name", "default"))] = item["template"]
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                templates["default"] = f.read()
        template = templates.get("default")
        if template is None and templates:
            template = next(iter(templates.values()))

        # EOS ids: generation_config's, else config.json's; the tokenizer's EOS token is added to
        # them (vLLM stops on both), e.g. instruct models whose config lists only <|end_of_text|>.
        eos_ids = _id_list(generation.get("eos_token_id")) or _id_list(model_config.get("eos_token_id"))
        if eos is not None:
            eos_id = tok.token_to_id(eos)
            if eos_id is not None and eos_id not in eos_ids:
                eos_ids.append(eos_id)
        return cls(
            tok,
            bos_token=bos,
            eos_token=eos,
            eos_token_ids=eos_ids,
            chat_template=template,
            chat_templates=templates,
            special_tokens_map=special,
        )

    @property
    def hf(self) -> _HFTokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    # -- encode / decode ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False, limit: int | None = None) -> list[int]:
        """Token ids of `text`; long texts without special-token insertion reuse the ids of chunks seen
        before (`ChunkedEncoder`), with exactly the same result. With `limit`, raises TooManyTokens as
        soon as the text certainly has more tokens than that (long texts are not encoded to the end)."""
        if add_special_tokens:
            ids = self._tok.encode(text, add_special_tokens=True).ids
            if limit is not None and len(ids) > limit:
                raise TooManyTokens(limit, len(ids))
            return ids
        return self._chunked.encode(text, limit)

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """The most characters one token can stand for (its vocabulary entry's length: a byte-level piece
        has one character per byte, so this is never less). A text longer than context length x this
        cannot fit the context, whatever it holds."""
        return max(len(piece) for piece in self._tok.get_vocab(with_added_tokens=True))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_strs(self, ids: Iterable[int]) -> list[str]:
        """The vocabulary's own strings of `ids` (byte-level BPE's `Ġ` and all), as vLLM's /tokenize shows them."""
        return [self._tok.id_to_token(i) or "" for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_text(self, token_id: int) -> str:
        """The decoded text of one token (U+FFFD where it holds part of a character), for logprobs."""
        text = self._text_cache.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            self._text_cache[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The UTF-8 bytes a token stands for; for byte-level and byte-fallback tokens holding part
        of a character, the raw bytes (so concatenating them rebuilds the text)."""
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        text = self.token_text(token_id)
        result: list[int] | None = None
        if REPLACEMENT_CHAR in text and token_id not in self._added:
            piece = self._tok.id_to_token(token_id)
            if piece is not None:
                if self._byte_level:
                    try:
                        result = [_BYTE_DECODER[c] for c in piece]
                    except KeyError:
                        result = None
                if result is None and self._byte_fallback:
                    m = _BYTE_TOKEN.match(piece)
                    if m:
                        result = [int(m.group(1), 16)]
        if result is None:
            result = list(text.encode("utf-8"))
        self._bytes_cache[token_id] = result
        return result

    # -- incremental detokenization ------------------------------------------------------------------

    def decode_stream(
        self, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = False
    ) -> DecodeStream:
        """An incremental detokenizer for the tokens generated after `prompt_ids`."""
        seed: list[int] = list(prompt_ids[-SEED_TOKENS:]) if prompt_ids else []
        pending: list[int] = []
        skip = ""
        pieces = self._byte_level_pieces
        decode = self._tok.decode if pieces is None else pieces.decode
        if seed:
            # A prompt given as token ids may end inside a character. Its last, incomplete tokens are
            # stepped through the stream (so the generated token that completes the character emits
            # it), and the complete text they also hold, which belongs to the prompt, is cut off the
            # first emitted piece.
            full = decode(seed, skip_special_tokens=skip_special_tokens)
            if full.endswith(REPLACEMENT_CHAR):
                for cut in range(1, min(4, len(seed)) + 1):
                    head = decode(seed[:-cut], skip_special_tokens=skip_special_tokens)
                    if not head.endswith(REPLACEMENT_CHAR):
                        pending = seed[-cut:]
                        seed = seed[:-cut]
                        skip = full[len(head) :].rstrip(REPLACEMENT_CHAR) if full.startswith(head) else ""
                        break
        if pieces is not None:
            return ByteLevelStream(pieces, pending, skip, skip_special_tokens)
        if _NativeDecodeStream is not None:
            return _NativeStream(self._tok, seed, pending, skip, skip_special_tokens)
        return PyDecodeStream(self._tok, seed, pending, skip, skip_special_tokens)


class DecodeStream:
    """Incremental detokenizer: `step(token_id)` returns the text made complete by that token
    ("" while a character is incomplete)."""

    __slots__ = ("_skip",)

    def __init__(self) -> None:
        self._skip = ""

    def step(self, token_id: int) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def _cut_skip(self, piece: str) -> str:
        skip = self._skip
        self._skip = ""
        return piece[len(skip) :] if piece.startswith(skip) else piece


class _NativeStream(DecodeStream):
    """`tokenizers.decoders.DecodeStream` (Rust): about half a microsecond a token."""

    __slots__ = ("_stream", "_tok", "_skip_special")

    def __init__(
        self, tok: _HFTokenizer, seed: list[int], pending: list[int], skip: str, skip_special_tokens: bool
    ) -> None:
        super().__init__()
        self._tok = tok
        self._skip_special = skip_special_tokens
        try:
            self._stream = _NativeDecodeStream(ids=seed or None, skip_special_tokens=skip_special_tokens)
        except TypeError:  # tokenizers 0.21: no seeding; step the seed through and drop its text
            self._stream = _NativeDecodeStream(skip_special_tokens=skip_special_tokens)
            for token_id in seed:
                self._stream.step(tok, token_id)
        for token_id in pending:
            self._stream.step(tok, token_id)
        self._skip = skip

    def step(self, token_id: int) -> str:
        try:
            piece = self._stream.step(self._tok, token_id)
        except Exception:  # InvalidPrefix: a decoder that rewrote text it had already produced
            # Restart from this token rather than failing the request (its text is lost).
            self._stream = _NativeDecodeStream(ids=[token_id], skip_special_tokens=self._skip_special)
            return ""
        if not piece:
            return ""
        if self._skip:
            return self._cut_skip(piece)
        return piece


class ByteLevelPieces:
    """What a byte-level decoder makes of each token: its bytes (the byte-level alphabet mapped back, or the
    UTF-8 of a token holding other characters, as `tokenizers`' ByteLevel decoder does), and its text when
    those bytes are whole characters by themselves. Shared by a tokenizer's streams, filled as tokens come."""

    def __init__(self, tokenizer: _HFTokenizer, special_ids: frozenset[int]) -> None:
        self._tok = tokenizer
        self.special_ids = special_ids
        self.whole: dict[int, str] = {}  # token -> its text, for tokens whose bytes are whole characters
        self._bytes: dict[int, bytes] = {}

    def token_bytes(self, token_id: int) -> bytes:
        cached = self._bytes.get(token_id)
        if cached is None:
            piece = self._tok.id_to_token(token_id)
            if piece is None:
                cached = b""  # `tokenizers` drops ids it does not know
            else:
                try:
                    cached = bytes([_BYTE_DECODER[c] for c in piece])
                except KeyError:
                    cached = piece.encode("utf-8")
            self._bytes[token_id] = cached
        return cached

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        special = self.special_ids if skip_special_tokens else _NO_IDS
        return b"".join(self.token_bytes(i) for i in ids if i not in special).decode("utf-8", "replace")


class ByteLevelStream(DecodeStream):
    """Incremental decoding for byte-level decoders, in Python: the bytes held since the last text, decoded
    once they end in a whole character (the text `tokenizers`' DecodeStream gives, without a call into it
    per token); a token that is whole characters by itself is one dict lookup."""

    __slots__ = ("_pieces", "_whole", "_skipped", "_pending")

    def __init__(self, pieces: ByteLevelPieces, pending: list[int], skip: str, skip_special_tokens: bool) -> None:
        super().__init__()
        self._pieces = pieces
        self._whole = pieces.whole
        self._skipped = pieces.special_ids if skip_special_tokens else _NO_IDS
        self._pending = b""
        for token_id in pending:
            self.step(token_id)
        self._skip = skip

    def step(self, token_id: int) -> str:
        if not self._pending:
            text = self._whole.get(token_id)
            if text is not None and token_id not in self._skipped:
                return self._cut_skip(text) if self._skip else text
        if token_id in self._skipped:
            return ""
        data = self._pieces.token_bytes(token_id)
        pending = self._pending + data if self._pending else data
        text = pending.decode("utf-8", "replace")
        if not text or text.endswith(REPLACEMENT_CHAR):
            self._pending = pending
            return ""
        if not self._pending:
            self._whole[token_id] = text
        self._pending = b""
        return self._cut_skip(text) if self._skip else text


class PyDecodeStream(DecodeStream):
    """vLLM's prefix_offset/read_offset incremental detokenizer, for `tokenizers` without DecodeStream.

    Each step decodes only the tokens since the last emitted piece plus the one before them.
    """

    __slots__ = ("_tok", "_ids", "_prefix", "_read", "_prefix_text", "_skip_special")

    def __init__(
        self, tok: _HFTokenizer, seed: list[int], pending: list[int], skip: str, skip_special_tokens: bool
    ) -> None:
        super().__init__()
        self._tok = tok
        self._skip_special = skip_special_tokens
        self._ids: list[int] = seed + pending
        self._prefix = 0
        self._read = len(seed)
        self._prefix_text = tok.decode(seed, skip_special_tokens=skip_special_tokens) if seed else ""
        self._skip = skip

    def step(self, token_id: int) -> str:
        ids = self._ids
        ids.append(token_id)
        text = self._tok.decode(ids[self._prefix :], skip_special_tokens=self._skip_special)
        prefix_text = self._prefix_text
        if len(text) <= len(prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        piece = text[len(prefix_text) :]
        # The next window starts at the tokens read so far; its decoded text is the new prefix.
        start = self._read
        self._prefix_text = self._tok.decode(ids[start:], skip_special_tokens=self._skip_special)
        if start > 64:  # keep the buffer short: drop tokens no window will read again
            del ids[:start]
            start = 0
        self._prefix = start
        self._read = len(ids)
        if self._skip:
            return self._cut_skip(piece)
        return piece
