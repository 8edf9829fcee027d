"""The mocker as a `WorkerEngine`: `generate` for aggregated, prefill and decode workers (the vLLM
worker's contract), `embed` for an embedding model, and `clear_kv_blocks`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from tandem.llm.protocols import (
    CompletionUsage,
    DisaggregatedParams,
    EmbeddingOutput,
    EmbeddingRequest,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
)
from tandem.mocker.args import MockerConfig
from tandem.mocker.engine import MockEngine, SimLogprobs, SyntheticTokens
from tandem.mocker.scheduler import SimRequest, StepOutput
from tandem.router.hashing import MediaSpan, request_seed
from tandem.runtime import Context
from tandem.runtime.errors import InvalidRequestError
from tandem.worker.config import DisaggregationMode
from tandem.worker.encoders import Encoders
from tandem.worker.images import ImagePrompts
from tandem.worker.synthetic import synthetic_embedding


class MockerHandler:
    def __init__(self, config: MockerConfig, engines: list[MockEngine], tokens: SyntheticTokens,
                 worker_id: int, embedding_size: int = 0) -> None:
        self.config = config
        self.embedding_size = embedding_size  # an embedding model's vector size (0: it generates text)
        self.engines = engines  # one per data-parallel rank
        self.tokens = tokens
        self.worker_id = worker_id
        self.images = ImagePrompts(config.images, "the mocker")
        self.encoders: Encoders | None = None  # --ec-consumer-mode: encoder workers encode the images (set by main)

    async def generate(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[LLMEngineOutput]:
        if request.priority:  # the client's 400, never a priority silently dropped
            raise InvalidRequestError(f"priority {request.priority} (x-dynamo-request-priority) is not supported: "
                                      "the mocker schedules first come, first served")
        prompt, media = request.token_ids, list[MediaSpan]()
        if request.multi_modal_data is not None:
            prompt, media = await self.images.expand(request)
        encoded = bool(media) and self.encoders is not None and await self.encoders.encode(request)
        try:
            sim = self._sim_request(request, context.id(), prompt, media, encoded)
            engine = self._engine(request)
            logprobs = self._logprobs(request)
        except ValueError as e:
            yield LLMEngineOutput.failed(str(e))
            return
        prompt_len = len(sim.prompt)
        ends_answer = not self.config.is_prefill and sim.max_tokens < self._limit(request, prompt_len)  # --answer-tokens
        prefill_details = request.prefill_result.prompt_tokens_details if request.prefill_result else None
        transfer_ms = await self._pull_kv(prompt_len) if sim.prefilled else None
        if context.is_stopped():  # while the KV was on its way
            yield LLMEngineOutput.cancelled(CompletionUsage.of(prompt_len, 0, details=prefill_details))
            return
        try:
            queue = engine.submit(sim)
        except ValueError as e:  # it can never fit this engine
            yield LLMEngineOutput.failed(str(e))
            return
        unsubscribe = context.on_signal(lambda killed: queue.put_nowait(None))
        cached: int | None = None
        generated = 0
        try:
            while True:
                output: StepOutput | None = await queue.get()
                if output is None:  # stopped by the caller
                    yield LLMEngineOutput.cancelled(CompletionUsage.of(prompt_len, generated, cached, prefill_details))
                    return
                generated += 1
                if output.cached_tokens is not None:
                    cached = output.cached_tokens
                item = LLMEngineOutput([output.token_id])
                if logprobs is not None:
                    item.log_probs, item.top_logprobs = logprobs(output.token_id)
                if transfer_ms is not None and generated == 1:
                    item.kv_transfer_ms = transfer_ms
                if output.finished:
                    item.finish_reason = FinishReason.EOS if ends_answer else FinishReason.LENGTH
                    item.completion_usage = CompletionUsage.of(prompt_len, generated, cached, prefill_details)
                    if self.config.is_prefill:
                        item.disaggregated_params = DisaggregatedParams(self._transfer_params(context.id(), prompt_len))
                yield item
                if output.finished:
                    return
        finally:
            unsubscribe()
            engine.release(sim.request_id)

    async def embed(self, request: EmbeddingRequest, context: Context) -> AsyncIterator[EmbeddingOutput]:
        """An embedding model: each input costs its prefill on the simulated engine (one step's worth of
        output, never decoded); the vectors are synthetic (`synthetic_embedding`)."""
        engine = self.engines[0]
        sims = [SimRequest(request_id=f"{context.id()}-{i}", prompt=ids, max_tokens=1,
                           output_token=self.tokens.for_request(ids)) for i, ids in enumerate(request.token_ids)]
        queues = []
        try:
            for sim in sims:
                queues.append(engine.submit(sim))
            for queue in queues:
                while (output := await queue.get()) is not None and not output.finished:
                    pass
                if output is None:  # stopped by the caller
                    return
        except ValueError as e:  # an input that can never fit this engine
            raise InvalidRequestError(str(e)) from None
        finally:
            for sim in sims:
                engine.release(sim.request_id)
        tokens = sum(map(len, request.token_ids))
        yield EmbeddingOutput([synthetic_embedding(ids, self.embedding_size, request.dimensions)
                               for ids in request.token_ids], tokens, tokens)

    async def _pull_kv(self, prompt_len: int) -> float:
        """A decode worker given a prefill_result first pulls the prompt's KV from the prefill worker
        (NIXL in vLLM): wait the simulated transfer, scaled like every simulated duration. Returns the
        milliseconds waited, reported to the frontend as `kv_transfer_ms`."""
        seconds = self.config.kv_transfer_seconds(prompt_len) / self.config.speedup_ratio
        await asyncio.sleep(seconds)
        return seconds * 1000

    def _engine(self, request: PreprocessedRequest) -> MockEngine:
        """The engine of the request's `routing.dp_rank` (rank 0 when it names none)."""
        rank = request.dp_rank or 0
        if not 0 <= rank < len(self.engines):
            raise ValueError(f"dp_rank {rank!r} is not a data-parallel rank of this worker "
                             f"(it has {len(self.engines)})")
        return self.engines[rank]

    def _sim_request(self, request: PreprocessedRequest, request_id: str, token_ids: list[int],
                     media: list[MediaSpan], encoded: bool) -> SimRequest:
        """`encoded`: an encoder worker encoded the images, so the engine does not spend their encode time."""
        if not token_ids:
            raise ValueError("the request has no prompt tokens")
        prompt_len = len(token_ids)
        room = self.config.context_length - prompt_len
        if room < 1:
            raise ValueError(f"the prompt ({prompt_len} tokens) does not fit the context length "
                             f"({self.config.context_length} tokens)")
        max_tokens = self._limit(request, prompt_len)
        if self.config.answer_tokens is not None and not request.stop_conditions.ignore_eos:
            max_tokens = min(max_tokens, self.config.answer_tokens)
        if self.config.is_prefill:
            max_tokens = 1
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        salt = request.routing.cache_salt if request.routing else None
        handed_over = request.prefill_result is not None and bool(
            request.prefill_result.disaggregated_params.kv_transfer_params)
        prefilled = self.config.disaggregation_mode is DisaggregationMode.DECODE and handed_over
        # A prompt computed elsewhere (its KV cache pulled from the prefill worker) needs no image encoded here.
        encode = self.config.images is not None and not (encoded or prefilled)
        return SimRequest(
            request_id=request_id, prompt=token_ids, max_tokens=max_tokens,
            output_token=self.tokens.for_request(token_ids, request.sampling_options.seed),
            hash_seed=request_seed(None, salt), prefilled=prefilled, media=media,
            encode_ms=self.config.images.encode_ms if encode and self.config.images else 0.0,
        )

    def _limit(self, request: PreprocessedRequest, prompt_len: int) -> int:
        """The tokens the request allows: its max_tokens, else what the context leaves."""
        room = self.config.context_length - prompt_len
        return room if request.max_tokens is None else min(request.max_tokens, room)

    def _logprobs(self, request: PreprocessedRequest) -> Callable[[int], SimLogprobs] | None:
        """The simulated logprobs when `output_options.logprobs` asks for them (the number of
        alternatives, 0 = the generated token's alone); None, and no cost per token, otherwise."""
        top = request.output_options.logprobs
        if top is None:
            return None
        if top < 0:
            raise ValueError(f"logprobs must be at least 0, got {top}")
        return self.tokens.logprobs_for(request.token_ids, request.sampling_options.seed, top)

    def _transfer_params(self, request_id: str, prompt_len: int) -> dict[str, Any]:
        """What a decode worker needs to 'pull' the KV (nothing real moves in the mocker)."""
        return {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": f"{self.worker_id:x}",
                "remote_request_id": request_id, "num_prompt_tokens": prompt_len}

    async def clear_kv_blocks(self) -> None:
        for engine in self.engines:
            engine.scheduler.kv.clear()



class EmbeddingMocker(MockerHandler):
    """The mocker as an embedding model: `generate` takes an `EmbeddingRequest`."""

    generate = MockerHandler.embed  # type: ignore[assignment]


class MockEncoder:
    """The mocker as an encoder worker (--vllm-native-encoder-worker): it encodes one request's images at a
    time, each in the simulated --image-encode-ms (at the speedup ratio), and answers once they are done. Its
    consumers have already fetched and checked the images; it does not read them again."""

    def __init__(self, config: MockerConfig) -> None:
        assert config.images is not None  # checked with the flags
        self.seconds_per_image = config.images.encode_ms / 1000 / config.speedup_ratio
        self._busy = asyncio.Lock()  # one encoder engine: one batch of images at a time

    async def generate(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[LLMEngineOutput]:
        media = request.multi_modal_data
        if media is None or not media.image_url:
            raise InvalidRequestError("multi_modal_data: an encoder worker takes requests with images")
        async with self._busy:
            await asyncio.sleep(len(media.image_url) * self.seconds_per_image)
        yield LLMEngineOutput([], finish_reason=FinishReason.STOP,
                              completion_usage=CompletionUsage.of(len(request.token_ids), 0))
