"""tandem.llm.piece_encoder: byte-level BPE piece by piece gives exactly the `tokenizers` encoding."""

from __future__ import annotations

import random
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from tandem.llm import piece_encoder
from tandem.llm.piece_encoder import PieceEncoder
from tandem.llm.tokenizer import Tokenizer

# Every ASCII character, the regex's alternatives (contractions, space runs before words, digits, symbols),
# added tokens glued to text, and non-ASCII text between them.
UNITS = [chr(c) for c in range(128)] + [
    " ", "  ", "   ", "\n", "\n\n", " \n ", "\t", "\r\n", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'x",
    "Hello", " world", "12", "345", "x9", "...", "!?", "--", "naïve", "東京", "🙂", "½", "\u00a0", "\u2028", "\x85",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|", "im_end|>",
]


def _hf_ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.hf.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def encoder(tok: Tokenizer) -> PieceEncoder:
    built = PieceEncoder.for_tokenizer(tok.hf)
    assert built is not None, "SmolLM2's tokenizer is byte-level BPE: the piece encoder must take it"
    return built


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(UNITS), min_size=0, max_size=60))
def test_equals_the_tokenizers_encoding(tok: Tokenizer, encoder: PieceEncoder, units: list[str]) -> None:
    text = "".join(units)
    assert encoder.encode(text) == _hf_ids(tok, text)
    assert encoder.encode(text) == _hf_ids(tok, text)  # now from the remembered pieces


@pytest.mark.parametrize("code", range(128))
def test_every_ascii_character_in_every_position(tok: Tokenizer, encoder: PieceEncoder, code: int) -> None:
    """Where Python's classes and the tokenizer's Unicode ones could part: whitespace (\\x1c-\\x1f are space to
    Python, not to Unicode), letters, digits, and a character before and after spaces, words and digits."""
    c = chr(code)
    for text in (c, c * 3, f" {c}", f"{c} ", f"a{c}b", f"1{c}2", f"  {c}  x", f"x{c}\n\n{c}", f"'{c}", f"{c}'s",
                 f"<|im_start|>{c}<|im_end|>", f"{c}\u00e9{c}"):
        assert encoder.encode(text) == _hf_ids(tok, text), repr(text)


def test_a_long_prompt(tok: Tokenizer, encoder: PieceEncoder) -> None:
    with open(piece_encoder.__file__, encoding="utf-8") as f:
        source = f.read() * 3
    assert encoder.encode(source) == _hf_ids(tok, source)


def test_the_frontend_tokenizer_uses_it(tok: Tokenizer) -> None:
    """`Tokenizer.encode` goes through the piece encoder for SmolLM2 (short prompts included)."""
    assert tok._chunked._pieces is not None
    text = "<|im_start|>user\nWrite one sentence about a quick brown fox.<|im_end|>\n"
    assert tok.encode(text) == _hf_ids(tok, text)


def test_remembered_pieces_are_bounded(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(piece_encoder, "_MAX_CACHED_PIECES", 50)
    encoder = PieceEncoder.for_tokenizer(tok.hf)
    assert encoder is not None
    for n in range(10):
        text = " ".join(f"w{n}x{i}" for i in range(30)) + " " + "7" * 500
        assert encoder.encode(text) == _hf_ids(tok, text)
        assert 0 < len(encoder._pieces) <= 50
    assert "7" * 500 not in encoder._pieces  # a long piece is encoded, not remembered


def test_mostly_new_text_goes_to_tokenizers_whole(tok: Tokenizer) -> None:
    """Random words: each piece new, so the text is encoded whole and its pieces are not remembered; a
    text of known pieces with a few new ones remembers those."""
    encoder = PieceEncoder.for_tokenizer(tok.hf)
    assert encoder is not None
    rng = random.Random(0)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(8)) for _ in range(300)]
    random_words = " " + " ".join(words)
    assert encoder.encode(random_words) == _hf_ids(tok, random_words)
    assert f" {words[7]}" not in encoder._pieces
    familiar = " the cat sat on the mat" * 20
    assert encoder.encode(familiar) == _hf_ids(tok, familiar)
    assert " cat" in encoder._pieces
    with_new = familiar + f" {words[7]} {words[8]}"
    assert encoder.encode(with_new) == _hf_ids(tok, with_new)
    assert f" {words[7]}" in encoder._pieces


def test_a_failed_self_check_leaves_the_tokenizer_to_tokenizers(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    import re

    monkeypatch.setattr(piece_encoder, "_ASCII_PIECES", re.compile(r"\S+|\s+"))  # wrong pieces
    assert PieceEncoder.for_tokenizer(tok.hf) is None


def _bpe(**pre: object) -> HFTokenizer:
    vocab = {"a": 0, "b": 1, "Ġ": 2, "ab": 3}
    tokenizer = HFTokenizer(models.BPE(vocab, [("a", "b")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(**pre)  # type: ignore[arg-type]
    return tokenizer


def test_other_shapes_are_left_to_tokenizers() -> None:
    assert PieceEncoder.for_tokenizer(_bpe(add_prefix_space=False)) is not None
    assert PieceEncoder.for_tokenizer(_bpe(add_prefix_space=True)) is None
    assert PieceEncoder.for_tokenizer(_bpe(add_prefix_space=False, use_regex=False)) is None
    normalized = _bpe(add_prefix_space=False)
    normalized.normalizer = normalizers.NFKC()
    assert PieceEncoder.for_tokenizer(normalized) is None
    stripping = _bpe(add_prefix_space=False)
    stripping.add_special_tokens([AddedToken("<x>", lstrip=True)])
    assert PieceEncoder.for_tokenizer(stripping) is None
    dropout = HFTokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")], dropout=0.5))
    dropout.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert PieceEncoder.for_tokenizer(dropout) is None  # random merges: nothing to remember
    wordlevel = HFTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    wordlevel.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert PieceEncoder.for_tokenizer(wordlevel) is None
    metaspace = HFTokenizer(models.BPE({"a": 0, "▁": 1}, []))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    assert PieceEncoder.for_tokenizer(metaspace) is None
