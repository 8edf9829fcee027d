"""How each route writes its answer. The HTTP server runs every generation request the same way
(preprocess, route, collect the worker's deltas into an `Outcome`); an `Answer` turns that into the
route's own wire format: its SSE events while streaming, its JSON body when unary, its error shape.
One `Answer` object serves one request, so it may keep the state its event sequence needs."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tandem.frontend import openai
from tandem.llm.parsers import ParsedDelta, ToolCallDelta
from tandem.llm.postprocess import ProcessedDelta, TokenLogprob


@dataclass
class Outcome:
    """What one request produced, for the response, metrics and the log line."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's message.tool_calls
    reasoning_tokens: int | None = None  # counted when the model has a reasoning parser
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    completion_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None

    def add_calls(self, deltas: list[ToolCallDelta]) -> None:
        for d in deltas:
            if d.id is not None:
                self.tool_calls.append({"id": d.id, "type": "function",
                                        "function": {"name": d.name, "arguments": d.arguments}})
            else:
                self.tool_calls[d.index]["function"]["arguments"] += d.arguments


class Usage(msgspec.Struct, frozen=True):
    """The token counts every route reports, each in its own words."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None  # prompt tokens the engine found in its prefix cache
    reasoning_tokens: int | None = None  # when the model has a reasoning parser


class Ending(msgspec.Struct, frozen=True):
    """How an answer ended: tandem's finish reason (eos, length, stop, cancelled, content_filter,
    error), the stop string or token id that ended it, whether it ended by calling tools."""

    reason: str
    stop_reason: str | int | None
    called_tools: bool
    usage: Usage

    @property
    def openai(self) -> str:
        """OpenAI's finish_reason (`tool_calls` for an answer that called tools)."""
        finish = openai.finish_reason(self.reason) or "stop"
        return "tool_calls" if finish == "stop" and self.called_tools else finish


def openai_error(error: openai.RequestError) -> dict[str, Any]:
    """OpenAI's error body, what the OpenAI routes answer."""
    return error.body()


class Answer(ABC):
    """One request's answer in its route's format. Streaming: `opening()`, `delta()` per processed
    delta, then `closing()` or, when the request fails midway, `failure()`. Unary: `collect()` per
    processed delta, then `body()`. `headers`: the route's own response headers (a warning, say)."""

    headers: dict[str, str] = {}

    def opening(self) -> list[bytes]:
        return []

    def collect(self, delta: ProcessedDelta, parsed: ParsedDelta | None) -> None:  # noqa: B027 (optional hook)
        """A delta of a unary answer. The `Outcome` has it already; an answer whose body keeps the order
        of its parts (as its stream shows them) keeps that order here."""

    @abstractmethod
    def delta(self, delta: ProcessedDelta, parsed: ParsedDelta | None) -> list[bytes]:
        """The events of one delta; `parsed` is what the request's parser found in it (None: no parser,
        the text is content)."""

    @abstractmethod
    def closing(self, outcome: Outcome, ending: Ending) -> list[bytes]:
        """The events that end a stream that succeeded."""

    @abstractmethod
    def failure(self, error: openai.RequestError) -> bytes:
        """What ends a stream that failed after its headers were sent."""

    @abstractmethod
    def body(self, outcome: Outcome, ending: Ending) -> Any:
        """The unary answer (a JSON value)."""

    @staticmethod
    def error_body(error: openai.RequestError) -> dict[str, Any]:
        """An error answered before the stream began, in the route's shape."""
        return openai_error(error)


class _ChunkAnswer(Answer):
    """What both OpenAI streams end with: the finish chunk, the usage chunk when asked, [DONE]; an error
    midway is an error object in a data event."""

    chunks: openai.ChatStream | openai.CompletionStream

    def closing(self, outcome: Outcome, ending: Ending) -> list[bytes]:
        events = [openai.sse(self.chunks.finish(ending.openai))]
        if self.chunks.include_usage:
            events.append(openai.sse(self.chunks.usage(_openai_usage(ending.usage))))
        events.append(openai.SSE_DONE)
        return events

    def failure(self, error: openai.RequestError) -> bytes:
        return error.sse()


class ChatAnswer(_ChunkAnswer):
    """`/v1/chat/completions`: chat.completion.chunk events (role first; finish; usage when asked; [DONE])."""

    def __init__(self, chunks: openai.ChatStream, reasoning_field: str, *, parsed_reasoning: bool) -> None:
        self.chunks: openai.ChatStream = chunks
        self.reasoning_field = reasoning_field
        self.parsed_reasoning = parsed_reasoning  # the request had a parser: a unary answer reports its thinking

    def opening(self) -> list[bytes]:
        return [openai.sse(self.chunks.start())]

    def delta(self, delta: ProcessedDelta, parsed: ParsedDelta | None) -> list[bytes]:
        chunks = self.chunks
        logprobs = openai.chat_logprobs(delta.logprobs) if delta.logprobs else None
        if parsed is None:  # no parser: the text is content
            return [openai.sse(chunks.content(delta.text, logprobs))] if delta.text or logprobs else []
        events = []
        if parsed.reasoning:
            events.append(openai.sse(chunks.reasoning(parsed.reasoning, self.reasoning_field, logprobs)))
            logprobs = None
        if parsed.content or logprobs:
            events.append(openai.sse(chunks.content(parsed.content, logprobs)))
        if parsed.tool_calls:
            events.append(openai.sse(chunks.tool_calls([d.openai() for d in parsed.tool_calls])))
        return events

    def body(self, outcome: Outcome, ending: Ending) -> Any:
        chunks = self.chunks
        content = "".join(outcome.text)
        return openai.chat_completion(chunks.id, chunks.created, chunks.model,
                                      content=None if outcome.tool_calls and not content else content,
                                      finish_reason=ending.openai, usage=_openai_usage(ending.usage),
                                      logprobs=openai.chat_logprobs(outcome.logprobs) if outcome.logprobs else None,
                                      tool_calls=outcome.tool_calls,
                                      reasoning=("".join(outcome.reasoning) or None) if self.parsed_reasoning else None,
                                      reasoning_field=self.reasoning_field)


class CompletionAnswer(_ChunkAnswer):
    """`/v1/completions`: text_completion events (finish; usage when asked; [DONE])."""

    def __init__(self, chunks: openai.CompletionStream) -> None:
        self.chunks: openai.CompletionStream = chunks
        self.text_offset = 0  # logprob offsets continue across chunks

    def delta(self, delta: ProcessedDelta, parsed: ParsedDelta | None) -> list[bytes]:
        if not (delta.text or delta.logprobs):
            return []
        logprobs = openai.completion_logprobs(delta.logprobs, self.text_offset) if delta.logprobs else None
        self.text_offset += len(delta.text)
        return [openai.sse(self.chunks.text(delta.text, logprobs))]

    def body(self, outcome: Outcome, ending: Ending) -> Any:
        chunks = self.chunks
        return openai.completion(chunks.id, chunks.created, chunks.model, text="".join(outcome.text),
                                 finish_reason=ending.openai, usage=_openai_usage(ending.usage),
                                 logprobs=openai.completion_logprobs(outcome.logprobs) if outcome.logprobs else None)


def _openai_usage(usage: Usage) -> dict[str, Any]:
    return openai.usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens,
                        reasoning_tokens=usage.reasoning_tokens)
