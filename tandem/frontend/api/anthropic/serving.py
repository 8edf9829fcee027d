"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`, answered in
Anthropic's shapes: content blocks in the order the model writes them (`thinking`, `text`, `tool_use`),
streamed as Anthropic's events. Usage follows Anthropic's split: `input_tokens` are the prompt tokens the
engine computed, `cache_read_input_tokens` those it found in its prefix cache (their sum is the prompt).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from aiohttp import web

from tandem.frontend.api.anthropic.protocol import (
    MessagesRequest,
    error_body,
    note_betas,
    parse_count_tokens_request,
    parse_messages_request,
)
from tandem.frontend.models import ServedModel
from tandem.frontend.preprocess import Prepared
from tandem.frontend.protocol.answer import Answer, Ending, Outcome, Usage
from tandem.frontend.protocol.errors import RequestError
from tandem.frontend.protocol.sse import named_sse
from tandem.frontend.requests import ChatRequest
from tandem.frontend.serving import Mount, Serving
from tandem.frontend.tolerant import left_out_header
from tandem.llm.model_card import ModelType
from tandem.llm.parsers import ParsedDelta
from tandem.llm.postprocess import ProcessedDelta

# tandem's finish reasons (eos, length, stop, cancelled, content_filter, error) as Anthropic's stop_reason.
_STOP_REASONS = {"length": "max_tokens", "content_filter": "refusal"}


def stop_reason(outcome: Outcome, ending: Ending) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence: an answer that ended by itself with tool calls is a
    tool_use (a forced tool too, unlike OpenAI's finish_reason); a stop string is a stop_sequence."""
    if ending.reason in ("eos", "stop") and (ending.called_tools or outcome.tool_calls):
        return "tool_use", None
    if ending.reason == "stop" and isinstance(ending.stop_reason, str):
        return "stop_sequence", ending.stop_reason
    return _STOP_REASONS.get(ending.reason, "end_turn"), None


def message_usage(counts: Usage) -> dict[str, Any]:
    """Anthropic's usage: `input_tokens` leaves out the prompt tokens read from the cache."""
    cached = counts.cached_tokens
    out: dict[str, Any] = {"input_tokens": counts.prompt_tokens - (cached or 0),
                           "output_tokens": counts.completion_tokens}
    if cached is not None:
        out["cache_read_input_tokens"] = cached
    if counts.reasoning_tokens is not None:
        out["output_tokens_details"] = {"thinking_tokens": counts.reasoning_tokens}
    return out


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use's `input` object. Arguments that are no JSON object (a call cut off
    by max_tokens, which stop_reason tells) give an empty input: Anthropic's input is always an object."""
    try:
        value = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def sse(event: dict[str, Any]) -> bytes:
    """One server-sent event, named by its type as Anthropic's are."""
    return named_sse(event["type"], event)


_EMPTY_BLOCKS: dict[str, dict[str, Any]] = {"text": {"type": "text", "text": ""},
                                            "thinking": {"type": "thinking", "thinking": "", "signature": ""}}
_DELTAS = {"text": "text_delta", "thinking": "thinking_delta"}


class MessagesAnswer(Answer):
    """`/v1/messages`: a Message object, or Anthropic's events: message_start, ping, then per content block
    content_block_start / content_block_delta... / content_block_stop (a new kind of output closes the open
    block), message_delta (stop reason, usage) and message_stop; `error` when the stream fails midway."""

    error_body = staticmethod(error_body)

    def __init__(self, model: str, message_id: str, input_tokens: int, left_out_tools: Sequence[str] = ()) -> None:
        if left_out_tools:
            self.headers = left_out_header(left_out_tools)
        self.model = model
        self.message_id = message_id
        self.input_tokens = input_tokens
        self._content: list[dict[str, Any]] = []  # the blocks so far, in the order they were written
        self._parts: list[list[str]] = []  # each block's text, thinking or input JSON so far
        self._open: str | None = None  # the type of the block being written
        self._quiet = False  # a unary answer: blocks are kept, events not written

    def _message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                 usage: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    def opening(self) -> list[bytes]:
        start = self._message([], (None, None), {"input_tokens": self.input_tokens, "output_tokens": 0})
        return [sse({"type": "message_start", "message": start}), sse({"type": "ping"})]

    def delta(self, delta: ProcessedDelta, parsed: ParsedDelta | None) -> list[bytes]:
        if parsed is None:  # no parser: the text is the answer
            return self._write("text", delta.text)
        events = self._write("thinking", parsed.reasoning) + self._write("text", parsed.content)
        for call in parsed.tool_calls:
            if call.id is not None:  # a call's first piece: its own block
                events += self._start({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
            if call.arguments and self._open == "tool_use":
                events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}, call.arguments))
        return events

    def _write(self, kind: str, text: str) -> list[bytes]:
        if not text:
            return []
        events = [] if self._open == kind else self._start(dict(_EMPTY_BLOCKS[kind]))
        events.append(self._delta({"type": _DELTAS[kind], kind: text}, text))
        return events

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        events = self._stop()
        self._content.append(block)
        self._parts.append([])
        self._open = block["type"]
        if not self._quiet:
            events.append(sse({"type": "content_block_start", "index": len(self._content) - 1,
                               "content_block": block}))
        return events

    def _delta(self, delta: dict[str, Any], piece: str) -> bytes:
        self._parts[-1].append(piece)
        if self._quiet:
            return b""
        return sse({"type": "content_block_delta", "index": len(self._content) - 1, "delta": delta})

    def _stop(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        if self._quiet:
            return []
        events = []
        if self._content[-1]["type"] == "thinking":
            # Anthropic ends every thinking block with its signature; tandem's thinking has none to verify.
            events.append(self._delta({"type": "signature_delta", "signature": ""}, ""))
        events.append(sse({"type": "content_block_stop", "index": len(self._content) - 1}))
        return events

    def closing(self, outcome: Outcome, ending: Ending) -> list[bytes]:
        reason, sequence = stop_reason(outcome, ending)
        return [*self._stop(),
                sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                     "usage": message_usage(ending.usage)}),
                sse({"type": "message_stop"})]  # fmt: skip

    def failure(self, error: RequestError) -> bytes:
        return sse(error_body(error))

    def collect(self, delta: ProcessedDelta, parsed: ParsedDelta | None) -> None:
        """The same blocks as a stream would have, in the order the model wrote them; no events."""
        self._quiet = True
        self.delta(delta, parsed)

    def body(self, outcome: Outcome, ending: Ending) -> Any:
        content = []
        for block, parts in zip(self._content, self._parts, strict=True):
            kind, text = block["type"], "".join(parts)
            content.append(block | ({"input": tool_input(text)} if kind == "tool_use" else {kind: text}))
        return self._message(content, stop_reason(outcome, ending), message_usage(ending.usage))


def routes(serving: Serving) -> Mount:
    """The Messages routes (unless `--no-anthropic-api`); errors under /v1/messages are Anthropic's either way."""
    api = MessagesApi(serving)
    table = [web.post("/v1/messages", api.messages), web.post("/v1/messages/count_tokens", api.count_tokens)]
    return Mount(table if serving.config.anthropic_api else [], "/v1/messages", error_body)


class MessagesApi:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def messages(self, request: web.Request) -> web.StreamResponse:
        note_betas(request.headers.get("anthropic-beta"))
        body, model, parsed, chat = await self._read(request, parse_messages_request, "/v1/messages")

        def answer(request_id: str, prepared: Prepared) -> Answer:
            return MessagesAnswer(model.name, f"msg_{request_id}", len(prepared.prompt_ids), parsed.left_out_tools)

        return await self.serving.serve(request, chat, len(body), model.pipeline, "messages", answer)

    async def count_tokens(self, request: web.Request) -> web.Response:
        route = "/v1/messages/count_tokens"
        body, model, _, chat = await self._read(request, parse_count_tokens_request, route)
        count = await self.serving.token_input(model, route).count_prompt_tokens(chat, len(body))
        return web.json_response({"input_tokens": count})

    async def _read(self, request: web.Request, parse: Callable[[bytes], MessagesRequest],
                    route: str) -> tuple[bytes, ServedModel, MessagesRequest, ChatRequest]:
        """A Messages API body, its model, the request, and the chat request it means for that model."""
        serving = self.serving
        body = await serving.body(request)
        parsed = parse(body)
        model = serving.model(parsed.model, ModelType.Chat, route)
        reasoning = serving.token_input(model, route).parsers.reasoning is not None
        return body, model, parsed, parsed.chat(reasoning=reasoning)
