"""OpenAI's routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`. A token-input
model's request runs in the shared frame (`Serving.serve`) and is written by `ChatAnswer` or
`CompletionAnswer`; a text-input model's chat request (`--use-vllm-tokenizer`) is relayed to its engine as
it is, and the chunks it streams back are relayed to the client."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

from tandem.frontend.api.openai.protocol import (
    ChatStream,
    CompletionStream,
    chat_completion,
    chat_logprobs,
    completion,
    completion_logprobs,
    models_list,
    parse_chat_request,
    parse_completion_request,
    usage_body,
)
from tandem.frontend.hints import hint_param, routing_hints
from tandem.frontend.pipeline import ModelPipeline
from tandem.frontend.preprocess import Prepared
from tandem.frontend.protocol.answer import Answer, Ending, Outcome, Usage
from tandem.frontend.protocol.errors import RequestError
from tandem.frontend.protocol.sse import SSE_DONE, SSE_HEADERS, sse
from tandem.frontend.protocol.validation import check_wire_fields
from tandem.frontend.requests import ChatRequest
from tandem.frontend.serving import STREAM_ERRORS, Mount, Serving, public_error
from tandem.llm.model_card import ModelType
from tandem.llm.parsers import ParsedDelta
from tandem.llm.postprocess import ProcessedDelta
from tandem.llm.protocols import CompletionUsage, RoutingHints, TextChunk


def routes(serving: Serving) -> Mount:
    api = OpenAIApi(serving)
    return Mount([web.post("/v1/chat/completions", api.chat_completions), web.post("/v1/completions", api.completions),
                  web.get("/v1/models", api.list_models), web.get("/v1/models/{model:.+}", api.get_model)])


class OpenAIApi:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        serving = self.serving
        body = await serving.body(request)
        chat = parse_chat_request(body)
        model = serving.model(chat.model, ModelType.Chat, "/v1/chat/completions")
        pipeline: ModelPipeline = model.pipeline
        if pipeline.preprocessor is None:
            hints = routing_hints(chat, request.headers)
            _check_text_input(chat, model.name, hints, request)
            raw = check_wire_fields(msgspec.json.decode(body))
            return await self._relay_text(request, chat, raw, hints, pipeline)
        reasoning_field = serving.config.reasoning_field

        def answer(request_id: str, prepared: Prepared) -> Answer:
            chunks = ChatStream(model.name, include_usage=chat.include_usage, id=f"chatcmpl-{request_id}")
            return ChatAnswer(chunks, reasoning_field, parsed_reasoning=prepared.parser is not None)

        return await serving.serve(request, chat, len(body), pipeline, "chat_completions", answer)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        serving = self.serving
        body = await serving.body(request)
        parsed = parse_completion_request(body)
        model = serving.model(parsed.model, ModelType.Completions, "/v1/completions")
        pipeline: ModelPipeline = model.pipeline
        if pipeline.preprocessor is None:
            raise RequestError(f"model {model.name!r} only serves chat completions", param="model")

        def answer(request_id: str, prepared: Prepared) -> Answer:
            return CompletionAnswer(CompletionStream(model.name, include_usage=parsed.include_usage,
                                                     id=f"cmpl-{request_id}"))

        return await serving.serve(request, parsed, len(body), pipeline, "completions", answer)

    def _entries(self) -> list[tuple[str, int, str, str | None]]:
        return [(m.name, m.created, "tandem", m.parent) for m in self.serving.manager.served()]

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response(models_list(self._entries()))

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        for entry in self._entries():
            if entry[0] == name:
                return web.json_response(models_list([entry])["data"][0])
        raise RequestError.model_not_found(name)

    async def _relay_text(self, request: web.Request, chat: ChatRequest, raw: dict[str, Any],
                          hints: RoutingHints | None, pipeline: ModelPipeline) -> web.StreamResponse:
        """Text-input models (`--use-vllm-tokenizer` workers) template and tokenize in the engine: forward the
        OpenAI request and relay the chat chunks it streams back, in the same frame as every request (its
        token counts are the engine's usage)."""
        serving, endpoint = self.serving, "chat_completions"
        pinned = serving.pinned(hints, pipeline, request)
        if hints is not None and hints.decode_worker_id is not None:
            pinned = hints.decode_worker_id  # no prefill leg here: its decode worker serves it whole
        model_name = pipeline.model.name
        async with serving.track(request, model_name, endpoint, stream=chat.stream) as t:
            outcome, engine_usage = t.outcome, None
            response_id, created = f"chatcmpl-{t.request_id}", int(time.time())
            outputs = t.outputs = pipeline.generate(dict(raw, model=model_name), t.context, t.attempt, pinned=pinned)
            try:
                first: TextChunk | None = await anext(outputs, None)
            except Exception as e:
                return serving.failure(e, model_name, endpoint)
            if first is not None:  # the engine's first chunk carries its first text
                outcome.first_token_at = time.perf_counter()
                serving.metrics.queued.labels(model_name).dec()
            if chat.stream:
                t.response = web.StreamResponse(headers=SSE_HEADERS)
                await t.response.prepare(request)
            chunk = first
            try:
                while chunk is not None:
                    chunk.id, chunk.created, chunk.model = response_id, created, model_name
                    for choice in chunk.choices:
                        outcome.text.append(choice.delta.content)
                        outcome.finish_reason = choice.finish_reason or outcome.finish_reason
                    engine_usage = chunk.usage or engine_usage
                    if t.response is not None:
                        await t.response.write(sse(chunk))
                    chunk = await anext(outputs, None)
                serving.raise_if_cut_off(t.context)
            except STREAM_ERRORS as e:
                if t.response is None:
                    return serving.failure(e, model_name, endpoint)
                await t.response.write(public_error(e).sse())
                await t.response.write_eof()
                return t.response
            engine_usage = engine_usage or CompletionUsage(0, 0, 0)
            t.prompt_tokens, outcome.completion_tokens = engine_usage.prompt_tokens, engine_usage.completion_tokens
            t.status = "success"
            if t.response is not None:
                await t.response.write(SSE_DONE)
                await t.response.write_eof()
                return t.response
            return web.json_response(chat_completion(
                response_id, created, model_name, content="".join(outcome.text),
                finish_reason=outcome.finish_reason or "stop", usage=msgspec.to_builtins(engine_usage)))
        return t.gone()


class _ChunkAnswer(Answer):
    """What both OpenAI streams end with: the finish chunk, the usage chunk when asked, [DONE]; an error
    midway is an error object in a data event."""

    chunks: ChatStream | CompletionStream

    def closing(self, outcome: Outcome, ending: Ending) -> list[bytes]:
        finish = self.chunks.finish(ending.openai)
        if ending.nvext:
            finish["nvext"] = ending.nvext
        events = [sse(finish)]
        if self.chunks.include_usage:
            events.append(sse(self.chunks.usage(_openai_usage(ending.usage))))
        events.append(SSE_DONE)
        return events

    def failure(self, error: RequestError) -> bytes:
        return error.sse()


class ChatAnswer(_ChunkAnswer):
    """`/v1/chat/completions`: chat.completion.chunk events (role first; finish; usage when asked; [DONE])."""

    def __init__(self, chunks: ChatStream, reasoning_field: str, *, parsed_reasoning: bool) -> None:
        self.chunks: ChatStream = chunks
        self.reasoning_field = reasoning_field
        self.parsed_reasoning = parsed_reasoning  # the request had a parser: a unary answer reports its thinking

    def opening(self) -> list[bytes]:
        return [sse(self.chunks.start())]

    def delta(self, delta: ProcessedDelta, parsed: ParsedDelta | None) -> list[bytes]:
        chunks = self.chunks
        logprobs = chat_logprobs(delta.logprobs) if delta.logprobs else None
        if parsed is None:  # no parser: the text is content
            if logprobs:
                return [sse(chunks.content(delta.text, logprobs))]
            return [chunks.text_event(delta.text)] if delta.text else []
        events = []
        if parsed.reasoning:
            events.append(sse(chunks.reasoning(parsed.reasoning, self.reasoning_field, logprobs)))
            logprobs = None
        if parsed.content or logprobs:
            events.append(sse(chunks.content(parsed.content, logprobs)))
        if parsed.tool_calls:
            events.append(sse(chunks.tool_calls([d.openai() for d in parsed.tool_calls])))
        return events

    def body(self, outcome: Outcome, ending: Ending) -> Any:
        chunks = self.chunks
        content = "".join(outcome.text)
        return _with_nvext(chat_completion(
            chunks.id, chunks.created, chunks.model, content=None if outcome.tool_calls and not content else content,
            finish_reason=ending.openai, usage=_openai_usage(ending.usage),
            logprobs=chat_logprobs(outcome.logprobs) if outcome.logprobs else None, tool_calls=outcome.tool_calls,
            reasoning=("".join(outcome.reasoning) or None) if self.parsed_reasoning else None,
            reasoning_field=self.reasoning_field), ending)


class CompletionAnswer(_ChunkAnswer):
    """`/v1/completions`: text_completion events (finish; usage when asked; [DONE])."""

    def __init__(self, chunks: CompletionStream) -> None:
        self.chunks: CompletionStream = chunks
        self.text_offset = 0  # logprob offsets continue across chunks

    def delta(self, delta: ProcessedDelta, parsed: ParsedDelta | None) -> list[bytes]:
        if not (delta.text or delta.logprobs):
            return []
        logprobs = completion_logprobs(delta.logprobs, self.text_offset) if delta.logprobs else None
        self.text_offset += len(delta.text)
        return [sse(self.chunks.text(delta.text, logprobs)) if logprobs else self.chunks.text_event(delta.text)]

    def body(self, outcome: Outcome, ending: Ending) -> Any:
        chunks = self.chunks
        return _with_nvext(completion(chunks.id, chunks.created, chunks.model, text="".join(outcome.text),
                                      finish_reason=ending.openai, usage=_openai_usage(ending.usage),
                                      logprobs=completion_logprobs(outcome.logprobs) if outcome.logprobs else None),
                           ending)


def _with_nvext(body: dict[str, Any], ending: Ending) -> dict[str, Any]:
    """A unary answer with the `nvext` its request asked for (`nvext.extra_fields`)."""
    if ending.nvext:
        body["nvext"] = ending.nvext
    return body


def _openai_usage(usage: Usage) -> dict[str, Any]:
    return usage_body(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens,
                        reasoning_tokens=usage.reasoning_tokens)


# What a text-input worker's request (the client's body, relayed) has no place for: refused by name.
_TEXT_UNSERVED_NVEXT = ("annotations", "use_raw_prompt", "greed_sampling", "extra_fields")
_TEXT_UNSERVED_HINTS = ("prefill_worker_id", "dp_rank", "prefill_dp_rank", "priority", "cache_salt")


def _check_text_input(chat: ChatRequest, model: str, hints: RoutingHints | None, request: web.Request) -> None:
    """A text-input model's engine templates the request and its output is relayed as it is: what needs the
    frontend's parsing or the engine's guided decoding, and what its worker's request cannot carry (routing
    hints other than the worker, nvext's prompt and sampling switches), is refused rather than ignored."""
    why = f"model {model!r} takes text input (--use-vllm-tokenizer): its engine's output is relayed unparsed"
    relayed = f"model {model!r} takes text input (--use-vllm-tokenizer): its engine gets the request as it is"
    for name in _TEXT_UNSERVED_NVEXT:
        if getattr(chat.ext, name):
            raise RequestError(f"{relayed}, and 'nvext.{name}' is not honoured there", param=f"nvext.{name}")
    for name in _TEXT_UNSERVED_HINTS if hints is not None else ():
        if getattr(hints, name) is not None:
            param = hint_param(name, request.headers)
            raise RequestError(f"{relayed}, and '{param}' is not honoured there", param=param)
    if chat.tools and chat.tool_choice != "none":
        raise RequestError(f"{why}, so tool calls cannot be returned; send tool_choice 'none' or serve "
                                  "the model with token input", param="tool_choice")
    if chat.guided is not None:
        given = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "structured_outputs")
        raise RequestError(f"{why} and its text mode has no guided decoding",
                                  param=next((name for name in given if getattr(chat, name) is not None), None))
    if chat.ext.max_thinking_tokens is not None:
        raise RequestError(f"{why}, with no reasoning parser", param="nvext.max_thinking_tokens")
