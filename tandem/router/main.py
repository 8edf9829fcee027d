"""`tandem router` / `python -m tandem.router`: the KV router as a service of its own (Dynamo's
`python -m dynamo.router`), for components that route without a frontend.

It follows the workers of `--endpoint` (their KV events, their instances) and serves, on
`dyn://<namespace>.<--router-component>.*`:

* `generate`: a PreprocessedRequest in, the chosen worker's output stream out (the router tracks the
  request's load until it ends), like Dynamo's `KvPushRouter.generate`;
* `best_worker_id`: `{"token_ids": [...]}` in, `{"worker_id", "overlap_blocks"}` out, without
  tracking anything (the caller sends the request itself).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from tandem.llm.protocols import LLMEngineOutput, PreprocessedRequest, RoutingHints
from tandem.router.config import add_router_args, parse_args_with_router_config
from tandem.router.kv_router import KvRouter, RouterMetrics
from tandem.runtime import (
    Context,
    DistributedRuntime,
    RuntimeConfig,
    add_runtime_args,
    configure_logging,
    run,
)
from tandem.runtime.keys import parse_endpoint_path

log = logging.getLogger("tandem.router")


class RouterService:
    def __init__(self, router: KvRouter, client: Any, worker_path: str) -> None:
        self.router = router
        self.client = client
        self.worker_path = worker_path

    def _workers(self) -> list[int]:
        ids = self.client.instance_ids()
        self.router.sync_workers(dict.fromkeys(ids, self.worker_path))
        if not ids:
            raise RuntimeError(f"no workers serve {self.worker_path}")
        return ids

    def _select_args(self, request: PreprocessedRequest) -> dict[str, Any]:
        return {"cache_salt": request.routing.cache_salt if request.routing else None,
                "override": request.router_config_override, "dp_rank": request.dp_rank}

    async def generate(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[LLMEngineOutput]:
        with self.router.select(context.id(), request.token_ids, self._workers(),
                                **self._select_args(request)) as routed:
            routing = msgspec.structs.replace(request.routing or RoutingHints(), dp_rank=routed.decision.dp_rank)
            request = msgspec.structs.replace(request, routing=routing)
            stream = await self.client.direct(request, routed.decision.worker_id, context, item_type=LLMEngineOutput)
            async for output in stream:
                if output.token_ids:
                    routed.tokens_arrived()
                yield output

    async def best_worker_id(self, request: PreprocessedRequest) -> AsyncIterator[dict[str, Any]]:
        decision = self.router.best_worker(request.token_ids, self._workers(), **self._select_args(request))
        yield {"worker_id": decision.worker_id, "dp_rank": decision.dp_rank,
               "overlap_blocks": decision.overlap_blocks,
               "overlaps": {str(worker[0]): blocks for worker, blocks in decision.scores.scores.items()}}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem router", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", default="dyn://dynamo.backend.generate",
                        help="the workers' generate endpoint [dyn://dynamo.backend.generate]")
    parser.add_argument("--block-size", "--kv-cache-block-size", dest="block_size", type=int, required=True,
                        help="the workers' KV block size (tokens)")
    parser.add_argument("--router-component", default="router", help="component this service serves as [router]")
    add_router_args(parser)
    add_runtime_args(parser)
    return parser


async def serve(args: argparse.Namespace) -> int:
    namespace, component, endpoint = parse_endpoint_path(args.endpoint)
    runtime = await DistributedRuntime.create(RuntimeConfig.from_args(args).replace(namespace=namespace))
    runtime.install_signal_handlers()
    worker_path = f"{namespace}.{component}.{endpoint}"
    client = await runtime.endpoint(worker_path).client()
    metrics = RouterMetrics(runtime.registry)
    router = KvRouter(runtime, worker_path, block_size=args.block_size, config=args.router_config, metrics=metrics)
    metrics.watch_load(router)
    service = RouterService(router, client, worker_path)
    router.sync_workers(dict.fromkeys(client.instance_ids(), worker_path))
    own = runtime.namespace(namespace).component(args.router_component)
    served = await own.endpoint("generate").start_serving(service.generate, request_type=PreprocessedRequest)
    await own.endpoint("best_worker_id").start_serving(service.best_worker_id, request_type=PreprocessedRequest)
    runtime.set_ready()
    print(f"READY {runtime.instance_id:x} {served.path}", flush=True)
    await runtime.wait_closed()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args_with_router_config(parser, sys.argv[1:] if argv is None else argv)
    if args.block_size <= 0:
        parser.error("--block-size must be positive")
    configure_logging()
    return run(lambda: serve(args))


if __name__ == "__main__":
    sys.exit(main())
