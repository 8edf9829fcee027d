"""The vLLM engine behind the worker contract: `generate` for aggregated and decode workers (token input),
text-input workers, prefill workers and embedding workers, `clear_kv_blocks`, and the sleep / wake
engine routes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Histogram
from vllm.exceptions import VLLMClientError
from vllm.inputs import TextPrompt, TokensPrompt
from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

from tandem.llm import prompt_embeds
from tandem.llm.images import ImageError, ImageLimits, ImageLoader
from tandem.llm.protocols import (
    CompletionUsage,
    DisaggregatedParams,
    EmbeddingOutput,
    EmbeddingRequest,
    FinishReason,
    LLMEngineOutput,
    MultiModalData,
    PreprocessedRequest,
    RankedLogprob,
    TextRequest,
    text_chunk,
)
from tandem.runtime import Context
from tandem.runtime.errors import InvalidRequestError
from tandem.vllm.abort import abort_monitor
from tandem.worker.forward_pass import PendingPrompts

log = logging.getLogger(__name__)

_SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)
_GUIDED_KEYS = ("json", "regex", "choice", "grammar", "whitespace_pattern", "structural_tag")


def _given(options: msgspec.Struct) -> dict[str, Any]:
    """The fields of an options Struct that the request set, by name."""
    return {name: value for name in options.__struct_fields__ if (value := getattr(options, name)) is not None}


def build_sampling_params(request: PreprocessedRequest, defaults: dict[str, Any],
                          model_max_len: int | None) -> SamplingParams:
    """A PreprocessedRequest's options -> vLLM SamplingParams. Stop strings stay with the
    frontend; the hidden EOS ids join stop_token_ids; the frontend detokenizes."""
    kwargs: dict[str, Any] = dict(defaults)
    sampling = request.sampling_options
    if sampling.guided_decoding is not None:
        guided = _given(sampling.guided_decoding)
        kwargs["structured_outputs"] = StructuredOutputsParams(**{k: guided[k] for k in _GUIDED_KEYS if k in guided})
    for key, value in _given(sampling).items():
        if key in _SAMPLING_FIELDS and key != "guided_decoding":
            kwargs[key] = value
    stop = request.stop_conditions
    for key, value in _given(stop).items():
        if key in _SAMPLING_FIELDS and key != "stop":
            kwargs[key] = value
    if stop.max_thinking_tokens is not None:
        # vLLM forces the end of thinking after this many tokens (the engine's reasoning config, set from
        # --dyn-reasoning-parser, says which tokens open and close it).
        kwargs["thinking_token_budget"] = stop.max_thinking_tokens
    if stop.stop_token_ids_hidden:
        kwargs["stop_token_ids"] = sorted(set(kwargs.get("stop_token_ids") or []) | set(stop.stop_token_ids_hidden))
    for key, value in (("logprobs", request.output_options.logprobs),
                       ("prompt_logprobs", request.output_options.prompt_logprobs)):
        if value is None:
            continue
        if value < 0:
            log.warning("ignoring invalid %s=%r", key, value)
            continue
        kwargs[key] = value
    if kwargs.get("max_tokens") is None and model_max_len:
        kwargs["max_tokens"] = max(1, model_max_len - len(request.token_ids))
    kwargs["detokenize"] = False
    kwargs["output_kind"] = RequestOutputKind.DELTA
    return SamplingParams(**kwargs)


def _finish_reason(value: Any) -> FinishReason | None:
    """vLLM's finish reason -> the contract's; vLLM's `abort` is a cancellation."""
    if value is None:
        return None
    text = str(value)
    if text.startswith("abort"):
        return FinishReason.CANCELLED
    try:
        return FinishReason(text)
    except ValueError:  # a reason newer than this contract: the stream ended, not cleanly
        log.warning("unknown vLLM finish reason %r", text)
        return FinishReason.ERROR


def _logprobs(output: Any, new_ids: list[int]) -> tuple[list[float], list[list[RankedLogprob]]] | None:
    """vLLM per-position {token_id: Logprob} -> the contract's log_probs / top_logprobs for the new tokens."""
    positions = output.logprobs
    if not positions:
        return None
    positions = positions[-len(new_ids):] if len(positions) > len(new_ids) else positions
    sampled: list[float] = []
    tops: list[list[RankedLogprob]] = []
    for token_id, position in zip(new_ids, positions, strict=False):
        chosen = position.get(token_id)
        sampled.append(chosen.logprob if chosen is not None else float("-inf"))
        tops.append([RankedLogprob(lp.rank, tid, lp.decoded_token, lp.logprob)
                     for tid, lp in sorted(position.items(), key=lambda item: item[1].rank or 0)])
    return sampled, tops


def _kv_wait_ms(result: Any) -> float | None:
    """How long a remote-prefill request waited in the decode engine before its first step, in ms: from
    entering the engine's queue until first scheduled. vLLM parks such a request until the connector has
    pulled the prompt's KV, so this is the KV transfer (with the NIXL handshake the first time, and any
    wait for a free slot). None when vLLM keeps no request stats."""
    stats = getattr(result, "metrics", None)
    queued = getattr(stats, "queued_ts", 0.0)
    scheduled = getattr(stats, "scheduled_ts", 0.0)
    if not queued or not scheduled:
        return None
    return max(scheduled - queued, 0.0) * 1000


class DisaggMetrics:
    """Decode-side metrics of disaggregated serving on the worker's /metrics (the frontend's
    `dynamo_frontend_remote_prefills_total` / `..._kv_transfer_seconds` are their counterparts)."""

    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        self.remote_prefills = Counter(
            "dynamo_component_remote_prefill_requests", "Requests this worker decoded from a prefill worker's KV "
            "(they came with kv_transfer_params)", ["model"], registry=registry).labels(model)
        self.kv_transfer_seconds = Histogram(
            "dynamo_component_kv_transfer_seconds", "Wait of a remote-prefill request in the engine until its "
            "first step: the KV pull from the prefill worker", ["model"], registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
        ).labels(model)


class SleepRequest(msgspec.Struct):
    level: int | None = None  # 1: offload the weights, 2: discard them, 3: discard everything; None: the flag's


class WakeRequest(msgspec.Struct):
    tags: list[str] | None = None  # what to restore (vLLM's `weights`, `kv_cache`); None: everything


class BaseWorkerHandler:
    """The vLLM engine as a `WorkerEngine`; one subclass per role (see `handler_class`)."""

    def __init__(
        self,
        runtime: Any,
        engine_client: Any,
        config: Any,
        *,
        default_sampling_params: dict[str, Any],
        model_max_len: int | None,
        shutdown_event: asyncio.Event,
        lora: Any = None,
        disagg_metrics: DisaggMetrics | None = None,
        pending_prompts: PendingPrompts | None = None,
    ) -> None:
        self.runtime = runtime
        self.engine_client = engine_client
        self.config = config
        self.default_sampling_params = default_sampling_params
        self.model_max_len = model_max_len
        self.shutdown_event = shutdown_event
        self.lora = lora
        self.disagg_metrics = disagg_metrics
        self.pending_prompts = pending_prompts or PendingPrompts()  # this engine's prefill queue, in tokens
        self._images: ImageLoader | None = None  # made on the first request with images
        # --ec-consumer-mode: has an encoder worker store the encoder outputs of a request's images, given with
        # their content digests (set by main)
        self.encode_images: Callable[[PreprocessedRequest, list[str]], Awaitable[bool]] | None = None
        # --embedding-transfer-mode: a request's images as an encoder's outputs (tensors, digests), None when
        # the encoder could not (set by main)
        self.embed_images: Callable[[PreprocessedRequest], Awaitable[tuple[list[Any], list[str]] | None]] | None = None
        self.on_sleep: Callable[[], Awaitable[None]] | None = None  # leave / rejoin discovery, set by main
        self.on_wake: Callable[[], Awaitable[None]] | None = None

    def generate(self, request: Any, context: Context) -> AsyncIterator[Any]:
        raise NotImplementedError

    # -- prompts -------------------------------------------------------------------------------
    def _prompt(self, request: PreprocessedRequest) -> tuple[Any, int]:
        """Prompt embeddings (base64 torch tensor) or token ids; returns (prompt, prompt length). Embeddings
        are checked as the frontend checks them (a second line of defence): a bad tensor is an
        InvalidRequestError, the client's 400, never a crash. A request's `cache_salt` salts the engine's
        prefix cache, so prompts of different salts never share cached blocks."""
        salt = request.routing.cache_salt if request.routing is not None else None
        if request.prompt_embeds is not None:
            from vllm.inputs import EmbedsPrompt

            model = self.engine_client.model_config
            if not model.enable_prompt_embeds:
                raise InvalidRequestError("this worker does not take prompt_embeds (it runs without "
                                          "--enable-prompt-embeds)")
            try:
                tensor = prompt_embeds.load(request.prompt_embeds, hidden_size=model.get_hidden_size(),
                                            max_len=model.max_model_len - 1)
            except prompt_embeds.PromptEmbedsError as e:
                raise InvalidRequestError(str(e)) from None
            # Cast as vLLM's own server does: a client need not know the engine's --dtype.
            embeds = EmbedsPrompt(prompt_embeds=tensor.to(model.dtype))
            if salt is not None:
                embeds["cache_salt"] = salt
            return embeds, int(tensor.shape[0])
        tokens = TokensPrompt(prompt_token_ids=request.token_ids)
        if salt is not None:
            tokens["cache_salt"] = salt
        return tokens, len(request.token_ids)

    async def _multimodal_prompt(self, request: PreprocessedRequest, media: MultiModalData) -> tuple[Any, int]:
        """The token prompt with its images, fetched and decoded here; the engine expands each image's one
        placeholder token into the image's tokens. The images' content digests are their identities in the
        engine's prefix cache, so the same image shares cached blocks across requests and another does not."""
        self._check_media(media)
        try:
            if self._images is None:
                self._images = ImageLoader(ImageLimits(allow_private=self.config.allow_private_media_urls))
            images = await self._images.load_all([item.url for item in media.image_url])
        except ImageError as e:
            raise InvalidRequestError(f"multi_modal_data.image_url: {e}", e.status) from None
        tokens, prompt_len = self._prompt(request)
        tokens["multi_modal_data"] = {"image": [loaded.image for loaded in images]}
        tokens["multi_modal_uuids"] = {"image": [loaded.digest for loaded in images]}
        return tokens, prompt_len

    def _check_media(self, media: MultiModalData) -> None:
        if not self.config.enable_multimodal:
            raise InvalidRequestError("Received multimodal data but multimodal processing is not enabled: start the "
                                      "worker with --enable-multimodal")
        if media.video_url:
            raise InvalidRequestError("multi_modal_data.video_url: video input is not supported yet")
        if not media.image_url:
            raise InvalidRequestError("multi_modal_data: no image_url items")

    async def _images_prompt(self, request: PreprocessedRequest, media: MultiModalData) -> tuple[Any, int]:
        """The token prompt with the images' encoder outputs when an encoder hands them over, else with the
        images themselves (for the engine to encode)."""
        if self.embed_images is not None:
            self._check_media(media)
            embedded = await self.embed_images(request)
            if embedded is not None:
                tensors, digests = embedded
                tokens, prompt_len = self._prompt(request)
                tokens["multi_modal_data"] = {"image": tensors}
                tokens["multi_modal_uuids"] = {"image": digests}
                return tokens, prompt_len
        return await self._multimodal_prompt(request, media)

    async def close_images(self) -> None:
        if self._images is not None:
            await self._images.close()

    def _lora_request(self, request: PreprocessedRequest) -> Any:
        """The LoRARequest of the adapter the request names; None for the base model. An adapter this worker
        does not hold (unloaded since the frontend routed the request here) raises LookupError: computing
        the request with the base weights instead would be a silently wrong answer."""
        if self.lora is None or not request.model or request.model == self.config.served_model_name:
            return None
        adapter = self.lora.lora_request(request.model)
        if adapter is None:
            raise LookupError(f"LoRA adapter {request.model!r} is not loaded on this worker")
        return adapter

    async def _stream_tokens(
        self, request: PreprocessedRequest, context: Context, sampling: SamplingParams, *, prefill: bool,
        remote_prefill: bool = False,
    ) -> AsyncIterator[LLMEngineOutput]:
        """Run one request on the engine and yield its outputs, new tokens only. A `remote_prefill`
        request's first output also reports its KV wait as `kv_transfer_ms`."""
        media = request.multi_modal_data
        try:
            if request.prompt_embeds is not None:
                # Loading a tensor of thousands of embeddings takes a while: not on the event loop.
                prompt, prompt_len = await asyncio.to_thread(self._prompt, request)
            elif media is not None:
                prompt, prompt_len = await self._images_prompt(request, media)
            else:
                prompt, prompt_len = self._prompt(request)
        except InvalidRequestError:
            raise  # the client's 400
        except Exception as e:
            yield LLMEngineOutput.failed(f"Invalid prompt: {e}")
            return
        if self.encode_images is not None and media is not None:
            # The images are read by now: their digests name the encoder outputs already stored.
            await self.encode_images(request, prompt["multi_modal_uuids"]["image"])
        try:
            lora_request = self._lora_request(request)
        except LookupError as e:  # a prefill worker's failure makes the frontend prefill on the decode worker
            yield LLMEngineOutput.failed(str(e))
            return
        request_id = context.id()
        prefill_details = request.prefill_result.prompt_tokens_details if request.prefill_result else None
        generated = 0
        first = True
        try:
            # A remote prefill's prompt was computed on the prefill worker: nothing queued here.
            with self.pending_prompts.prompt(0 if remote_prefill else prompt_len) as first_token_out:
                async with abort_monitor(self.engine_client, context, request_id, self.shutdown_event) as monitor:
                    async for result in monitor.stream(self.engine_client.generate(
                        prompt, sampling, request_id, lora_request=lora_request,
                        data_parallel_rank=request.dp_rank, priority=request.priority,
                    )):
                        if not result.outputs:
                            yield LLMEngineOutput.failed("No outputs from vLLM engine")
                            return
                        output = result.outputs[0]
                        if first and media is not None and result.prompt_token_ids:
                            prompt_len = len(result.prompt_token_ids)  # with each image's tokens
                        new_ids = list(output.token_ids)
                        generated += len(new_ids)
                        if new_ids:
                            first_token_out()
                        item = LLMEngineOutput(new_ids)
                        if remote_prefill and first:
                            waited = _kv_wait_ms(result)
                            if waited is not None:
                                item.kv_transfer_ms = waited
                                if self.disagg_metrics is not None:
                                    self.disagg_metrics.kv_transfer_seconds.observe(waited / 1000)
                        first = False
                        if sampling.logprobs is not None and new_ids:
                            parsed = _logprobs(output, new_ids)
                            if parsed is not None:
                                item.log_probs, item.top_logprobs = parsed
                        if prefill and result.kv_transfer_params:
                            item.disaggregated_params = DisaggregatedParams(result.kv_transfer_params)
                        if output.finish_reason is not None or (prefill and result.finished):
                            item.finish_reason = _finish_reason(output.finish_reason)
                            item.stop_reason = output.stop_reason
                            # A disaggregated request's cache hits were on the prefill worker.
                            item.completion_usage = CompletionUsage.of(prompt_len, generated, result.num_cached_tokens,
                                                                       prefill_details)
                        yield item
        except VLLMClientError as e:  # the request does not fit the engine (a prompt its images make too long)
            raise InvalidRequestError(str(e)) from None

    # -- other endpoints -----------------------------------------------------------------------
    async def clear_kv_blocks(self) -> None:
        await self.engine_client.reset_prefix_cache()

    async def sleep(self, body: dict[str, Any] | None) -> dict[str, Any]:
        """Engine route /engine/sleep: leave discovery first so nothing new is routed here."""
        try:
            level = msgspec.convert(body or {}, SleepRequest).level or self.config.sleep_mode_level
        except msgspec.ValidationError as e:
            return {"status": "error", "message": f"invalid sleep request: {e}"}
        try:
            if self.on_sleep is not None:
                try:
                    await self.on_sleep()
                except Exception as e:
                    log.warning("could not unregister before sleeping: %s", e)
            await self.engine_client.sleep(level)
            return {"status": "ok", "message": f"Engine slept (level={level})"}
        except Exception as e:
            return {"status": "error", "message": str(e)}

    async def wake_up(self, body: dict[str, Any] | None) -> dict[str, Any]:
        try:
            tags = msgspec.convert(body or {}, WakeRequest).tags
        except msgspec.ValidationError as e:
            return {"status": "error", "message": f"invalid wake_up request: {e}"}
        try:
            await self.engine_client.wake_up(tags)
            if self.on_wake is not None:
                try:
                    await self.on_wake()
                except Exception as e:
                    log.warning("could not re-register after waking: %s", e)
            return {"status": "ok", "message": f"Engine woke (tags={tags})"}
        except Exception as e:
            return {"status": "error", "message": str(e)}


class DecodeWorkerHandler(BaseWorkerHandler):
    """Aggregated and decode workers with token input: a request with a `prefill_result` decodes from
    the prefill worker's KV, any other is served whole."""

    async def generate(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[LLMEngineOutput]:
        sampling = build_sampling_params(request, self.default_sampling_params, self.model_max_len)
        kv_params = request.prefill_result.disaggregated_params.kv_transfer_params if request.prefill_result else None
        if kv_params is not None:
            # vLLM's connector pulls the prompt's KV from the prefill worker before the first step.
            sampling.extra_args = {**(sampling.extra_args or {}), "kv_transfer_params": kv_params}
            if self.disagg_metrics is not None:
                self.disagg_metrics.remote_prefills.inc()
        async for item in self._stream_tokens(request, context, sampling, prefill=False,
                                              remote_prefill=kv_params is not None):
            yield item


class TextWorkerHandler(BaseWorkerHandler):
    """Text input (--use-vllm-tokenizer): the client's OpenAI request in, OpenAI chat chunks out; the
    engine templates and detokenizes."""

    async def generate(self, request: TextRequest, context: Context) -> AsyncIterator[dict[str, Any]]:
        tokenizer = self.engine_client.tokenizer
        kwargs: dict[str, Any] = {**self.default_sampling_params, **request.sampling_fields()}
        kwargs.update(detokenize=True, output_kind=RequestOutputKind.DELTA)
        if request.messages is not None:
            template_kwargs = dict(request.chat_template_kwargs or {})
            if request.tools:
                template_kwargs["tools"] = request.tools
            text = tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True,
                                                 **template_kwargs)
            prompt: Any = TextPrompt(prompt=text)
            prompt_len = len(tokenizer.encode(text, add_special_tokens=False))
        elif request.prompt is not None:
            ids = tokenizer.encode(request.prompt)
            prompt, prompt_len = TokensPrompt(prompt_token_ids=ids), len(ids)
        else:
            raise ValueError("a text-mode request needs 'messages' or 'prompt'")
        if kwargs.get("max_tokens") is None and self.model_max_len:
            kwargs["max_tokens"] = max(1, self.model_max_len - prompt_len)
        sampling = SamplingParams(**kwargs)
        request_id = context.id()
        response_id = request.id or request_id
        generated = 0
        async with abort_monitor(self.engine_client, context, request_id, self.shutdown_event) as monitor:
            async for result in monitor.stream(self.engine_client.generate(prompt, sampling, request_id)):
                if not result.outputs:
                    yield text_chunk(response_id, "", FinishReason.ERROR)
                    return
                output = result.outputs[0]
                generated += len(output.token_ids)
                reason = _finish_reason(output.finish_reason)
                usage = CompletionUsage.of(prompt_len, generated, result.num_cached_tokens) if reason else None
                yield text_chunk(response_id, output.text, reason, usage)


class PrefillWorkerHandler(BaseWorkerHandler):
    """Prefill workers: compute the prompt's KV, generate one token, hand the KV transfer
    parameters back for the decode worker."""

    async def generate(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[LLMEngineOutput]:
        sampling = build_sampling_params(request, self.default_sampling_params, self.model_max_len)
        # vLLM's connector keeps the prompt's KV for a decode worker to pull, and says where it is.
        params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
        sampling.extra_args = {**(sampling.extra_args or {}), "kv_transfer_params": params}
        sampling.max_tokens = 1
        sampling.min_tokens = 1
        async for item in self._stream_tokens(request, context, sampling, prefill=True):
            yield item


class EmbeddingWorkerHandler(BaseWorkerHandler):
    """Embedding workers (vLLM's pooling runner): one vector per input, pooled as the model's pooler says
    (a converted causal LM: its last token's hidden state, normalized)."""

    async def generate(self, request: EmbeddingRequest, context: Context) -> AsyncIterator[EmbeddingOutput]:
        from vllm.pooling_params import PoolingParams

        params = PoolingParams(task="embed", dimensions=request.dimensions)
        request_id = context.id()
        # The inputs go to the engine together, so it batches them into the same steps.
        vectors = await asyncio.gather(*(self._embed(ids, params, f"{request_id}-{i}", context)
                                         for i, ids in enumerate(request.token_ids)))
        if not context.is_stopped():
            tokens = sum(map(len, request.token_ids))
            yield EmbeddingOutput(list(vectors), tokens, tokens)

    async def _embed(self, token_ids: list[int], params: Any, request_id: str, context: Context) -> list[float]:
        final = None
        try:
            async with abort_monitor(self.engine_client, context, request_id, self.shutdown_event) as monitor:
                async for output in monitor.stream(self.engine_client.encode(
                        TokensPrompt(prompt_token_ids=token_ids), params, request_id)):
                    final = output
        except ValueError as e:  # vLLM's check of the input (its length, the dimensions asked for)
            raise InvalidRequestError(str(e)) from None
        if final is None or not final.finished:
            return []  # stopped before the engine finished it: the caller sends nothing
        return final.outputs.data.tolist()


def handler_class(*, prefill: bool, text_input: bool, embedding: bool = False) -> type[BaseWorkerHandler]:
    """The handler of a worker's role."""
    if embedding:
        return EmbeddingWorkerHandler
    if prefill:
        return PrefillWorkerHandler
    return TextWorkerHandler if text_input else DecodeWorkerHandler
