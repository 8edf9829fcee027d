"""How every worker kind serves: the endpoints, the drain policy, the model card, readiness.

A worker kind (vLLM, the mocker, the test engine; generation or embedding models) supplies a
`WorkerEngine` (its `generate` and `clear_kv_blocks`) and a `WorkerSpec` (what it serves and what its
engine turned out to be); `serve_worker` does the rest, the same way for all of them:

- `generate`, with requests decoded into `PreprocessedRequest` (token input), `TextRequest` (text
  input) or `EmbeddingRequest` (embedding models) before the engine sees them; a request that does not
  fit gets a 400 naming the field;
- `clear_kv_blocks`, and `worker_kv_indexer_query` when the worker keeps its KV events for re-fetching;
- the drain policy: a worker whose requests can migrate (migration limit > 0) does not wait for them at
  shutdown, it ends their streams as incomplete and the frontend moves them; otherwise it drains;
- the canary health payload, the model card (and one card per LoRA adapter named up front);
- ready: the runtime's health turns ready and `READY <instance id> <endpoint>` goes to stdout, the
  line launchers and tests wait for.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.llm.model_card import (
    ModelDeploymentCard,
    ModelInput,
    ModelRuntimeConfig,
    ModelType,
    build_card,
    register_model,
)
from tandem.llm.protocols import (
    EmbeddingOutput,
    EmbeddingRequest,
    LLMEngineOutput,
    PreprocessedRequest,
    StatusReply,
    TextChunk,
    TextRequest,
)
from tandem.router.protocols import WORKER_KV_INDEXER_QUERY_ENDPOINT
from tandem.router.publisher import indexer_query_handler
from tandem.runtime import Context
from tandem.runtime.component import Component, Endpoint, ServedEndpoint
from tandem.worker.config import DisaggregationMode
from tandem.worker.health import health_check_payload

log = logging.getLogger(__name__)


class WorkerEngine(Protocol):
    """What a worker kind supplies to `serve_worker`."""

    def generate(self, request: Any,
                 context: Context) -> AsyncIterator[LLMEngineOutput | EmbeddingOutput | TextChunk]:
        """Answer one request in the output type `OUTPUT_OF` names for it: `PreprocessedRequest` ->
        `LLMEngineOutput`s (token input); `TextRequest` -> `TextChunk`s (text input); `EmbeddingRequest` ->
        one `EmbeddingOutput`."""
        ...

    async def clear_kv_blocks(self) -> None:
        """Drop every cached KV block; raise if the engine cannot."""
        ...


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker serves and what its engine turned out to be: the model card's content."""

    model_path: str
    served_model_name: str
    mode: DisaggregationMode
    block_size: int
    migration_limit: int
    runtime_config: ModelRuntimeConfig
    model_type: ModelType = ModelType.Chat | ModelType.Completions
    model_input: ModelInput = ModelInput.Tokens
    context_length: int | None = None
    custom_template_path: str | None = None
    bos_token_id: int | None = None  # the canary's one-token prompt
    loras: Sequence[str] = field(default_factory=tuple)  # adapters served from the start, one card each

    def __post_init__(self) -> None:
        if self.is_embedding and self.model_type != ModelType.Embedding:
            raise ValueError("an embedding model serves embeddings only: its endpoint types cannot also name "
                             "chat or completions")
        if self.is_embedding and self.mode is not DisaggregationMode.AGGREGATED:
            raise ValueError("an embedding model has no prefill or decode side: serve it aggregated")

    @property
    def is_embedding(self) -> bool:
        return bool(self.model_type & ModelType.Embedding)

    def card(self) -> ModelDeploymentCard:
        prefill = self.mode is DisaggregationMode.PREFILL
        return build_card(
            self.model_path, self.served_model_name,
            model_type=ModelType.Prefill if prefill else self.model_type, model_input=self.model_input,
            worker_type=self.mode.worker_type, context_length=self.context_length,
            kv_cache_block_size=self.block_size,
            migration_limit=0 if prefill else self.migration_limit,  # the frontend re-runs a failed prefill
            runtime_config=self.runtime_config, custom_template_path=self.custom_template_path,
        )


@dataclass
class ServedWorker:
    endpoint: Endpoint
    served: ServedEndpoint
    card: ModelDeploymentCard


async def serve_worker(
    component: Component,
    engine: WorkerEngine,
    spec: WorkerSpec,
    *,
    endpoint: str = "generate",
    kv_publishers: Sequence[Any] = (),
    before_ready: Callable[[ServedWorker], Awaitable[None]] | None = None,
    summary: str = "",
) -> ServedWorker:
    """Serve `engine` as one worker instance on `component`'s runtime (see the module docstring).
    `kv_publishers` (one per data-parallel rank) answer `worker_kv_indexer_query`; `before_ready` adds
    what only this worker kind has (more endpoints, engine routes) before it is marked ready; `summary`
    ends the log line that says it serves."""
    runtime = component.runtime
    generate = component.endpoint(endpoint)
    labels = {"model": spec.served_model_name}
    text_input = spec.model_input is ModelInput.Text
    request_type = TextRequest if text_input else EmbeddingRequest if spec.is_embedding else PreprocessedRequest
    served = await generate.start_serving(
        engine.generate, graceful_shutdown=spec.migration_limit <= 0, metrics_labels=labels,
        health_check_payload=health_check_payload(spec.bos_token_id, text_mode=text_input,
                                                  embedding=spec.is_embedding),
        request_type=request_type,
    )

    async def clear_kv_blocks(request: Any = None) -> AsyncIterator[StatusReply]:
        try:
            await engine.clear_kv_blocks()
        except Exception as e:  # the engine's own failure is the caller's answer, not a dead stream
            yield StatusReply("error", str(e))
            return
        yield StatusReply("success", "KV cache cleared")

    await component.endpoint("clear_kv_blocks").start_serving(clear_kv_blocks, metrics_labels=labels)
    if kv_publishers:
        await component.endpoint(WORKER_KV_INDEXER_QUERY_ENDPOINT).start_serving(
            indexer_query_handler(kv_publishers), metrics_labels=labels)
    card = spec.card()
    await register_model(generate, card)
    for name in spec.loras:
        await register_model(generate, card.for_lora(name))
    worker = ServedWorker(generate, served, card)
    if before_ready is not None:
        await before_ready(worker)
    runtime.set_ready()
    log.info("serving %s as dyn://%s%s", spec.served_model_name, served.path, f" ({summary})" if summary else "")
    print(f"READY {runtime.instance_id:x} {served.path}", flush=True)  # for launchers and tests
    return worker
