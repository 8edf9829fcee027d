"""tandem.llm.tokenizer: loading a model folder, token text/bytes, incremental detokenization."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from tandem.llm import tokenizer as tokenizer_module
from tandem.llm.tokenizer import ByteLevelPieces, ByteLevelStream, PyDecodeStream, Tokenizer, TokenizerError

MULTIBYTE_TEXTS = [
    " Héllo 😀 世界! naïve café 🎉🎉 ok",
    "日本語のテキストと中文混合，还有한국어",
    "👩‍👩‍👧‍👦 family, 🏳️‍🌈 flag, e\u0301 combining, Ωμέγα",
    "emoji at the end 🤖",
    "🚀",
    "  leading spaces\n\ttabs\n\nand newlines  ",
]


# --- loading ----------------------------------------------------------------------------------------


def test_from_folder_smollm2(tok: Tokenizer) -> None:
    assert tok.bos_token == "<|im_start|>"
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_ids == [2]
    assert tok.vocab_size == 49152
    assert {0, 1, 2} <= tok.special_token_ids
    assert 6004 not in tok.special_token_ids
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template
    assert tok.special_tokens_map["eos_token"] == "<|im_end|>"


def test_encode_decode_roundtrip(tok: Tokenizer) -> None:
    text = "<|im_start|>user\nHello there!<|im_end|>\n"
    ids = tok.encode(text)
    assert ids[0] == 1 and 2 in ids  # special tokens in text are recognised
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\nHello there!\n"
    for text in MULTIBYTE_TEXTS:
        assert tok.decode(tok.encode(text)) == text


def _copy_tokenizer(src: str, dst: Path) -> Path:
    dst.mkdir()
    shutil.copy(Path(src) / "tokenizer.json", dst / "tokenizer.json")
    return dst


def test_from_folder_variants(smollm2: str, tmp_path: Path) -> None:
    folder = _copy_tokenizer(smollm2, tmp_path / "m")
    # AddedToken dicts, a list of named templates, no generation_config: config.json's eos first.
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<|im_start|>", "lstrip": False, "special": True},
                "eos_token": {"__type": "AddedToken", "content": "<|im_end|>"},
                "pad_token": None,
                "chat_template": [
                    {"name": "default", "template": "D{{ messages[0]['content'] }}"},
                    {"name": "tool_use", "template": "T"},
                ],
            }
        )
    )
    (folder / "config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    tok = Tokenizer.from_folder(folder)
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    assert tok.chat_template == "D{{ messages[0]['content'] }}"
    assert set(tok.chat_templates) == {"default", "tool_use"}
    assert tok.eos_token_ids == [0, 2]

    # generation_config wins over config.json; the tokenizer's EOS token is added.
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert Tokenizer.from_folder(folder).eos_token_ids == [0, 2]

    # chat_template.jinja wins over tokenizer_config's (as in transformers).
    (folder / "chat_template.jinja").write_text("J")
    assert Tokenizer.from_folder(folder).chat_template == "J"

    # Only the tokenizer's EOS token.
    (folder / "generation_config.json").unlink()
    (folder / "config.json").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    tok = Tokenizer.from_folder(folder)
    assert tok.eos_token_ids == [0]
    assert tok.chat_template == "J"


def test_from_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(TokenizerError):
        Tokenizer.from_folder(tmp_path)


# --- token text / bytes --------------------------------------------------------------------------------


def test_token_text_and_bytes(tok: Tokenizer) -> None:
    hello = tok.encode(" Hello")
    assert len(hello) == 1
    assert tok.token_text(hello[0]) == " Hello"
    assert tok.token_bytes(hello[0]) == list(b" Hello")
    assert tok.token_text(2) == "<|im_end|>"
    assert tok.token_bytes(2) == list(b"<|im_end|>")

    # A character split over tokens: each token's bytes are the raw UTF-8 bytes it stands for.
    for text in ("😀", " 世界", "🎉 café"):
        ids = tok.encode(text)
        raw = b"".join(bytes(tok.token_bytes(i)) for i in ids)
        assert raw == text.encode("utf-8")
    emoji = tok.encode("😀")
    assert len(emoji) > 1
    assert "\ufffd" in tok.token_text(emoji[0])  # a partial character, like vLLM's logprob token text
    assert tok.token_bytes(emoji[0]) == list("😀".encode()[: len(tok.token_bytes(emoji[0]))])


# --- incremental detokenization ------------------------------------------------------------------------


@pytest.fixture(params=["bytelevel", "native", "python"])
def impl(request: pytest.FixtureRequest, tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run with the byte-level streams (SmolLM2's decoder), tokenizers' DecodeStream and the Python fallback
    (vLLM's algorithm)."""
    if request.param != "bytelevel":
        monkeypatch.setattr(tok, "_byte_level_pieces", None)
    if request.param == "python":
        monkeypatch.setattr(tokenizer_module, "_NativeDecodeStream", None)
    return str(request.param)


def test_decode_stream_multibyte(tok: Tokenizer, impl: str) -> None:
    prompt = tok.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")
    saw_split = False
    for text in MULTIBYTE_TEXTS:
        ids = tok.encode(text)
        saw_split |= any("\ufffd" in tok.token_text(i) for i in ids)
        for seed in (prompt, None, []):
            stream = tok.decode_stream(seed)
            assert isinstance(stream, PyDecodeStream) == (impl == "python")
            assert isinstance(stream, ByteLevelStream) == (impl == "bytelevel")
            pieces = [stream.step(i) for i in ids]
            assert not any("\ufffd" in p for p in pieces), pieces
            assert "".join(pieces) == tok.decode(ids)
    assert saw_split, "the test texts must contain characters split over tokens"


def test_decode_stream_emits_each_character_when_complete(tok: Tokenizer) -> None:
    ids = tok.encode("a😀b")
    step = tok.decode_stream(tok.encode("x")).step
    pieces = [step(i) for i in ids]
    # The emoji's tokens give "" until the last one completes it.
    assert "".join(pieces) == "a😀b"
    assert "😀" in pieces or any(p.endswith("😀") for p in pieces)
    first_emoji_piece = next(i for i, p in enumerate(pieces) if "😀" in p)
    assert all(p == "" or "😀" not in p for p in pieces[:first_emoji_piece])


def test_decode_stream_skip_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("Hi<|im_end|>")
    assert "".join(tok.decode_stream([1], skip_special_tokens=False).step(i) for i in ids) == "Hi<|im_end|>"
    assert "".join(tok.decode_stream([1], skip_special_tokens=True).step(i) for i in ids) == "Hi"


def test_decode_stream_prompt_ending_inside_a_character(tok: Tokenizer, impl: str) -> None:
    """Token-id prompts may end mid-character: the generated token completing it emits the
    character (and only the part the prompt had not already made complete)."""
    ids = tok.encode("hi 😀 世界")
    full = tok.decode(ids)
    ended_inside = 0
    for cut in range(1, len(ids)):
        prompt_text = tok.decode(ids[:cut])
        ended_inside += prompt_text.endswith("\ufffd")
        stream = tok.decode_stream(ids[:cut])
        pieces = [stream.step(i) for i in ids[cut:]]
        assert not any("\ufffd" in p for p in pieces)
        assert prompt_text.rstrip("\ufffd") + "".join(pieces) == full, (cut, pieces)
    assert ended_inside >= 3


def test_decode_stream_long_prompt_is_cheap(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode stream is seeded with the prompt's last few tokens, not the whole prompt (whose decoding
    would cost O(prompt) per request)."""
    import tandem.llm.tokenizer as module

    pieces = tok._byte_level_pieces
    assert pieces is not None
    decoded: list[int] = []
    monkeypatch.setattr(pieces, "decode", lambda ids, **kw: decoded.append(len(ids)) or ByteLevelPieces.decode(pieces, ids, **kw))
    prompt = tok.encode("The quick brown fox jumps over the lazy dog. " * 2000)
    assert tok.decode_stream(prompt).step(tok.encode(" Yes")[0]) == " Yes"
    assert decoded and max(decoded) <= module.SEED_TOKENS
    monkeypatch.setattr(tok, "_byte_level_pieces", None)  # the native and Python streams
    seeds: list[int] = []
    native = module._NativeDecodeStream
    if native is not None:
        monkeypatch.setattr(module, "_NativeDecodeStream",
                            lambda ids=None, **kw: seeds.append(len(ids or [])) or native(ids=ids, **kw))
    prompt = tok.encode("The quick brown fox jumps over the lazy dog. " * 2000)
    stream = tok.decode_stream(prompt)
    assert stream.step(tok.encode(" Yes")[0]) == " Yes"
    held = seeds if native is not None else [len(stream._ids) - 1]  # type: ignore[attr-defined]
    assert len(prompt) > 10_000 and held and max(held) <= module.SEED_TOKENS


def _metaspace_tokenizer() -> Tokenizer:
    vocab = {
        "<unk>": 0,
        "▁Hello": 1,
        "▁world": 2,
        "Hello": 3,
        "<0xE4>": 4,
        "<0xB8>": 5,
        "<0x96>": 6,
        "<s>": 7,
    }
    hf = HFTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    hf.add_special_tokens(["<s>"])
    return Tokenizer(hf, bos_token="<s>")


def test_decode_stream_leading_space_relative_to_prompt(impl: str) -> None:
    """SentencePiece-style decoders drop the first token's space: seeding with the prompt keeps it."""
    tok = _metaspace_tokenizer()
    assert tok.decode([1, 2]) == "Hello world" and tok.decode([2]) == "world"

    stream = tok.decode_stream([7, 1])
    assert [stream.step(i) for i in (2, 2, 4, 5, 6, 2)] == [" world", " world", "", "", "世", " world"]
    stream = tok.decode_stream([])
    assert [stream.step(i) for i in (2, 2)] == ["world", " world"]
    # Byte-fallback tokens: bytes of a split character.
    assert tok.token_bytes(4) == [0xE4]
    assert tok.token_text(1) == "Hello"


def test_decode_stream_random_token_soup(tok: Tokenizer, impl: str) -> None:
    """Random ids, many of them partial characters (even invalid UTF-8): the stream emits exactly the
    text the prompt did not already make complete, minus a trailing part still ending mid-character."""
    rng = random.Random(1234)
    partial = [i for i in range(tok.vocab_size) if "\ufffd" in tok.token_text(i)]
    for _ in range(300):
        ids = [
            rng.choice(partial) if rng.random() < 0.6 else rng.randrange(tok.vocab_size) for _ in range(12)
        ]
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 8))]
        stream = tok.decode_stream(prompt)
        emitted = "".join(stream.step(i) for i in ids)
        prompt_text = tok.decode(prompt).rstrip("\ufffd")
        full = tok.decode(prompt + ids)
        assert full.startswith(prompt_text)
        rest = full[len(prompt_text) :]
        assert rest.startswith(emitted)
        assert rest == emitted or rest.endswith("\ufffd")


def test_native_stream_error_restarts(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tok, "_byte_level_pieces", None)
    stream = tok.decode_stream([1])
    if isinstance(stream, PyDecodeStream):
        pytest.skip("tokenizers has no DecodeStream")

    class Broken:
        def step(self, *_: object) -> str:
            raise Exception("InvalidPrefix")

    stream._stream = Broken()  # type: ignore[attr-defined]
    assert stream.step(100) == ""
    assert stream.step(tok.encode(" ok")[0]) == " ok"


@pytest.fixture(scope="module")
def partial_ids(tok: Tokenizer) -> list[int]:
    """Tokens that hold part of a character."""
    return [i for i in range(tok.vocab_size) if "\ufffd" in tok.token_text(i)][:200]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_byte_level_stream_equals_tokenizers_decode_stream(tok: Tokenizer, partial_ids: list[int],
                                                            data: st.DataObject) -> None:
    """Any ids (parts of characters in any order, special tokens, ids past the vocabulary), any prompt end, with
    and without skipping special tokens: the same pieces as tokenizers' own DecodeStream."""
    native = tokenizer_module._NativeDecodeStream
    if native is None:
        pytest.skip("tokenizers without DecodeStream")
    ids_of = st.one_of(st.sampled_from(partial_ids), st.integers(0, 40), st.integers(0, tok.vocab_size + 5),
                       st.sampled_from(tok.encode("a😀b 世界 naïve")))
    seed = data.draw(st.lists(ids_of, max_size=8))
    ids = data.draw(st.lists(ids_of, max_size=40))
    skip = data.draw(st.booleans())
    # A prompt whose last SEED_TOKENS tokens end in bytes no cut of up to 4 tokens makes whole: tokenizers' stream
    # repeats them in its first piece, the byte-level one does not (the test below).
    window = seed[-tokenizer_module.SEED_TOKENS:]
    assume(not tok.decode(window, skip).endswith("\ufffd")
           or any(not tok.decode(window[:-cut], skip).endswith("\ufffd") for cut in range(1, min(4, len(window)) + 1)))
    ours = tok.decode_stream(seed, skip_special_tokens=skip)
    assert isinstance(ours, ByteLevelStream)
    tok._byte_level_pieces, pieces = None, tok._byte_level_pieces
    try:
        theirs = tok.decode_stream(seed, skip_special_tokens=skip)
    finally:
        tok._byte_level_pieces = pieces
    assert [ours.step(i) for i in ids] == [theirs.step(i) for i in ids]


def test_a_prompt_ending_in_undecodable_bytes_is_not_repeated(tok: Tokenizer) -> None:
    """Five stray continuation bytes end the prompt: the first piece is the generated text alone (tokenizers'
    own stream, seeded with them, would repeat the prompt's five U+FFFD)."""
    stray = next(i for i in range(tok.vocab_size) if tok.token_bytes(i) == [0xA1])
    stream = tok.decode_stream([stray] * 5)
    assert isinstance(stream, ByteLevelStream)
    assert [stream.step(i) for i in tok.encode("<|endoftext|> ok")] == ["<|endoftext|>", " ok"]
