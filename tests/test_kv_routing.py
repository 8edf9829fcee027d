"""KV-aware routing end to end: a frontend with `--router-mode kv` in front of mocker workers (real
processes, real KV events, the official openai client). Cached tokens in usage say where a prompt's
prefix was found."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import TandemProcess
from tests.deployment import MODEL, Deployment

BLOCK = 16
MOCKER = ["--block-size", str(BLOCK), "--speedup-ratio", "100"]


def _conversation(n: int) -> str:
    return f"conversation {n}: " + " ".join(f"topic{n}-{i}" for i in range(120))


def _cached(client: openai.OpenAI, prompt: str) -> tuple[int, int]:
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens or 0, reply.usage.prompt_tokens


@pytest.fixture(scope="module")
def kv_deployment(tmp_path_factory: pytest.TempPathFactory, smollm2: str) -> Iterator[Deployment]:
    deployment = Deployment(tmp_path_factory.mktemp("kv"), smollm2, engine_module="tandem.mocker",
                            engines=[MOCKER, MOCKER, MOCKER], frontend_args=["--router-mode", "kv"])
    yield deployment
    deployment.stop()


def test_requests_sharing_a_prefix_go_where_it_is_cached(kv_deployment: Deployment) -> None:
    client = kv_deployment.client()
    for n in range(6):
        prefix = _conversation(n)
        cached, _ = _cached(client, prefix)
        assert cached == 0
        for turn in range(3):
            cached, prompt_tokens = _cached(client, f"{prefix} follow-up {turn}")
            # Round robin over 3 workers would miss the cache on 2 of 3 follow-ups.
            assert cached >= (prompt_tokens - 10) // BLOCK * BLOCK - BLOCK, (n, turn, cached, prompt_tokens)
    metrics = kv_deployment.metrics()
    assert "dynamo_router_decision_seconds_count" in metrics
    applied = [line for line in metrics.splitlines() if line.startswith("dynamo_component_kv_cache_events_applied_total")]
    assert applied and float(applied[0].rsplit(" ", 1)[1]) > 0


def test_a_new_frontend_learns_what_workers_already_cache(kv_deployment: Deployment) -> None:
    """A frontend that starts after the blocks were stored reads each worker's buffered events."""
    prefix = _conversation(100)
    assert _cached(kv_deployment.client(), prefix)[0] == 0
    late = TandemProcess("tandem.frontend", "--http-host", "127.0.0.1", "--http-port", "0",
                         "--discovery-backend", "file", "--router-mode", "kv", env=kv_deployment.env)
    try:
        client = openai.OpenAI(base_url=f"{late.ready[0]}/v1", api_key="none", max_retries=0)
        for _ in range(100):  # until it has seen the three workers
            if len(_health(late.ready[0])) == 3:
                break
            time.sleep(0.1)
        time.sleep(0.5)  # and fetched their buffered events
        for turn in range(3):
            cached, _ = _cached(client, f"{prefix} again {turn}")
            assert cached > 0
    finally:
        late.stop()


def _health(url: str) -> list[int]:
    return httpx.get(f"{url}/health").json().get("instances", [])


def test_approximate_mode_routes_by_its_own_decisions(tmp_path: Path, smollm2: str) -> None:
    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker", engines=[MOCKER, MOCKER, MOCKER],
                            frontend_args=["--router-mode", "kv", "--no-router-kv-events"])
    try:
        client = deployment.client()
        for n in range(4):
            prefix = _conversation(200 + n)
            _cached(client, prefix)
            for turn in range(2):
                cached, _ = _cached(client, f"{prefix} next {turn}")
                assert cached > 0
        assert "dynamo_component_kv_cache_events_applied_total{" not in deployment.metrics()  # no events used
    finally:
        deployment.stop()


def test_prefill_workers_are_chosen_by_cached_prefix(tmp_path: Path, smollm2: str) -> None:
    """Disaggregated: the prefill worker that computed a prefix gets the follow-ups (its cache hits come
    back in usage through the decode worker)."""
    prefill = [*MOCKER, "--disaggregation-mode", "prefill", "--kv-transfer-bandwidth", "0"]
    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker",
                            engines=[[*MOCKER, "--disaggregation-mode", "decode"], prefill, prefill],
                            frontend_args=["--router-mode", "kv"], instances=1)
    try:
        client = deployment.client()
        time.sleep(1.0)  # the frontend's model watcher picks up the prefill workers
        for n in range(4):
            prefix = _conversation(400 + n)
            _cached(client, prefix)
            for turn in range(3):
                cached, _ = _cached(client, f"{prefix} then {turn}")
                assert cached > 0, (n, turn)  # round robin over the 2 prefill workers would miss half
    finally:
        deployment.stop()


async def test_recent_decisions_count_until_the_events_arrive(runtimes, namespace) -> None:  # type: ignore[no-untyped-def]
    """No KV event has arrived yet (none will here): the predicted side index still sends a follow-up to
    the worker just chosen for its prefix; with --router-predicted-ttl-secs 0 it is a coin toss."""
    from tandem.router.config import KvRouterConfig
    from tandem.router.kv_router import KvRouter

    workers = {i: f"{namespace}.backend.generate" for i in range(1, 9)}
    prompt = list(range(100, 100 + 10 * BLOCK))
    for ttl, expect_same in ((5.0, True), (0.0, False)):
        router = KvRouter(await runtimes(), "m", block_size=BLOCK,
                          config=KvRouterConfig(predicted_ttl_secs=ttl))
        router.sync_workers(workers)
        chosen = set()
        for n in range(8):
            worker, _ = router.select(f"r{n}", prompt + [n], sorted(workers))
            router.free(f"r{n}")
            chosen.add(worker)
        assert (len(chosen) == 1) == expect_same, (ttl, chosen)


async def test_data_parallel_ranks_are_separate_candidates(runtimes, namespace) -> None:  # type: ignore[no-untyped-def]
    """Each dp rank of a data-parallel worker has its own cache and load: a prompt goes back to the
    rank that holds it, other prompts fill the idle ranks, and a request naming a rank stays on it."""
    from tandem.router.config import KvRouterConfig
    from tandem.router.kv_router import KvRouter

    router = KvRouter(await runtimes(), "m", block_size=BLOCK, config=KvRouterConfig(use_kv_events=False))
    router.sync_workers({7: f"{namespace}.backend.generate", 9: f"{namespace}.backend.generate"}, {7: 2})
    assert router.candidate_ranks([7, 9]) == [(7, 0), (7, 1), (9, 0)]
    prompts = [list(range(1000 * n, 1000 * n + 8 * BLOCK)) for n in range(3)]
    placed = [router.select(f"r{n}", p, [7, 9])[0] for n, p in enumerate(prompts)]
    assert sorted(placed) == [(7, 0), (7, 1), (9, 0)]  # three prompts, three idle ranks
    for n in range(3):
        router.free(f"r{n}")
    again, overlap = router.select("again", prompts[1] + [5], [7, 9])
    assert again == placed[1] and overlap == 8
    router.free("again")
    assert router.select("pinned", prompts[1], [7, 9], dp_rank=1)[0] == (7, 1)  # only worker 7 has rank 1
    with pytest.raises(ValueError, match="rank 5"):
        router.select("bad", prompts[0], [7, 9], dp_rank=5)


def test_data_parallel_worker_ranks_are_routed_by_their_own_caches(tmp_path: Path, smollm2: str) -> None:
    """One mocker worker with 4 dp ranks: each rank has its own cache (a prompt cached on rank 2 misses
    on rank 3), and the KV router sends a prompt to the rank holding it, named in routing.dp_rank."""
    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker",
                            engines=[[*MOCKER, "--data-parallel-size", "4"]], frontend_args=["--router-mode", "kv"])
    try:
        client = deployment.client()

        def cached(prompt: str, rank: int | None = None) -> int:
            headers = {"x-dynamo-dp-rank": str(rank)} if rank is not None else None
            reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_headers=headers)
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            return reply.usage.prompt_tokens_details.cached_tokens or 0

        first, second = _conversation(500), _conversation(501)
        assert cached(first, rank=2) == 0
        assert cached(first, rank=2) > 0
        assert cached(first, rank=3) == 0  # another rank, another cache
        assert cached(second, rank=1) == 0
        time.sleep(0.5)  # the rank's KV events reach the router
        for turn in range(4):  # only rank 1 holds it: a router blind to ranks would miss 3 times in 4
            assert cached(f"{second} turn {turn}") > 0, turn
    finally:
        deployment.stop()
