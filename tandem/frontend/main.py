"""`tandem frontend`: the HTTP entry point in front of the workers found through discovery."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass, replace

from tandem.frontend.media import RoutedImages
from tandem.frontend.metrics import FrontendMetrics
from tandem.frontend.models import ModelManager, ServedModel
from tandem.frontend.pipeline import ModelPipeline
from tandem.frontend.preprocess import ParserNames
from tandem.frontend.replicas import REPLICA_ENV, supervise
from tandem.frontend.routing import LoadMonitor, LoadThresholds
from tandem.frontend.server import FrontendServer
from tandem.frontend.serving import HttpConfig
from tandem.llm.images import ImageLimits, ImageLoader
from tandem.llm.model_card import ModelInput
from tandem.router.config import add_router_args, parse_args_with_router_config
from tandem.router.kv_router import KvRouter, RouterMetrics
from tandem.runtime import DistributedRuntime, RuntimeConfig, add_runtime_args, configure_logging, run
from tandem.runtime.config import WILDCARDS, env_str
from tandem.runtime.keys import frontend_key, parse_endpoint_path
from tandem.runtime.logs import lean_records
from tandem.runtime.options import (
    ALLOW_PRIVATE_MEDIA_URLS,
    MIGRATION_LIMIT,
    ROUTER_MODES,
    Option,
    RouterMode,
    add_options,
    apply_options,
)

log = logging.getLogger("tandem.frontend")


@dataclass
class FrontendConfig:
    http_host: str = "0.0.0.0"
    http_port: int = 8000
    num_processes: int = 1
    api_key: str | None = None
    http_body_timeout: float = 60.0
    http_body_limit_mb: float = 192.0
    tls_cert_path: str | None = None
    tls_key_path: str | None = None
    model_path: str | None = None
    router_mode: RouterMode = RouterMode.ROUND_ROBIN
    migration_limit: int = 3  # the frontend moves a stream cut off mid-way; workers default to 0 (their drain)
    migration_max_seq_len: int | None = None
    enforce_disagg: bool = False
    active_decode_blocks_threshold: float | None = None
    active_prefill_tokens_threshold: int | None = None
    active_prefill_tokens_threshold_frac: float | None = None
    dyn_tool_call_parser: str | None = None
    dyn_reasoning_parser: str | None = None
    reasoning_field_name: str = "reasoning_content"
    responses_store_size: int = 1024
    enable_anthropic_api: bool = True
    allow_private_media_urls: bool = False  # KV routing fetches the images of requests to hash them


_HTTP = (
    Option("http_host", ("--http-host",), ("DYN_HTTP_HOST",), "address to listen on", kind=str),
    Option("http_port", ("--http-port",), ("DYN_HTTP_PORT",), "port to listen on; 0 = any free one", kind=int,
           minimum=0, maximum=65535),
    Option("num_processes", ("--num-processes",), ("DYN_FRONTEND_NUM_PROCESSES",),
           "serve the port from this many frontend processes (SO_REUSEPORT), each with its own KV router kept "
           "in step by replica sync", kind=int, minimum=1),
    Option("api_key", ("--api-key",), ("DYN_API_KEY",), "require `Authorization: Bearer KEY` on /v1 routes",
           kind=str),
    Option("http_body_timeout", ("--http-body-timeout",), ("DYN_HTTP_BODY_TIMEOUT_SECS",),
           "seconds a client may take to send its request body before a 408", positive=True),
    Option("http_body_limit_mb", (), ("DYN_HTTP_BODY_LIMIT_MB",), "largest request body, MB (413 above)",
           positive=True),
    Option("tls_cert_path", ("--tls-cert-path",), ("DYN_TLS_CERT_PATH",), "serve HTTPS with this certificate",
           kind=str),
    Option("tls_key_path", ("--tls-key-path",), ("DYN_TLS_KEY_PATH",), "... and this key", kind=str),
)
_APIS = (
    Option("responses_store_size", ("--responses-store-size",), ("DYN_RESPONSES_STORE_SIZE",),
           "responses each frontend process keeps for previous_response_id and GET /v1/responses/{id}, the least "
           "recently used evicted first; 0 keeps none", kind=int, minimum=0),
    Option("enable_anthropic_api", ("--enable-anthropic-api",), ("DYN_ENABLE_ANTHROPIC_API",),
           "serve Anthropic's Messages API (/v1/messages); --no-enable-anthropic-api turns it off", kind=bool),
)
_MODELS = (
    Option("model_path", ("--model-path",), ("DYN_MODEL_PATH",), "local copy of the model's tokenizer files when "
           "the workers' folder is not visible here", kind=str),
    ALLOW_PRIVATE_MEDIA_URLS,  # the KV router fetches image URLs to hash their content
    Option("router_mode", ("--router-mode",), ("DYN_ROUTER_MODE",), "how to pick a worker", kind=RouterMode,
           choices=ROUTER_MODES),
    MIGRATION_LIMIT,  # a request no worker has accepted yet always goes to another
    Option("migration_max_seq_len", ("--migration-max-seq-len",), ("DYN_MIGRATION_MAX_SEQ_LEN",),
           "no migration once prompt + generated tokens exceed this", kind=int, positive=True),
    Option("enforce_disagg", ("--enforce-disagg",), ("DYN_ENFORCE_DISAGG",), "disaggregated serving only: a "
           "request no prefill worker can take fails with 503 instead of being prefilled by its decode worker",
           kind=bool),
)
_PARSERS = (
    Option("dyn_tool_call_parser", ("--dyn-tool-call-parser",), ("DYN_TOOL_CALL_PARSER",),
           "tool-call parser for every model, instead of the one its workers name", kind=str),
    Option("dyn_reasoning_parser", ("--dyn-reasoning-parser",), ("DYN_REASONING_PARSER",),
           "reasoning parser for every model, instead of the one its workers name", kind=str),
    Option("reasoning_field_name", ("--reasoning-field-name",), ("DYN_REASONING_FIELD_NAME",),
           "the answer field that carries the model's thinking", kind=str,
           choices=("reasoning_content", "reasoning")),
)
_OVERLOAD = (
    Option("active_decode_blocks_threshold", ("--active-decode-blocks-threshold",),
           ("DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD",), "a worker is busy above this fraction of its KV blocks in use",
           minimum=0.0, maximum=1.0),
    Option("active_prefill_tokens_threshold", ("--active-prefill-tokens-threshold",),
           ("DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD",), "a worker is busy above this many prompt tokens waiting "
           "for prefill", kind=int, minimum=0),
    Option("active_prefill_tokens_threshold_frac", ("--active-prefill-tokens-threshold-frac",),
           ("DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC",), "... or above this fraction of its "
           "max_num_batched_tokens", minimum=0.0),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem frontend", description=__doc__)
    defaults = FrontendConfig()
    add_options(parser.add_argument_group("HTTP"), _HTTP, defaults)
    add_options(parser.add_argument_group("Responses and Anthropic APIs"), _APIS, defaults)
    add_options(parser.add_argument_group("Models and routing"), _MODELS, defaults)
    add_options(parser.add_argument_group("Tool calls and reasoning"), _PARSERS, defaults)
    add_options(parser.add_argument_group("Overload"), _OVERLOAD, defaults)
    add_router_args(parser)
    add_runtime_args(parser)
    return parser


async def serve(args: argparse.Namespace, frontend: FrontendConfig) -> int:
    if bool(frontend.tls_cert_path) != bool(frontend.tls_key_path):
        raise SystemExit("tandem frontend: --tls-cert-path and --tls-key-path must be given together")
    if args.router_config.conditional_disagg and frontend.router_mode is not RouterMode.KV:
        raise SystemExit("tandem frontend: --router-conditional-disagg needs --router-mode kv")
    config = RuntimeConfig.from_args(args)
    scope = args.namespace or env_str("DYN_NAMESPACE")  # which workers to serve; None = every namespace
    runtime = await DistributedRuntime.create(config)
    runtime.install_signal_handlers()
    metrics = FrontendMetrics(runtime.registry, runtime.instance_id)
    load = LoadMonitor(LoadThresholds(frontend.active_decode_blocks_threshold, frontend.active_prefill_tokens_threshold,
                                      frontend.active_prefill_tokens_threshold_frac))
    subscribed: set[str] = set()
    manager: ModelManager

    if frontend.allow_private_media_urls and frontend.router_mode is not RouterMode.KV:
        # Said, not refused: the variable is often set for a whole deployment, where the workers use it.
        log.warning("--allow-private-media-urls (TANDEM_ALLOW_PRIVATE_MEDIA_URLS) has no effect on this frontend: it "
                    "fetches images only with --router-mode kv (to hash them); the workers fetch them otherwise")
    router_config = args.router_config if frontend.router_mode is RouterMode.KV else None
    router_metrics = RouterMetrics(runtime.registry) if router_config is not None else None
    images = RoutedImages(ImageLoader(ImageLimits(allow_private=frontend.allow_private_media_urls)))

    def build(model: ServedModel) -> ModelPipeline:
        kv_router = prefill_router = None
        if router_config is not None and model.card.model_input == ModelInput.Tokens:
            block_size = model.card.kv_cache_block_size
            kv_router = KvRouter(runtime, model.name, block_size=block_size, config=router_config,
                                 metrics=router_metrics)
            if router_metrics is not None:
                router_metrics.watch_load(kv_router)
            # Prefill workers: by cached prefix, without tracking their short-lived requests' blocks.
            prefill_router = KvRouter(runtime, model.name, block_size=block_size, metrics=router_metrics,
                                      config=replace(router_config, track_active_blocks=False, replica_sync=False))
        return ModelPipeline(model, manager, router_mode=frontend.router_mode, migration_limit=frontend.migration_limit,
                             migration_max_seq_len=frontend.migration_max_seq_len, load=load, metrics=metrics,
                             kv_router=kv_router, prefill_router=prefill_router, enforce_disagg=frontend.enforce_disagg,
                             parsers=ParserNames(frontend.dyn_tool_call_parser, frontend.dyn_reasoning_parser),
                             images=images)

    def on_change() -> None:
        for model in manager.served():
            config = model.card.runtime_config
            metrics.set_model(model.name, {
                "total_kv_blocks": config.total_kv_blocks, "max_num_seqs": config.max_num_seqs,
                "max_num_batched_tokens": config.max_num_batched_tokens,
                "context_length": model.card.context_length, "kv_cache_block_size": model.card.kv_cache_block_size,
                "migration_limit": model.pipeline.migration_limit if model.pipeline else None,
                "workers": len(model.instances), "prefill_workers": len(model.prefill_instances),
            })
            if model.pipeline is not None and model.pipeline.kv_router is not None:
                model.pipeline.kv_router.sync_workers(model.instances, model.dp_sizes)
            if model.pipeline is not None and model.pipeline.prefill_router is not None:
                model.pipeline.prefill_router.sync_workers(model.prefill_instances, model.dp_sizes)
            if load.thresholds.enabled:
                for path in set(model.instances.values()) - subscribed:
                    subscribed.add(path)
                    runtime.spawn(_follow_load(runtime, path, load))

    manager = ModelManager(runtime, namespace=scope, model_path=frontend.model_path, build_pipeline=build,
                           on_change=on_change)
    await manager.start()
    server = FrontendServer(runtime, manager, metrics, HttpConfig(
        host=frontend.http_host, port=frontend.http_port, api_key=frontend.api_key, tls_cert_path=frontend.tls_cert_path,
        tls_key_path=frontend.tls_key_path,
        body_limit_bytes=int(frontend.http_body_limit_mb * 1024 * 1024),
        body_read_timeout=frontend.http_body_timeout, reasoning_field=frontend.reasoning_field_name,
        reuse_port=REPLICA_ENV in os.environ, responses_store_size=frontend.responses_store_size,
        anthropic_api=frontend.enable_anthropic_api,
    ))
    await server.start()
    runtime.add_drain(server.drain)  # SIGTERM: finish the HTTP streams before the planes close
    scheme = "https" if frontend.tls_cert_path else "http"
    # This process's own /metrics, for the planner: the system port when there is one (a replica's, since the
    # HTTP port may be shared), else the HTTP port.
    own = (f"http://{_reachable(config.system_host, config)}:{runtime.system_server.port}"
           if runtime.system_server is not None else f"{scheme}://{_reachable(frontend.http_host, config)}:{server.port}")
    await runtime.register_key(frontend_key(config.namespace, runtime.instance_id), f"{own}/metrics".encode())
    runtime.set_ready()
    print(f"READY {scheme}://{frontend.http_host}:{server.port}", flush=True)
    await runtime.wait_closed()
    await server.close()
    await manager.close()
    await images.loader.close()
    return 0


def _reachable(bind: str, config: RuntimeConfig) -> str:
    """The address peers reach a listener bound to `bind` at."""
    host = config.advertised_host() if bind in WILDCARDS else bind
    return f"[{host}]" if ":" in host else host


async def _follow_load(runtime: DistributedRuntime, endpoint_path: str, load: LoadMonitor) -> None:
    namespace, component, _ = parse_endpoint_path(endpoint_path)
    subscriber = await runtime.namespace(namespace).component(component).subscribe("kv_metrics")
    async for event in subscriber:
        load.apply(event)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args_with_router_config(parser, sys.argv[1:] if argv is None else argv)
    try:
        frontend = apply_options(FrontendConfig(), _HTTP + _APIS + _MODELS + _PARSERS + _OVERLOAD, args)
        ParserNames(frontend.dyn_tool_call_parser, frontend.dyn_reasoning_parser).checked()
    except ValueError as e:  # including a parser name that is not built
        parser.error(str(e))
    configure_logging()
    lean_records()
    if frontend.num_processes > 1:
        return run(lambda: supervise(sys.argv[1:] if argv is None else argv, frontend.http_host, frontend.http_port,
                                     frontend.num_processes, replica_sync=frontend.router_mode is RouterMode.KV))
    return run(lambda: serve(args, frontend))


if __name__ == "__main__":
    sys.exit(main())
