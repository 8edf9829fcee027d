"""The per-model pipeline: preprocess an OpenAI request into a PreprocessedRequest, send it to a
worker (with migration), and turn the worker's token stream back into text.

    HTTP -> Preprocessor -> ModelPipeline.generate (route + migrate) -> OutputProcessor -> HTTP
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tandem.frontend import openai
from tandem.frontend.metrics import FrontendMetrics
from tandem.frontend.models import ModelManager, ServedModel
from tandem.frontend.routing import LoadMonitor, NoWorkerError, Selector, make_selector
from tandem.llm.chat_template import ChatTemplate
from tandem.llm.protocols import PreprocessedRequest, RoutingHints
from tandem.llm.tokenizer import Tokenizer
from tandem.router.kv_router import KvRouter
from tandem.runtime import Client, Context, InstanceUnreachableError, NoInstancesError, StreamIncompleteError
from tandem.runtime.request_plane import ResponseStream

log = logging.getLogger(__name__)


class Preprocessor:
    """Chat template + tokenizer of one model (token-input models)."""

    def __init__(self, model: ServedModel) -> None:
        self.tokenizer = Tokenizer.from_folder(model.folder)
        template = model.card.chat_template or self.tokenizer.chat_template
        self.template = (
            ChatTemplate(template, bos_token=self.tokenizer.bos_token, eos_token=self.tokenizer.eos_token)
            if template else None
        )
        self.context_length = model.card.context_length

    def chat_prompt(self, request: openai.ChatRequest) -> tuple[list[int], str]:
        if self.template is None:
            raise openai.RequestError("this model has no chat template; use /v1/completions", param="messages")
        use_raw = bool(request.ext.use_raw_prompt)
        if use_raw:
            text = "".join(_text_of(m.get("content")) for m in request.messages)
        else:
            try:
                text = self.template.render(request.messages, tools=request.tools,
                                            chat_template_kwargs=request.chat_template_kwargs)
            except ValueError as e:
                raise openai.RequestError(f"cannot apply the chat template: {e}", param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False), text

    def completion_prompt(self, request: openai.CompletionRequest) -> list[int]:
        if isinstance(request.prompt, str):
            return self.tokenizer.encode(request.prompt, add_special_tokens=False)
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt):
            raise openai.RequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        return list(request.prompt)


def _text_of(content: Any) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def _finished(output: dict[str, Any]) -> bool:
    """Token engines set `finish_reason`; text engines stream OpenAI chunks with it per choice."""
    if output.get("finish_reason") is not None:
        return True
    return any(choice.get("finish_reason") for choice in output.get("choices") or ())


@dataclass
class Attempt:
    """Bookkeeping of one request across migrations."""

    instance_id: int | None = None
    generated: list[int] = field(default_factory=list)
    migrations: int = 0
    stream: ResponseStream | None = None  # the current worker stream

    @property
    def output_ready(self) -> bool:
        """The worker's next output has already arrived."""
        return self.stream is not None and self.stream.buffered


class ModelPipeline:
    """Routing and migration for one model; shared by all requests to it."""

    def __init__(
        self,
        model: ServedModel,
        manager: ModelManager,
        *,
        router_mode: str,
        migration_limit: int,
        migration_max_seq_len: int | None,
        load: LoadMonitor,
        metrics: FrontendMetrics,
        kv_router: KvRouter | None = None,
        prefill_router: KvRouter | None = None,
    ) -> None:
        self.model = model
        self.manager = manager
        self.preprocessor = Preprocessor(model) if model.card.model_input == "Tokens" else None
        self.router_mode = router_mode
        self.inflight: dict[int, int] = {}
        # `kv` routes token requests with the KV router; text-input requests (no tokens here) round robin.
        self.kv_router = kv_router if router_mode == "kv" else None
        self.prefill_router = prefill_router if router_mode == "kv" else None
        self.selector: Selector = make_selector("round-robin" if router_mode == "kv" else router_mode, self.inflight)
        self.prefill_selector: Selector = make_selector("round-robin", self.inflight)
        self.migration_limit = migration_limit or model.card.migration_limit
        self.migration_max_seq_len = migration_max_seq_len
        self.load = load
        self.metrics = metrics

    # -- preprocessing -------------------------------------------------------------------------
    def preprocess(self, request: openai.ChatRequest | openai.CompletionRequest, prompt_ids: list[int],
                   routing: RoutingHints | None) -> PreprocessedRequest:
        assert self.preprocessor is not None
        tokenizer = self.preprocessor.tokenizer
        stop = openai.stop_conditions(request)
        context_length = self.preprocessor.context_length
        if context_length:
            if len(prompt_ids) >= context_length:
                raise openai.RequestError(
                    f"this model's maximum context length is {context_length} tokens, but the prompt has "
                    f"{len(prompt_ids)} tokens", param="messages" if isinstance(request, openai.ChatRequest) else "prompt",
                )
            room = context_length - len(prompt_ids)
            if stop.max_tokens is None:
                stop.max_tokens = room
            elif stop.max_tokens > room:
                raise openai.RequestError(
                    f"this model's maximum context length is {context_length} tokens; the prompt has "
                    f"{len(prompt_ids)} tokens and max_tokens is {stop.max_tokens}",
                    param="max_tokens",
                )
        eos = list(tokenizer.eos_token_ids)
        if stop.ignore_eos:
            stop.stop = None
            stop.stop_token_ids = None
            stop.stop_token_ids_hidden = None
            eos_ids: list[int] = []
        else:
            stop.stop_token_ids_hidden = eos
            eos_ids = eos
        ext = request.ext
        return PreprocessedRequest(
            model=self.model.name,
            token_ids=prompt_ids,
            stop_conditions=stop,
            sampling_options=openai.sampling_options(request),
            output_options=openai.output_options(request),
            eos_token_ids=eos_ids,
            mdc_sum=self.model.card.mdcsum,
            annotations=list(ext.annotations),
            routing=routing,
            extra_args={"nvext": msgspec.to_builtins(ext)} if ext != openai.Nvext() else None,
        )

    # -- routing -------------------------------------------------------------------------------
    def candidates(self, exclude: set[int]) -> list[int]:
        instances = [i for i in self.model.instances if i not in exclude]
        # Skip instances that just failed to answer, unless that leaves none.
        live = [i for i in instances if self._is_usable(i)] or [i for i in instances if self._is_listed(i)]
        if not live:
            raise NoWorkerError(f"no workers are serving model {self.model.name!r}")
        if self.load.thresholds.enabled:
            config = self.model.card.runtime_config
            free = [i for i in live if not self.load.is_busy(i, config.get("total_kv_blocks"),
                                                             config.get("max_num_batched_tokens"))]
            if not free:
                raise NoWorkerError("Service temporarily unavailable: All workers are busy, please retry later",
                                    busy=True)
            return free
        return live

    def _client_of(self, instance_id: int) -> Client | None:
        return self.manager.clients.get(self.model.instances[instance_id])

    def _is_usable(self, instance_id: int) -> bool:
        client = self._client_of(instance_id)
        return client is not None and client.is_usable(instance_id)

    def _is_listed(self, instance_id: int) -> bool:
        client = self._client_of(instance_id)
        return client is not None and client.transport_of(instance_id) is not None

    def route(self, request: Any, pinned: int | None, exclude: set[int], request_id: str = "") -> tuple[int, bool]:
        """(instance, whether the KV router now tracks the request there)."""
        if pinned is not None:
            if pinned not in self.model.instances:
                raise NoWorkerError(f"worker instance {pinned} does not serve model {self.model.name!r}")
            return pinned, False
        if self.router_mode == "direct":
            raise openai.RequestError(
                "the frontend runs with --router-mode direct: name the worker in the x-worker-instance-id header",
                param="x-worker-instance-id",
            )
        candidates = sorted(self.candidates(exclude))
        if self.kv_router is not None and isinstance(request, PreprocessedRequest):
            lora = self.model.card.lora
            instance, _ = self.kv_router.select(
                request_id, request.token_ids, candidates, lora_name=lora.name if lora else None,
                cache_salt=request.routing.cache_salt if request.routing else None,
                override=request.router_config_override,
            )
            return instance, True
        return self.selector.select(candidates, request), False

    # -- generation with migration -------------------------------------------------------------
    async def generate(self, request: PreprocessedRequest | dict[str, Any], context: Context,
                       attempt: Attempt, *, pinned: int | None = None,
                       guided: bool = False) -> AsyncGenerator[dict[str, Any], None]:
        """Stream engine outputs for `request`, moving to another worker when one fails.

        `attempt` records the serving instance, the tokens generated so far and the migrations.
        Raises NoWorkerError, StreamIncompleteError (migration exhausted or not allowed) or
        RemoteError (the worker reported an error).
        """
        budget = self.migration_limit
        exclude: set[int] = set()
        if isinstance(request, PreprocessedRequest) and self.model.prefill_instances and pinned is None:
            request = await self.prefill(request, context)
        prompt_len = len(request.token_ids) if isinstance(request, PreprocessedRequest) else 0
        while True:
            instance, prefill_pending = self.route(request, pinned, exclude, context.id())
            attempt.instance_id = instance
            outgoing: Any = request
            if attempt.generated and isinstance(request, PreprocessedRequest):
                outgoing = self._continuation(request, attempt.generated)
            child = Context(context.id())
            context.link_child(child)
            self.inflight[instance] = self.inflight.get(instance, 0) + 1
            client = self.manager.clients[self.model.instances[instance]]
            try:
                try:
                    stream = attempt.stream = await client.direct(outgoing, instance, child)
                except (InstanceUnreachableError, NoInstancesError) as e:
                    if budget > 0 and pinned is None and not attempt.generated:
                        budget -= 1
                        attempt.migrations += 1
                        exclude.add(instance)
                        self.metrics.migration(self.model.name, "new_request")
                        log.warning("request %s: worker %x unreachable (%s); retrying elsewhere",
                                    context.id(), instance, e)
                        continue
                    raise NoWorkerError(str(e)) from None
                try:
                    async for output in stream:
                        ids = output.get("token_ids")
                        if ids:
                            if prefill_pending:  # the KV router stops counting its prompt as load
                                prefill_pending = False
                                self.kv_router.prefill_done(context.id())  # type: ignore[union-attr]
                            attempt.generated.extend(ids)
                        yield output
                        if _finished(output):
                            return
                    if context.is_stopped():
                        return
                    raise StreamIncompleteError(f"worker {instance:x} ended the stream without a finish reason")
                except StreamIncompleteError as e:
                    if context.is_stopped():
                        return
                    seq_len = prompt_len + len(attempt.generated)
                    too_long = self.migration_max_seq_len is not None and seq_len > self.migration_max_seq_len
                    if too_long:
                        self.metrics.migration_max_seq_len_exceeded(self.model.name)
                    if budget <= 0 or guided or too_long or pinned is not None:
                        if guided and budget > 0:
                            raise StreamIncompleteError(
                                f"{e}; guided-decoding requests cannot be migrated to another worker"
                            ) from None
                        raise
                    budget -= 1
                    attempt.migrations += 1
                    exclude = {instance}
                    self.metrics.migration(self.model.name, "ongoing_request")
                    log.warning("request %s: stream from worker %x cut off after %d tokens (%s); migrating",
                                context.id(), instance, len(attempt.generated), e)
            finally:
                self.inflight[instance] -= 1
                if self.kv_router is not None:
                    self.kv_router.free(context.id())

    # -- disaggregated prefill (reference §B.8) ------------------------------------------------
    async def prefill(self, request: PreprocessedRequest, context: Context) -> PreprocessedRequest:
        """Run the prompt on a prefill worker (max_tokens 1) and return the decode request carrying
        its `prefill_result` (the KV transfer parameters). Any failure falls back to aggregated
        decode: the decode worker then computes the prompt itself."""
        candidates = sorted(self.model.prefill_instances)
        if self.prefill_router is not None:
            instance, _ = self.prefill_router.select(context.id(), request.token_ids, candidates)
        else:
            instance = self.prefill_selector.select(candidates, request)
        client = self.manager.clients.get(self.model.prefill_instances[instance])
        stop = msgspec.structs.replace(request.stop_conditions, max_tokens=1, min_tokens=None)
        child = Context(context.id())
        context.link_child(child)
        last: dict[str, Any] = {}
        try:
            if client is None:
                raise NoInstancesError(f"no client for prefill worker {instance:x}")
            stream = await client.direct(msgspec.structs.replace(request, stop_conditions=stop), instance, child)
            async for output in stream:
                last = output
            reason = last.get("finish_reason")
            if isinstance(reason, dict) or str(reason).startswith("error"):
                raise RuntimeError(f"prefill worker error: {reason}")
            params = last.get("disaggregated_params")
            if params is None:
                raise RuntimeError("the prefill worker returned no disaggregated_params")
        except Exception as e:  # includes unreachable workers and cut-off streams
            if not context.is_stopped():
                log.warning("request %s: prefill on worker %x failed (%s); decoding with local prefill",
                            context.id(), instance, e)
            return request
        finally:
            if self.prefill_router is not None:
                self.prefill_router.free(context.id())
        details = (last.get("completion_usage") or {}).get("prompt_tokens_details")
        return msgspec.structs.replace(request, prefill_result={"disaggregated_params": params,
                                                                "prompt_tokens_details": details})

    @staticmethod
    def _continuation(request: PreprocessedRequest, generated: list[int]) -> PreprocessedRequest:
        """The original request, resumed: prompt + tokens so far, limits reduced by what was produced."""
        stop = msgspec.structs.replace(request.stop_conditions)
        if stop.max_tokens is not None:
            stop.max_tokens = max(stop.max_tokens - len(generated), 1)
        if stop.min_tokens is not None:
            stop.min_tokens = max(stop.min_tokens - len(generated), 0)
        # The prefill worker's KV hand-off was for the first worker: the next one computes the prompt itself.
        return msgspec.structs.replace(request, token_ids=request.token_ids + generated, stop_conditions=stop,
                                       prefill_result=None)
