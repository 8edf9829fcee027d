"""Disaggregated serving in the frontend's pipeline, in one process: the real ModelManager, ModelPipeline
and KV routers against scripted prefill and decode workers on in-memory discovery; and the pure policies
(conditional disaggregation, the decode stage's router override). End to end with mocker processes:
tests/mocker/test_disagg_mocker.py."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tandem.frontend.disagg import bypass_remote_prefill, decode_stage_override
from tandem.frontend.metrics import FrontendMetrics
from tandem.frontend.models import ModelManager, ServedModel
from tandem.frontend.pipeline import Attempt, ModelPipeline
from tandem.frontend.routing import LoadMonitor, LoadThresholds, NoWorkerError
from tandem.llm.model_card import ModelRuntimeConfig, ModelType, build_card, register_model
from tandem.llm.protocols import PreprocessedRequest, PromptTokensDetails, StopConditions
from tandem.router.config import KvRouterConfig, add_router_args, parse_args_with_router_config
from tandem.router.kv_router import KvRouter
from tandem.runtime import Context
from tandem.runtime.options import RouterMode
from tandem.runtime.request_plane import framed

BLOCK = 16
PROMPT = list(range(1000, 1000 + 6 * BLOCK))


# -- policies ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("prompt", "cached", "expected"), [
    (1000, 896, True),  # 104 uncached tokens, 10 % of the prompt
    (200, 0, False),  # short but nothing cached: the ratio is 1
    (100_000, 64_000, False),  # 36k uncached: over the absolute threshold although the ratio is low
    (2048, 0, False),  # at the threshold: strictly below is required
    (1000, 300, False),  # 700 uncached = ratio 0.7: not below
    (1000, 301, True),
    (500, 640, True),  # more cached than the prompt (whole blocks): nothing to compute
    (0, 0, True),  # Dynamo's guard for an empty prompt: ratio 0
])
def test_isl_bounding_policy(prompt: int, cached: int, expected: bool) -> None:
    config = KvRouterConfig(conditional_disagg=True)
    assert bypass_remote_prefill(prompt, cached, config) is expected
    assert bypass_remote_prefill(prompt, cached, KvRouterConfig()) is False  # off by default


def test_isl_bounding_thresholds_are_settable() -> None:
    config = KvRouterConfig(conditional_disagg=True, conditional_disagg_eff_isl_threshold=100,
                            conditional_disagg_eff_isl_ratio_threshold=0.2)
    assert bypass_remote_prefill(1000, 901, config)  # 99 uncached
    assert not bypass_remote_prefill(1000, 850, config)  # 150 uncached
    assert not bypass_remote_prefill(100, 10, config)  # 90 uncached, ratio 0.9


def test_conditional_disagg_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    def parse(*argv: str) -> KvRouterConfig:
        parser = argparse.ArgumentParser()
        add_router_args(parser)
        return parse_args_with_router_config(parser, list(argv)).router_config

    defaults = parse()
    assert (defaults.conditional_disagg, defaults.conditional_disagg_eff_isl_threshold,
            defaults.conditional_disagg_eff_isl_ratio_threshold) == (False, 2048, 0.7)
    config = parse("--router-conditional-disagg", "--router-conditional-disagg-eff-isl-threshold", "512",
                   "--router-conditional-disagg-eff-isl-ratio-threshold", "0.5")
    assert (config.conditional_disagg, config.conditional_disagg_eff_isl_threshold,
            config.conditional_disagg_eff_isl_ratio_threshold) == (True, 512, 0.5)
    monkeypatch.setenv("DYN_ROUTER_CONDITIONAL_DISAGG", "true")
    monkeypatch.setenv("DYN_ROUTER_CONDITIONAL_DISAGG_EFF_ISL_THRESHOLD", "64")
    assert parse().conditional_disagg and parse().conditional_disagg_eff_isl_threshold == 64
    with pytest.raises(SystemExit):
        parse("--router-conditional-disagg-eff-isl-ratio-threshold", "1.5")  # must be in [0, 1]


def test_decode_stage_override() -> None:
    plain = decode_stage_override({"router_temperature": 0.5, "overlap_score_credit": 2}, conditional=False)
    assert plain == {"router_temperature": 0.5, "overlap_score_credit": 0.0, "host_cache_hit_weight": 0.0,
                     "disk_cache_hit_weight": 0.0, "assume_kv_reuse": False, "track_prefill_tokens": False}
    # Conditional disaggregation keeps the overlap credit: decode workers' caches are known then.
    assert decode_stage_override(None, conditional=True) == {"assume_kv_reuse": False, "track_prefill_tokens": False}
    config = KvRouterConfig().with_overrides(plain)
    assert (config.overlap_score_credit, config.assume_kv_reuse, config.track_prefill_tokens, config.temperature) \
        == (0.0, False, False, 0.5)
    with pytest.raises(ValueError, match="track_prefill_tokens must be true or false"):
        KvRouterConfig().with_overrides({"track_prefill_tokens": 0})


# -- the pipeline against scripted workers ----------------------------------------------------------------


class Workers:
    """Scripted prefill and decode workers of model `m`; `prefill_mode`: ok, error or hang."""

    def __init__(self) -> None:
        self.prefill_mode = "ok"
        self.prefill_requests: list[dict[str, Any]] = []
        self.decode_requests: list[dict[str, Any]] = []
        self.prefill_started = asyncio.Event()
        self.prefill_cancelled = asyncio.Event()
        self.decode_prefill_load: list[int] = []  # the decode router's queued prefill tokens, seen by decode
        self.pipeline: ModelPipeline | None = None

    async def prefill(self, request: dict[str, Any], context: Any) -> Any:
        self.prefill_requests.append(request)
        self.prefill_started.set()
        if self.prefill_mode == "hang":
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.prefill_cancelled.set()
                raise
        if self.prefill_mode == "error":
            yield {"token_ids": [], "finish_reason": "error: out of blocks"}
            return
        yield {"token_ids": [7], "finish_reason": "length",
               "completion_usage": {"prompt_tokens": len(request["token_ids"]), "completion_tokens": 1,
                                    "prompt_tokens_details": {"cached_tokens": 32}},
               "disaggregated_params": {"kv_transfer_params": {"remote_engine_id": "p"}}}

    async def decode(self, request: dict[str, Any], context: Any) -> Any:
        self.decode_requests.append(request)
        router = self.pipeline.kv_router if self.pipeline else None
        if router is not None:
            self.decode_prefill_load.append(sum(router.sequences.active_prefill_tokens((w, 0))
                                                for w in self.pipeline.model.instances))  # type: ignore[union-attr]
        first: dict[str, Any] = {"token_ids": [1]}
        if request.get("prefill_result"):
            first["kv_transfer_ms"] = 4.0
        yield first
        yield {"token_ids": [2], "finish_reason": "length",
               "completion_usage": {"prompt_tokens": len(request["token_ids"]), "completion_tokens": 2,
                                    "prompt_tokens_details": {"cached_tokens": 0}}}


async def _pipeline(runtimes: Any, namespace: str, smollm2: str, workers: Workers, *, prefill: bool = True,
                    enforce_disagg: bool = False, migration_limit: int = 0,
                    router_mode: RouterMode = RouterMode.KV) -> tuple[ModelPipeline, FrontendMetrics]:
    async def serve(component: str, handler: Any, worker_type: str, model_type: ModelType) -> None:
        runtime = await runtimes()
        endpoint = runtime.namespace(namespace).component(component).endpoint("generate")
        await endpoint.start_serving(handler)
        await register_model(endpoint, build_card(smollm2, "m", model_type=model_type, worker_type=worker_type,
                                                  kv_cache_block_size=BLOCK))

    await serve("backend", workers.decode, "Decode", ModelType.Chat | ModelType.Completions)
    if prefill:
        await serve("prefill", workers.prefill, "Prefill", ModelType.Prefill)
    frontend = await runtimes()
    metrics = FrontendMetrics(CollectorRegistry())
    config = KvRouterConfig(use_kv_events=False)  # routers of their own decisions: no event plane here
    kv = router_mode == RouterMode.KV  # the KV routers exist in kv mode only, as the frontend builds them

    def build(model: ServedModel) -> ModelPipeline:
        return ModelPipeline(
            model, manager, router_mode=router_mode, migration_limit=migration_limit, migration_max_seq_len=None,
            load=LoadMonitor(LoadThresholds()), metrics=metrics, enforce_disagg=enforce_disagg,
            kv_router=KvRouter(frontend, "m", block_size=BLOCK, config=config) if kv else None,
            prefill_router=KvRouter(frontend, "m", block_size=BLOCK, config=KvRouterConfig(
                use_kv_events=False, track_active_blocks=False)) if kv else None)

    manager = ModelManager(frontend, namespace=namespace, build_pipeline=build)
    await manager.start()
    async with asyncio.timeout(10):
        while (model := manager.get("m")) is None or len(model.prefill_instances) != int(prefill):
            manager.changed.clear()
            await manager.changed.wait()
    for router, instances in ((model.pipeline.kv_router, model.instances),
                              (model.pipeline.prefill_router, model.prefill_instances)):
        if router is not None:
            router.sync_workers(instances)
    workers.pipeline = model.pipeline
    return model.pipeline, metrics


def _request() -> PreprocessedRequest:
    return PreprocessedRequest(model="m", token_ids=list(PROMPT), stop_conditions=StopConditions(max_tokens=2))


async def _generate(pipeline: ModelPipeline, context: Context | None = None) -> list[dict[str, Any]]:
    return [output async for output in pipeline.generate(_request(), context or Context(), Attempt())]


def _count(metrics: FrontendMetrics, outcome: str) -> float:
    return metrics.remote_prefills.labels("m", outcome).value


async def test_prefill_then_decode(runtimes: Any, namespace: str, smollm2: str) -> None:
    workers = Workers()
    pipeline, metrics = await _pipeline(runtimes, namespace, smollm2, workers)
    outputs = await _generate(pipeline)
    assert [o.token_ids for o in outputs] == [[1], [2]]
    (prefill,), (decode,) = workers.prefill_requests, workers.decode_requests
    assert prefill["stop_conditions"]["max_tokens"] == 1 and prefill["token_ids"] == PROMPT
    assert decode["stop_conditions"]["max_tokens"] == 2
    assert decode["prefill_result"] == {"disaggregated_params": {"kv_transfer_params": {"remote_engine_id": "p"}},
                                        "prompt_tokens_details": {"cached_tokens": 32}}
    # Usage reports the prefill worker's cache hits, not the decode worker's.
    assert outputs[-1].completion_usage.prompt_tokens_details == PromptTokensDetails(cached_tokens=32)
    # The decode stage does not count the prompt as load on the decode worker.
    assert workers.decode_prefill_load == [0]
    assert _count(metrics, "ok") == 1
    assert metrics.prefill_seconds.labels("m").sum > 0
    assert metrics.kv_transfer_seconds.labels("m").sum == pytest.approx(0.004)
    # Both routers freed the request.
    assert len(pipeline.prefill_router.sequences) == 0  # type: ignore[union-attr]
    assert len(pipeline.kv_router.sequences) == 0  # type: ignore[union-attr]


async def test_a_disaggregated_prompt_is_hashed_once(runtimes: Any, namespace: str, smollm2: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill router, the conditional-disaggregation check and the decode router share one set of
    block hashes per request."""
    from tandem.router import kv_router

    workers = Workers()
    pipeline, _ = await _pipeline(runtimes, namespace, smollm2, workers)
    pipeline.kv_router.config.conditional_disagg = True  # type: ignore[union-attr]  # one more user of the hashes
    calls = []
    real = kv_router.local_block_hashes
    monkeypatch.setattr(kv_router, "local_block_hashes", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert [o.token_ids for o in await _generate(pipeline)] == [[1], [2]]
    assert len(workers.prefill_requests) == 1 and len(calls) == 1


async def test_aggregated_requests_keep_prefill_load(runtimes: Any, namespace: str, smollm2: str) -> None:
    """No prefill worker: decode prefills locally and the router counts its prompt as load."""
    workers = Workers()
    pipeline, metrics = await _pipeline(runtimes, namespace, smollm2, workers, prefill=False)
    await _generate(pipeline)
    assert "prefill_result" not in workers.decode_requests[0]
    assert workers.decode_prefill_load == [len(PROMPT)]
    assert not metrics.remote_prefills.children  # not a disaggregated model: nothing counted


async def test_no_prefill_worker_under_enforce_disagg(runtimes: Any, namespace: str, smollm2: str) -> None:
    workers = Workers()
    pipeline, metrics = await _pipeline(runtimes, namespace, smollm2, workers, prefill=False, enforce_disagg=True)
    with pytest.raises(NoWorkerError, match="--enforce-disagg"):
        await _generate(pipeline)
    assert workers.decode_requests == [] and _count(metrics, "error") == 1


@pytest.mark.parametrize("enforce", [False, True])
async def test_failed_prefill(runtimes: Any, namespace: str, smollm2: str, enforce: bool) -> None:
    """Falls back to local prefill on the decode worker, or fails under --enforce-disagg."""
    workers = Workers()
    workers.prefill_mode = "error"
    pipeline, metrics = await _pipeline(runtimes, namespace, smollm2, workers, enforce_disagg=enforce,
                                        router_mode=RouterMode.ROUND_ROBIN)
    if enforce:
        with pytest.raises(NoWorkerError):
            await _generate(pipeline)
        assert workers.decode_requests == [] and _count(metrics, "error") == 1
    else:
        outputs = await _generate(pipeline)
        assert outputs[-1].finish_reason == "length"
        assert "prefill_result" not in workers.decode_requests[0] and _count(metrics, "fallback") == 1
        assert outputs[-1].completion_usage.prompt_tokens_details == PromptTokensDetails(cached_tokens=0)  # the decode's own
    assert len(workers.prefill_requests) == 1


@pytest.mark.parametrize("how", ["task cancelled", "context killed"])
async def test_cancel_during_prefill(runtimes: Any, namespace: str, smollm2: str, how: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The client goes away while the prefill runs (the HTTP server cancels the handler task; a stream
    consumer may kill the context instead): the prefill leg is killed on its worker, the prefill router
    forgets the request and no decode starts."""
    workers = Workers()
    workers.prefill_mode = "hang"
    pipeline, metrics = await _pipeline(runtimes, namespace, smollm2, workers)
    accepted = asyncio.Event()
    accept = framed.FramedResponseStream.on_frame

    def noting_the_acceptance(stream: framed.FramedResponseStream, kind: int, payload: bytes) -> None:
        accept(stream, kind, payload)
        if kind == framed.PROLOGUE:
            accepted.set()

    monkeypatch.setattr(framed.FramedResponseStream, "on_frame", noting_the_acceptance)
    context = Context()
    task = asyncio.create_task(_generate(pipeline, context))
    await asyncio.wait_for(workers.prefill_started.wait(), 10)
    await asyncio.wait_for(accepted.wait(), 10)  # the frontend is now waiting for the prefill's output
    assert len(pipeline.prefill_router.sequences) == 1  # type: ignore[union-attr]
    if how == "task cancelled":
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        context.kill()
        assert await asyncio.wait_for(task, 10) == []
    await asyncio.wait_for(workers.prefill_cancelled.wait(), 10)
    assert len(pipeline.prefill_router.sequences) == 0  # type: ignore[union-attr]
    # No decode: one started for it would reach the decode worker before this request's, on one connection.
    workers.prefill_mode = "ok"
    assert (await _generate(pipeline))[-1].finish_reason == "length"
    assert len(workers.decode_requests) == 1 and _count(metrics, "cancelled") == 1


async def test_cancel_as_the_prefill_worker_accepts(runtimes: Any, namespace: str, smollm2: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The client goes away just as the prefill worker accepts the leg (both reach the frontend in one
    turn of its loop, as on a busy host): the same outcome as any cancelled prefill."""
    workers = Workers()
    workers.prefill_mode = "hang"
    pipeline, metrics = await _pipeline(runtimes, namespace, smollm2, workers)
    task: asyncio.Task | None = None
    accept = framed.FramedResponseStream.on_frame

    def accepted_then_cancelled(stream: framed.FramedResponseStream, kind: int, payload: bytes) -> None:
        accept(stream, kind, payload)
        if kind == framed.PROLOGUE and task is not None:
            task.cancel()

    monkeypatch.setattr(framed.FramedResponseStream, "on_frame", accepted_then_cancelled)
    task = asyncio.create_task(_generate(pipeline, Context()))
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(10):
            await task
    await asyncio.wait_for(workers.prefill_cancelled.wait(), 10)
    assert len(pipeline.prefill_router.sequences) == 0  # type: ignore[union-attr]
    assert workers.prefill_started.is_set() and workers.decode_requests == [] and _count(metrics, "cancelled") == 1


async def test_the_serving_workers_card_configures_the_model_whoever_registers_first(
        runtimes: Any, namespace: str, smollm2: str) -> None:
    """A prefill worker registering before any decode worker does not give the model its configuration: the
    migration limit and the KV blocks of the busy thresholds are the decode workers' (a frontend with
    --migration-limit 0 defers to the card)."""
    workers = Workers()

    async def serve(component: str, handler: Any, card: Any) -> None:
        runtime = await runtimes()
        endpoint = runtime.namespace(namespace).component(component).endpoint("generate")
        await endpoint.start_serving(handler)
        await register_model(endpoint, card)

    frontend = await runtimes()
    manager = ModelManager(frontend, namespace=namespace, build_pipeline=lambda model: ModelPipeline(
        model, manager, router_mode=RouterMode.ROUND_ROBIN, migration_limit=0, migration_max_seq_len=None,
        load=LoadMonitor(LoadThresholds()), metrics=FrontendMetrics(CollectorRegistry())))
    await manager.start()

    async def model_with(instances: int, prefill_instances: int) -> ServedModel:
        async with asyncio.timeout(10):
            while (model := manager.models.get("m")) is None or (
                    len(model.instances), len(model.prefill_instances)) != (instances, prefill_instances):
                manager.changed.clear()
                await manager.changed.wait()
        return model

    await serve("prefill", workers.prefill, build_card(
        smollm2, "m", model_type=ModelType.Prefill, worker_type="Prefill", kv_cache_block_size=BLOCK,
        runtime_config=ModelRuntimeConfig(total_kv_blocks=10)))
    model = await model_with(0, 1)
    await serve("backend", workers.decode, build_card(
        smollm2, "m", worker_type="Decode", kv_cache_block_size=BLOCK, migration_limit=2,
        runtime_config=ModelRuntimeConfig(total_kv_blocks=500)))
    assert await model_with(1, 1) is model
    assert model.card.runtime_config.total_kv_blocks == 500
    assert model.pipeline.migration_limit == 2


async def test_a_started_manager_already_serves_the_models_registered_before_it(
        runtimes: Any, namespace: str, smollm2: str) -> None:
    """A frontend (or a replica started again) opens its port only after start(): the cards already in
    discovery are applied by then, so its first request does not get a 404 for a served model."""
    workers = Workers()
    for component in ("backend", "other"):
        runtime = await runtimes()
        endpoint = runtime.namespace(namespace).component(component).endpoint("generate")
        await endpoint.start_serving(workers.decode)
        await register_model(endpoint, build_card(smollm2, "m", kv_cache_block_size=BLOCK))
    manager = ModelManager(await runtimes(), namespace=namespace, build_pipeline=lambda model: ModelPipeline(
        model, manager, router_mode=RouterMode.ROUND_ROBIN, migration_limit=0, migration_max_seq_len=None,
        load=LoadMonitor(LoadThresholds()), metrics=FrontendMetrics(CollectorRegistry())))
    await manager.start()
    model = manager.get("m")
    assert model is not None and len(model.instances) == 2
    await manager.close()
    empty = ModelManager(await runtimes(), namespace=f"{namespace}-empty")
    await asyncio.wait_for(empty.start(), 5)  # nothing registered: nothing to wait for
    assert empty.served() == []
    await empty.close()
