"""The contract between the request frame (`frontend.serving`) and each API: the frame runs every
generation request the same way (preprocess, route, collect the worker's deltas into an `Outcome`); an
`Answer` turns that into the route's own wire format: its SSE events while streaming, its JSON body when
unary, its error shape. One `Answer` object serves one request, so it may keep the state its event sequence
needs."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tandem.frontend.protocol.errors import RequestError
from tandem.llm.parsers import ParsedDelta, ToolCallDelta
from tandem.llm.postprocess import ProcessedDelta, TokenLogprob
from tandem.llm.protocols import CompletionUsage, FinishReason


@dataclass
class Outcome:
    """What one request produced, for the response, metrics and the log line."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's message.tool_calls
    reasoning_tokens: int | None = None  # counted when the model has a reasoning parser
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: CompletionUsage | None = None  # the engine's
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
    nvext: dict[str, Any] | None = None  # what the request's `nvext.extra_fields` asked for (OpenAI's routes)

    @property
    def openai(self) -> str:
        """OpenAI's finish_reason (`tool_calls` for an answer that called tools)."""
        finish = FinishReason(self.reason).openai
        return "tool_calls" if finish == "stop" and self.called_tools else finish


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
    def failure(self, error: RequestError) -> bytes:
        """What ends a stream that failed after its headers were sent."""

    @abstractmethod
    def body(self, outcome: Outcome, ending: Ending) -> Any:
        """The unary answer (a JSON value)."""

    @staticmethod
    def error_body(error: RequestError) -> dict[str, Any]:
        """An error answered before the stream began, in the route's shape."""
        return error.body()
