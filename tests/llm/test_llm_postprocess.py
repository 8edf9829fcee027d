"""tandem.llm.postprocess.OutputProcessor: Dynamo's Backend operator (detokenize + stop conditions)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from tandem.llm.postprocess import OutputProcessor, ProcessedDelta
from tandem.llm.protocols import (
    CompletionUsage,
    LLMEngineOutput,
    OutputOptions,
    SamplingOptions,
    StopConditions,
)
from tandem.llm.tokenizer import Tokenizer

EOS = 2


@pytest.fixture(scope="session")
def prompt(tok: Tokenizer) -> list[int]:
    return tok.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def make(
    tok: Tokenizer,
    prompt: list[int],
    *,
    sampling: SamplingOptions | None = None,
    output: OutputOptions | None = None,
    **stop: Any,
) -> OutputProcessor:
    stop.setdefault("stop_token_ids_hidden", [EOS])
    return OutputProcessor(
        tok, prompt, StopConditions(**stop), sampling or SamplingOptions(), output or OutputOptions()
    )


def feed(proc: OutputProcessor, ids: list[int], **last: Any) -> list[ProcessedDelta]:
    """One token per engine output; `last` keys go on the final one."""
    outs: list[dict[str, Any]] = [{"token_ids": [i]} for i in ids]
    if last:
        if outs:
            outs[-1].update(last)
        else:
            outs.append(dict(last))
    return [proc.process(engine_output(o)) for o in outs]


def engine_output(fields: dict[str, Any]) -> LLMEngineOutput:
    """A worker's output as the request plane decodes it (`token_ids` empty unless given)."""
    return msgspec.convert({"token_ids": [], **fields}, LLMEngineOutput)


def text_of(deltas: list[ProcessedDelta]) -> str:
    return "".join(d.text for d in deltas)


def test_detokenizes_multibyte_one_token_at_a_time(tok: Tokenizer, prompt: list[int]) -> None:
    text = " Sure! 😀 Voilà: 世界, naïve 🎉🎉 done."
    ids = tok.encode(text)
    proc = make(tok, prompt)
    deltas = feed(proc, ids)
    assert text_of(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d.text for d in deltas)
    assert any(d.text == "" for d in deltas)  # some tokens held half a character
    assert [d.completion_tokens for d in deltas] == list(range(1, len(ids) + 1))
    assert [d.token_ids for d in deltas] == [[i] for i in ids]
    assert all(d.finish_reason is None for d in deltas)
    assert proc.finish().text == ""


def test_multi_token_chunks_equal_single_tokens(tok: Tokenizer, prompt: list[int]) -> None:
    ids = tok.encode(" a 😀 b STOP c") + [EOS]
    one = feed(make(tok, prompt, stop=["STOP"]), ids)
    proc = make(tok, prompt, stop=["STOP"])
    chunked = [proc.process(engine_output({"token_ids": ids[i : i + 3]})) for i in range(0, len(ids), 3)]
    assert text_of(one) == text_of(chunked) == " a 😀 b "
    assert one[-1].finish_reason == "stop"
    assert [d for d in chunked if d.finish_reason][0].finish_reason == "stop"
    assert sum(len(d.token_ids) for d in one) == sum(len(d.token_ids) for d in chunked)


def test_hidden_eos(tok: Tokenizer, prompt: list[int]) -> None:
    ids = tok.encode(" Hello there.")
    proc = make(tok, prompt)
    deltas = feed(proc, [*ids, EOS, 100, 101])
    assert text_of(deltas) == " Hello there."
    end = deltas[len(ids)]
    assert end.finish_reason == "eos" and end.stop_reason is None and end.text == ""
    assert end.token_ids == [EOS] and end.completion_tokens == len(ids) + 1
    # After a local stop: empty deltas with the same reason.
    for after in deltas[len(ids) + 1 :]:
        assert after == ProcessedDelta("", [], "eos", None, None, None, None, len(ids) + 1)
    assert proc.finished
    # EOS in the middle of a chunk: later tokens are dropped.
    proc = make(tok, prompt)
    d = proc.process(engine_output({"token_ids": [*ids, EOS, 100]}))
    assert d.text == " Hello there." and d.token_ids == [*ids, EOS] and d.finish_reason == "eos"


def test_ignore_eos(tok: Tokenizer, prompt: list[int]) -> None:
    ids = tok.encode(" a")
    proc = make(tok, prompt, ignore_eos=True)
    deltas = feed(proc, [*ids, EOS, *ids])
    assert all(d.finish_reason is None for d in deltas)
    assert text_of(deltas) == " a<|im_end|> a"  # skip_special_tokens defaults to False (Dynamo)
    proc = make(tok, prompt, ignore_eos=True, output=OutputOptions(skip_special_tokens=True))
    assert text_of(feed(proc, [*ids, EOS, *ids])) == " a a"


def test_user_stop_token_ids(tok: Tokenizer, prompt: list[int]) -> None:
    ids = tok.encode(" one two three")
    proc = make(tok, prompt, stop_token_ids=[ids[2]])
    deltas = feed(proc, ids)
    assert text_of(deltas) == " one two"
    assert deltas[2].finish_reason == "stop" and deltas[2].stop_reason == ids[2] and deltas[2].text == ""
    assert deltas[2].token_ids == [ids[2]]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(tok: Tokenizer, prompt: list[int], include: bool) -> None:
    ids = tok.encode(" The answer is 42.\n\nUser: thanks")
    stop_piece_tokens = [tok.token_text(i) for i in ids]
    assert "\n" in "".join(stop_piece_tokens) and ":" in "".join(stop_piece_tokens)
    proc = make(tok, prompt, stop=["\n\nUser:"], sampling=SamplingOptions(include_stop_str_in_output=include))
    deltas = feed(proc, ids)
    expected = " The answer is 42." + ("\n\nUser:" if include else "")
    assert text_of(deltas) == expected
    ends = [d for d in deltas if d.finish_reason]
    assert ends[0].finish_reason == "stop" and ends[0].stop_reason == "\n\nUser:"
    # The stop string spans several tokens: its first pieces were held, not emitted.
    stop_index = deltas.index(ends[0])
    assert stop_index > 0 and ends[0].token_ids != []
    assert deltas[stop_index - 1].text == ""
    assert all(d.text == "" and d.token_ids == [] for d in deltas[stop_index + 1 :])


def test_partial_stop_released(tok: Tokenizer, prompt: list[int]) -> None:
    ids = tok.encode(" x ## y ## z")
    proc = make(tok, prompt, stop=["###"])
    deltas = feed(proc, ids, finish_reason="eos")
    assert text_of(deltas) == " x ## y ## z"
    assert deltas[-1].finish_reason == "eos"
    # Held text is released when the engine finishes (eos/stop/length)...
    ids = tok.encode(" x ##")
    proc = make(tok, prompt, stop=["###"])
    deltas = feed(proc, ids)
    assert text_of(deltas) == " x "
    end = proc.process(engine_output({"token_ids": [], "finish_reason": "length"}))
    assert end.text == "##" and end.finish_reason == "length"
    # ...or by finish() when the stream just ends...
    proc = make(tok, prompt, stop=["###"])
    assert text_of(feed(proc, ids)) == " x "
    assert proc.finish().text == "##"
    # ...but not on cancellation.
    proc = make(tok, prompt, stop=["###"])
    deltas = feed(proc, ids, finish_reason="abort")
    assert text_of(deltas) == " x " and deltas[-1].finish_reason == "cancelled"


def test_stop_at_eos_flushes_jail(tok: Tokenizer, prompt: list[int]) -> None:
    ids = tok.encode(" x ##")
    proc = make(tok, prompt, stop=["###"])
    deltas = feed(proc, [*ids, EOS])
    assert text_of(deltas) == " x ##" and deltas[-1].finish_reason == "eos"


def test_min_tokens(tok: Tokenizer, prompt: list[int]) -> None:
    # An EOS among the first min_tokens tokens does not stop (and is decoded like any token).
    a = tok.encode(" a")
    proc = make(tok, prompt, min_tokens=3, output=OutputOptions(skip_special_tokens=True))
    deltas = feed(proc, [*a, EOS, *a, EOS])
    assert [d.finish_reason for d in deltas] == [None, None, None, "eos"]
    assert text_of(deltas) == " a a"
    # Stop token ids likewise.
    proc = make(tok, prompt, min_tokens=2, stop_token_ids=[a[0]])
    assert [d.finish_reason for d in feed(proc, [*a, *a, *a])] == [None, None, "stop"]
    # A stop string completed before min_tokens does not count; one completed after does.
    ids = tok.encode(" END and END again")
    proc = make(tok, prompt, min_tokens=3, stop=["END"])
    deltas = feed(proc, ids)
    assert text_of(deltas) == " END and "
    assert deltas[3].finish_reason == "stop" and deltas[3].stop_reason == "END"
    # Without min_tokens the first one stops.
    assert text_of(feed(make(tok, prompt, stop=["END"]), ids)) == " "


def test_max_tokens(tok: Tokenizer, prompt: list[int]) -> None:
    ids = tok.encode(" one two three four")
    proc = make(tok, prompt, max_tokens=3)
    deltas = feed(proc, ids)
    assert text_of(deltas) == " one two three"  # the max-th token's text is emitted
    assert deltas[2].finish_reason == "length" and deltas[2].completion_tokens == 3
    assert deltas[3] == ProcessedDelta("", [], "length", None, None, None, None, 3)
    # In one chunk: truncated to max_tokens.
    proc = make(tok, prompt, max_tokens=2)
    d = proc.process(engine_output({"token_ids": ids}))
    assert d.text == " one two" and d.token_ids == ids[:2] and d.finish_reason == "length"
    # A held partial stop string is released at the length limit.
    proc = make(tok, prompt, max_tokens=2, stop=["two three"])
    assert text_of(feed(proc, ids)) == " one two"


def test_engine_text_passthrough(tok: Tokenizer, prompt: list[int]) -> None:
    proc = make(tok, prompt, stop=["STOP"])
    d1 = proc.process(engine_output({"token_ids": [10, 11], "text": "Hello ST"}))
    assert d1.text == "Hello " and d1.completion_tokens == 2
    d2 = proc.process(engine_output({"token_ids": [12], "text": "OP and more"}))
    assert d2.text == "" and d2.finish_reason == "stop" and d2.stop_reason == "STOP"
    # No stop strings: verbatim, even text the tokenizer would not produce for these ids.
    proc = make(tok, prompt)
    assert proc.process(engine_output({"token_ids": [5], "text": "anything"})).text == "anything"
    d = proc.process(engine_output({"token_ids": [6], "text": "!", "finish_reason": "stop", "stop_reason": "x"}))
    assert (d.text, d.finish_reason, d.stop_reason) == ("!", "stop", "x")
    # max_tokens still counts the ids.
    proc = make(tok, prompt, max_tokens=2)
    d = proc.process(engine_output({"token_ids": [5, 6], "text": "ab"}))
    assert (d.text, d.finish_reason) == ("ab", "length")


def test_engine_finish_reasons(tok: Tokenizer, prompt: list[int]) -> None:
    ids = tok.encode(" hi")
    d = make(tok, prompt).process(engine_output({"token_ids": ids, "finish_reason": "length"}))
    assert (d.text, d.finish_reason, d.error) == (" hi", "length", None)
    d = make(tok, prompt).process(engine_output({"token_ids": [], "finish_reason": {"error": "engine died"}}))
    assert (d.finish_reason, d.error) == ("error", "engine died")
    d = make(tok, prompt).process(engine_output({"finish_reason": "error: out of memory"}))
    assert (d.finish_reason, d.error) == ("error", "out of memory")
    d = make(tok, prompt).process(engine_output({"finish_reason": "content_filter"}))
    assert d.finish_reason == "content_filter"
    usage = CompletionUsage(prompt_tokens=5, completion_tokens=1, total_tokens=6)
    proc = make(tok, prompt)
    d = proc.process(engine_output({"token_ids": ids, "finish_reason": "stop", "completion_usage": usage}))
    assert d.usage == usage and d.finish_reason == "stop"
    # Usage arriving after a local stop is still passed on.
    proc = make(tok, prompt)
    assert proc.process(engine_output({"token_ids": [EOS]})).finish_reason == "eos"
    assert proc.process(engine_output({"completion_usage": usage})).usage == usage


def test_logprobs(tok: Tokenizer, prompt: list[int]) -> None:
    ids = tok.encode(" 😀!")
    proc = make(tok, prompt, output=OutputOptions(logprobs=1))
    outs = [
        {
            "token_ids": [i],
            "log_probs": [-0.25 * (n + 1)],
            "top_logprobs": [
                [
                    {"rank": 1, "token_id": i, "token": "ignored", "logprob": -0.25 * (n + 1)},
                    {"rank": 2, "token_id": EOS, "token": None, "logprob": -9.0},
                ]
            ],
        }
        for n, i in enumerate(ids)
    ]
    deltas = [proc.process(engine_output(o)) for o in outs]
    entries = [e for d in deltas for e in (d.logprobs or [])]
    assert [e.token_id for e in entries] == ids
    assert [e.logprob for e in entries] == [-0.25 * (n + 1) for n in range(len(ids))]
    assert b"".join(bytes(e.bytes or []) for e in entries) == " 😀!".encode()
    assert entries[0].token == tok.token_text(ids[0])
    assert [t.token_id for t in entries[0].top] == [ids[0], EOS]
    assert entries[0].top[1].token == "<|im_end|>" and entries[0].top[1].bytes == list(b"<|im_end|>")
    # Not requested: none.
    proc = make(tok, prompt)
    assert proc.process(engine_output(outs[0])).logprobs is None
    # return_tokens_as_token_ids
    proc = make(tok, prompt, output=OutputOptions(logprobs=0, return_tokens_as_token_ids=True))
    (entry,) = proc.process(engine_output(outs[0])).logprobs or []
    assert entry.token == f"token_id:{ids[0]}"


def test_per_token_work_does_not_grow_with_the_output(tok: Tokenizer, prompt: list[int]) -> None:
    """Each token's stop check looks at the new text plus at most a stop string's length held back, never
    at the whole output: what is held stays shorter than the longest stop string."""
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 100)
    proc = make(tok, prompt, stop=["\n\nUser:"], max_tokens=10**6)
    matcher = proc._matcher
    assert matcher is not None
    text = []
    for i in ids:
        text.append(proc.process(engine_output({"token_ids": [i]})).text)
        assert len(matcher.held) < len("\n\nUser:")
    assert "".join(text) + proc.finish().text == tok.decode(ids)
