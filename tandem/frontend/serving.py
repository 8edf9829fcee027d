"""The request frame every route runs in.

`track` is the frame of every request that reaches a worker (generation, embeddings, the text relay): it is
in flight (the shutdown drain waits for it), counted and timed in the frontend's metrics, killed on its
worker when the client goes away, and logged once when it ends. `serve` runs a token-input generation
request inside it: preprocess, route (`ModelPipeline.generate`), feed the worker's outputs through the
output processor and the request's parser, and hand the deltas to the route's `Answer`, streamed or unary.
The HTTP side an API needs (its body, its model, the worker a request names) is here too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from tandem.frontend.hints import hint_param, routing_hints
from tandem.frontend.metrics import FrontendMetrics
from tandem.frontend.models import ModelManager, ServedModel
from tandem.frontend.pipeline import Attempt, ModelPipeline, StreamLost
from tandem.frontend.preprocess import Prepared, Preprocessor
from tandem.frontend.protocol.answer import Answer, Ending, Outcome, Usage
from tandem.frontend.protocol.errors import RequestError
from tandem.frontend.protocol.sse import SSE_HEADERS
from tandem.frontend.requests import AnyRequest, ChatRequest
from tandem.frontend.routing import NoWorkerError
from tandem.llm.model_card import ModelType
from tandem.llm.parsers import ChatParser, ParsedDelta
from tandem.llm.postprocess import OutputProcessor, ProcessedDelta
from tandem.llm.protocols import LLMEngineOutput, RoutingHints
from tandem.runtime import Context, DistributedRuntime, RemoteError, StreamIncompleteError

log = logging.getLogger("tandem.frontend")

SSE_BATCH = 16  # most SSE events held back for one write while the worker's outputs are already here
# Loop turns a stream whose burst is already here lets pass after its first token: a new request needs a
# few turns (its body, the worker's acceptance and first output, the write) before its own first token.
FIRST_TOKEN_YIELDS = 3
# (request id, the prepared request) -> the request's answer in its route's format
AnswerFactory = Callable[[str, Prepared], Answer]
ErrorShape = Callable[[RequestError], dict[str, Any]]
# The errors of a request's worker stream that end it with the route's error, not a defect.
STREAM_ERRORS = (StreamIncompleteError, RemoteError, NoWorkerError)


class EventStream(web.StreamResponse):
    """A streamed answer whose status line and headers go out with its first events, in one send: the first
    write comes right after `prepare` (the worker's first output is already here), so holding them costs
    no latency and saves a send per request. (aiohttp sends a StreamResponse's headers at `prepare` unless
    the class says otherwise; a write of b"" sends them alone.)"""

    _send_headers_immediately = False


@dataclass(frozen=True)
class Mount:
    """An API's routes, as the server mounts them; errors on paths under `prefix` (before a handler ran,
    or raised by one) are written in the API's `error_shape` instead of OpenAI's."""

    routes: list[web.RouteDef]
    prefix: str = ""
    error_shape: ErrorShape | None = None


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


class Tracked:
    """One request while a worker serves it: `async with serving.track(...) as t`. Cancellation (the client
    went away) kills it on the worker; a write to a closed connection is swallowed, and the handler answers
    with `gone()`. The handler sets `status` on success, and what it learns (`prompt_tokens`, `outputs` to
    close, the `response` it opened) as it goes."""

    __slots__ = ("serving", "request", "model", "endpoint", "request_type", "generation", "request_id", "context",
                 "attempt", "outcome", "status", "prompt_tokens", "inputs", "outputs", "response", "started")

    def __init__(self, serving: Serving, request: web.Request, model: str, endpoint: str, stream: bool,
                 generation: bool) -> None:
        self.serving = serving
        self.request = request
        self.model = model
        self.endpoint = endpoint
        self.request_type = "stream" if stream else "unary"
        self.generation = generation  # it makes tokens: queued until its first, and its TTFT and ITL observed
        # 128 random bits like a UUID4's (a fifth of its cost); never the client's x-request-id: two clients may send
        # the same one
        self.request_id = os.urandom(16).hex()
        self.context = Context(self.request_id)
        self.attempt = Attempt()
        self.outcome = Outcome()
        self.status = "error"
        self.prompt_tokens = 0
        self.inputs: int | None = None  # an embeddings request's inputs, for the log line
        self.outputs: Any = None  # the worker's stream (an async generator), closed at the end
        self.response: web.StreamResponse | None = None
        self.started = 0.0

    async def __aenter__(self) -> Tracked:
        metrics = self.serving.metrics
        metrics.inflight.labels(self.model).inc()
        if self.generation:
            metrics.queued.labels(self.model).inc()  # until its first token (`Serving._deltas`, the relay)
        self.serving.inflight[self.request_id] = self.context
        self.started = time.perf_counter()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: Any) -> bool:
        gone = kind is not None and issubclass(kind, (asyncio.CancelledError, ConnectionResetError))
        if gone:
            self.context.kill()  # the client went away: stop the worker now
            self.serving.metrics.cancellations.labels(self.model, self.endpoint, self.request_type).inc()
            self.status = "cancelled"
        del self.serving.inflight[self.request_id]
        if self.outputs is not None:
            await self.outputs.aclose()
        self._end()
        # A write hit the closed connection: nothing to answer, and nothing worth a traceback.
        return kind is ConnectionResetError

    def gone(self) -> web.StreamResponse:
        """The answer of a request whose client left while it was written."""
        return self.response or web.Response(status=499)

    def _end(self) -> None:
        """Its counts, histograms and log line."""
        metrics, model, outcome = self.serving.metrics, self.model, self.outcome
        elapsed = time.perf_counter() - self.started
        metrics.inflight.labels(model).dec()
        metrics.requests.labels(model, self.endpoint, self.request_type, self.status).inc()
        metrics.isl.labels(model).observe(self.prompt_tokens)
        metrics.duration.labels(model).observe(elapsed)
        attempt = self.attempt
        worker = f"{attempt.instance_id:x}" if attempt.instance_id else "-"
        if not self.generation:
            log.info("request %s%s model=%s worker=%s status=%s inputs=%d prompt_tokens=%d migrations=%d "
                     "total_ms=%.1f", self.request_id, _client_id(self.request), model, worker, self.status,
                     self.inputs or 0, self.prompt_tokens, attempt.migrations, elapsed * 1000)
            return
        if outcome.first_token_at is None:
            metrics.queued.labels(model).dec()
        metrics.osl.labels(model).observe(outcome.completion_tokens)
        ttft = (outcome.first_token_at - self.started) if outcome.first_token_at else None
        if ttft is not None:
            metrics.ttft.labels(model).observe(ttft)
        log.info(
            "request %s%s model=%s worker=%s status=%s prompt_tokens=%d completion_tokens=%d finish=%s "
            "migrations=%d ttft_ms=%s total_ms=%.1f",
            self.request_id, _client_id(self.request), model, worker, self.status, self.prompt_tokens,
            outcome.completion_tokens, outcome.finish_reason, attempt.migrations,
            f"{ttft * 1000:.1f}" if ttft is not None else "-", elapsed * 1000,
        )


@dataclass
class Exchange:
    """One token-input request while it is answered: what the streaming and the unary paths share."""

    tracked: Tracked
    processor: OutputProcessor
    parser: ChatParser | None  # thinking and tool calls in a chat answer
    answer: Answer
    first: LLMEngineOutput | None  # the worker's first output (routing failures were answered before)
    images: bool = False  # the prompt has images: its length is the engine's count, with their tokens
    extra_fields: list[str] = field(default_factory=list)  # `nvext.extra_fields`: what the answer's nvext holds


class Serving:
    """What every API's handlers run on: the served models, the metrics, the requests in flight."""

    def __init__(self, runtime: DistributedRuntime, manager: ModelManager, metrics: FrontendMetrics,
                 config: HttpConfig) -> None:
        self.runtime = runtime
        self.manager = manager
        self.metrics = metrics
        self.config = config
        self.inflight: dict[str, Context] = {}  # requests being served, by request id
        self.drain_expired = False  # the shutdown's drain bound passed: what still runs is being cut off

    # -- what a handler reads ------------------------------------------------------------------
    async def body(self, request: web.Request) -> bytes:
        limit = self.config.body_limit_bytes
        if request.content_length is not None and request.content_length > limit:
            raise RequestError(f"request body exceeds the limit of {limit} bytes", status=413)
        # A body in another type (text/plain, a form) is what a web page can send without a CORS
        # preflight: refuse it. No Content-Type at all is read as JSON, as vLLM does.
        if request.headers.get("Content-Type") is not None and not _is_json(request.content_type):
            raise RequestError(f"Content-Type must be application/json (got {request.content_type!r})", status=415)
        if request.content.is_eof():  # the whole body came with the headers (the common case): no timer
            return await request.read()
        try:
            async with asyncio.timeout(self.config.body_read_timeout):
                return await request.read()
        except TimeoutError:
            raise RequestError(f"the request body did not arrive within {self.config.body_read_timeout:g} s",
                               status=408) from None

    def model(self, name: str, kind: ModelType, route: str) -> ServedModel:
        """The served model `name`, if it serves `kind` of requests (a generation model makes no
        embeddings, an embedding model answers no chat)."""
        model = self.manager.get(name)
        if model is None:
            raise RequestError.model_not_found(name)
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
        raise RequestError(why, param="model")

    def named_or_only(self, model: str | None) -> str:
        """The model a request names, or when it names none the one served (vLLM's server has one)."""
        if model is not None:
            return model
        names = [m.name for m in self.manager.served()]
        if len(names) != 1:
            raise RequestError(f"'model' is required: {len(names)} models are served", param="model")
        return names[0]

    @staticmethod
    def token_input(model: ServedModel, route: str) -> Preprocessor:
        """The model's preprocessor; a text-input model's engine templates chat requests itself and its output
        is relayed as OpenAI chat chunks, which only /v1/chat/completions can answer with."""
        preprocessor = model.pipeline.preprocessor
        if preprocessor is None:
            raise RequestError(f"model {model.name!r} takes text input (--use-vllm-tokenizer) and is served on "
                               f"/v1/chat/completions only, not {route}", param="model")
        return preprocessor

    @staticmethod
    def pinned(hints: RoutingHints | None, pipeline: ModelPipeline, request: web.Request) -> int | None:
        """The worker the request names for all of it (header or nvext.backend_instance_id), once every worker
        it names is checked: a 404 naming the header or field when one is not a worker of the model of its
        kind (a worker that serves the model for the whole request or its decode leg, a prefill worker for
        the prefill leg)."""
        if hints is None:
            return None
        model = pipeline.model
        for name, workers, kind in (("backend_instance_id", model.instances, "a worker serving"),
                                    ("decode_worker_id", model.instances, "a decode worker of"),
                                    ("prefill_worker_id", model.prefill_instances, "a prefill worker of")):
            worker = getattr(hints, name)
            if worker is not None and worker not in workers:
                raise RequestError(f"worker instance {worker} is not {kind} model {model.name!r}", status=404,
                                   param=hint_param(name, request.headers), code="worker_not_found")
        return hints.backend_instance_id

    # -- the frame -----------------------------------------------------------------------------
    def track(self, request: web.Request, model: str, endpoint: str, *, stream: bool,
              generation: bool = True) -> Tracked:
        return Tracked(self, request, model, endpoint, stream, generation)

    def failure(self, error: BaseException, model: str, endpoint: str, shape: ErrorShape | None = None) -> web.Response:
        """A request that failed before its answer began, in the route's error shape (OpenAI's by default)."""
        if isinstance(error, NoWorkerError) and error.busy:
            self.metrics.rejections.labels(model, endpoint).inc()
            busy = RequestError(str(error), status=503, type="service_unavailable", code=503)
            if shape is None:  # Dynamo's busy answer repeats the error's fields at the top
                return web.json_response({"message": busy.message, "type": busy.type, "code": 503, **busy.body()},
                                         status=503)
            return web.json_response(shape(busy), status=503)
        if isinstance(error, RequestError):
            return web.json_response(shape(error) if shape else error.body(), status=error.status)
        if not isinstance(error, STREAM_ERRORS):
            log.exception("unexpected error serving %s", model, exc_info=error)
        else:
            log.warning("%s request to %s failed: %s", endpoint, model, error)
        public = public_error(error)
        return web.json_response(shape(public) if shape else public.body(), status=public.status)

    def raise_if_cut_off(self, context: Context) -> None:
        """A stream that ended because the shutdown's drain bound passed fails with that reason."""
        if self.drain_expired and context.is_killed():
            raise NoWorkerError("the server is shutting down: the request was cut off before it finished")

    async def serve(self, request: web.Request, req: AnyRequest, body_size: int, pipeline: ModelPipeline,
                    endpoint: str, answer_for: AnswerFactory) -> web.StreamResponse:
        """A token-input request: preprocess, then the frame around the streaming or the unary answer, which
        `answer_for(request_id, prepared)` writes in the route's format."""
        preprocessor = pipeline.preprocessor
        assert preprocessor is not None
        hints = routing_hints(req, request.headers)
        pinned = self.pinned(hints, pipeline, request)
        prepared = await preprocessor.prepare(req, body_size, hints)
        async with self.track(request, pipeline.model.name, endpoint, stream=req.stream) as t:
            t.prompt_tokens = prepared.prompt_tokens
            if isinstance(req, ChatRequest) and preprocessor.parsers.reasoning:
                t.outcome.reasoning_tokens = 0
            outputs = t.outputs = pipeline.generate(prepared.request, t.context, t.attempt, pinned=pinned,
                                                    guided=req.is_guided)
            answer = answer_for(t.request_id, prepared)
            # Route and open the worker stream before answering, so routing failures get a status code.
            try:
                first = await anext(outputs, None)
            except Exception as e:
                return self.failure(e, t.model, endpoint, answer.error_body)
            exchange = Exchange(t, prepared.processor, prepared.parser, answer, first,  # type: ignore[arg-type]
                                prepared.request.multi_modal_data is not None, req.ext.extra_fields)
            if req.stream:
                headers = {**SSE_HEADERS, **answer.headers} if answer.headers else SSE_HEADERS
                response = t.response = EventStream(headers=headers)
                await response.prepare(request)
                if req.ext.annotations:
                    await response.write(_annotation_events(req, prepared))
                if await self._stream(response, exchange):
                    t.status = "success"
                return response
            reply, ok = await self._unary(exchange)
            if ok:
                t.status = "success"
            return reply
        return t.gone()

    async def _stream(self, response: web.StreamResponse, exchange: Exchange) -> bool:
        """The streaming answer: the route's events as the deltas come, then its closing events. Returns
        whether the request succeeded; a failure mid-stream ends the stream with the route's error event."""
        answer, attempt = exchange.answer, exchange.tracked.attempt
        # Events wait in `pending` while the worker's next output is already here, so a burst goes out
        # in one write; the first content, and any event before a wait, go out at once. Once its first token
        # is out, a stream whose burst is here steps back a few loop turns behind the requests ready to run, so
        # a burst does not hold back the first tokens of the streams that came with or after it.
        # The last output's events go out with the closing ones and the end of the body, in one send (nothing is
        # awaited between them); the headers go out with the first events, or alone before a wait for the worker.
        pending: list[bytes] = answer.opening()
        flushed = False
        outcome = exchange.tracked.outcome
        try:
            async for delta, parsed in self._deltas(exchange):
                pending.extend(answer.delta(delta, parsed))
                if outcome.finish_reason is not None:
                    continue
                if pending and (not flushed or len(pending) >= SSE_BATCH or not attempt.output_ready):
                    await response.write(b"".join(pending))
                    pending.clear()
                    if not flushed:
                        flushed = True
                        if attempt.output_ready:
                            for _ in range(FIRST_TOKEN_YIELDS):
                                await asyncio.sleep(0)
                elif not flushed and not attempt.output_ready:
                    await response.write(b"")
        except STREAM_ERRORS as e:
            log.warning("request %s failed mid-stream: %s", exchange.tracked.request_id, e)
            pending.append(answer.failure(public_error(e)))
            await response.write_eof(b"".join(pending))  # the last events and the end of the body: one send
            return False
        pending.extend(answer.closing(exchange.tracked.outcome, _ending(exchange)))
        await response.write_eof(b"".join(pending))
        return True

    async def _unary(self, exchange: Exchange) -> tuple[web.Response, bool]:
        """The whole answer in one JSON body, once the worker has finished; and whether it succeeded."""
        answer, t = exchange.answer, exchange.tracked
        try:
            async for delta, parsed in self._deltas(exchange):
                answer.collect(delta, parsed)
        except STREAM_ERRORS as e:
            return self.failure(e, t.model, t.endpoint, answer.error_body), False
        body = answer.body(t.outcome, _ending(exchange))
        return web.Response(body=msgspec.json.encode(body), content_type="application/json",
                            headers=answer.headers or None), True

    async def _deltas(self, exchange: Exchange) -> AsyncIterator[tuple[ProcessedDelta, ParsedDelta | None]]:
        """Engine outputs -> (processed delta, what it means for the client), one per output; stops the
        worker on a local stop."""
        t, processor, parser = exchange.tracked, exchange.processor, exchange.parser
        outcome, context, outputs = t.outcome, t.context, t.outputs
        itl = self.metrics.itl.labels(t.model)
        queued = self.metrics.queued.labels(t.model)
        output = exchange.first
        while output is not None:
            delta = processor.process(output)
            if output.completion_usage is not None:
                outcome.usage = output.completion_usage
            if delta.token_ids:
                now = time.perf_counter()
                if outcome.first_token_at is None:
                    outcome.first_token_at = now
                    queued.dec()
                elif outcome.last_token_at is not None:
                    n = len(delta.token_ids)  # the gap shared by the tokens that came together, as Dynamo counts it
                    itl.observe((now - outcome.last_token_at) / n, n)
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
                parsed = _parse(exchange, delta)
                _collect(outcome, delta, parsed)
            if delta.finish_reason:
                outcome.finish_reason = delta.finish_reason
                if parser is not None:
                    yield delta, parsed
                    delta, parsed = ProcessedDelta(completion_tokens=delta.completion_tokens), parser.finish()
                    _collect(outcome, delta, parsed)
                yield delta, parsed  # even an empty one: the caller may have events to flush before the next wait
                if output.finish_reason is None:
                    context.stop_generating()  # stopped here (stop string, max tokens): the worker can stop
                return
            yield delta, parsed
            output = await anext(outputs, None)
        self.raise_if_cut_off(context)
        tail = processor.finish()
        parsed = None
        if parser is not None:
            parsed = _parse(exchange, tail)
            end = parser.finish()
            parsed.content += end.content
            parsed.reasoning += end.reasoning
            parsed.tool_calls.extend(end.tool_calls)
        _collect(outcome, tail, parsed)
        if tail.text or parsed:
            yield tail, parsed


def _parse(exchange: Exchange, delta: ProcessedDelta) -> ParsedDelta:
    """The delta's text as content, reasoning and tool calls (the request has a parser); its tokens counted
    as reasoning while the output thinks."""
    parser = exchange.parser
    assert parser is not None
    outcome = exchange.tracked.outcome
    was_thinking = parser.thinking
    parsed = parser.feed(delta.text) if delta.text else ParsedDelta()
    if outcome.reasoning_tokens is not None and (was_thinking or parser.thinking):
        outcome.reasoning_tokens += len(delta.token_ids)
    return parsed


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


def _ending(exchange: Exchange) -> Ending:
    t, parser = exchange.tracked, exchange.parser
    outcome = t.outcome
    engine_usage = outcome.usage
    if exchange.images and engine_usage is not None:
        t.prompt_tokens = engine_usage.prompt_tokens
    details = engine_usage.prompt_tokens_details if engine_usage is not None else None
    usage = Usage(t.prompt_tokens, outcome.completion_tokens, details.cached_tokens if details else None,
                  outcome.reasoning_tokens)
    return Ending(outcome.finish_reason or "stop", exchange.processor.stop_reason,
                  parser is not None and parser.calls_finish, usage,
                  _response_nvext(exchange.extra_fields, t.attempt) if exchange.extra_fields else None)


def _response_nvext(fields: list[str], attempt: Attempt) -> dict[str, Any]:
    """An answer's `nvext`: `worker_id` (Dynamo's: the prefill and decode workers and their dp ranks) and
    `routing` (each KV-routed leg's decision: its blocks and credit per tier)."""
    out: dict[str, Any] = {}
    if "worker_id" in fields:
        ids = {"prefill_worker_id": attempt.prefill_instance, "prefill_dp_rank": attempt.prefill_dp_rank,
               "decode_worker_id": attempt.instance_id, "decode_dp_rank": attempt.dp_rank}
        out["worker_id"] = {name: value for name, value in ids.items() if value is not None}
    if "routing" in fields:
        out["routing"] = {leg: decision.report() for leg, decision in
                          (("prefill", attempt.prefill_route), ("decode", attempt.route)) if decision is not None}
    return out


def _annotation_events(req: AnyRequest, prepared: Prepared) -> bytes:
    """The SSE events a streamed answer opens with for the request's `nvext.annotations`, as Dynamo writes
    them: `event: <name>` and a comment line holding the value as a JSON string (the templated prompt; the
    prompt's token ids as JSON text)."""
    events = []
    for name in req.ext.annotations:
        if name == "token_ids":
            value = msgspec.json.encode(prepared.prompt_ids).decode()
        elif isinstance(req, ChatRequest):
            value = prepared.prompt_text
        else:
            value = req.prompt if isinstance(req.prompt, str) else ""
        events.append(b"event: " + name.encode() + b"\n: " + msgspec.json.encode(value) + b"\n\n")
    return b"".join(events)


def public_error(error: BaseException) -> RequestError:
    """What the client is told, with its status: the frontend's own messages and the errors a worker
    reports; the request plane's details (addresses, ports) stay in the log."""
    if isinstance(error, RequestError):
        return error
    if isinstance(error, RemoteError):
        return RequestError(str(error), status=error.code if 400 <= error.code < 500 else 500)
    if isinstance(error, NoWorkerError):
        return RequestError(str(error), status=503)
    if isinstance(error, StreamLost):
        return RequestError(error.public, status=503)
    if isinstance(error, StreamIncompleteError):
        return RequestError("the worker serving this request stopped before finishing it", status=503)
    return RequestError("internal error while serving the request", status=503)


def _is_json(content_type: str) -> bool:
    return content_type == "application/json" or (content_type.startswith("application/")
                                                   and content_type.endswith("+json"))


def _client_id(request: web.Request) -> str:
    """The client's own x-request-id, for the log line only."""
    client = request.headers.get("x-request-id")
    return f" (x-request-id {client[:128]!r})" if client else ""
