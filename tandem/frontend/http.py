"""The HTTP server (aiohttp): OpenAI's chat completions, completions and Responses routes, Anthropic's
Messages route, vLLM's token-in/token-out route (/inference/v1/generate), /v1/models, /health, /live,
/metrics, /openapi.json.

Every generation route runs the same way (`_serve`: preprocess, route, stream the worker's deltas) and
writes its answer through its own `Answer` (`tandem.frontend.answers`). Client mistakes get the route's
error shape with a 4xx status; a client that disconnects kills its request on the worker at once
(handler cancellation).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tandem.frontend import anthropic, embeddings, generate, openai, responses, tokenize
from tandem.frontend.answers import Answer, ChatAnswer, CompletionAnswer, Ending, Outcome, Usage, openai_error
from tandem.frontend.metrics import FrontendMetrics
from tandem.frontend.models import ModelManager, ServedModel
from tandem.frontend.openapi import openapi_spec
from tandem.frontend.pipeline import Attempt, ModelPipeline, StreamLost
from tandem.frontend.preprocess import Prepared, Preprocessor
from tandem.frontend.response_store import ResponseStore
from tandem.frontend.routing import NoWorkerError
from tandem.llm.model_card import ModelType
from tandem.llm.parsers import ChatParser, ParsedDelta
from tandem.llm.postprocess import OutputProcessor, ProcessedDelta
from tandem.llm.protocols import EmbeddingOutput, EmbeddingRequest, RoutingHints
from tandem.runtime import Context, DistributedRuntime, RemoteError, StreamIncompleteError
from tandem.runtime.auth import bearer_matches, key_matches

log = logging.getLogger("tandem.frontend")

SSE_BATCH = 16  # most SSE events held back for one write while the worker's outputs are already here
# (request id, the prepared request) -> the request's answer in its route's format
AnswerFactory = Callable[[str, Prepared], Answer]
ErrorShape = Callable[[openai.RequestError], dict[str, Any]]
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}
_ANY_MODEL = ModelType.Chat | ModelType.Completions | ModelType.Embedding  # the tokenizer routes serve every model
# Paths behind --api-key and closed to new POSTs while draining: vLLM's --api-key guards /inference too.
_GUARDED = ("/v1/", "/inference/")


@dataclass
class HttpConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None
    tls_cert_path: str | None = None
    tls_key_path: str | None = None
    body_limit_bytes: int = 192 * 1024 * 1024
    body_read_timeout: float = 60.0  # a client that declares a body and never sends it is cut off after this
    reasoning_field: str = "reasoning_content"  # or "reasoning" (vLLM's newer name)
    reuse_port: bool = False  # one of several frontend processes on the port (`--num-processes`)
    responses_store_size: int = 1024  # responses kept for previous_response_id (0: none)
    anthropic_api: bool = True  # /v1/messages


@dataclass
class Exchange:
    """One token-input request while it is answered: what the streaming and the unary paths share."""

    model: str
    request_id: str
    context: Context
    attempt: Attempt
    outcome: Outcome
    processor: OutputProcessor
    parser: ChatParser | None  # thinking and tool calls in a chat answer
    answer: Answer
    prompt_tokens: int  # the prompt's length: its token ids, or the rows of its prompt embeddings
    first: dict[str, Any]  # the worker's first output (routing failures were answered before)
    outputs: Any  # the rest of the worker's outputs


def _error(request: web.Request, status: int, message: str) -> web.Response:
    """An error the server answers before any route handler ran, in the shape of the route asked for."""
    error = openai.RequestError(message, status=status)
    return web.json_response(_error_shape(request.path)(error), status=status)


def _error_shape(path: str) -> ErrorShape:
    if path.startswith("/inference/"):
        return generate.error_body  # vLLM's: its `code` is the HTTP status
    return anthropic.error_body if path.startswith("/v1/messages") else openai_error


class FrontendServer:
    def __init__(self, runtime: DistributedRuntime, manager: ModelManager, metrics: FrontendMetrics,
                 config: HttpConfig) -> None:
        self.runtime = runtime
        self.manager = manager
        self.metrics = metrics
        self.config = config
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        self._inflight: dict[str, Context] = {}  # generation requests being served, by request id
        self.draining = False  # new generation requests are refused (shutdown)
        self._drain_expired = False  # the drain's bound passed: what still runs is being cut off
        self.responses = ResponseStore(config.responses_store_size, runtime.instance_id)

    # -- app -----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.body_limit_bytes,
                              middlewares=[self._errors, self._gate, self._auth])
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/responses", self.create_response)
        app.router.add_post("/v1/responses/input_tokens", self.count_response_tokens)
        app.router.add_get("/v1/responses/{response_id}", self.get_response)
        app.router.add_delete("/v1/responses/{response_id}", self.delete_response)
        if self.config.anthropic_api:
            app.router.add_post("/v1/messages", self.messages)
            app.router.add_post("/v1/messages/count_tokens", self.count_message_tokens)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post(generate.ROUTE, self.generate_tokens)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model:.+}", self.get_model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/live", self.live)
        app.router.add_get("/metrics", self.metrics_route)
        app.router.add_get("/openapi.json", self.openapi)
        return app

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        ssl_context = None
        if self.config.tls_cert_path:
            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(self.config.tls_cert_path, self.config.tls_key_path)
        site = web.TCPSite(self._runner, self.config.host, self.config.port, ssl_context=ssl_context,
                           backlog=1024, reuse_port=self.config.reuse_port or None)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        scheme = "https" if ssl_context else "http"
        log.info("OpenAI API on %s://%s:%d/v1", scheme, self.config.host, self.port)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except openai.RequestError as e:
            return web.json_response(_error_shape(request.path)(e), status=e.status)
        except web.HTTPException as e:
            if e.status == 413:
                return _error(request, 413, f"request body exceeds the limit of {self.config.body_limit_bytes} bytes")
            if isinstance(e, web.HTTPMethodNotAllowed):
                response = _error(request, 405, f"{request.method} {request.path}: {e.reason}")
                response.headers["Allow"] = ", ".join(sorted(e.allowed_methods))
                return response
            if e.status == 404:
                return _error(request, 404, f"{request.method} {request.path}: {e.reason}")
            raise
        except Exception:  # a defect here, never the client's mistake: the route's error shape, one log record
            log.exception("unexpected error serving %s %s", request.method, request.path)
            return _error(request, 500, "internal error while serving the request")

    @web.middleware
    async def _gate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.draining and request.method == "POST" and request.path.startswith(_GUARDED):
            response = _error(request, 503, "the server is shutting down; send the request to another frontend")
            response.headers["Connection"] = "close"
            return response
        return await handler(request)

    async def drain(self, timeout: float) -> None:
        """Shutdown: refuse new generation requests (503, and /health says unhealthy), let those in flight
        finish for at most `timeout` seconds, then cut the rest off with a "shutting down" error."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self._inflight:
            log.info("draining %d in-flight requests (at most %.0f s)", len(self._inflight), timeout)
        while self._inflight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self._inflight:
            log.warning("drain bound reached: cutting off %d requests", len(self._inflight))
            self._drain_expired = True
            for context in list(self._inflight.values()):
                context.kill()
            cutoff = loop.time() + 5.0  # their handlers write the error and end
            while self._inflight and loop.time() < cutoff:
                await asyncio.sleep(0.05)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        key = self.config.api_key
        if key and request.path.startswith(_GUARDED):
            headers = request.headers
            # Anthropic's clients send the key as x-api-key, OpenAI's as a bearer token: either will do.
            if not (bearer_matches(headers.get("Authorization", ""), key) or key_matches(headers.get("x-api-key"), key)):
                error = openai.RequestError("Incorrect or missing API key", status=401,
                                            type="invalid_request_error", code="invalid_api_key")
                return web.json_response(_error_shape(request.path)(error), status=401)
        return await handler(request)

    # -- infra routes --------------------------------------------------------------------------
    def list_entries(self) -> list[tuple[str, int, str, str | None]]:
        return [(m.name, m.created, "tandem", m.parent) for m in self.manager.served()]

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response(openai.models_list(self.list_entries()))

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        for entry in self.list_entries():
            if entry[0] == name:
                return web.json_response(openai.models_list([entry])["data"][0])
        raise openai.RequestError.model_not_found(name)

    async def health(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "unhealthy", "message": "shutting down", "endpoints": [],
                                      "instances": []}, status=503)
        models = self.manager.served()
        endpoints = sorted({path for m in models for path in m.instances.values()})
        instances = sorted({i for m in models for i in m.instances})
        if not endpoints:
            return web.json_response({"status": "unhealthy", "message": "No endpoints available",
                                      "endpoints": [], "instances": []}, status=503)
        # Prefill workers serve no request themselves: listed apart (disaggregated serving).
        prefill = sorted({i for m in models for i in m.prefill_instances})
        return web.json_response({"status": "healthy", "endpoints": endpoints, "instances": instances,
                                  "prefill_instances": prefill, "frontend": f"{self.runtime.instance_id:x}"})

    async def live(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "live", "message": "Service is live"})

    async def metrics_route(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.runtime.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_spec([entry[0] for entry in self.list_entries()],
                                              anthropic=self.config.anthropic_api))

    # -- inference routes ----------------------------------------------------------------------
    async def _body(self, request: web.Request) -> bytes:
        if request.content_length is not None and request.content_length > self.config.body_limit_bytes:
            raise openai.RequestError(
                f"request body exceeds the limit of {self.config.body_limit_bytes} bytes", status=413
            )
        # A body in another type (text/plain, a form) is what a web page can send without a CORS
        # preflight: refuse it. No Content-Type at all is read as JSON, as vLLM does.
        if request.headers.get("Content-Type") is not None and not _is_json(request.content_type):
            raise openai.RequestError(f"Content-Type must be application/json (got {request.content_type!r})",
                                      status=415)
        try:
            async with asyncio.timeout(self.config.body_read_timeout):
                return await request.read()
        except TimeoutError:
            raise openai.RequestError(f"the request body did not arrive within {self.config.body_read_timeout:g} s",
                                      status=408) from None

    def _model(self, name: str, kind: ModelType, route: str) -> ServedModel:
        """The served model `name`, if it serves `kind` of requests (a generation model makes no
        embeddings, an embedding model answers no chat)."""
        model = self.manager.get(name)
        if model is None:
            raise openai.RequestError.model_not_found(name)
        types = model.types
        if types & kind:
            return model
        if types & ModelType.Embedding:
            why = f"model {name!r} is an embedding model: it is served on /v1/embeddings, not {route}"
        elif kind is ModelType.Embedding:
            why = (f"model {name!r} is not an embedding model: /v1/embeddings needs a model its workers serve "
                   "in pooling mode (`tandem vllm --embedding-worker`)")
        else:
            why = f"model {name!r} is not served for {route} (its workers' --endpoint-types leave it out)"
        raise openai.RequestError(why, param="model")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        chat = openai.parse_chat_request(body)
        model = self._model(chat.model, ModelType.Chat, "/v1/chat/completions")
        pipeline: ModelPipeline = model.pipeline
        if pipeline.preprocessor is None:
            hints = openai.routing_hints(chat, request.headers)
            _check_text_input(chat, model.name, hints, request)
            raw = openai.check_wire_fields(msgspec.json.decode(body))
            return await self._relay_text(request, chat, raw, hints, pipeline, "chat_completions")
        reasoning_field = self.config.reasoning_field

        def answer(request_id: str, prepared: Prepared) -> Answer:
            chunks = openai.ChatStream(model.name, include_usage=chat.include_usage, id=f"chatcmpl-{request_id}")
            return ChatAnswer(chunks, reasoning_field, parsed_reasoning=prepared.parser is not None)

        return await self._serve(request, chat, len(body), pipeline, "chat_completions", answer)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        completion = openai.parse_completion_request(body)
        model = self._model(completion.model, ModelType.Completions, "/v1/completions")
        pipeline: ModelPipeline = model.pipeline
        if pipeline.preprocessor is None:
            raise openai.RequestError(f"model {model.name!r} only serves chat completions", param="model")

        def answer(request_id: str, prepared: Prepared) -> Answer:
            return CompletionAnswer(openai.CompletionStream(model.name, include_usage=completion.include_usage,
                                                            id=f"cmpl-{request_id}"))

        return await self._serve(request, completion, len(body), pipeline, "completions", answer)

    async def create_response(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        parsed = responses.parse_request(body)
        model = self._model(parsed.model, ModelType.Chat, "/v1/responses")
        _token_input(model, "/v1/responses")
        history = self._history(parsed.previous_response_id)
        conversation = [*history, *parsed.input]
        store = self.responses

        def answer(request_id: str, prepared: Prepared) -> Answer:
            return responses.ResponseAnswer(parsed, store.new_id(request_id), model.name, conversation, store)

        return await self._serve(request, parsed.chat(history), len(body), model.pipeline, "responses", answer)

    async def count_response_tokens(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        parsed = responses.parse_request(body)
        model = self._model(parsed.model, ModelType.Chat, "/v1/responses/input_tokens")
        chat = parsed.chat(self._history(parsed.previous_response_id))
        count = await _token_input(model, "/v1/responses/input_tokens").count_prompt_tokens(chat, len(body))
        return web.json_response({"object": "response.input_tokens", "input_tokens": count})

    async def get_response(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        stored = self.responses.get(response_id)
        if stored is None:
            raise openai.RequestError(self.responses.why_missing(response_id), status=404, param="response_id")
        return web.Response(body=msgspec.json.encode(stored.response), content_type="application/json")

    async def delete_response(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        if not self.responses.delete(response_id):
            raise openai.RequestError(self.responses.why_missing(response_id), status=404, param="response_id")
        return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})

    def _history(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        """The conversation a response continues (`previous_response_id`), as chat messages."""
        if previous_response_id is None:
            return []
        stored = self.responses.get(previous_response_id)
        if stored is None:
            raise openai.RequestError(self.responses.why_missing(previous_response_id), param="previous_response_id")
        return stored.messages

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        parsed = embeddings.parse_request(body)
        model = self._model(parsed.model, ModelType.Embedding, "/v1/embeddings")
        embeddings.check_dimensions(parsed.dimensions, model.name, model.card.runtime_config)
        pipeline: ModelPipeline = model.pipeline
        preprocessor = _token_input(model, "/v1/embeddings")
        token_ids = await preprocessor.embedding_inputs(parsed, len(body))
        work = EmbeddingRequest(token_ids, model=model.name, dimensions=parsed.dimensions, mdc_sum=preprocessor.mdcsum)
        request_id = uuid.uuid4().hex
        context = Context(request_id)
        attempt = Attempt()
        hints = openai.routing_hints(None, request.headers)
        if hints is not None and hints.priority is not None:  # pooling runs no scheduler policy of the client's
            raise openai.RequestError(f"header {openai.PRIORITY_HEADER} is not supported on /v1/embeddings",
                                      param=openai.PRIORITY_HEADER)
        pinned = _pinned_instance(hints, pipeline, request)
        outputs = pipeline.generate(work, context, attempt, pinned=pinned)
        metrics, started, status = self.metrics, time.perf_counter(), "error"
        prompt_tokens = sum(map(len, token_ids))
        metrics.inflight.labels(model.name).inc()
        metrics.isl.labels(model.name).observe(prompt_tokens)
        self._inflight[request_id] = context
        try:
            try:
                output = msgspec.convert(await anext(outputs), EmbeddingOutput)
            except StopAsyncIteration:
                return self._failure(StreamIncompleteError("the worker answered with nothing"), model.name,
                                     "embeddings")
            except Exception as e:  # routing, the worker's error, or an answer not in the contract's shape
                return self._failure(e, model.name, "embeddings")
            if len(output.embeddings) != len(token_ids):
                return self._failure(RemoteError(f"the worker returned {len(output.embeddings)} vectors for "
                                                 f"{len(token_ids)} inputs"), model.name, "embeddings")
            status = "success"
            answer = embeddings.response(request_id, model.name, parsed, output.embeddings, prompt_tokens)
            return web.Response(body=msgspec.json.encode(answer), content_type="application/json")
        except asyncio.CancelledError:
            context.kill()
            metrics.cancellations.labels(model.name, "embeddings", "unary").inc()
            status = "cancelled"
            raise
        finally:
            del self._inflight[request_id]
            await outputs.aclose()
            elapsed = time.perf_counter() - started
            metrics.inflight.labels(model.name).dec()
            metrics.requests.labels(model.name, "embeddings", "unary", status).inc()
            metrics.duration.labels(model.name).observe(elapsed)
            log.info("request %s%s model=%s worker=%s status=%s inputs=%d prompt_tokens=%d migrations=%d total_ms=%.1f",
                     request_id, _client_id(request), model.name,
                     f"{attempt.instance_id:x}" if attempt.instance_id else "-", status, len(token_ids),
                     prompt_tokens, attempt.migrations, elapsed * 1000)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        parsed = tokenize.parse_tokenize(body)
        preprocessor = _token_input(self._model(self._named_or_only(parsed.model), _ANY_MODEL, "/tokenize"),
                                    "/tokenize")
        ids = await preprocessor.tokenize(parsed, len(body))
        strs = preprocessor.tokenizer.token_strs(ids) if parsed.return_token_strs else None
        return web.json_response(tokenize.tokenize_response(ids, preprocessor.max_model_len, strs))

    async def detokenize(self, request: web.Request) -> web.Response:
        parsed = tokenize.parse_detokenize(await self._body(request))
        preprocessor = _token_input(self._model(self._named_or_only(parsed.model), _ANY_MODEL, "/detokenize"),
                                    "/detokenize")
        return web.json_response({"prompt": preprocessor.detokenize(parsed.tokens)})

    async def generate_tokens(self, request: web.Request) -> web.StreamResponse:
        """vLLM's token-in/token-out route: the token ids go to the workers as they are (no template)."""
        body = await self._body(request)
        parsed = generate.parse_request(body)
        model = self._model(self._named_or_only(parsed.model), ModelType.Chat | ModelType.Completions, generate.ROUTE)
        _token_input(model, generate.ROUTE)

        def answer(request_id: str, prepared: Prepared) -> Answer:
            return generate.GenerateAnswer(parsed, model.name, request_id, prepared)

        return await self._serve(request, parsed.completion_request(model.name), len(body), model.pipeline,
                                 "generate", answer)

    def _named_or_only(self, model: str | None) -> str:
        """The model a request names, or when it names none the one served (vLLM's server has one)."""
        if model is not None:
            return model
        names = [m.name for m in self.manager.served()]
        if len(names) != 1:
            raise openai.RequestError(f"'model' is required: {len(names)} models are served", param="model")
        return names[0]

    async def messages(self, request: web.Request) -> web.StreamResponse:
        anthropic.note_betas(request.headers.get("anthropic-beta"))
        body, model, parsed, chat = await self._anthropic(request, anthropic.parse_messages_request, "/v1/messages")

        def answer(request_id: str, prepared: Prepared) -> Answer:
            return anthropic.MessagesAnswer(model.name, f"msg_{request_id}", len(prepared.prompt_ids),
                                            parsed.left_out_tools)

        return await self._serve(request, chat, len(body), model.pipeline, "messages", answer)

    async def count_message_tokens(self, request: web.Request) -> web.Response:
        route = "/v1/messages/count_tokens"
        body, model, _, chat = await self._anthropic(request, anthropic.parse_count_tokens_request, route)
        count = await _token_input(model, route).count_prompt_tokens(chat, len(body))
        return web.json_response({"input_tokens": count})

    async def _anthropic(self, request: web.Request, parse: Callable[[bytes], anthropic.MessagesRequest],
                         route: str) -> tuple[bytes, ServedModel, anthropic.MessagesRequest, openai.ChatRequest]:
        """A Messages API body, its model, the request, and the chat request it means for that model."""
        body = await self._body(request)
        parsed = parse(body)
        model = self._model(parsed.model, ModelType.Chat, route)
        reasoning = _token_input(model, route).parsers.reasoning is not None
        return body, model, parsed, parsed.chat(reasoning=reasoning)

    async def _serve(self, request: web.Request, req: openai.AnyRequest, body_size: int, pipeline: ModelPipeline,
                     endpoint: str, answer_for: AnswerFactory) -> web.StreamResponse:
        """A token-input request: preprocess, then the same frame (metrics, log line, cancellation) around
        the streaming or the unary answer, which `answer_for(request_id)` writes in the route's format."""
        assert pipeline.preprocessor is not None
        hints = openai.routing_hints(req, request.headers)
        pinned = _pinned_instance(hints, pipeline, request)
        prepared = await pipeline.preprocessor.prepare(req, body_size, hints)
        prompt_tokens, processor = prepared.prompt_tokens, prepared.processor
        request_id = uuid.uuid4().hex  # never the client's x-request-id: two clients may send the same one
        context = Context(request_id)
        attempt = Attempt()
        outputs = pipeline.generate(prepared.request, context, attempt, pinned=pinned, guided=req.is_guided)
        model_name = pipeline.model.name
        answer = answer_for(request_id, prepared)
        started = time.perf_counter()
        chat = isinstance(req, openai.ChatRequest)
        outcome = Outcome(reasoning_tokens=0 if chat and pipeline.preprocessor.parsers.reasoning else None)
        request_type = "stream" if req.stream else "unary"
        status = "error"
        self._begin(model_name)
        response: web.StreamResponse | None = None
        self._inflight[request_id] = context
        try:
            # Route and open the worker stream before answering, so routing failures get a status code.
            try:
                first: dict[str, Any] = await anext(outputs, {})
            except Exception as e:
                return self._failure(e, model_name, endpoint, answer.error_body)
            exchange = Exchange(model_name, request_id, context, attempt, outcome, processor, prepared.parser,
                                answer, prompt_tokens, first, outputs)
            if req.stream:
                headers = {**SSE_HEADERS, **answer.headers} if answer.headers else SSE_HEADERS
                response = web.StreamResponse(headers=headers)
                await response.prepare(request)
                if req.ext.annotations:
                    await response.write(_annotation_events(req, prepared))
                if await self._stream(response, exchange):
                    status = "success"
                return response
            reply, ok = await self._unary(exchange, endpoint)
            if ok:
                status = "success"
            return reply
        except (asyncio.CancelledError, ConnectionResetError) as gone:
            context.kill()  # the client went away: stop the worker now
            self.metrics.cancellations.labels(model_name, endpoint, request_type).inc()
            status = "cancelled"
            if isinstance(gone, asyncio.CancelledError):
                raise
            # A write hit the closed connection: nothing to answer, and nothing worth a traceback.
            return response or web.Response(status=499)
        finally:
            del self._inflight[request_id]
            await outputs.aclose()
            self._end(request, request_id, model_name, endpoint, request_type, status, started, attempt,
                      prompt_tokens, outcome)

    def _begin(self, model: str) -> None:
        """A generation request starts: in flight, and queued until its first token (`_deltas`, or the
        text relay, takes it off the queue)."""
        self.metrics.inflight.labels(model).inc()
        self.metrics.queued.labels(model).inc()

    def _end(self, request: web.Request, request_id: str, model: str, endpoint: str, request_type: str,
             status: str, started: float, attempt: Attempt, prompt_tokens: int, outcome: Outcome) -> None:
        """A generation request (token or text input) ends: its counts, histograms and log line."""
        metrics = self.metrics
        elapsed = time.perf_counter() - started
        metrics.inflight.labels(model).dec()
        if outcome.first_token_at is None:
            metrics.queued.labels(model).dec()
        metrics.requests.labels(model, endpoint, request_type, status).inc()
        metrics.isl.labels(model).observe(prompt_tokens)
        metrics.duration.labels(model).observe(elapsed)
        metrics.osl.labels(model).observe(outcome.completion_tokens)
        ttft = (outcome.first_token_at - started) if outcome.first_token_at else None
        if ttft is not None:
            metrics.ttft.labels(model).observe(ttft)
        log.info(
            "request %s%s model=%s worker=%s status=%s prompt_tokens=%d completion_tokens=%d finish=%s "
            "migrations=%d ttft_ms=%s total_ms=%.1f",
            request_id, _client_id(request), model, f"{attempt.instance_id:x}" if attempt.instance_id else "-", status,
            prompt_tokens, outcome.completion_tokens, outcome.finish_reason, attempt.migrations,
            f"{ttft * 1000:.1f}" if ttft is not None else "-", elapsed * 1000,
        )

    async def _stream(self, response: web.StreamResponse, exchange: Exchange) -> bool:
        """The streaming answer: the route's events as the deltas come, then its closing events. Returns
        whether the request succeeded; a failure mid-stream ends the stream with the route's error event."""
        answer = exchange.answer
        # Events wait in `pending` while the worker's next output is already here, so a burst goes out
        # in one write; the first content, and any event before a wait, go out at once.
        pending: list[bytes] = answer.opening()
        flushed = False
        try:
            async for delta, parsed in self._deltas(exchange):
                pending.extend(answer.delta(delta, parsed))
                if pending and (not flushed or not exchange.attempt.output_ready or len(pending) >= SSE_BATCH):
                    await response.write(b"".join(pending))
                    pending.clear()
                    flushed = True
        except (StreamIncompleteError, RemoteError, NoWorkerError) as e:
            log.warning("request %s failed mid-stream: %s", exchange.request_id, e)
            pending.append(answer.failure(openai.RequestError(_public_message(e), status=_status_of(e))))
            await response.write(b"".join(pending))
            await response.write_eof()
            return False
        pending.extend(answer.closing(exchange.outcome, self._ending(exchange)))
        await response.write(b"".join(pending))
        await response.write_eof()
        return True

    async def _unary(self, exchange: Exchange, endpoint: str) -> tuple[web.Response, bool]:
        """The whole answer in one JSON body, once the worker has finished; and whether it succeeded."""
        answer = exchange.answer
        try:
            async for delta, parsed in self._deltas(exchange):
                answer.collect(delta, parsed)
        except (StreamIncompleteError, RemoteError, NoWorkerError) as e:
            return self._failure(e, exchange.model, endpoint, answer.error_body), False
        body = answer.body(exchange.outcome, self._ending(exchange))
        return web.Response(body=msgspec.json.encode(body), content_type="application/json",
                            headers=answer.headers or None), True

    @staticmethod
    def _ending(exchange: Exchange) -> Ending:
        outcome, parser = exchange.outcome, exchange.parser
        usage = Usage(exchange.prompt_tokens, outcome.completion_tokens, _cached(outcome.usage),
                      outcome.reasoning_tokens)
        return Ending(outcome.finish_reason or "stop", exchange.processor.stop_reason,
                      parser is not None and parser.calls_finish, usage)

    async def _deltas(self, exchange: Exchange) -> Any:
        """Engine outputs -> (processed delta, what it means for the client), one per output; stops the
        worker on a local stop."""
        processor, outcome, context, outputs = exchange.processor, exchange.outcome, exchange.context, exchange.outputs
        parser = exchange.parser
        itl = self.metrics.itl.labels(exchange.model)
        queued = self.metrics.queued.labels(exchange.model)
        output: dict[str, Any] | None = exchange.first
        while output is not None:
            delta = processor.process(output)
            if output.get("completion_usage"):
                outcome.usage = output["completion_usage"]
            if delta.token_ids:
                now = time.perf_counter()
                if outcome.first_token_at is None:
                    outcome.first_token_at = now
                    queued.dec()
                elif outcome.last_token_at is not None:
                    itl.observe((now - outcome.last_token_at) / len(delta.token_ids))
                outcome.last_token_at = now
            outcome.completion_tokens = delta.completion_tokens
            if delta.error:
                raise RemoteError(delta.error, 500)
            parsed = None
            if parser is None:  # the common case, inline: the text is content
                if delta.text:
                    outcome.text.append(delta.text)
                if delta.logprobs:
                    outcome.logprobs.extend(delta.logprobs)
            else:
                parsed = self._parse(exchange, delta)
                self._collect(outcome, delta, parsed)
            if delta.finish_reason:
                outcome.finish_reason = delta.finish_reason
                if parser is not None:
                    yield delta, parsed
                    delta, parsed = ProcessedDelta(completion_tokens=delta.completion_tokens), parser.finish()
                    self._collect(outcome, delta, parsed)
                yield delta, parsed  # even an empty one: the caller may have events to flush before the next wait
                if output.get("finish_reason") is None:
                    context.stop_generating()  # stopped here (stop string, max tokens): the worker can stop
                return
            yield delta, parsed
            output = await anext(outputs, None)
        self._raise_if_cut_off(context)
        tail = processor.finish()
        parsed = None
        if parser is not None:
            parsed = self._parse(exchange, tail)
            end = parser.finish()
            parsed.content += end.content
            parsed.reasoning += end.reasoning
            parsed.tool_calls.extend(end.tool_calls)
        self._collect(outcome, tail, parsed)
        if tail.text or parsed:
            yield tail, parsed

    @staticmethod
    def _parse(exchange: Exchange, delta: ProcessedDelta) -> ParsedDelta:
        """The delta's text as content, reasoning and tool calls (the request has a parser); its tokens
        counted as reasoning while the output thinks."""
        parser = exchange.parser
        assert parser is not None
        was_thinking = parser.thinking
        parsed = parser.feed(delta.text) if delta.text else ParsedDelta()
        if exchange.outcome.reasoning_tokens is not None and (was_thinking or parser.thinking):
            exchange.outcome.reasoning_tokens += len(delta.token_ids)
        return parsed

    @staticmethod
    def _collect(outcome: Outcome, delta: ProcessedDelta, parsed: ParsedDelta | None) -> None:
        """The delta into the answer so far; without a parser its text is content."""
        if delta.logprobs:
            outcome.logprobs.extend(delta.logprobs)
        if parsed is None:
            if delta.text:
                outcome.text.append(delta.text)
            return
        if parsed.content:
            outcome.text.append(parsed.content)
        if parsed.reasoning:
            outcome.reasoning.append(parsed.reasoning)
        if parsed.tool_calls:
            outcome.add_calls(parsed.tool_calls)

    def _raise_if_cut_off(self, context: Context) -> None:
        """A stream that ended because the shutdown's drain bound passed fails with that reason."""
        if self._drain_expired and context.is_killed():
            raise NoWorkerError("the server is shutting down: the request was cut off before it finished")

    def _failure(self, error: BaseException, model: str, endpoint: str,
                 shape: ErrorShape = openai_error) -> web.Response:  # fmt: skip
        """A request that failed before its answer began, in the route's error shape."""
        if isinstance(error, NoWorkerError) and error.busy:
            self.metrics.rejections.labels(model, endpoint).inc()
            busy = openai.RequestError(str(error), status=503, type="service_unavailable", code=503)
            body = shape(busy)
            if shape is openai_error:  # Dynamo's busy answer repeats the error's fields at the top
                body = {"message": busy.message, "type": busy.type, "code": 503, **body}
            return web.json_response(body, status=503)
        if isinstance(error, openai.RequestError):
            return web.json_response(shape(error), status=error.status)
        if not isinstance(error, (NoWorkerError, StreamIncompleteError, RemoteError)):
            log.exception("unexpected error serving %s", model, exc_info=error)
        else:
            log.warning("%s request to %s failed: %s", endpoint, model, error)
        status = _status_of(error)
        return web.json_response(shape(openai.RequestError(_public_message(error), status=status)), status=status)

    async def _relay_text(self, request: web.Request, chat: openai.ChatRequest, raw: dict[str, Any],
                          hints: RoutingHints | None, pipeline: ModelPipeline, endpoint: str) -> web.StreamResponse:
        """Text-input models (`--use-vllm-tokenizer` workers) template and tokenize in the engine: forward
        the OpenAI request and relay the chat chunks it streams back; counted and logged as every request
        (its token counts are the engine's usage)."""
        pinned = _pinned_instance(hints, pipeline, request)
        if hints is not None and hints.decode_worker_id is not None:
            pinned = hints.decode_worker_id  # no prefill leg here: its decode worker serves it whole
        request_id = uuid.uuid4().hex
        context = Context(request_id)
        attempt, outcome = Attempt(), Outcome()
        response_id, created, model_name = f"chatcmpl-{request_id}", int(time.time()), pipeline.model.name
        body = dict(raw, model=model_name)
        outputs = pipeline.generate(body, context, attempt, pinned=pinned)
        request_type = "stream" if chat.stream else "unary"
        status = "error"
        started = time.perf_counter()
        self._begin(model_name)
        response: web.StreamResponse | None = None
        usage: dict[str, Any] = {}
        self._inflight[request_id] = context
        try:
            try:
                first: dict[str, Any] = await anext(outputs, {})
            except Exception as e:
                return self._failure(e, model_name, endpoint)
            if first:  # the engine's first chunk carries its first text
                outcome.first_token_at = time.perf_counter()
                self.metrics.queued.labels(model_name).dec()
            chunks = [first]
            if chat.stream:
                response = web.StreamResponse(headers=SSE_HEADERS)
                await response.prepare(request)
            try:
                while chunks:
                    chunk = chunks.pop()
                    if chunk:
                        chunk.update(id=response_id, created=created, model=model_name)
                        for choice in chunk.get("choices", []):
                            outcome.text.append((choice.get("delta") or {}).get("content") or "")
                            outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
                        usage = chunk.get("usage") or usage
                        if response is not None:
                            await response.write(openai.sse(chunk))
                    nxt = await anext(outputs, None)
                    if nxt is not None:
                        chunks.append(nxt)
                    else:
                        self._raise_if_cut_off(context)
            except (StreamIncompleteError, RemoteError, NoWorkerError) as e:
                if response is None:
                    return self._failure(e, model_name, endpoint)
                await response.write(openai.sse_error(_status_of(e), _public_message(e)))
                await response.write_eof()
                return response
            outcome.completion_tokens = usage.get("completion_tokens", 0)
            status = "success"
            if response is not None:
                await response.write(openai.SSE_DONE)
                await response.write_eof()
                return response
            return web.json_response(openai.chat_completion(
                response_id, created, model_name, content="".join(outcome.text),
                finish_reason=outcome.finish_reason or "stop", usage=usage or openai.usage(0, 0)))
        except (asyncio.CancelledError, ConnectionResetError) as gone:
            context.kill()
            self.metrics.cancellations.labels(model_name, endpoint, request_type).inc()
            status = "cancelled"
            if isinstance(gone, asyncio.CancelledError):
                raise
            return response or web.Response(status=499)
        finally:
            del self._inflight[request_id]
            await outputs.aclose()
            self._end(request, request_id, model_name, endpoint, request_type, status, started, attempt,
                      usage.get("prompt_tokens", 0), outcome)


# What a text-input worker's request (the client's body, relayed) has no place for: refused by name.
_TEXT_UNSERVED_NVEXT = ("annotations", "use_raw_prompt", "greed_sampling")
_TEXT_UNSERVED_HINTS = ("prefill_worker_id", "dp_rank", "prefill_dp_rank", "priority", "cache_salt")


def _check_text_input(chat: openai.ChatRequest, model: str, hints: RoutingHints | None, request: web.Request) -> None:
    """A text-input model's engine templates the request and its output is relayed as it is: what needs the
    frontend's parsing or the engine's guided decoding, and what its worker's request cannot carry (routing
    hints other than the worker, nvext's prompt and sampling switches), is refused rather than ignored."""
    why = f"model {model!r} takes text input (--use-vllm-tokenizer): its engine's output is relayed unparsed"
    relayed = f"model {model!r} takes text input (--use-vllm-tokenizer): its engine gets the request as it is"
    for name in _TEXT_UNSERVED_NVEXT:
        if getattr(chat.ext, name):
            raise openai.RequestError(f"{relayed}, and 'nvext.{name}' is not honoured there", param=f"nvext.{name}")
    for name in _TEXT_UNSERVED_HINTS if hints is not None else ():
        if getattr(hints, name) is not None:
            param = openai.hint_param(name, request.headers)
            raise openai.RequestError(f"{relayed}, and '{param}' is not honoured there", param=param)
    if chat.tools and chat.tool_choice != "none":
        raise openai.RequestError(f"{why}, so tool calls cannot be returned; send tool_choice 'none' or serve "
                                  "the model with token input", param="tool_choice")
    if chat.guided is not None:
        given = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "structured_outputs")
        raise openai.RequestError(f"{why} and its text mode has no guided decoding",
                                  param=next((name for name in given if getattr(chat, name) is not None), None))
    if chat.ext.max_thinking_tokens is not None:
        raise openai.RequestError(f"{why}, with no reasoning parser", param="nvext.max_thinking_tokens")


def _token_input(model: ServedModel, route: str) -> Preprocessor:
    """The model's preprocessor; a text-input model's engine templates chat requests itself and its output
    is relayed as OpenAI chat chunks, which only /v1/chat/completions can answer with."""
    preprocessor = model.pipeline.preprocessor
    if preprocessor is None:
        raise openai.RequestError(f"model {model.name!r} takes text input (--use-vllm-tokenizer) and is served on "
                                  f"/v1/chat/completions only, not {route}", param="model")
    return preprocessor


def _is_json(content_type: str) -> bool:
    return content_type == "application/json" or (content_type.startswith("application/")
                                                   and content_type.endswith("+json"))


def _client_id(request: web.Request) -> str:
    """The client's own x-request-id, for the log line only."""
    client = request.headers.get("x-request-id")
    return f" (x-request-id {client[:128]!r})" if client else ""


def _pinned_instance(hints: RoutingHints | None, pipeline: ModelPipeline, request: web.Request) -> int | None:
    """The worker the request names for all of it (header or nvext.backend_instance_id), once every worker it
    names is checked: a 404 naming the header or field when one is not a worker of the model of its kind
    (a worker that serves the model for the whole request or its decode leg, a prefill worker for the
    prefill leg)."""
    if hints is None:
        return None
    model = pipeline.model
    for name, workers, kind in (("backend_instance_id", model.instances, "a worker serving"),
                                ("decode_worker_id", model.instances, "a decode worker of"),
                                ("prefill_worker_id", model.prefill_instances, "a prefill worker of")):
        worker = getattr(hints, name)
        if worker is not None and worker not in workers:
            raise openai.RequestError(f"worker instance {worker} is not {kind} model {model.name!r}", status=404,
                                      param=openai.hint_param(name, request.headers), code="worker_not_found")
    return hints.backend_instance_id


def _annotation_events(req: openai.AnyRequest, prepared: Prepared) -> bytes:
    """The SSE events a streamed answer opens with for the request's `nvext.annotations`, as Dynamo writes
    them: `event: <name>` and a comment line holding the value as a JSON string (the templated prompt; the
    prompt's token ids as JSON text)."""
    events = []
    for name in req.ext.annotations:
        if name == "token_ids":
            value = msgspec.json.encode(prepared.prompt_ids).decode()
        elif isinstance(req, openai.ChatRequest):
            value = prepared.prompt_text
        else:
            value = req.prompt if isinstance(req.prompt, str) else ""
        events.append(b"event: " + name.encode() + b"\n: " + msgspec.json.encode(value) + b"\n\n")
    return b"".join(events)


def _public_message(error: BaseException) -> str:
    """What the client is told: the frontend's own messages and the errors a worker reports; the request
    plane's details (addresses, ports) stay in the log."""
    if isinstance(error, (openai.RequestError, NoWorkerError, RemoteError)):
        return str(error)
    if isinstance(error, StreamLost):
        return error.public
    if isinstance(error, StreamIncompleteError):
        return "the worker serving this request stopped before finishing it"
    return "internal error while serving the request"


def _status_of(error: BaseException) -> int:
    if isinstance(error, openai.RequestError):
        return error.status
    if isinstance(error, RemoteError):
        return error.code if 400 <= error.code < 500 else 500
    return 503


def _cached(usage: dict[str, Any] | None) -> int | None:
    details = (usage or {}).get("prompt_tokens_details") or {}
    return details.get("cached_tokens")


