"""`tandem vllm` / `python -m tandem.vllm`: a vLLM worker.

Startup: parse flags, (checkpoint lifecycle), runtime, engine, handlers, KV event relays and the
stat logger, engine routes, LoRA, endpoints per role, model registration, then serve until SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from tandem.llm.forward_pass import FORWARD_PASS_TOPIC
from tandem.llm.model_card import ImagePrompt, ModelInput, ModelRuntimeConfig, ModelType
from tandem.models.resolve import loaded_model_folder
from tandem.router.protocols import KV_METRICS_TOPIC
from tandem.runtime import DistributedRuntime, configure_logging, run
from tandem.runtime.config import ConfigError
from tandem.vllm.args import Config, dump_config, parse_args
from tandem.vllm.bos_token import bos_token_id_of
from tandem.vllm.checkpoint_restore import get_checkpoint_config
from tandem.vllm.embedding_transfer import NixlOffers, NixlReader, NixlWriteReceiver
from tandem.vllm.encoder import EncoderEmbeddings, EncoderWorkerHandler, StoredEncoderOutputs
from tandem.vllm.encoder_cache import EC_EXAMPLE_CONNECTOR, NIXL_READ, NIXL_WRITE
from tandem.vllm.engine_monitor import VllmEngineMonitor
from tandem.vllm.forward_pass import ForwardPasses, ForwardPassLoggerFactory, enable_iteration_details
from tandem.vllm.handlers import DisaggMetrics, handler_class
from tandem.vllm.lifeline import mark_owner
from tandem.vllm.publisher import StatLoggerFactory
from tandem.worker.encoders import Encoders, serve_encoder
from tandem.worker.harness import ServedWorker, WorkerSpec, serve_worker

log = logging.getLogger("tandem.vllm")


def setup_vllm_engine(config: Config, stat_loggers: list[Any] | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """Create the AsyncLLM. Returns (engine, vllm_config, default sampling params).

    vLLM v1 records its metrics in this process (the engine core reports to it), so they land in
    prometheus_client's default registry, which `_expose_engine_metrics` serves."""
    os.environ["VLLM_NO_USAGE_STATS"] = "1"
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    mark_owner()  # the engine's processes die with this one, however it ends
    engine_args = config.engine_args
    if not config.embedding_worker:
        # Per-step details for the forward-pass metrics, which the load planner fits generation workers'
        # step times on; they cost the engine ~5% of its throughput, which an embedding worker keeps.
        enable_iteration_details(engine_args)
    if engine_args.enable_lora:
        os.environ.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        os.environ.setdefault("VLLM_LORA_MODULES_LOADING_TIMEOUT", "600")
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    defaults = engine_args.create_model_config().get_diff_sampling_param()
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    if config.enable_multimodal:
        _image_token_id(vllm_config.model_config)  # before the engine starts: a text-only model is refused now
    if config.ec_consumer_mode and config.embedding_transfer_mode is not None:
        _check_takes_image_embeddings(vllm_config)
    engine = AsyncLLM.from_vllm_config(
        vllm_config=vllm_config, usage_context=UsageContext.OPENAI_API_SERVER, stat_loggers=stat_loggers or None,
        enable_log_requests=False, disable_log_stats=False,
    )
    return engine, vllm_config, defaults


@dataclass
class _EngineStats:
    """vLLM's stat loggers of the worker, made with its engine: in checkpoint mode before the runtime, so the
    KV load loggers get the worker's id and metrics registry once the runtime is up (`bind`)."""

    passes: ForwardPasses
    load: StatLoggerFactory | None  # a prefill worker reports no KV load

    @classmethod
    def of(cls, config: Config) -> _EngineStats:
        dp_rank = config.engine_args.data_parallel_rank or 0
        return cls(ForwardPasses(dp_rank), None if config.is_prefill_worker else StatLoggerFactory(dp_rank=dp_rank))

    @property
    def loggers(self) -> list[Any]:
        return [ForwardPassLoggerFactory(self.passes), *([self.load] if self.load else [])]


async def worker(config: Config) -> int:
    early_exit, checkpoint = get_checkpoint_config()
    if early_exit:
        log.info("checkpoint already exists: nothing to do")
        return 0
    if config.dump_config_to:
        dump_config(config.dump_config_to, config)
    engine = vllm_config = defaults = None
    stats = _EngineStats.of(config)
    if checkpoint is not None:
        # The engine exists before the runtime so the checkpoint holds no open connections.
        engine, vllm_config, defaults = setup_vllm_engine(config, stats.loggers)
        if not await checkpoint.run_lifecycle(engine, sleep_level=config.sleep_mode_level):
            engine.shutdown()
            return 0
    runtime = await DistributedRuntime.create(config.runtime)
    runtime.install_signal_handlers()
    shutdown_event = asyncio.Event()
    try:
        return await _serve(config, runtime, shutdown_event, stats, engine, vllm_config, defaults)
    finally:
        if not runtime.is_shutting_down:
            await runtime.shutdown()


async def _serve(config: Config, runtime: DistributedRuntime, shutdown_event: asyncio.Event, stats: _EngineStats,
                 engine: Any, vllm_config: Any, defaults: Any) -> int:
    from tandem.vllm.publisher import KvEventRelay

    component = runtime.namespace(config.namespace).component(config.component)
    worker_id = runtime.instance_id
    dp_rank = config.engine_args.data_parallel_rank or 0
    passes, stat_factory = stats.passes, stats.load
    if stat_factory is not None:
        stat_factory.bind(worker_id, runtime.registry)
    if engine is None:
        engine, vllm_config, defaults = await asyncio.to_thread(setup_vllm_engine, config, stats.loggers)
    try:
        num_blocks = vllm_config.cache_config.num_gpu_blocks or 0
        block_size = vllm_config.cache_config.block_size
        model_max_len = vllm_config.model_config.max_model_len
        if stat_factory is not None:
            stat_factory.set_publisher(await component.event_publisher(KV_METRICS_TOPIC))
            stat_factory.set_num_gpu_blocks(num_blocks)
            stat_factory.init_publish()
        passes.start(worker_id, await component.event_publisher(FORWARD_PASS_TOPIC), num_blocks, block_size,
                     vllm_config.scheduler_config.max_num_batched_tokens)
        runtime.add_shutdown_hook(passes.stop)
        _expose_engine_metrics(runtime)

        lora = None
        # Prefill workers too: an adapter's prompt must be computed with the adapter. Each worker that loads
        # it registers the adapter's card, so the frontend prefills it only on prefill workers that hold it.
        if config.engine_args.enable_lora:
            from tandem.vllm.lora import LoRAService

            lora = LoRAService(engine)
        model_config = vllm_config.model_config
        embedding = config.embedding_worker  # vLLM runs the pooling runner exactly then (args.py forces it)
        kind = EncoderWorkerHandler if config.vllm_native_encoder_worker else handler_class(
            prefill=config.is_prefill_worker, text_input=config.use_vllm_tokenizer, embedding=embedding)
        handler = kind(
            runtime, engine, config, default_sampling_params=defaults, model_max_len=model_max_len,
            shutdown_event=shutdown_event, lora=lora, pending_prompts=passes.pending,
            disagg_metrics=None if config.is_prefill_worker else DisaggMetrics(runtime.registry,
                                                                               config.served_model_name),
        )

        async def abort_in_flight() -> None:
            # After the drain: what still runs is aborted and ends as incomplete, so the frontend migrates it.
            shutdown_event.set()
            await asyncio.sleep(0.2)

        runtime.add_shutdown_hook(abort_in_flight)
        runtime.add_shutdown_hook(handler.close_images)  # the image fetcher's connections
        if config.ec_consumer_mode:
            encoders = Encoders(runtime, config.namespace)
            if config.embedding_transfer_mode is not None:
                receiver = {NIXL_READ: NixlReader, NIXL_WRITE: NixlWriteReceiver}.get(config.embedding_transfer_mode)
                handler.embed_images = EncoderEmbeddings(encoders, vllm_config.model_config.dtype,
                                                         receiver() if receiver else None).embed
            else:
                stored = StoredEncoderOutputs(encoders, config.ec_storage_path
                                              if config.ec_connector_backend == EC_EXAMPLE_CONNECTOR else None)
                handler.encode_images = stored.encode
            runtime.add_shutdown_hook(encoders.close)
        if isinstance(handler, EncoderWorkerHandler) and config.ec_connector_backend == EC_EXAMPLE_CONNECTOR:
            handler.storage = config.ec_storage_path
            if config.embedding_transfer_mode in (NIXL_READ, NIXL_WRITE):  # it serves consumers of both
                handler.offers = NixlOffers()
                handler.offers.start()
                runtime.add_shutdown_hook(handler.offers.stop)
        monitor = VllmEngineMonitor(runtime, engine, shutdown_event)
        monitor.start()

        relays: list[Any] = []
        if config.use_kv_events and config.kv_events_endpoint:
            for rank in range(vllm_config.parallel_config.data_parallel_size):
                relay = KvEventRelay(component, worker_id=worker_id, kv_block_size=block_size,
                                     zmq_endpoint=_offset_port(config.kv_events_endpoint, rank), dp_rank=rank,
                                     durable=config.durable_kv_events)
                await relay.start()
                relays.append(relay)
        runtime.register_engine_route("sleep", handler.sleep)
        runtime.register_engine_route("wake_up", handler.wake_up)

        if config.vllm_native_encoder_worker:
            await serve_encoder(component, config.endpoint, handler.generate, config.served_model_name)
            await runtime.wait_closed()
            await monitor.stop()
            return 0

        if dp_rank:
            log.info("non-leader data-parallel rank %d: the leader serves all ranks; not serving endpoints", dp_rank)
            await runtime.wait_closed()
            return 0

        async def serve_loras(worker: ServedWorker) -> None:
            if lora is None:
                return
            from tandem.vllm.lora import card_callbacks, install_lora_routes

            lora.register, lora.unregister = card_callbacks(worker.endpoint, worker.card)
            for name, fn in (("load_lora", lora.load_lora), ("unload_lora", lora.unload_lora),
                             ("list_loras", lora.list_loras)):
                await component.endpoint(name).start_serving(fn, metrics_labels={"model": config.served_model_name})
            install_lora_routes(runtime, lora)

        # The card describes the files the engine loaded: for a hub id, the HF cache's snapshot (downloaded now if
        # it was not cached at startup) at the revision vLLM used, in vLLM's download dir if one was given.
        model_folder = loaded_model_folder(model_config.model, model_config.revision,
                                           vllm_config.load_config.download_dir)
        spec = WorkerSpec(
            model_folder, config.served_model_name, config.disaggregation_mode, block_size,
            config.migration_limit,
            model_type=ModelType.Embedding if embedding else ModelType.parse(config.endpoint_types),
            model_input=ModelInput.Text if config.use_vllm_tokenizer else ModelInput.Tokens,
            context_length=model_max_len, custom_template_path=config.custom_jinja_template,
            bos_token_id=await bos_token_id_of(engine),
            runtime_config=ModelRuntimeConfig(
                total_kv_blocks=num_blocks, max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
                max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
                context_length=model_max_len, enable_local_indexer=bool(relays),
                data_parallel_size=vllm_config.parallel_config.data_parallel_size,
                tool_call_parser=config.dyn_tool_call_parser, reasoning_parser=config.dyn_reasoning_parser,
                enable_prompt_embeds=config.engine_args.enable_prompt_embeds,
                **(await _image_config(engine, model_config) if config.enable_multimodal else {}),
                **_embedding_config(model_config, embedding),
            ),
        )
        await serve_worker(component, handler, spec, endpoint=config.endpoint, kv_publishers=relays,
                           before_ready=serve_loras, summary=f"{num_blocks} KV blocks of {block_size} tokens")
        handler.on_sleep, handler.on_wake = runtime.leave_discovery, runtime.rejoin_discovery
        await runtime.wait_closed()
        await monitor.stop()
        for relay in relays:
            await relay.close()
        return 0
    finally:
        engine.shutdown()


def _embedding_config(model_config: Any, embedding: bool) -> dict[str, Any]:
    """What the frontend checks an embedding request's `dimensions` against."""
    if not embedding:
        return {}
    return {"embedding_size": model_config.embedding_size, "matryoshka": bool(model_config.is_matryoshka),
            "matryoshka_dimensions": model_config.matryoshka_dimensions}


def _image_token_id(model_config: Any) -> int:
    """The placeholder token of an image in the prompt of the vision-language model the engine loaded."""
    hf_config = model_config.hf_config
    token_id = getattr(hf_config, "image_token_id", None)
    if token_id is None:
        token_id = getattr(hf_config, "image_token_index", None)  # LLaVA's name for it
    if not model_config.is_multimodal_model or token_id is None:
        raise ConfigError(f"--enable-multimodal: {model_config.model} is not a vision-language model this worker "
                          "can give images to (its config names no image token)")
    return int(token_id)


async def _image_config(engine: Any, model_config: Any) -> dict[str, Any]:
    """What the frontend checks a request's images against (the placeholder, how many one prompt may hold)
    and what its KV router hashes them as (the placeholder's expansion)."""
    limits = model_config.multimodal_config
    token_id = _image_token_id(model_config)
    return {"image_token_id": token_id, "max_images": limits.get_limit_per_prompt("image") if limits else None,
            "image_prompt": await _image_prompt(engine, token_id)}


async def _image_prompt(engine: Any, token_id: int) -> ImagePrompt | None:
    """The tokens the engine puts in place of one image placeholder, from its input processor (no model run)
    given images of two sizes; None when they differ (the model's count of an image's tokens depends on the
    image) or the processor cannot be asked."""
    from PIL import Image
    from vllm import SamplingParams

    tasks = await engine.get_supported_tasks()
    seen = []
    for n, size in enumerate(((64, 48), (400, 300))):
        prompt = {"prompt_token_ids": [token_id], "multi_modal_data": {"image": Image.new("RGB", size)},
                  "multi_modal_uuids": {"image": [f"tandem-image-probe-{n}"]}}
        try:
            processed = engine.input_processor.process_inputs(f"tandem-image-probe-{n}", prompt,
                                                              SamplingParams(max_tokens=1), tasks)
        except Exception:  # noqa: BLE001 - an engine-internal call: without it images are routed unexpanded
            log.warning("could not ask the engine how it expands an image placeholder: the KV router will not "
                        "know images' blocks", exc_info=True)
            return None
        features = processed.mm_features or []
        if len(features) != 1:
            return None
        span = features[0].mm_position
        seen.append(ImagePrompt(list(processed.prompt_token_ids or ()), span.offset, span.length))
    if seen[0] != seen[1]:
        log.info("the model's image prompt depends on the image: the KV router hashes images unexpanded")
        return None
    return seen[0]


def _check_takes_image_embeddings(vllm_config: Any) -> None:
    """ConfigError unless vLLM's input processor of the model takes an image given as its encoder output (what
    a consumer with --embedding-transfer-mode gives its engine), asked before the engine starts: the size of
    one image's output is asked with an image, then a tensor of that size is offered (no model run)."""
    import torch
    from PIL import Image
    from vllm import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    model_config = vllm_config.model_config
    token_id = _image_token_id(model_config)

    def process(processor: Any, name: str, image: Any) -> Any:
        prompt = {"prompt_token_ids": [token_id], "multi_modal_data": {"image": image},
                  "multi_modal_uuids": {"image": [name]}}
        return processor.process_inputs(name, prompt, SamplingParams(max_tokens=1), ("generate",))

    try:
        processor = InputProcessor(vllm_config)
        features = process(processor, "tandem-embeddings-probe-image", Image.new("RGB", (64, 48))).mm_features or []
        embeds = features[0].mm_position.get_num_embeds()
        process(processor, "tandem-embeddings-probe",
                [torch.zeros(embeds, model_config.get_inputs_embeds_size(), dtype=model_config.dtype)])
    except Exception as e:  # noqa: BLE001 - whatever the processor says, the worker cannot serve this way
        raise ConfigError(f"--embedding-transfer-mode: {model_config.model}'s vLLM processor does not take an image "
                          f"as its encoder output ({type(e).__name__}: {e}); use --route-to-encoder without it (the "
                          "engine loads encoder outputs through the encoder-cache connector)") from None


def _offset_port(endpoint: str, dp_rank: int) -> str:
    """vLLM's publisher of data-parallel rank r binds the configured port + r."""
    address, port = endpoint.rsplit(":", 1)
    return f"{address}:{int(port) + dp_rank}"


def _expose_engine_metrics(runtime: DistributedRuntime) -> None:
    """Serve vLLM's own `vllm:` metrics on the system port's /metrics too; with a
    PROMETHEUS_MULTIPROC_DIR given by the user, also what other processes wrote there."""
    from prometheus_client import REGISTRY, CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    sources = [REGISTRY]
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        shared = CollectorRegistry()
        MultiProcessCollector(shared)
        sources.append(shared)

    class VllmMetrics:
        def collect(self):  # type: ignore[no-untyped-def]
            seen = set()
            for source in sources:
                for family in source.collect():
                    if family.name.startswith(("vllm:", "lmcache:")) and family.name not in seen:
                        seen.add(family.name)
                        yield family

    runtime.registry.register(VllmMetrics())  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    config = parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging()
    if config.dtype_note:
        log.info("%s", config.dtype_note)
    return run(lambda: worker(config))


if __name__ == "__main__":
    sys.exit(main())
