"""tandem.llm.chunked_encoder: cached chunked tokenization gives exactly the plain encoding."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from tandem.llm.chunked_encoder import ChunkedEncoder, TooManyTokens, _size
from tandem.llm.tokenizer import Tokenizer

UNITS = [" ", "  ", "\n", "\n\n", " \n", "\t", "a", "the", "Hello", "it's", "don't", "12", "345", ".", "!", ",", "x9", "½",
         "(", ")", '"', "é", "東京", "🙂", "<|im_start|>", "<|im_end|>", "user", "\r\n", "-", "--", "/", "x1"]


def _hf(tok: Tokenizer) -> HFTokenizer:
    return tok.hf


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(UNITS), min_size=0, max_size=400), st.integers(4, 64))
def test_equals_plain_encoding(tok: Tokenizer, units: list[str], chunk_chars: int) -> None:
    """Any text, any chunk size (small ones put cuts everywhere): the same ids as one plain encode."""
    encoder = ChunkedEncoder(_hf(tok), chunk_chars=chunk_chars)
    text = "".join(units)
    assert encoder.encode(text) == _hf(tok).encode(text, add_special_tokens=False).ids
    assert encoder.encode(text) == _hf(tok).encode(text, add_special_tokens=False).ids  # now from the cache


def test_follow_up_turn_reuses_the_shared_prefix(tok: Tokenizer) -> None:
    rng = random.Random(3)
    words = ["alpha", "beta", "gamma", "delta", "naïve", "42", "end.\n"]
    encoder = ChunkedEncoder(_hf(tok), chunk_chars=256)
    text = "<|im_start|>user\n" + " ".join(rng.choice(words) for _ in range(2000))
    encoder.encode(text)
    assert encoder.enabled and encoder.hits == 0
    misses = encoder.misses
    turn2 = text + "<|im_end|>\n<|im_start|>assistant\n ok " + " ".join(rng.choice(words) for _ in range(100))
    assert encoder.encode(turn2) == _hf(tok).encode(turn2, add_special_tokens=False).ids
    assert encoder.hits >= misses - 1  # every full chunk of turn 1 but the last came from the cache
    assert encoder.misses - misses <= 4


def test_tokenizer_encode_uses_it(tok: Tokenizer) -> None:
    text = " ".join(["word"] * 3000)
    assert tok.encode(text) == _hf(tok).encode(text, add_special_tokens=False).ids
    assert tok.encode(text, add_special_tokens=True) == _hf(tok).encode(text, add_special_tokens=True).ids


def test_cache_is_bounded_in_bytes(tok: Tokenizer) -> None:
    encoder = ChunkedEncoder(_hf(tok), chunk_chars=64, capacity_bytes=4096)
    for n in range(20):
        encoder.encode(" ".join(f"w{n}x{i}" for i in range(200)))
    assert 0 < encoder.cached_bytes <= 4096
    assert encoder.cached_bytes == sum(_size(c, ids) for c, ids in encoder._cache.items())


def test_a_run_without_safe_boundary_is_not_cached(tok: Tokenizer) -> None:
    """A chunk as long as the whole text (digits, no spaces) would evict everything else."""
    encoder = ChunkedEncoder(_hf(tok), chunk_chars=64)
    text = "one two " + "7" * 5000 + " three four"
    assert encoder.encode(text) == _hf(tok).encode(text, add_special_tokens=False).ids
    assert all(len(chunk) <= 8 * 64 for chunk in encoder._cache)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(UNITS), min_size=0, max_size=600), st.integers(1, 300))
def test_limit(tok: Tokenizer, units: list[str], limit: int) -> None:
    """Under the limit: the plain ids. Over it: TooManyTokens, whose count never exceeds the real one."""
    encoder = ChunkedEncoder(_hf(tok), chunk_chars=16)
    text = "".join(units)
    expected = _hf(tok).encode(text, add_special_tokens=False).ids
    if len(expected) <= limit:
        assert encoder.encode(text, limit) == expected
    else:
        with pytest.raises(TooManyTokens) as raised:
            encoder.encode(text, limit)
        assert limit < raised.value.at_least <= len(expected)


@pytest.mark.parametrize("kind", ["words", "letters and digits, no spaces"])
def test_over_the_limit_stops_early(tok: Tokenizer, kind: str) -> None:
    """A long text far over the limit is not encoded to its end, also without spaces (base64-like text is
    cut where an ASCII letter meets a digit)."""
    encoder = ChunkedEncoder(_hf(tok), chunk_chars=64)
    rng = random.Random(5)
    text = (" ".join(f"word{i}" for i in range(20000)) if kind == "words"
            else "".join(rng.choice("abcXYZ0123456789") for _ in range(200_000)))
    with pytest.raises(TooManyTokens):
        encoder.encode(text, limit=100)
    assert encoder.misses <= ChunkedEncoder.GROUP_CHUNKS


def test_other_tokenizer_families_are_left_alone() -> None:
    """A normalizer or a Metaspace (SentencePiece) pre-tokenizer may act across a cut: plain encoding."""
    vocab = {"[UNK]": 0, "a": 1, "b": 2, "▁": 3}
    metaspace = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    metaspace.decoder = decoders.Metaspace()
    assert ChunkedEncoder(metaspace).enabled is False
    normalized = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    normalized.normalizer = normalizers.NFKC()
    normalized.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert ChunkedEncoder(normalized).enabled is False
    text = " ".join(["a b"] * 3000)
    assert ChunkedEncoder(metaspace, chunk_chars=32).encode(text) == metaspace.encode(text, add_special_tokens=False).ids
