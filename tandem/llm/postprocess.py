"""Dynamo's Backend operator: engine output maps -> client text deltas.

Per request, an `OutputProcessor` detokenizes the engine's new token ids incrementally (unless the
engine sent `text`), and enforces the stop conditions: hidden stop ids (EOS) -> "eos", user stop
token ids and stop strings -> "stop", max_tokens -> "length", all of them held off until min_tokens.
Once it has stopped locally it only returns empty deltas carrying the finish reason; the caller
stops the upstream generation.

Token accounting: the token that ends the stream (EOS, a stop token id, the token completing a
stop string, the max_tokens-th token) is accepted: it is in `token_ids`, counted in
`completion_tokens` and has a logprob entry, but an EOS / stop token id's text is never emitted.
Tokens after it in the same engine chunk are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from tandem.llm.protocols import (
    CompletionUsage,
    LLMEngineOutput,
    OutputOptions,
    SamplingOptions,
    StopConditions,
    parse_finish_reason,
)
from tandem.llm.stop import StopStringMatcher
from tandem.llm.tokenizer import Tokenizer

# Engine finish reasons after which text held back for a possible stop string is still emitted.
_FLUSH_REASONS = frozenset(("eos", "stop", "length"))


class TopLogprob(msgspec.Struct):
    token: str
    token_id: int
    logprob: float | None
    bytes: list[int] | None = None
    rank: int | None = None  # 1 = the most likely (the token-out route reports it)


class TokenLogprob(msgspec.Struct):
    token: str
    token_id: int
    logprob: float | None
    bytes: list[int] | None = None
    top: list[TopLogprob] = msgspec.field(default_factory=list)


class ProcessedDelta(msgspec.Struct):
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    finish_reason: str | None = None  # eos, length, stop, cancelled, content_filter, error
    error: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    usage: CompletionUsage | None = None  # the engine's, when it sent one
    completion_tokens: int = 0  # accepted tokens so far


class OutputProcessor:
    """Turns one request's stream of `LLMEngineOutput`s into `ProcessedDelta`s."""

    __slots__ = (
        "_tok",
        "_step",
        "_matcher",
        "_hidden",
        "_stop_ids",
        "_min_tokens",
        "_max_tokens",
        "_want_logprobs",
        "_as_ids",
        "stop_token_logprobs",
        "completion_tokens",
        "finish_reason",
        "stop_reason",
        "error",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        stop_conditions: StopConditions,
        sampling: SamplingOptions,
        output: OutputOptions,
    ) -> None:
        sc = stop_conditions
        self._tok = tokenizer
        self._step = tokenizer.decode_stream(prompt_ids, bool(output.skip_special_tokens)).step
        matcher = StopStringMatcher(sc.stop, bool(sampling.include_stop_str_in_output)) if sc.stop else None
        self._matcher: StopStringMatcher | None = matcher if matcher is not None and matcher.stops else None
        self._hidden: frozenset[int] = (
            frozenset() if sc.ignore_eos else frozenset(sc.stop_token_ids_hidden or ())
        )
        self._stop_ids: frozenset[int] = frozenset(sc.stop_token_ids or ())
        self._min_tokens: int = sc.min_tokens or 0
        self._max_tokens: int | None = sc.max_tokens
        self._want_logprobs = output.logprobs is not None
        self._as_ids = bool(output.return_tokens_as_token_ids)
        # The token that ends the stream without text (EOS, a stop id) gets a logprob too: the token-out
        # route pairs every token id with one, as vLLM does.
        self.stop_token_logprobs = False
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(self, engine_output: LLMEngineOutput) -> ProcessedDelta:
        if self.finish_reason is not None:
            return self._finished_delta(engine_output.completion_usage)
        ids = engine_output.token_ids
        engine_text = engine_output.text
        count = self.completion_tokens
        min_tokens = self._min_tokens
        max_tokens = self._max_tokens
        hidden = self._hidden
        stop_ids = self._stop_ids
        matcher = self._matcher
        reason: str | None = None
        stop_reason: str | int | None = None
        text = ""
        n = 0
        silent_last = False  # the last accepted token ends the stream and shows no text (EOS, stop id)
        # Text-input engines decode themselves: their text passes through (stop strings still apply)
        # and the token ids only count and end the stream.
        step = self._step if engine_text is None else None
        for tid in ids:
            count += 1
            n += 1
            if count > min_tokens:
                if tid in hidden:
                    reason, silent_last = "eos", True
                    break
                if tid in stop_ids:
                    reason, stop_reason, silent_last = "stop", tid, True
                    break
            if step is not None:
                piece = step(tid)
                if matcher is None:
                    text += piece
                elif piece:
                    emitted, matched = matcher.feed(piece, count >= min_tokens)
                    text += emitted
                    if matched is not None:
                        reason, stop_reason = "stop", matched
                        break
            if max_tokens is not None and count >= max_tokens:
                reason = "length"
                break
        if engine_text is not None:
            if matcher is None:
                text = engine_text
            elif engine_text:
                emitted, matched = matcher.feed(engine_text, count >= min_tokens)
                text = emitted
                if matched is not None:
                    reason, stop_reason = "stop", matched
        self.completion_tokens = count
        error = None
        if reason is not None:
            if matcher is not None:
                text += matcher.flush()
        else:
            raw = engine_output.finish_reason
            if raw is not None:
                reason, error = parse_finish_reason(raw, engine_output.error)
                stop_reason = engine_output.stop_reason
                if matcher is not None and reason in _FLUSH_REASONS:
                    text += matcher.flush()
        if reason is not None:
            self.finish_reason = reason
            self.stop_reason = stop_reason
            self.error = error
        accepted = ids if n == len(ids) else ids[:n]
        logprobs = None
        shown = accepted[:-1] if silent_last and not self.stop_token_logprobs else accepted
        if self._want_logprobs and shown:
            logprobs = self._logprobs(shown, engine_output)
        return ProcessedDelta(
            text, accepted, reason, error, stop_reason, logprobs, engine_output.completion_usage, count
        )

    def finish(self) -> ProcessedDelta:
        """End of stream: release text still held back for a possible stop string."""
        text = ""
        if self.finish_reason is None and self._matcher is not None:
            text = self._matcher.flush()
        return ProcessedDelta(
            text, [], self.finish_reason, self.error, self.stop_reason, None, None, self.completion_tokens
        )

    def _finished_delta(self, usage: CompletionUsage | None) -> ProcessedDelta:
        return ProcessedDelta(
            "", [], self.finish_reason, self.error, self.stop_reason, None, usage, self.completion_tokens
        )

    def _token_text(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self._as_ids else self._tok.token_text(token_id)

    def _logprobs(self, ids: list[int], out: LLMEngineOutput) -> list[TokenLogprob] | None:
        values = out.log_probs
        if not values:
            return None
        tops = out.top_logprobs or ()
        tok = self._tok
        result: list[TokenLogprob] = []
        for j, tid in enumerate(ids):
            top = [TopLogprob(self._token_text(e.token_id), e.token_id, e.logprob, tok.token_bytes(e.token_id), e.rank)
                   for e in tops[j]] if j < len(tops) and tops[j] else []
            result.append(TokenLogprob(self._token_text(tid), tid, values[j] if j < len(values) else None,
                                       tok.token_bytes(tid), top))
        return result
