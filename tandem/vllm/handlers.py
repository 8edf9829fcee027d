"""The worker's endpoint handlers: `generate` in token and text
mode for aggregated / decode workers and for prefill workers, `clear_kv_blocks`, and the sleep /
wake engine routes."""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from vllm.inputs import TextPrompt, TokensPrompt
from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

from tandem.vllm.abort import abort_monitor

log = logging.getLogger(__name__)

_SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)
_GUIDED_KEYS = ("json", "regex", "choice", "grammar", "whitespace_pattern", "structural_tag")
# OpenAI request fields a text-mode request may set on SamplingParams.
_TEXT_MODE_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "top_k",
                     "repetition_penalty", "min_p", "length_penalty", "max_tokens", "stop", "ignore_eos",
                     "min_tokens")


def build_sampling_params(request: dict[str, Any], defaults: dict[str, Any], model_max_len: int | None) -> SamplingParams:
    """A PreprocessedRequest's options -> vLLM SamplingParams. Stop strings stay with the
    frontend; the hidden EOS ids join stop_token_ids; the frontend detokenizes."""
    kwargs: dict[str, Any] = dict(defaults)
    sampling = request.get("sampling_options") or {}
    guided = sampling.get("guided_decoding")
    if guided:
        chosen = {k: guided[k] for k in _GUIDED_KEYS if guided.get(k) is not None}
        kwargs["structured_outputs"] = StructuredOutputsParams(**chosen)
    for key, value in sampling.items():
        if value is not None and key in _SAMPLING_FIELDS and key != "guided_decoding":
            kwargs[key] = value
    stop = request.get("stop_conditions") or {}
    for key, value in stop.items():
        if value is not None and key in _SAMPLING_FIELDS and key != "stop":
            kwargs[key] = value
    hidden = stop.get("stop_token_ids_hidden")
    if hidden:
        kwargs["stop_token_ids"] = sorted(set(kwargs.get("stop_token_ids") or []) | set(hidden))
    output = request.get("output_options") or {}
    for key in ("logprobs", "prompt_logprobs"):
        value = output.get(key)
        if value is None:
            continue
        try:
            parsed = int(value)
        except (TypeError, ValueError):
            parsed = -1
        if parsed < 0:
            log.warning("ignoring invalid %s=%r", key, value)
            continue
        kwargs[key] = parsed
    if kwargs.get("max_tokens") is None and model_max_len:
        kwargs["max_tokens"] = max(1, model_max_len - len(request.get("token_ids") or ()))
    kwargs["detokenize"] = False
    kwargs["output_kind"] = RequestOutputKind.DELTA
    return SamplingParams(**kwargs)


def _finish_reason(value: Any) -> str | None:
    if value is None:
        return None
    text = str(value)
    return "cancelled" if text.startswith("abort") else text


def _usage(prompt_tokens: int | None, completion_tokens: int, cached: int | None) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": None if prompt_tokens is None else prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached} if cached is not None else None,
    }


def _logprobs(output: Any, new_ids: list[int]) -> tuple[list[float], list[list[dict[str, Any]]]] | None:
    """vLLM per-position {token_id: Logprob} -> Dynamo's log_probs / top_logprobs for the new tokens."""
    positions = output.logprobs
    if not positions:
        return None
    positions = positions[-len(new_ids):] if len(positions) > len(new_ids) else positions
    sampled: list[float] = []
    tops: list[list[dict[str, Any]]] = []
    for token_id, position in zip(new_ids, positions, strict=False):
        chosen = position.get(token_id)
        sampled.append(chosen.logprob if chosen is not None else float("-inf"))
        tops.append([
            {"rank": lp.rank, "token_id": tid, "token": lp.decoded_token, "logprob": lp.logprob}
            for tid, lp in sorted(position.items(), key=lambda item: item[1].rank or 0)
        ])
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


class BaseWorkerHandler:
    def generate(self, request: dict[str, Any], context: Any) -> AsyncIterator[dict[str, Any]]:
        raise NotImplementedError

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
    ) -> None:
        self.runtime = runtime
        self.engine_client = engine_client
        self.config = config
        self.default_sampling_params = default_sampling_params
        self.model_max_len = model_max_len
        self.shutdown_event = shutdown_event
        self.lora = lora
        self.disagg_metrics = disagg_metrics
        self.generate_endpoint: Any = None  # set by main once served
        self.on_sleep: Any = None  # callbacks main sets: unregister / re-register in discovery
        self.on_wake: Any = None
        self.kv_publishers: list[Any] = []

    # -- prompts -------------------------------------------------------------------------------
    def _prompt(self, request: dict[str, Any]) -> tuple[Any, int]:
        """Prompt embeddings (base64 torch tensor) or token ids; returns (prompt, prompt length)."""
        embeds = request.get("prompt_embeds")
        if embeds:
            import torch
            from vllm.inputs import EmbedsPrompt

            tensor = torch.load(io.BytesIO(base64.b64decode(embeds)), weights_only=True)
            if not isinstance(tensor, torch.Tensor):
                raise ValueError("prompt_embeds must be a base64-encoded torch.Tensor")
            length = tensor.shape[0] if tensor.dim() == 2 else tensor.shape[1]
            return EmbedsPrompt(prompt_embeds=tensor), int(length)
        if request.get("multi_modal_data"):
            raise ValueError("this worker does not take multimodal data: multimodal serving is not built yet in tandem")
        token_ids = request["token_ids"]
        return TokensPrompt(prompt_token_ids=token_ids), len(token_ids)

    def _lora_request(self, request: dict[str, Any]) -> Any:
        if self.lora is None:
            return None
        return self.lora.lora_request(request.get("model") or "")

    @staticmethod
    def _dp_rank(request: dict[str, Any]) -> int | None:
        rank = request.get("dp_rank")
        if rank is None:
            rank = (request.get("routing") or {}).get("dp_rank")
        return rank

    async def _stream_tokens(
        self, request: dict[str, Any], context: Any, sampling: SamplingParams, *, prefill: bool,
        remote_prefill: bool = False,
    ) -> AsyncIterator[dict[str, Any]]:
        """Run one request on the engine and yield Dynamo LLMEngineOutput deltas. A
        `remote_prefill` request's first output also reports its KV wait as `kv_transfer_ms`."""
        try:
            prompt, prompt_len = self._prompt(request)
        except Exception as e:
            error: dict[str, Any] = {"finish_reason": f"error: Invalid prompt: {e}", "token_ids": []}
            if prefill:
                error["disaggregated_params"] = None
            yield error
            return
        request_id = context.id()
        prefill_details = (request.get("prefill_result") or {}).get("prompt_tokens_details")
        generated = 0
        first = True
        async with abort_monitor(self.engine_client, context, request_id, self.shutdown_event) as monitor:
            async for result in monitor.stream(self.engine_client.generate(
                prompt, sampling, request_id, lora_request=self._lora_request(request),
                data_parallel_rank=self._dp_rank(request),
            )):
                if not result.outputs:
                    yield {"finish_reason": "error: No outputs from vLLM engine", "token_ids": []}
                    return
                output = result.outputs[0]
                new_ids = list(output.token_ids)
                generated += len(new_ids)
                item: dict[str, Any] = {"token_ids": new_ids}
                if remote_prefill and first:
                    waited = _kv_wait_ms(result)
                    if waited is not None:
                        item["kv_transfer_ms"] = waited
                        if self.disagg_metrics is not None:
                            self.disagg_metrics.kv_transfer_seconds.observe(waited / 1000)
                first = False
                if sampling.logprobs is not None and new_ids:
                    parsed = _logprobs(output, new_ids)
                    if parsed is not None:
                        item["log_probs"], item["top_logprobs"] = parsed
                if prefill:
                    params = result.kv_transfer_params
                    item["disaggregated_params"] = {"kv_transfer_params": params} if params else None
                if output.finish_reason is not None or (prefill and result.finished):
                    if output.finish_reason is not None:
                        item["finish_reason"] = _finish_reason(output.finish_reason)
                    if output.stop_reason is not None:
                        item["stop_reason"] = output.stop_reason
                    usage = _usage(prompt_len, generated, result.num_cached_tokens)
                    if prefill_details is not None:
                        usage["prompt_tokens_details"] = prefill_details  # the cache hits were on the prefill worker
                    item["completion_usage"] = usage
                yield item

    # -- other endpoints -----------------------------------------------------------------------
    async def clear_kv_blocks(self, request: Any = None, context: Any = None) -> AsyncIterator[dict[str, Any]]:
        try:
            await self.engine_client.reset_prefix_cache()
            yield {"status": "success", "message": "KV cache cleared"}
        except Exception as e:
            yield {"status": "error", "message": str(e)}

    async def sleep(self, body: dict[str, Any] | None) -> dict[str, Any]:
        """Engine route /engine/sleep: leave discovery first so nothing new is routed here."""
        level = int((body or {}).get("level", getattr(self.config, "sleep_mode_level", 1)))
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
        tags = (body or {}).get("tags")
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
    """Aggregated and decode workers: token mode, or text mode with --use-vllm-tokenizer."""

    async def generate(self, request: dict[str, Any], context: Any) -> AsyncIterator[dict[str, Any]]:
        if getattr(self.config, "use_vllm_tokenizer", False):
            async for chunk in self._generate_text(request, context):
                yield chunk
            return
        sampling = build_sampling_params(request, self.default_sampling_params, self.model_max_len)
        prefill_result = request.get("prefill_result")
        kv_params = None
        if isinstance(prefill_result, dict):
            kv_params = (prefill_result.get("disaggregated_params") or {}).get("kv_transfer_params")
        if kv_params is not None:
            # vLLM's connector pulls the prompt's KV from the prefill worker before the first step.
            sampling.extra_args = {**(sampling.extra_args or {}), "kv_transfer_params": kv_params}
            if self.disagg_metrics is not None:
                self.disagg_metrics.remote_prefills.inc()
        async for item in self._stream_tokens(request, context, sampling, prefill=False,
                                              remote_prefill=kv_params is not None):
            yield item

    async def _generate_text(self, request: dict[str, Any], context: Any) -> AsyncIterator[dict[str, Any]]:
        """An OpenAI request in, OpenAI chat chunks out; the engine templates and detokenizes."""
        tokenizer = self.engine_client.tokenizer
        kwargs: dict[str, Any] = dict(self.default_sampling_params)
        for key in _TEXT_MODE_FIELDS:
            if request.get(key) is not None:
                kwargs[key] = request[key]
        kwargs.update(detokenize=True, output_kind=RequestOutputKind.DELTA)
        if "messages" in request:
            template_kwargs = dict(request.get("chat_template_kwargs") or {})
            if request.get("tools"):
                template_kwargs["tools"] = request["tools"]
            text = tokenizer.apply_chat_template(request["messages"], tokenize=False, add_generation_prompt=True,
                                                 **template_kwargs)
            prompt: Any = TextPrompt(prompt=text)
            prompt_len = len(tokenizer.encode(text, add_special_tokens=False))
        elif "prompt" in request or "text" in request:
            ids = tokenizer.encode(request.get("prompt") or request.get("text"))
            prompt, prompt_len = TokensPrompt(prompt_token_ids=ids), len(ids)
        else:
            raise ValueError("a text-mode request needs 'messages' or 'prompt'")
        if kwargs.get("max_tokens") is None and self.model_max_len:
            kwargs["max_tokens"] = max(1, self.model_max_len - prompt_len)
        sampling = SamplingParams(**kwargs)
        request_id = context.id()
        response_id = request.get("id") or request.get("request_id") or request_id
        generated = 0
        async with abort_monitor(self.engine_client, context, request_id, self.shutdown_event) as monitor:
            async for result in monitor.stream(self.engine_client.generate(prompt, sampling, request_id)):
                if not result.outputs:
                    yield _text_chunk(response_id, "", "error")
                    return
                output = result.outputs[0]
                generated += len(output.token_ids)
                reason = _finish_reason(output.finish_reason)
                chunk = _text_chunk(response_id, output.text, reason)
                if reason is not None:
                    chunk["usage"] = _usage(prompt_len, generated, result.num_cached_tokens)
                yield chunk


def _text_chunk(response_id: str, text: str, finish_reason: str | None) -> dict[str, Any]:
    return {
        "id": response_id, "created": int(time.time()), "object": "chat.completion.chunk", "model": "unknown",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": finish_reason}],
    }


class PrefillWorkerHandler(BaseWorkerHandler):
    """Prefill workers: compute the prompt's KV, generate one token, hand the KV transfer
    parameters back for the decode worker."""

    async def generate(self, request: dict[str, Any], context: Any) -> AsyncIterator[dict[str, Any]]:
        sampling = build_sampling_params(request, self.default_sampling_params, self.model_max_len)
        params = dict((sampling.extra_args or {}).get("kv_transfer_params") or {})
        for key, value in (("do_remote_decode", True), ("do_remote_prefill", False), ("remote_engine_id", None),
                           ("remote_block_ids", None), ("remote_host", None), ("remote_port", None)):
            params.setdefault(key, value)
        sampling.extra_args = {**(sampling.extra_args or {}), "kv_transfer_params": params}
        sampling.max_tokens = 1
        sampling.min_tokens = 1
        async for item in self._stream_tokens(request, context, sampling, prefill=True):
            yield item
