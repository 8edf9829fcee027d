"""`tandem frontend`: the HTTP entry point in front of the workers found through discovery."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace

from tandem.frontend.http import FrontendServer, HttpConfig
from tandem.frontend.metrics import FrontendMetrics
from tandem.frontend.models import ModelManager, ServedModel
from tandem.frontend.pipeline import ModelPipeline
from tandem.frontend.routing import LoadMonitor, LoadThresholds
from tandem.llm.model_card import ModelInput
from tandem.router.config import add_router_args, parse_args_with_router_config
from tandem.router.kv_router import KvRouter, RouterMetrics
from tandem.runtime import DistributedRuntime, RuntimeConfig, add_runtime_args, configure_logging, run
from tandem.runtime.config import env_bool, env_number, env_str
from tandem.runtime.options import MIGRATION_LIMIT, ROUTER_MODES

DEFAULT_MIGRATION_LIMIT = 3  # the frontend moves a stream cut off mid-way; workers default to 0 (their drain)

log = logging.getLogger("tandem.frontend")


def _optional_float(name: str) -> float | None:
    value = env_str(name)
    return float(value) if value is not None else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem frontend", description=__doc__)
    http = parser.add_argument_group("HTTP")
    http.add_argument("--http-host", default=env_str("DYN_HTTP_HOST", "0.0.0.0"), help="[env DYN_HTTP_HOST]")
    http.add_argument("--http-port", type=int, default=int(env_number("DYN_HTTP_PORT", 8000, int)),
                      help="[env DYN_HTTP_PORT, default 8000]")
    http.add_argument("--api-key", default=env_str("DYN_API_KEY"),
                      help="require `Authorization: Bearer KEY` on /v1 routes [env DYN_API_KEY]")
    http.add_argument("--http-body-timeout", type=float, default=env_number("DYN_HTTP_BODY_TIMEOUT_SECS", 60.0),
                      help="seconds a client may take to send its request body before a 408 "
                      "[env DYN_HTTP_BODY_TIMEOUT_SECS, default 60]")
    http.add_argument("--tls-cert-path", default=env_str("DYN_TLS_CERT_PATH"), help="[env DYN_TLS_CERT_PATH]")
    http.add_argument("--tls-key-path", default=env_str("DYN_TLS_KEY_PATH"), help="[env DYN_TLS_KEY_PATH]")
    models = parser.add_argument_group("Models and routing")
    models.add_argument("--model-path", default=env_str("DYN_MODEL_PATH"),
                        help="local copy of the model's tokenizer files when the workers' folder is not "
                        "visible here [env DYN_MODEL_PATH]")
    models.add_argument("--router-mode", default=env_str("DYN_ROUTER_MODE", "round-robin"), choices=ROUTER_MODES,
                        help="how to pick a worker [env DYN_ROUTER_MODE, default round-robin]")
    MIGRATION_LIMIT.add_to(models, DEFAULT_MIGRATION_LIMIT)  # a request no worker accepted always moves
    models.add_argument("--migration-max-seq-len", type=int,
                        default=int(v) if (v := env_str("DYN_MIGRATION_MAX_SEQ_LEN")) else None,
                        help="no migration once prompt + generated tokens exceed this [env DYN_MIGRATION_MAX_SEQ_LEN]")
    models.add_argument("--enforce-disagg", action=argparse.BooleanOptionalAction,
                        default=env_bool("DYN_ENFORCE_DISAGG"),
                        help="disaggregated serving only: a request no prefill worker can take fails with 503 "
                        "instead of being prefilled by its decode worker [env DYN_ENFORCE_DISAGG, default off]")
    load = parser.add_argument_group("Overload")
    load.add_argument("--active-decode-blocks-threshold", type=float,
                      default=_optional_float("DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD"),
                      help="a worker is busy above this fraction of its KV blocks in use (0..1)")
    load.add_argument("--active-prefill-tokens-threshold", type=int,
                      default=(lambda v: int(v) if v is not None else None)(env_str("DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD")),
                      help="a worker is busy above this many prompt tokens waiting for prefill")
    load.add_argument("--active-prefill-tokens-threshold-frac", type=float,
                      default=_optional_float("DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC"),
                      help="... or above this fraction of its max_num_batched_tokens")
    add_router_args(parser)
    add_runtime_args(parser)
    return parser


async def serve(args: argparse.Namespace) -> int:
    if bool(args.tls_cert_path) != bool(args.tls_key_path):
        raise SystemExit("tandem frontend: --tls-cert-path and --tls-key-path must be given together")
    if args.router_config.conditional_disagg and args.router_mode != "kv":
        raise SystemExit("tandem frontend: --router-conditional-disagg needs --router-mode kv")
    config = RuntimeConfig.from_args(args)
    scope = args.namespace or env_str("DYN_NAMESPACE")  # which workers to serve; None = every namespace
    runtime = await DistributedRuntime.create(config)
    runtime.install_signal_handlers()
    metrics = FrontendMetrics(runtime.registry)
    load = LoadMonitor(LoadThresholds(args.active_decode_blocks_threshold, args.active_prefill_tokens_threshold,
                                      args.active_prefill_tokens_threshold_frac))
    subscribed: set[str] = set()
    manager: ModelManager

    router_config = args.router_config if args.router_mode == "kv" else None
    router_metrics = RouterMetrics(runtime.registry) if router_config is not None else None

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
        return ModelPipeline(model, manager, router_mode=args.router_mode, migration_limit=args.migration_limit,
                             migration_max_seq_len=args.migration_max_seq_len, load=load, metrics=metrics,
                             kv_router=kv_router, prefill_router=prefill_router, enforce_disagg=args.enforce_disagg)

    def on_change() -> None:
        for model in manager.served():
            config = model.card.runtime_config
            metrics.set_model(model.name, {
                "total_kv_blocks": config.total_kv_blocks, "max_num_seqs": config.max_num_seqs,
                "max_num_batched_tokens": config.max_num_batched_tokens,
                "context_length": model.card.context_length, "kv_cache_block_size": model.card.kv_cache_block_size,
                "migration_limit": model.pipeline.migration_limit if model.pipeline else None,
                "workers": len(model.instances),
            })
            if model.pipeline is not None and model.pipeline.kv_router is not None:
                model.pipeline.kv_router.sync_workers(model.instances, model.dp_sizes)
            if model.pipeline is not None and model.pipeline.prefill_router is not None:
                model.pipeline.prefill_router.sync_workers(model.prefill_instances, model.dp_sizes)
            if load.thresholds.enabled:
                for path in set(model.instances.values()) - subscribed:
                    subscribed.add(path)
                    runtime.spawn(_follow_load(runtime, path, load))

    manager = ModelManager(runtime, namespace=scope, model_path=args.model_path, build_pipeline=build,
                           on_change=on_change)
    await manager.start()
    server = FrontendServer(runtime, manager, metrics, HttpConfig(
        host=args.http_host, port=args.http_port, api_key=args.api_key, tls_cert_path=args.tls_cert_path,
        tls_key_path=args.tls_key_path,
        body_limit_bytes=int(env_number("DYN_HTTP_BODY_LIMIT_MB", 192) * 1024 * 1024),
        body_read_timeout=args.http_body_timeout,
    ))
    await server.start()
    runtime.add_drain(server.drain)  # SIGTERM: finish the HTTP streams before the planes close
    runtime.set_ready()
    scheme = "https" if args.tls_cert_path else "http"
    print(f"READY {scheme}://{args.http_host}:{server.port}", flush=True)
    await runtime.wait_closed()
    await server.close()
    await manager.close()
    return 0


async def _follow_load(runtime: DistributedRuntime, endpoint_path: str, load: LoadMonitor) -> None:
    namespace, component, _ = endpoint_path.split(".")
    subscriber = await runtime.namespace(namespace).component(component).subscribe("kv_metrics")
    async for event in subscriber:
        if isinstance(event, dict):
            load.apply(event)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args_with_router_config(parser, sys.argv[1:] if argv is None else argv)
    try:
        args.migration_limit = MIGRATION_LIMIT.value(args, DEFAULT_MIGRATION_LIMIT)
    except ValueError as e:
        parser.error(str(e))
    configure_logging()
    return run(lambda: serve(args))


if __name__ == "__main__":
    sys.exit(main())
