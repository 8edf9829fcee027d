"""`serve_worker`, with a scripted engine in one process: what every worker kind gets from the harness
(typed requests, the endpoints, the drain policy, the card, readiness)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tandem.llm.model_card import ModelDeploymentCard, ModelRuntimeConfig, ModelType, WorkerType
from tandem.llm.protocols import CompletionUsage, FinishReason, LLMEngineOutput, PreprocessedRequest
from tandem.router.protocols import WORKER_KV_INDEXER_QUERY_ENDPOINT
from tandem.router.publisher import KvEventPublisher
from tandem.runtime import Context, RemoteError
from tandem.worker.config import DisaggregationMode
from tandem.worker.harness import ServedWorker, WorkerSpec, serve_worker


class Scripted:
    """Answers with the prompt reversed; its first `clear_kv_blocks` fails."""

    def __init__(self) -> None:
        self.requests: list[PreprocessedRequest] = []
        self.clears = 0

    async def generate(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[LLMEngineOutput]:
        self.requests.append(request)
        tokens = request.token_ids[::-1][: request.max_tokens]
        for n, token in enumerate(tokens, 1):
            last = n == len(tokens)
            yield LLMEngineOutput([token], finish_reason=FinishReason.LENGTH if last else None,
                                  completion_usage=CompletionUsage.of(len(request.token_ids), n) if last else None)

    async def clear_kv_blocks(self) -> None:
        self.clears += 1
        if self.clears == 1:
            raise RuntimeError("the cache is busy")


async def _client(runtimes, path: str):  # type: ignore[no-untyped-def]
    client = await (await runtimes()).endpoint(path).client()
    await client.wait_for_instances(1, timeout=5)
    return client


@pytest.mark.parametrize(("mode", "migration_limit"), [(DisaggregationMode.AGGREGATED, 3),
                                                       (DisaggregationMode.PREFILL, 2)])
async def test_serve_worker(runtimes, namespace, smollm2, capsys, mode, migration_limit) -> None:  # type: ignore[no-untyped-def]
    runtime = await runtimes(namespace=namespace)
    component = runtime.namespace(namespace).component(mode.default_component)
    engine = Scripted()
    spec = WorkerSpec(smollm2, "m", mode, 16, migration_limit, loras=("adapter",),
                      runtime_config=ModelRuntimeConfig(total_kv_blocks=64, data_parallel_size=2))
    seen_before_ready: list[bool] = []

    async def before_ready(worker: ServedWorker) -> None:
        seen_before_ready.append(runtime.health.report()["status"] == "ready")

    publisher = KvEventPublisher(worker_id=runtime.instance_id, dp_rank=0, publisher=None)
    worker = await serve_worker(component, engine, spec, kv_publishers=[publisher], before_ready=before_ready)

    # Ready only after the card and what `before_ready` added; then the READY line.
    assert seen_before_ready == [False] and runtime.health.report()["status"] == "ready"
    assert capsys.readouterr().out.splitlines()[-1] == f"READY {runtime.instance_id:x} {worker.served.path}"
    # Requests that may move are not waited for at shutdown: the frontend migrates them.
    assert worker.served.graceful_shutdown is False

    # The card, as a frontend reads it from discovery, one for the base model and one for the adapter.
    cards = {key.rsplit("/", 1)[-1]: ModelDeploymentCard.from_json(value) for key, value in
             (await runtime.store.get_prefix(f"v1/mdc/{namespace}/{mode.default_component}/generate/")).items()}
    base, adapter = cards[f"{runtime.instance_id:x}"], cards["adapter"]
    prefill = mode is DisaggregationMode.PREFILL
    assert base.worker_type == (WorkerType.Prefill if prefill else WorkerType.Aggregated)
    assert base.types == (ModelType.Prefill if prefill else ModelType.Chat | ModelType.Completions)
    assert base.migration_limit == (0 if prefill else migration_limit)
    assert base.runtime_config == ModelRuntimeConfig(total_kv_blocks=64, data_parallel_size=2)
    assert (adapter.display_name, adapter.lora.base_model) == ("adapter", "m")

    # generate: the engine gets the Struct; a misshapen request is refused before it.
    client = await _client(runtimes, worker.served.path)
    request = {"model": "m", "token_ids": [5, 6, 7], "stop_conditions": {"max_tokens": 2}, "routing": {"dp_rank": 1}}
    out = [item async for item in await client.generate(request)]
    assert out == [{"token_ids": [7]}, {"token_ids": [6], "finish_reason": "length",
                                        "completion_usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                                             "total_tokens": 5}}]
    assert engine.requests[0].dp_rank == 1 and engine.requests[0].max_tokens == 2
    with pytest.raises(RemoteError) as info:
        async for _ in await client.generate({"token_ids": [5, "six"]}):
            pass
    assert info.value.code == 400 and "$.token_ids[1]" in str(info.value)
    assert len(engine.requests) == 1

    # clear_kv_blocks: the engine's failure is the answer, the next call succeeds.
    clear = await _client(runtimes, f"{namespace}.{mode.default_component}.clear_kv_blocks")
    assert [x async for x in await clear.generate({})] == [{"status": "error", "message": "the cache is busy"}]
    assert [x async for x in await clear.generate({})] == [{"status": "success", "message": "KV cache cleared"}]

    # The KV events kept by the publisher can be fetched again.
    query = await _client(runtimes, f"{namespace}.{mode.default_component}.{WORKER_KV_INDEXER_QUERY_ENDPOINT}")
    [answer] = [x async for x in await query.generate({"dp_rank": 0, "start_event_id": 0})]
    assert answer["complete"] and answer["events"] == []


async def test_a_worker_that_cannot_migrate_drains(runtimes, namespace, smollm2) -> None:  # type: ignore[no-untyped-def]
    runtime = await runtimes(namespace=namespace)
    spec = WorkerSpec(smollm2, "m", DisaggregationMode.DECODE, 16, 0, runtime_config=ModelRuntimeConfig())
    worker = await serve_worker(runtime.namespace(namespace).component("backend"), Scripted(), spec)
    assert worker.served.graceful_shutdown is True
    assert worker.card.worker_type == WorkerType.Decode


@pytest.mark.parametrize(("model_type", "mode"), [
    (ModelType.Embedding | ModelType.Chat, DisaggregationMode.AGGREGATED),
    (ModelType.Embedding, DisaggregationMode.PREFILL),
])
def test_an_embedding_model_serves_embeddings_only_and_aggregated(smollm2, model_type, mode):
    with pytest.raises(ValueError, match="embedding model"):
        WorkerSpec(smollm2, "m", mode, 16, 0, runtime_config=ModelRuntimeConfig(), model_type=model_type)


def test_an_embedding_card_is_not_the_generation_models(smollm2):
    """Workers serving a model's embeddings and its generation disagree on the card: one model name cannot
    mix them."""
    config = ModelRuntimeConfig()
    text = WorkerSpec(smollm2, "m", DisaggregationMode.AGGREGATED, 16, 0, runtime_config=config).card()
    vectors = WorkerSpec(smollm2, "m", DisaggregationMode.AGGREGATED, 16, 0, runtime_config=config,
                         model_type=ModelType.Embedding).card()
    assert vectors.types == ModelType.Embedding and vectors.mdcsum != text.mdcsum
