"""The per-model pipeline: route a preprocessed request to a worker (KV-aware or by the routing mode),
disaggregate it (prefill on a prefill worker first), and migrate its stream when a worker fails.

    HTTP -> Preprocessor.prepare -> ModelPipeline.generate (disaggregate, route, migrate) -> HTTP
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import msgspec

from tandem.frontend.disagg import (
    CANCELLED,
    ERROR,
    FALLBACK,
    OK,
    SKIPPED_CONDITIONAL,
    bypass_remote_prefill,
    decode_stage_override,
)
from tandem.frontend.media import RoutedImages
from tandem.frontend.metrics import FrontendMetrics
from tandem.frontend.models import ModelManager, ServedModel
from tandem.frontend.preprocess import ParserNames, Preprocessor
from tandem.frontend.protocol.errors import RequestError
from tandem.frontend.routing import (
    LoadMonitor,
    NoWorkerError,
    Selector,
    by_session,
    make_selector,
    session_of,
)
from tandem.llm.model_card import ModelInput
from tandem.llm.protocols import (
    OUTPUT_OF,
    EmbeddingOutput,
    EmbeddingRequest,
    FinishReason,
    LLMEngineOutput,
    PrefillResult,
    PreprocessedRequest,
    PromptTokensDetails,
    RoutingHints,
    TextChunk,
    parse_finish_reason,
)
from tandem.router.kv_router import KvRouter, PromptHashes, RoutedRequest, RoutingDecision
from tandem.runtime import Client, Context, InstanceUnreachableError, NoInstancesError, StreamIncompleteError
from tandem.runtime.options import RouterMode
from tandem.runtime.request_plane import ResponseStream

log = logging.getLogger(__name__)

def _on_dp_rank(request: Any, dp_rank: int) -> Any:
    """`request` addressed to one data-parallel rank of its worker (`routing.dp_rank`)."""
    if not isinstance(request, PreprocessedRequest):
        return request
    routing = msgspec.structs.replace(request.routing or RoutingHints(), dp_rank=dp_rank)
    return msgspec.structs.replace(request, routing=routing)


def _leg_pins(request: Any) -> tuple[int | None, int | None]:
    """The prefill and decode workers the request names for its legs (`routing.prefill_worker_id`,
    `routing.decode_worker_id`; the frontend checked that the model has them)."""
    routing = request.routing if isinstance(request, PreprocessedRequest) else None
    return (routing.prefill_worker_id, routing.decode_worker_id) if routing is not None else (None, None)


def _has_images(request: Any) -> TypeGuard[PreprocessedRequest]:
    return (isinstance(request, PreprocessedRequest) and request.multi_modal_data is not None
            and bool(request.multi_modal_data.image_url))


def _has_token_prompt(request: Any) -> TypeGuard[PreprocessedRequest]:
    """A token-input request whose prompt is its token ids (not prompt embeddings): what the KV routers hash
    and prefill workers take."""
    return isinstance(request, PreprocessedRequest) and request.prompt_embeds is None


def _output_type(request: Any) -> type:
    """What the worker answers `request` with; a text-input model's request is the client's body, relayed."""
    return TextChunk if isinstance(request, dict) else OUTPUT_OF[type(request)]


def _finished(output: TextChunk | EmbeddingOutput) -> bool:
    """Text engines stream OpenAI chunks with `finish_reason` per choice; an embedding engine's one output is its
    whole answer. (A token engine's output has its own `finish_reason`, read in the loop.)"""
    if isinstance(output, TextChunk):
        return any(choice.finish_reason for choice in output.choices)
    return True


class StreamLost(StreamIncompleteError):
    """A stream cut off that could not move to another worker; `public` says why, for the client (the
    request plane's detail, with addresses, is the message, for the log)."""

    def __init__(self, cut: StreamIncompleteError, reason: str) -> None:
        super().__init__(f"{cut}; {reason}")
        self.public = f"the worker serving this request stopped before finishing it; {reason}"


@dataclass
class Attempt:
    """Bookkeeping of one request across migrations."""

    instance_id: int | None = None
    dp_rank: int | None = None  # the serving instance's dp rank, when the request was routed to one
    route: RoutingDecision | None = None  # the KV router's decision for the serving instance
    # the prefill leg of a disaggregated request: its worker, dp rank and the KV router's decision
    prefill_instance: int | None = None
    prefill_dp_rank: int | None = None
    prefill_route: RoutingDecision | None = None
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
        router_mode: RouterMode,
        migration_limit: int,
        migration_max_seq_len: int | None,
        load: LoadMonitor,
        metrics: FrontendMetrics,
        kv_router: KvRouter | None = None,
        prefill_router: KvRouter | None = None,
        enforce_disagg: bool = False,
        parsers: ParserNames | None = None,
        images: RoutedImages | None = None,
    ) -> None:
        self.model = model
        self.manager = manager
        # `parsers`: the frontend's overrides of the model's tool-call and reasoning parsers.
        self.preprocessor = Preprocessor(model, parsers) if model.card.model_input == ModelInput.Tokens else None
        self.router_mode = RouterMode(router_mode)
        self.inflight: dict[int, int] = {}
        # `kv` routes token requests with the KV router; text-input requests (no tokens here) round robin.
        self.kv_router = kv_router  # given in kv mode only
        self.prefill_router = prefill_router
        self.selector: Selector = make_selector(router_mode, self.inflight)
        self.prefill_selector: Selector = make_selector(RouterMode.ROUND_ROBIN, self.inflight)
        self._migration_limit = migration_limit  # 0: the serving workers' card decides
        self.migration_max_seq_len = migration_max_seq_len
        self.load = load
        self.metrics = metrics
        self.enforce_disagg = enforce_disagg  # no remote prefill -> 503 instead of local prefill
        self.images = images  # hashes requests' images for the KV routers

    @property
    def migration_limit(self) -> int:
        return self._migration_limit or self.model.card.migration_limit

    # -- routing -------------------------------------------------------------------------------
    def candidates(self, exclude: set[int]) -> list[int]:
        instances = [i for i in self.model.instances if i not in exclude]
        # Skip instances that just failed to answer, unless that leaves none.
        live = [i for i in instances if self._is_usable(i)] or [i for i in instances if self._is_listed(i)]
        if not live:
            raise NoWorkerError(f"no workers are serving model {self.model.name!r}")
        if self.load.thresholds.enabled:
            config = self.model.card.runtime_config
            free = [i for i in live if not self.load.is_busy(i, config.total_kv_blocks, config.max_num_batched_tokens,
                                                             self.model.dp_sizes.get(i, 1))]
            if not free:
                raise NoWorkerError("Service temporarily unavailable: All workers are busy, please retry later",
                                    busy=True)
            return free
        return live

    def _client_of(self, instance_id: int) -> Client | None:
        path = self.model.instances.get(instance_id) or self.model.prefill_instances.get(instance_id)
        return self.manager.clients.get(path) if path else None

    def _is_usable(self, instance_id: int) -> bool:
        client = self._client_of(instance_id)
        return client is not None and client.is_usable(instance_id)

    def _is_listed(self, instance_id: int) -> bool:
        client = self._client_of(instance_id)
        return client is not None and client.transport_of(instance_id) is not None

    def _cache_keys(self, request: PreprocessedRequest) -> dict[str, Any]:
        """What seeds the request's block hashes besides its tokens, for the KV routers."""
        lora = self.model.card.lora
        return {"lora_name": lora.name if lora else None,
                "cache_salt": request.routing.cache_salt if request.routing else None}

    def _hashes(self, request: Any) -> PromptHashes | None:
        """The prompt's block hashes, computed once for its prefill and decode routing (one model, one
        block size); None without a KV router or for a request without token ids (text, prompt embeddings)."""
        router = self.kv_router or self.prefill_router
        if router is None or not _has_token_prompt(request):
            return None
        return router.hashes(request.token_ids, **self._cache_keys(request))

    async def _image_hashes(self, request: PreprocessedRequest) -> PromptHashes | None:
        """The block hashes of a prompt with images, as the engine will compute them: expanded, with the
        images' content on their blocks. Without an image prompt the card gives (it varies by image), the
        request's own tokens are hashed: blocks before the first image can still match."""
        router = self.kv_router or self.prefill_router
        config = self.model.card.runtime_config
        if router is None or self.images is None or config.image_prompt is None or config.image_token_id is None:
            return self._hashes(request)
        tokens, spans = await self.images.expand(request, config.image_token_id, config.image_prompt)
        return router.hashes(tokens, media=spans, added=len(tokens) - len(request.token_ids),
                             **self._cache_keys(request))

    def route(self, request: Any, pinned: int | None, exclude: set[int], request_id: str = "", *,
              preferred: int | None = None, decode_stage: bool = False,
              hashes: PromptHashes | None = None) -> tuple[int, int | None, RoutedRequest | None]:
        """(instance, its data-parallel rank chosen by the KV router or None, the request as the KV router
        tracks it there or None). `preferred`: the worker to use if it is a candidate (chosen by
        conditional disaggregation); `decode_stage`: the request's prompt was computed by a prefill
        worker; `hashes`: the prompt's block hashes, when already computed."""
        if pinned is not None:
            if pinned not in self.model.instances:
                raise NoWorkerError(f"worker instance {pinned} does not serve model {self.model.name!r}")
            return pinned, None, None
        if self.router_mode is RouterMode.DIRECT:
            raise RequestError(
                "the frontend runs with --router-mode direct: name the worker in the x-worker-instance-id header",
                param="x-worker-instance-id",
            )
        candidates = sorted(self.candidates(exclude))
        if preferred is not None and preferred in candidates:
            candidates = [preferred]
        if self.kv_router is not None and _has_token_prompt(request):
            override = request.router_config_override
            if decode_stage:
                override = decode_stage_override(override, self.kv_router.config.conditional_disagg)
            routed = self.kv_router.select(request_id, request.token_ids, candidates, override=override,
                                           dp_rank=request.dp_rank, hashes=hashes, session=session_of(request),
                                           **self._cache_keys(request))
            return routed.decision.worker_id, routed.decision.dp_rank, routed
        session = session_of(request)
        instance = by_session(candidates, session) if session else self.selector.select(candidates, request)
        return instance, None, None

    # -- generation with migration -------------------------------------------------------------
    async def generate(self, request: PreprocessedRequest | EmbeddingRequest | dict[str, Any], context: Context,
                       attempt: Attempt, *, pinned: int | None = None,
                       guided: bool = False) -> AsyncGenerator[LLMEngineOutput | TextChunk | EmbeddingOutput, None]:
        """Stream engine outputs for `request`, moving to another worker when one fails.

        `attempt` records the serving instance, the tokens generated so far and the migrations.
        `pinned`: the worker that serves the whole request (no remote prefill). Raises NoWorkerError,
        StreamIncompleteError (migration exhausted or not allowed) or RemoteError (the worker reported an
        error).
        """
        budget = self.migration_limit
        exclude: set[int] = set()
        preferred: int | None = None
        hashes = None
        if pinned is None:
            hashes = await self._image_hashes(request) if _has_images(request) else self._hashes(request)
        prefill_pin, decode_pin = _leg_pins(request)
        # A prompt-embeddings request is served whole by a decode worker: the prefill hand-off (and conditional
        # disaggregation's cache check) works on token ids, which it has none of.
        if (_has_token_prompt(request) and pinned is None
                and (self.model.prefill_instances or self.enforce_disagg)):
            request, preferred = await self._disaggregate(request, context, hashes, attempt, pinned_legs=(
                prefill_pin is not None or decode_pin is not None))
            if context.is_stopped():
                return  # the client went away during the prefill: no decode
        if decode_pin is not None:
            pinned = decode_pin  # the decode leg stays on it, as a request pinned whole does
        prompt_len = len(request.token_ids) if isinstance(request, PreprocessedRequest) else 0
        item_type = _output_type(request)
        while True:
            # A migrated request recomputes its prompt on the next worker (`_continuation`).
            decode_stage = (isinstance(request, PreprocessedRequest) and request.prefill_result is not None
                            and not attempt.generated)
            try:
                instance, dp_rank, routed = self.route(request, pinned, exclude, context.id(), preferred=preferred,
                                                       decode_stage=decode_stage, hashes=hashes)
            except NoWorkerError as e:
                if exclude and not e.busy and not attempt.generated:
                    raise NoWorkerError(f"no worker of model {self.model.name!r} could take the request "
                                        f"({len(exclude)} unreachable)") from None
                raise
            preferred = None
            attempt.instance_id, attempt.dp_rank = instance, dp_rank
            attempt.route = routed.decision if routed is not None else None
            outgoing: Any = request
            if attempt.generated and isinstance(request, PreprocessedRequest):
                outgoing = self._continuation(request, attempt.generated)
            if dp_rank is not None and instance in self.model.dp_sizes:
                outgoing = _on_dp_rank(outgoing, dp_rank)
            # Usage of a disaggregated request reports the prefill worker's prefix-cache hits.
            prefill_details = request.prefill_result.prompt_tokens_details if decode_stage else None
            child = Context(context.id())
            context.link_child(child)
            self.inflight[instance] = self.inflight.get(instance, 0) + 1
            # Its prompt is the worker's prefill load until a token comes (a decode stage's was prefilled elsewhere).
            prefill = self.load.prefill(instance, len(outgoing.token_ids)
                                        if _has_token_prompt(outgoing) and not decode_stage else 0)
            client = self.manager.clients[self.model.instances[instance]]
            try:
                try:
                    stream = attempt.stream = await client.direct(outgoing, instance, child, item_type=item_type)
                except (InstanceUnreachableError, NoInstancesError) as e:
                    # The worker never accepted the request: another one can take it, whatever the
                    # migration limit. The client has left it out of routing for everyone meanwhile.
                    log.warning("request %s: worker %x unreachable (%s)%s", context.id(), instance, e,
                                "" if pinned is not None else "; trying another")
                    if pinned is not None:
                        raise NoWorkerError(f"worker instance {pinned} is unreachable") from None
                    exclude.add(instance)
                    self.metrics.migration(self.model.name, "new_request")
                    continue
                try:
                    arrived = False  # the worker's first token: its prompt is no longer prefill load
                    async for output in stream:
                        if decode_stage:
                            self._decode_stage_output(output, prefill_details)
                        if type(output) is not LLMEngineOutput:
                            yield output
                            if _finished(output):
                                return
                            continue
                        ids = output.token_ids
                        if ids:
                            if not arrived:
                                arrived = True
                                prefill.done()
                                if routed is not None:  # the KV router stops counting its prompt as load
                                    routed.tokens_arrived()
                            attempt.generated.extend(ids)
                        yield output
                        if output.finish_reason is not None:
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
                    if guided:
                        raise StreamLost(e, "guided-decoding requests cannot be migrated to another worker") from None
                    if isinstance(request, PreprocessedRequest) and request.prompt_embeds is not None:
                        # Its continuation would be the prompt plus the tokens so far: there are no prompt tokens.
                        raise StreamLost(e, "prompt-embedding requests cannot be migrated to another worker") from None
                    if too_long:
                        raise StreamLost(e, "it is too long to migrate (--migration-max-seq-len)") from None
                    if pinned is not None:
                        raise StreamLost(e, "it names that worker") from None
                    if budget <= 0:
                        raise StreamLost(e, f"it was moved to another worker {attempt.migrations} times "
                                            f"(--migration-limit {self.migration_limit})") from None
                    budget -= 1
                    attempt.migrations += 1
                    exclude = {instance}
                    self.metrics.migration(self.model.name, "ongoing_request")
                    log.warning("request %s: stream from worker %x cut off after %d tokens (%s); migrating",
                                context.id(), instance, len(attempt.generated), e)
            finally:
                self.inflight[instance] -= 1
                prefill.done()
                if routed is not None:
                    routed.free()

    # -- disaggregated prefill ------------------------------------------------
    async def _disaggregate(self, request: PreprocessedRequest, context: Context, hashes: PromptHashes | None,
                            attempt: Attempt,
                            pinned_legs: bool = False) -> tuple[PreprocessedRequest, int | None]:
        """The request for the decode stage and, under conditional disaggregation, the decode worker that
        keeps it. It carries `prefill_result` when a prefill worker computed the prompt; otherwise it is
        the original request (the decode worker prefills locally), or NoWorkerError (503) under
        --enforce-disagg. `pinned_legs`: the client named the prefill or decode worker, so conditional
        disaggregation does not choose. Counted in `dynamo_frontend_remote_prefills_total` by outcome."""
        name = self.model.name
        if self.model.prefill_instances and not pinned_legs:
            local = self._conditional_decode_worker(request, hashes)
            if local is not None:
                self.metrics.remote_prefill(name, SKIPPED_CONDITIONAL)
                return request, local
        try:
            decode_request = await self.prefill(request, context, hashes, attempt)
        except asyncio.CancelledError:  # the client disconnected: prefill() has already stopped its leg
            self.metrics.remote_prefill(name, CANCELLED)
            raise
        if context.is_stopped():
            self.metrics.remote_prefill(name, CANCELLED)
            return request, None
        if decode_request is not None:
            self.metrics.remote_prefill(name, OK)
            return decode_request, None
        attempt.prefill_instance = attempt.prefill_dp_rank = attempt.prefill_route = None  # (none computed it)
        if self.enforce_disagg:
            self.metrics.remote_prefill(name, ERROR)
            raise NoWorkerError(f"no prefill worker of model {name!r} could take the request (--enforce-disagg)")
        self.metrics.remote_prefill(name, FALLBACK)
        return request, None

    def _conditional_decode_worker(self, request: PreprocessedRequest, hashes: PromptHashes | None) -> int | None:
        """Conditional disaggregation: the decode worker the KV router would choose, if it caches enough
        of the prompt to prefill the rest itself (`tandem.frontend.disagg.bypass_remote_prefill`)."""
        router = self.kv_router
        if router is None or not router.config.conditional_disagg:
            return None
        try:
            candidates = sorted(self.candidates(set()))
        except NoWorkerError:
            return None  # decode routing reports it
        decision = router.best_worker(request.token_ids, candidates, override=request.router_config_override,
                                      hashes=hashes, **self._cache_keys(request))
        cached = decision.overlap_blocks * router.block_size
        return decision.worker_id if bypass_remote_prefill(len(request.token_ids), cached, router.config) else None

    async def prefill(self, request: PreprocessedRequest, context: Context, hashes: PromptHashes | None = None,
                      attempt: Attempt | None = None) -> PreprocessedRequest | None:
        """Run the prompt on a prefill worker (max_tokens 1) and return the decode request carrying its
        `prefill_result` (the KV transfer parameters); None when no prefill worker is reachable or the
        prefill failed. The leg is a child of `context`: cancelling the request cancels it. A request that
        names its prefill worker (`routing.prefill_worker_id`) is prefilled there."""
        pin = _leg_pins(request)[0]
        candidates = [pin] if pin is not None else [i for i in sorted(self.model.prefill_instances)
                                                    if self._is_usable(i)]
        if not candidates:
            log.warning("request %s: no reachable prefill worker for model %r", context.id(), self.model.name)
            return None
        routed: RoutedRequest | None = None
        if self.prefill_router is not None:
            routed = self.prefill_router.select(
                context.id(), request.token_ids, candidates, hashes=hashes, session=session_of(request),
                dp_rank=request.routing.prefill_dp_rank if request.routing else None, **self._cache_keys(request))
            instance, dp_rank = routed.decision.worker_id, routed.decision.dp_rank
        else:
            session = session_of(request)
            selected = by_session(candidates, session) if session else self.prefill_selector.select(candidates, request)
            instance, dp_rank = selected, None
        if attempt is not None:  # (recorded once chosen: the answer's nvext names it)
            attempt.prefill_instance, attempt.prefill_dp_rank = instance, dp_rank
            attempt.prefill_route = routed.decision if routed is not None else None
        client = self._client_of(instance)
        stop = msgspec.structs.replace(request.stop_conditions, max_tokens=1, min_tokens=None)
        child = Context(context.id())
        context.link_child(child)
        started = time.perf_counter()
        stream: ResponseStream | None = None
        last = LLMEngineOutput([])
        try:
            if client is None:
                raise NoInstancesError(f"no client for prefill worker {instance:x}")
            leg = msgspec.structs.replace(request, stop_conditions=stop)
            if dp_rank is not None and instance in self.model.dp_sizes:
                leg = _on_dp_rank(leg, dp_rank)
            stream = await client.direct(leg, instance, child, item_type=LLMEngineOutput)
            async for output in stream:
                last = output
            reason, error = parse_finish_reason(last.finish_reason, last.error)
            if reason == FinishReason.ERROR:
                raise RuntimeError(f"prefill worker error: {error}")
            if last.disaggregated_params is None:
                raise RuntimeError("the prefill worker returned no disaggregated_params")
        except Exception as e:  # includes unreachable workers, cut-off streams and malformed outputs
            if not context.is_stopped():
                log.warning("request %s: prefill on worker %x failed (%s)", context.id(), instance, e)
            return None
        finally:
            if stream is not None:
                await stream.aclose()  # still running only when the client went away: stop it now
            if routed is not None:
                routed.free()
        self.metrics.prefill_seconds.labels(self.model.name).observe(time.perf_counter() - started)
        usage = last.completion_usage
        return msgspec.structs.replace(request, prefill_result=PrefillResult(
            last.disaggregated_params, usage.prompt_tokens_details if usage is not None else None))

    def _decode_stage_output(self, output: LLMEngineOutput, prefill_details: PromptTokensDetails | None) -> None:
        """A decode worker's output for a disaggregated request: record the KV transfer time it reports
        (`kv_transfer_ms`, first output) and give its usage the prefill worker's cached tokens."""
        if output.kv_transfer_ms is not None:
            self.metrics.kv_transfer_seconds.labels(self.model.name).observe(output.kv_transfer_ms / 1000)
        if output.completion_usage is not None and prefill_details is not None:
            output.completion_usage.prompt_tokens_details = prefill_details

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
