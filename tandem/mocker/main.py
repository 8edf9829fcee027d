"""`tandem mocker` / `python -m tandem.mocker`: simulated vLLM workers.

Each of the `--num-workers` engines is its own worker instance (own runtime, lease, endpoints, KV
event stream and load metrics) in this one process; only the first serves DYN_SYSTEM_PORT. To the
frontend and routers a mocker worker looks like the vLLM worker: same model card (real tokenizer),
same endpoints (`generate`, `clear_kv_blocks`, `worker_kv_indexer_query`), same events on
`kv-events`, `kv_metrics` and `forward_pass_metrics` (each simulated step), same `READY <instance id> <endpoint>` line.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.llm.forward_pass import FORWARD_PASS_TOPIC, EngineState
from tandem.llm.model_card import ModelRuntimeConfig, ModelType, hidden_size_of
from tandem.llm.tokenizer import Tokenizer
from tandem.mocker.args import MockerConfig, parse_args
from tandem.mocker.engine import MockEngine, SyntheticTokens
from tandem.mocker.handlers import EmbeddingMocker, MockEncoder, MockerHandler
from tandem.mocker.kv_manager import KvEvent
from tandem.mocker.offload import KvbmMetrics, OffloadTiers, RankMetrics
from tandem.mocker.perf_model import load_perf_model
from tandem.mocker.scheduler import Scheduler, SchedulerLoad, StepResult
from tandem.router.consolidator import KvEventConsolidator
from tandem.router.protocols import KV_EVENT_TOPIC, KV_METRICS_TOPIC, KvCacheEventData, StorageTier
from tandem.router.publisher import KvEventPublisher, SupportsPublish
from tandem.runtime import DistributedRuntime, configure_logging, run
from tandem.runtime.runtime import install_signal_handlers
from tandem.worker.encoders import Encoders, serve_encoder
from tandem.worker.forward_pass import ForwardPassRecorder
from tandem.worker.harness import WorkerSpec, serve_worker
from tandem.worker.load import KvMetricsStatLogger

log = logging.getLogger("tandem.mocker")


class DroppingPublisher:
    """Test hook, `DYN_MOCKER_DROP_KV_EVENTS=N`: of each engine's KV events, ids N-1, 2N-1, ... (every
    one when N = 1) are numbered and kept for `worker_kv_indexer_query` as usual, but never published,
    as if the event plane had lost them; a router sees the gap at the next event and fetches it."""

    def __init__(self, publisher: SupportsPublish, every: int) -> None:
        self.publisher = publisher
        self.every = every

    def publish(self, event: Any) -> bool:
        if event["event"]["event_id"] % self.every == self.every - 1:
            return False
        return self.publisher.publish(event)


class LagCollector(Collector):
    """Each engine's simulated time against the wall time it was busy: a benchmark whose mockers fall behind
    their timing model (too fast a speedup for the host) measures the host, not the policy under test. One per
    process, on the first worker's system port: the engines of every worker in the process share its event
    loop, and so its lag."""

    def __init__(self, engines: list[tuple[int, int, MockEngine]]) -> None:
        self.engines = engines  # (worker instance id, data-parallel rank, engine)

    def collect(self) -> Iterator[Metric]:
        labels = ["worker", "dp_rank"]
        simulated = CounterMetricFamily("tandem_mocker_simulated_seconds", "Wall time the timing model gives the "
                                        "steps run so far, at the speedup", labels=labels)
        busy = CounterMetricFamily("tandem_mocker_busy_seconds", "Wall time spent with work to do; above the "
                                   "simulated time when the mocker falls behind", labels=labels)
        for worker_id, rank, engine in self.engines:
            simulated.add_metric([f"{worker_id:x}", str(rank)], engine.simulated_seconds)
            busy.add_metric([f"{worker_id:x}", str(rank)], engine.busy_seconds)
        yield simulated
        yield busy


class EngineReports:
    """What a simulated engine reports: its KV usage (`kv_metrics`) and its steps (`forward_pass_metrics`)."""

    def __init__(self, scheduler: Scheduler, load: KvMetricsStatLogger) -> None:
        self.scheduler = scheduler
        self.load = load
        self.recorder: ForwardPassRecorder | None = None

    def on_load(self, state: SchedulerLoad) -> None:
        self.load.record_usage(state.gpu_cache_usage)

    def on_step(self, result: StepResult, seconds: float) -> None:
        if self.recorder is not None:
            self.recorder.record(result.num_prefill_tokens, self.scheduler.kv.num_active * self.scheduler.config.block_size,
                                 seconds)

    def state(self) -> EngineState:
        load, config = self.scheduler.load(), self.scheduler.config
        return EngineState(load.active_prefill_tokens, load.kv_used_blocks * config.block_size,
                           config.max_num_batched_tokens)


def tiered_events(config: MockerConfig, events: KvEventPublisher | None, metrics: RankMetrics | None
                  ) -> tuple[Callable[[KvEvent], None] | None, OffloadTiers | None]:
    """Where an engine's pool sends its KV events, and its offload tiers if it has any. With tiers, the
    pool's events and the tiers' go through one consolidator to the worker's publisher."""
    offload_config = config.offload()
    if not offload_config.enabled:
        return (events.emit if events is not None else None), None
    if events is None:
        return None, OffloadTiers(offload_config, config.engine.block_size, metrics=metrics)
    consolidator = KvEventConsolidator(events.emit)

    def from_pool(data: KvEvent) -> None:
        consolidator.apply("pool", "device", data)

    def from_tiers(data: KvCacheEventData, tier: StorageTier) -> None:
        consolidator.apply("tiers", tier, data)

    return from_pool, OffloadTiers(offload_config, config.engine.block_size, from_tiers, metrics)


async def start_worker(config: MockerConfig, runtime: DistributedRuntime, tokenizer: Tokenizer) -> list[MockEngine]:
    """One worker instance on `runtime`: a simulated engine per data-parallel rank (an encoder worker: none)."""
    component = runtime.namespace(config.namespace).component(config.component)
    if config.encoder:
        await serve_encoder(component, config.endpoint, MockEncoder(config).generate, config.served_model_name)
        return []
    worker_id = runtime.instance_id
    engine_config = config.engine
    event_plane: SupportsPublish | None = None
    if config.publishes_kv_events:
        event_plane = await component.event_publisher(KV_EVENT_TOPIC, config.durable_kv_events)
        if config.drop_kv_events:
            every = config.drop_kv_events
            log.warning("DYN_MOCKER_DROP_KV_EVENTS=%d (a test hook): KV events %d, %d, ... of each engine are not "
                        "published", every, every - 1, 2 * every - 1)
            event_plane = DroppingPublisher(event_plane, config.drop_kv_events)
    metrics_plane = await component.event_publisher(KV_METRICS_TOPIC)
    passes_plane = await component.event_publisher(FORWARD_PASS_TOPIC)
    engines: list[MockEngine] = []
    publishers: list[KvEventPublisher] = []
    kvbm = KvbmMetrics(runtime.registry) if config.offload().enabled else None
    for rank in range(config.data_parallel_size):
        events = None
        if event_plane is not None:
            events = KvEventPublisher(worker_id=worker_id, dp_rank=rank, publisher=event_plane)
            publishers.append(events)
        load = KvMetricsStatLogger(worker_id=worker_id, dp_rank=rank, registry=runtime.registry,
                                   publisher=metrics_plane)
        load.set_num_gpu_blocks(engine_config.num_blocks)
        load.init_publish()
        device_events, offload = tiered_events(config, events, kvbm.of(rank) if kvbm is not None else None)
        scheduler = Scheduler(engine_config, load_perf_model(config.planner_profile_data),
                              kv_events=device_events, offload=offload)
        reports = EngineReports(scheduler, load)
        reports.recorder = ForwardPassRecorder(worker_id=worker_id, dp_rank=rank, publisher=passes_plane,
                                               state=reports.state)
        engine = MockEngine(scheduler, speedup_ratio=config.speedup_ratio,
                            decode_speedup_ratio=config.decode_speedup_ratio, on_load=reports.on_load,
                            on_step=reports.on_step)
        engine.start()
        # Stopped after the drain and before the event planes close: a step emitting KV events must not
        # run against a closed publisher.
        runtime.add_shutdown_hook(engine.stop)
        reports.recorder.start()
        runtime.add_shutdown_hook(reports.recorder.stop)
        engines.append(engine)
    embedding = bool(config.model_type & ModelType.Embedding)
    embedding_size = hidden_size_of(config.model_path) if embedding else 0
    handler = (EmbeddingMocker if embedding else MockerHandler)(config, engines, SyntheticTokens(tokenizer, config.seed),
                                                               worker_id, embedding_size)
    runtime.add_shutdown_hook(handler.images.close)  # the image fetcher's connections
    if config.ec_consumer and isinstance(handler, MockerHandler):
        handler.encoders = Encoders(runtime, config.namespace)
        runtime.add_shutdown_hook(handler.encoders.close)
    spec = WorkerSpec(
        config.model_path, config.served_model_name, config.disaggregation_mode, engine_config.block_size,
        config.migration_limit, context_length=config.context_length, model_type=config.model_type,
        bos_token_id=tokenizer.token_to_id(tokenizer.bos_token) if tokenizer.bos_token else None,
        runtime_config=ModelRuntimeConfig(
            total_kv_blocks=engine_config.num_blocks, max_num_seqs=engine_config.max_num_seqs,
            max_num_batched_tokens=engine_config.max_num_batched_tokens, context_length=config.context_length,
            enable_local_indexer=bool(publishers), data_parallel_size=config.data_parallel_size,
            tool_call_parser=config.dyn_tool_call_parser, reasoning_parser=config.dyn_reasoning_parser,
            embedding_size=embedding_size or None, matryoshka=embedding,
            **(config.images.card_fields() if config.images else {}),
        ),
    )
    await serve_worker(component, handler, spec, endpoint=config.endpoint, kv_publishers=publishers,
                       summary=f"mocker: {engine_config.num_blocks} blocks of {engine_config.block_size} tokens, "
                       f"speedup {config.speedup_ratio:g}")
    return engines


async def worker(config: MockerConfig) -> int:
    tokenizer = Tokenizer.from_folder(config.model_path)
    runtimes = [await DistributedRuntime.create(config.runtime if i == 0 else config.runtime.replace(system_port=None))
                for i in range(config.num_workers)]
    install_signal_handlers(runtimes)
    engines: list[MockEngine] = []
    try:
        if config.startup_time > 0:
            await asyncio.sleep(config.startup_time)
        ranked: list[tuple[int, int, MockEngine]] = []
        for runtime in runtimes:
            started = await start_worker(config, runtime, tokenizer)
            ranked += [(runtime.instance_id, rank, engine) for rank, engine in enumerate(started)]
            engines.extend(started)
        runtimes[0].registry.register(LagCollector(ranked))
        await asyncio.gather(*(runtime.wait_closed() for runtime in runtimes))
        return 0
    finally:
        for engine in engines:
            await engine.stop()
        await asyncio.gather(*(runtime.shutdown() for runtime in runtimes if not runtime.is_shutting_down))


def main(argv: list[str] | None = None) -> int:
    config = parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging()
    return run(lambda: worker(config))


if __name__ == "__main__":
    sys.exit(main())
