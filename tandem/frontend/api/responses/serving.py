"""OpenAI's Responses API: `POST /v1/responses` (the answer as a Response object or its stream of events),
`POST /v1/responses/input_tokens`, and the stored responses (`GET` and `DELETE /v1/responses/{id}`).

Output items come in the order the model writes them: its thinking as a `reasoning` item (the text in
`content` as `reasoning_text`), its text as a `message`, each tool call as a `function_call`. Errors
are OpenAI's shape, as on the other OpenAI routes.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from tandem.frontend.api.responses.protocol import ResponsesRequest, opaque_reasoning, parse_request
from tandem.frontend.api.responses.store import ResponseStore, StoredResponse
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


class _Item:
    """One output item while it is written."""

    __slots__ = ("kind", "index", "id", "parts", "call_id", "name", "namespace", "opaque")

    def __init__(self, kind: str, index: int, call_id: str | None = None, name: str | None = None,
                 namespace: str | None = None, opaque: bool = False) -> None:  # fmt: skip
        self.kind = kind  # reasoning, message or function_call
        self.index = index
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        self.id = f"{prefix}_{uuid.uuid4().hex}"
        self.parts: list[str] = []  # its text, thinking or arguments so far
        self.call_id = call_id
        self.name = name
        self.namespace = namespace  # a namespace tool's function: called back as (namespace, name)
        self.opaque = opaque  # a reasoning item that carries encrypted_content

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def json(self, status: str) -> dict[str, Any]:
        """The item as the output lists it; `status` in_progress while it is added."""
        text = self.text if status != "in_progress" else ""
        if self.kind == "function_call":
            call = {"id": self.id, "type": "function_call", "status": status, "call_id": self.call_id,
                    "name": self.name, "arguments": text}  # fmt: skip
            return call if self.namespace is None else {**call, "namespace": self.namespace}
        if self.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
            item = {"id": self.id, "type": "reasoning", "status": status, "summary": [], "content": content}
            return {**item, "encrypted_content": opaque_reasoning(text)} if self.opaque else item
        content = [_output_text(text)] if status != "in_progress" else []
        return {"id": self.id, "type": "message", "status": status, "role": "assistant", "content": content}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseAnswer(Answer):
    """A Response object, or its events: response.created and response.in_progress; per output item
    output_item.added, its content part, its deltas, their done events and output_item.done; then
    response.completed (response.incomplete when max_output_tokens cut it; response.failed after an error
    event when the request failed). A finished response is stored when the request asked for it."""

    def __init__(self, request: ResponsesRequest, response_id: str, model: str, history: StoredResponse | None,
                 store: ResponseStore) -> None:  # fmt: skip
        self.request = request
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        # the earlier turns and this input, and their images, for the store
        self.conversation = [*history.messages, *request.input] if history else request.input
        self.images = [*history.images, *request.images] if history else request.images
        self.store = store
        self.sequence = 0
        self.items: list[_Item] = []
        self.open: _Item | None = None
        self.quiet = False  # a unary answer: items are kept, events not written
        self._echo = request.echo()  # the request's settings, the same in each Response the answer writes
        if request.left_out_tools:
            self.headers = left_out_header(request.left_out_tools)

    def response(self, status: str, output: list[dict[str, Any]], usage: Usage | None = None,
                 incomplete: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "background": False, "error": error,
                "incomplete_details": {"reason": incomplete} if incomplete else None, "model": self.model,
                "output": output, "usage": _usage(usage) if usage is not None else None,
                **self._echo}  # fmt: skip

    # -- streaming --
    def _event(self, kind: str, **fields: Any) -> bytes:
        if self.quiet:
            return b""
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return named_sse(kind, event)

    def opening(self) -> list[bytes]:
        started = self.response("in_progress", [])
        return [self._event("response.created", response=started), self._event("response.in_progress", response=started)]

    def delta(self, delta: ProcessedDelta, parsed: ParsedDelta | None) -> list[bytes]:
        if parsed is None:
            return self._write("message", delta.text) if delta.text else []
        events = self._write("reasoning", parsed.reasoning) if parsed.reasoning else []
        if parsed.content:
            events += self._write("message", parsed.content)
        for call in parsed.tool_calls:
            if call.id is not None:
                events += self._close()
                namespace, name = self.request.called(call.name or "")
                item = self._add(_Item("function_call", len(self.items), call.id, name, namespace))
                events.append(self._event("response.output_item.added", output_index=item.index,
                                          item=item.json("in_progress")))
            if call.arguments and self.open is not None:
                self.open.parts.append(call.arguments)
                events.append(self._event("response.function_call_arguments.delta", item_id=self.open.id,
                                          output_index=self.open.index, delta=call.arguments))
        return events

    def _add(self, item: _Item) -> _Item:
        self.items.append(item)
        self.open = item
        return item

    def _write(self, kind: str, text: str) -> list[bytes]:
        """Text into the open item of `kind`, opening one (and closing the one before) when needed."""
        events: list[bytes] = []
        item = self.open
        if item is None or item.kind != kind:
            events += self._close()
            opaque = kind == "reasoning" and self.request.encrypted_reasoning
            item = self._add(_Item(kind, len(self.items), opaque=opaque))
            events.append(self._event("response.output_item.added", output_index=item.index,
                                      item=item.json("in_progress")))
            part = _output_text("") if kind == "message" else {"type": "reasoning_text", "text": ""}
            events.append(self._event("response.content_part.added", item_id=item.id, output_index=item.index,
                                      content_index=0, part=part))
        item.parts.append(text)
        if kind == "message":
            events.append(self._event("response.output_text.delta", item_id=item.id, output_index=item.index,
                                      content_index=0, delta=text, logprobs=[]))
        else:
            events.append(self._event("response.reasoning_text.delta", item_id=item.id, output_index=item.index,
                                      content_index=0, delta=text))
        return events

    def _close(self, status: str = "completed") -> list[bytes]:
        item = self.open
        if item is None:
            return []
        self.open = None
        at = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call":
            events = [self._event("response.function_call_arguments.done", **at, name=item.name, arguments=item.text)]
        elif item.kind == "message":
            events = [self._event("response.output_text.done", **at, content_index=0, text=item.text, logprobs=[]),
                      self._event("response.content_part.done", **at, content_index=0, part=_output_text(item.text))]
        else:
            part = {"type": "reasoning_text", "text": item.text}
            events = [self._event("response.reasoning_text.done", **at, content_index=0, text=item.text),
                      self._event("response.content_part.done", **at, content_index=0, part=part)]
        events.append(self._event("response.output_item.done", output_index=item.index, item=item.json(status)))
        return events

    def closing(self, outcome: Outcome, ending: Ending) -> list[bytes]:
        incomplete = _incomplete(ending)
        status = "incomplete" if incomplete else "completed"
        events = self._close(status)
        done = self.response(status, [item.json(status) for item in self.items], ending.usage, incomplete)
        self._keep(done, outcome)
        events.append(self._event(f"response.{status}", response=done))
        return events

    def failure(self, error: RequestError) -> bytes:
        output = [item.json("incomplete") for item in self.items]
        failed = self.response("failed", output, error={"code": "server_error", "message": error.message})
        return (self._event("error", code="server_error", message=error.message, param=None)
                + self._event("response.failed", response=failed))

    # -- unary --
    def collect(self, delta: ProcessedDelta, parsed: ParsedDelta | None) -> None:
        """The same items as a stream would have, in the order the model wrote them; no events."""
        self.quiet = True
        self.delta(delta, parsed)

    def body(self, outcome: Outcome, ending: Ending) -> Any:
        incomplete = _incomplete(ending)
        status = "incomplete" if incomplete else "completed"
        self._close(status)
        response = self.response(status, [item.json(status) for item in self.items], ending.usage, incomplete)
        self._keep(response, outcome)
        return response

    def _keep(self, response: dict[str, Any], outcome: Outcome) -> None:
        """Store the finished response and its conversation (when the request asked to)."""
        if not self.request.store:
            return
        reply: dict[str, Any] = {"role": "assistant", "content": "".join(outcome.text) or None}
        if outcome.tool_calls:
            reply["tool_calls"] = outcome.tool_calls
        if outcome.reasoning:
            reply["reasoning_content"] = "".join(outcome.reasoning)
        self.store.put(self.id, StoredResponse(response, [*self.conversation, reply], self.images))


def _incomplete(ending: Ending) -> str | None:
    if ending.reason == "length":
        return "max_output_tokens"
    return "content_filter" if ending.reason == "content_filter" else None


def _usage(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens or 0, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens or 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}  # fmt: skip


def routes(serving: Serving) -> Mount:
    api = ResponsesApi(serving)
    return Mount([web.post("/v1/responses", api.create_response),
                  web.post("/v1/responses/input_tokens", api.count_response_tokens),
                  web.get("/v1/responses/{response_id}", api.get_response),
                  web.delete("/v1/responses/{response_id}", api.delete_response)])


class ResponsesApi:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.store = ResponseStore(serving.config.responses_store_size, serving.runtime.instance_id)

    async def create_response(self, request: web.Request) -> web.StreamResponse:
        serving = self.serving
        body = await serving.body(request)
        parsed = parse_request(body)
        model = serving.model(parsed.model, ModelType.Chat, "/v1/responses")
        serving.token_input(model, "/v1/responses")
        history = self._history(parsed.previous_response_id)
        store = self.store

        def answer(request_id: str, prepared: Prepared) -> Answer:
            return ResponseAnswer(parsed, store.new_id(request_id), model.name, history, store)

        return await serving.serve(request, _chat(parsed, history), len(body), model.pipeline, "responses", answer)

    async def count_response_tokens(self, request: web.Request) -> web.Response:
        serving = self.serving
        body = await serving.body(request)
        parsed = parse_request(body)
        model = serving.model(parsed.model, ModelType.Chat, "/v1/responses/input_tokens")
        chat = _chat(parsed, self._history(parsed.previous_response_id))
        count = await serving.token_input(model, "/v1/responses/input_tokens").count_prompt_tokens(chat, len(body))
        return web.json_response({"object": "response.input_tokens", "input_tokens": count})

    async def get_response(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        stored = self.store.get(response_id)
        if stored is None:
            raise RequestError(self.store.why_missing(response_id), status=404, param="response_id")
        return web.Response(body=msgspec.json.encode(stored.response), content_type="application/json")

    async def delete_response(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        if not self.store.delete(response_id):
            raise RequestError(self.store.why_missing(response_id), status=404, param="response_id")
        return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})

    def _history(self, previous_response_id: str | None) -> StoredResponse | None:
        """The conversation a response continues (`previous_response_id`)."""
        if previous_response_id is None:
            return None
        stored = self.store.get(previous_response_id)
        if stored is None:
            raise RequestError(self.store.why_missing(previous_response_id), param="previous_response_id")
        return stored


def _chat(parsed: ResponsesRequest, history: StoredResponse | None) -> ChatRequest:
    return parsed.chat(history.messages, history.images) if history else parsed.chat([])
