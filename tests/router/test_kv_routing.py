"""KV-aware routing end to end: a frontend with `--router-mode kv` in front of mocker workers (real
processes, real KV events, the official openai client). Cached tokens in usage say where a prompt's
prefix was found.

The routing tests run twice: `events-only` (`--router-predicted-ttl-secs 0`: only the workers' KV
events tell the router where a prefix is cached, so these runs prove the event path; each waits until
the frontend has applied every event the workers emitted before it relies on them) and
`with-predicted` (the router also counts its own recent decisions, so follow-ups sent at once hit).
`test_follow_ups_miss_when_kv_events_are_lost` is the control: the same traffic, events lost (and the
router's catch-up of quiet workers off)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.deployment import KV_EVENTS_APPLIED, MODEL, Deployment, metric_sum, wait_for_kv_events
from tests.support.processes import TandemProcess

BLOCK = 16
MOCKER = ["--block-size", str(BLOCK), "--speedup-ratio", "100"]
HITS = "dynamo_component_router_estimated_hit_blocks_total"
GAPS = "dynamo_router_event_gaps_recovered_total"
EVENTS_ONLY = "events-only"


def _conversation(n: int) -> str:
    return f"conversation {n}: " + " ".join(f"topic{n}-{i}" for i in range(120))


def _cached(client: openai.OpenAI, prompt: str, max_tokens: int = 2, **options: object) -> tuple[int, int]:
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, **options)  # type: ignore[call-overload]
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens or 0, reply.usage.prompt_tokens


def _shared_blocks(prefix_tokens: int) -> int:
    """Full blocks a follow-up shares with its prefix of `prefix_tokens` (the prefix's last token may
    merge with what follows it)."""
    return (prefix_tokens - 1) // BLOCK


def _router_args(routing: str) -> list[str]:
    return ["--router-mode", "kv", "--router-predicted-ttl-secs", "0" if routing == EVENTS_ONLY else "5"]


@pytest.fixture(scope="module", params=[EVENTS_ONLY, "with-predicted"])
def routing(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def kv_deployment(tmp_path_factory: pytest.TempPathFactory, smollm2: str, routing: str) -> Iterator[Deployment]:
    deployment = Deployment(tmp_path_factory.mktemp("kv"), smollm2, engine_module="tandem.mocker",
                            engines=[MOCKER, MOCKER, MOCKER], frontend_args=_router_args(routing))
    yield deployment
    deployment.stop()


def test_requests_sharing_a_prefix_go_where_it_is_cached(kv_deployment: Deployment, routing: str) -> None:
    client = kv_deployment.client()
    hits_before = metric_sum(kv_deployment.metrics(), HITS)
    expected_hits = 0
    for n in range(6):
        prefix = _conversation(n)
        cached, prefix_tokens = _cached(client, prefix)
        assert cached == 0
        if routing == EVENTS_ONLY:
            kv_deployment.wait_for_kv_events()  # the router knows the prefix from the worker's events alone
        for turn in range(3):
            cached, prompt_tokens = _cached(client, f"{prefix} follow-up {turn}")
            # Round robin over 3 workers would miss the cache on 2 of 3 follow-ups.
            assert cached >= _shared_blocks(prefix_tokens) * BLOCK, (n, turn, cached, prompt_tokens)
            expected_hits += _shared_blocks(prefix_tokens)
    metrics = kv_deployment.metrics()
    assert metric_sum(metrics, "dynamo_router_decision_seconds_count") >= 6 * 4
    # The router expected those hits (first requests: none; each follow-up: at least the shared blocks).
    assert metric_sum(metrics, HITS) - hits_before >= expected_hits
    emitted = kv_deployment.wait_for_kv_events()
    assert emitted > 0 and metric_sum(kv_deployment.metrics(), KV_EVENTS_APPLIED) == emitted  # each one once
    assert metric_sum(metrics, GAPS) == 0


def test_a_new_frontend_learns_what_workers_already_cache(kv_deployment: Deployment, routing: str) -> None:
    """A frontend that starts after the blocks were stored reads each worker's buffered events."""
    prefix = _conversation(100)
    assert _cached(kv_deployment.client(), prefix)[0] == 0
    late = TandemProcess("tandem.frontend", "--http-host", "127.0.0.1", "--http-port", "0",
                         "--discovery-backend", "file", *_router_args(routing), env=kv_deployment.env)
    try:
        url = late.ready[0]
        kv_deployment.wait_for_instances(3, url=url)
        emitted = kv_deployment.kv_events_emitted()
        wait_for_kv_events(url, emitted)  # the dump of every worker's buffer, no live event
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        for turn in range(3):
            cached, _ = _cached(client, f"{prefix} again {turn}")
            assert cached > 0, turn
    finally:
        late.stop()


def test_follow_ups_miss_when_kv_events_are_lost(tmp_path: Path, smollm2: str) -> None:
    """The events-only runs' control: the workers' KV events are all lost on the way
    (DYN_MOCKER_DROP_KV_EVENTS=1) and nothing else tells the router where a prefix is (its catch-up of
    quiet workers is off): it expects no hit, and a follow-up lands on the worker caching its prefix only
    by chance (1 in 3)."""
    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker", engines=[MOCKER, MOCKER, MOCKER],
                            env={"DYN_ROUTER_EVENT_CATCH_UP_SECS": "0"},
                            engine_env={"DYN_MOCKER_DROP_KV_EVENTS": "1"}, frontend_args=_router_args(EVENTS_ONLY))
    try:
        client = deployment.client()
        hits = 0
        for n in range(10):
            prefix = _conversation(300 + n)
            _cached(client, prefix)
            hits += _cached(client, f"{prefix} follow-up")[0] > 0
        metrics = deployment.metrics()
        assert deployment.kv_events_emitted() >= 10  # stored blocks the workers would tell a router about
        assert metric_sum(metrics, KV_EVENTS_APPLIED) == 0
        assert metric_sum(metrics, HITS) == 0
        assert hits < 10  # all 10 by chance: 1 in 59049
    finally:
        deployment.stop()


def test_a_quiet_workers_lost_kv_events_are_caught_up(tmp_path: Path, smollm2: str) -> None:
    """Every KV event is lost on the way, as the last ones of a burst are while a subscription still
    connects, and no later event reveals a gap: the router asks each worker quiet for
    DYN_ROUTER_EVENT_CATCH_UP_SECS for what it emitted since, and routes follow-ups by that."""
    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker", engines=[MOCKER, MOCKER, MOCKER],
                            env={"DYN_ROUTER_EVENT_CATCH_UP_SECS": "0.2"},
                            engine_env={"DYN_MOCKER_DROP_KV_EVENTS": "1"}, frontend_args=_router_args(EVENTS_ONLY))
    try:
        client = deployment.client()
        prefixes = [_conversation(400 + n) for n in range(6)]
        prefix_tokens = [_cached(client, prefix)[1] for prefix in prefixes]
        assert deployment.wait_for_kv_events() >= len(prefixes)  # none arrived live: all caught up
        assert metric_sum(deployment.metrics(), GAPS) >= 1
        for prefix, tokens in zip(prefixes, prefix_tokens, strict=True):
            cached, _ = _cached(client, f"{prefix} follow-up")
            assert cached >= _shared_blocks(tokens) * BLOCK, prefix[:16]
    finally:
        deployment.stop()


def test_lost_kv_events_are_fetched_from_the_worker(tmp_path: Path, smollm2: str) -> None:
    """Gap recovery: one worker's event plane loses every second KV event (DYN_MOCKER_DROP_KV_EVENTS=2).
    At the next event the router sees the gap in event ids, fetches the missing ones from the worker's
    `worker_kv_indexer_query` endpoint and routes by them (no predicted index: nothing else tells it)."""
    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker", engines=[MOCKER, MOCKER],
                            frontend_args=_router_args(EVENTS_ONLY))
    try:
        lossy = int(deployment.add_engine(*MOCKER, env={"DYN_MOCKER_DROP_KV_EVENTS": "2"}).ready[0], 16)
        deployment.wait_for_instances(3)
        client = deployment.client()
        prefixes = [_conversation(600 + n) for n in range(4)]
        # Pinned to the lossy worker, with max_tokens 1 (no generated token is fed back): one stored event
        # per prompt, ids 0-4; 1 and 3 (the 2nd and 4th prompts) are lost, the last prompt reveals the 2nd gap.
        prefix_tokens = [_cached(client, prompt, max_tokens=1, extra_headers={"x-worker-instance-id": str(lossy)})[1]
                         for prompt in [*prefixes, _conversation(699)]]
        assert deployment.wait_for_kv_events() == 5  # 3 received, 2 fetched
        metrics = deployment.metrics()
        assert metric_sum(metrics, GAPS) == 2
        assert metric_sum(metrics, KV_EVENTS_APPLIED) == 5
        for n, prefix in enumerate(prefixes):
            hits = metric_sum(deployment.metrics(), HITS)
            cached, _ = _cached(client, f"{prefix} follow-up")
            assert cached >= _shared_blocks(prefix_tokens[n]) * BLOCK, n  # on the lossy worker
            assert metric_sum(deployment.metrics(), HITS) - hits >= _shared_blocks(prefix_tokens[n]), n
    finally:
        deployment.stop()


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


def test_prefill_workers_are_chosen_by_cached_prefix(tmp_path: Path, smollm2: str, routing: str) -> None:
    """Disaggregated: the prefill worker that computed a prefix gets the follow-ups (its cache hits come
    back in usage through the decode worker)."""
    prefill = [*MOCKER, "--disaggregation-mode", "prefill", "--kv-transfer-bandwidth", "0"]
    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker",
                            engines=[[*MOCKER, "--disaggregation-mode", "decode"], prefill, prefill],
                            frontend_args=_router_args(routing), instances=1)
    try:
        deployment.wait_for_instances(2, kind="prefill_instances")
        client = deployment.client()
        for n in range(4):
            prefix = _conversation(400 + n)
            _cached(client, prefix)
            if routing == EVENTS_ONLY:
                deployment.wait_for_kv_events("prefill", instances=2)  # decode workers publish none
            for turn in range(3):
                cached, _ = _cached(client, f"{prefix} then {turn}")
                assert cached > 0, (n, turn)  # round robin over the 2 prefill workers would miss half
        metrics = deployment.metrics()
        assert metric_sum(metrics, "dynamo_frontend_remote_prefills_total", outcome="ok") == 4 * 4
        assert metric_sum(metrics, HITS) > 0
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
            with router.select(f"r{n}", prompt + [n], sorted(workers)) as routed:
                chosen.add(routed.decision.worker)
        assert (len(chosen) == 1) == expect_same, (ttl, chosen)


def _counting(handler):  # type: ignore[no-untyped-def]
    """The worker's `worker_kv_indexer_query` handler, and the number of times routers asked it (a list of
    one int, counted as they ask)."""
    asked = [0]

    async def counting(request, context=None):  # type: ignore[no-untyped-def]
        asked[0] += 1
        async for answer in handler(request, context):
            yield answer

    return counting, asked


async def _router_of_a_lossy_worker(runtimes, namespace: str, lost: set[int],  # type: ignore[no-untyped-def]
                                    catch_up_secs: float = 0.0):
    """A KV router (events only; its catch-up of quiet workers every `catch_up_secs`, 0 = off) following
    one in-process worker whose KV events with ids in `lost` never reach it. The worker has published
    event 0 (block hash 0, tokens hash 100) and the router applied it. Returns the router, the worker's
    event publisher, `value(metric name)` and the number of times the router asked the worker for events."""
    from prometheus_client import CollectorRegistry

    from tandem.router.config import KvRouterConfig
    from tandem.router.kv_router import KvRouter, RouterMetrics
    from tandem.router.protocols import KV_EVENT_TOPIC, WORKER_KV_INDEXER_QUERY_ENDPOINT
    from tandem.router.publisher import KvEventPublisher, indexer_query_handler

    runtime = await runtimes()
    component = runtime.namespace(namespace).component("backend")
    plane = await component.event_publisher(KV_EVENT_TOPIC)

    class Lossy:
        def publish(self, event: dict) -> bool:
            return event["event"]["event_id"] not in lost and plane.publish(event)

    events = KvEventPublisher(worker_id=runtime.instance_id, publisher=Lossy())
    handler, asked = _counting(indexer_query_handler([events]))
    await component.endpoint(WORKER_KV_INDEXER_QUERY_ENDPOINT).start_serving(handler)
    registry = CollectorRegistry()
    router = KvRouter(runtime, "m", block_size=BLOCK, metrics=RouterMetrics(registry),
                      config=KvRouterConfig(predicted_ttl_secs=0, event_catch_up_secs=catch_up_secs))
    router.sync_workers({runtime.instance_id: f"{namespace}.backend.generate"})

    def value(name: str) -> float:
        return registry.get_sample_value(name, {"model": "m"}) or 0.0

    events.emit(_stored(None, 0))
    first = events.query(0, 0)[0][0]
    # PUB/SUB loses what precedes the subscription: again until the router has had it live. Applied alone is
    # not enough: its dump of the worker it just saw may apply event 0 before the subscription connects, and
    # the test's next events would then be lost on the way.
    async with asyncio.timeout(10):
        while not value(KV_EVENTS_APPLIED) or (runtime.instance_id, 0) not in router._live_at:
            plane.publish(first)
            await asyncio.sleep(0.01)
    return router, events, value, asked


def _stored(parent: int | None, n: int):  # type: ignore[no-untyped-def]
    """A stored event of block `n` (block hash n, tokens hash 100 + n) under block `parent`."""
    from tandem.router.protocols import KvBlock, KvCacheEventData, KvStored

    return KvCacheEventData(stored=KvStored(parent, [KvBlock(block_hash=n, tokens_hash=100 + n)]))


async def _until(value, name: str, count: float) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(10):
        while value(name) < count:
            await asyncio.sleep(0.01)


async def test_applied_counts_each_event_once_fetched_ones_too(runtimes, namespace) -> None:  # type: ignore[no-untyped-def]
    """dynamo_component_kv_cache_events_applied_total: a live event once however often it arrives, an
    event fetched to fill a gap too; dynamo_router_event_gaps_recovered_total counts the gap."""
    router, events, value, _ = await _router_of_a_lossy_worker(runtimes, namespace, lost={1})
    duplicate = events.query(0, 0)[0][0]
    for _ in range(3):
        events.publisher.publish(duplicate)
    events.emit(_stored(None, 1))  # lost: a gap
    events.emit(_stored(None, 2))
    await _until(value, KV_EVENTS_APPLIED, 3)
    assert value(GAPS) == 1
    worker = (events.worker_id, 0)
    assert [router.indexer.find_matches([100 + n]).scores for n in range(3)] == [{worker: 1}] * 3
    events.publisher.publish(duplicate)  # a late one
    events.emit(_stored(None, 3))
    await _until(value, KV_EVENTS_APPLIED, 4)
    assert value(KV_EVENTS_APPLIED) == 4 and value(GAPS) == 1


async def test_blocks_stored_under_a_lost_block_are_indexed_after_the_recovery(runtimes, namespace) -> None:  # type: ignore[no-untyped-def]
    """A conversation's next turn stores blocks under the prefix whose event was lost."""
    router, events, value, _ = await _router_of_a_lossy_worker(runtimes, namespace, lost={1})
    events.emit(_stored(0, 1))  # lost
    events.emit(_stored(1, 2))  # reveals the gap
    await _until(value, GAPS, 1)
    assert router.indexer.find_matches([100, 101, 102]).scores == {(events.worker_id, 0): 3}


async def test_the_last_lost_event_of_a_quiet_worker_is_caught_up(runtimes, namespace) -> None:  # type: ignore[no-untyped-def]
    """No later event reveals the lost one: the router asks the quiet worker for what followed the
    last event it saw, applies it once, and counts the recovery."""
    router, events, value, asked = await _router_of_a_lossy_worker(runtimes, namespace, lost={1},
                                                                   catch_up_secs=0.05)
    events.emit(_stored(0, 1))  # lost, and the worker stays quiet
    await _until(value, KV_EVENTS_APPLIED, 2)
    assert router.indexer.find_matches([100, 101]).scores == {(events.worker_id, 0): 2}
    assert value(GAPS) == 1
    events.emit(_stored(1, 2))  # arrives live: no gap, nothing fetched again
    await _until(value, KV_EVENTS_APPLIED, 3)
    rounds = asked[0] + 3
    async with asyncio.timeout(10):
        while asked[0] < rounds:  # three catch-up rounds that find nothing new
            await asyncio.sleep(0.01)
    assert value(KV_EVENTS_APPLIED) == 3 and value(GAPS) == 1


async def test_data_parallel_ranks_are_separate_candidates(runtimes, namespace) -> None:  # type: ignore[no-untyped-def]
    """Each dp rank of a data-parallel worker has its own cache and load: a prompt goes back to the
    rank that holds it, other prompts fill the idle ranks, and a request naming a rank stays on it."""
    from tandem.router.config import KvRouterConfig
    from tandem.router.kv_router import KvRouter

    router = KvRouter(await runtimes(), "m", block_size=BLOCK, config=KvRouterConfig(use_kv_events=False))
    router.sync_workers({7: f"{namespace}.backend.generate", 9: f"{namespace}.backend.generate"}, {7: 2})
    assert router.candidate_ranks([7, 9]) == [(7, 0), (7, 1), (9, 0)]
    prompts = [list(range(1000 * n, 1000 * n + 8 * BLOCK)) for n in range(3)]
    routed = [router.select(f"r{n}", p, [7, 9]) for n, p in enumerate(prompts)]
    placed = [r.decision.worker for r in routed]
    assert sorted(placed) == [(7, 0), (7, 1), (9, 0)]  # three prompts, three idle ranks
    for r in routed:
        r.free()
    with router.select("again", prompts[1] + [5], [7, 9]) as again:
        assert again.decision.worker == placed[1] and again.decision.overlap_blocks == 8
    assert router.select("pinned", prompts[1], [7, 9], dp_rank=1).decision.worker == (7, 1)  # only 7 has rank 1
    with pytest.raises(ValueError, match="rank 5"):
        router.select("bad", prompts[0], [7, 9], dp_rank=5)


async def test_a_routed_request_counts_as_load_until_freed_once(runtimes, namespace) -> None:  # type: ignore[no-untyped-def]
    """The lifecycle object: its prompt is load until the first tokens, its blocks until it is freed; a
    second `free()` of an old one (a migrated request is routed again under the same id) frees nothing."""
    from tandem.router.config import KvRouterConfig
    from tandem.router.kv_router import KvRouter

    router = KvRouter(await runtimes(), "m", block_size=BLOCK, config=KvRouterConfig(use_kv_events=False))
    router.sync_workers({7: f"{namespace}.backend.generate"})
    prompt = list(range(4 * BLOCK))
    first = router.select("r", prompt, [7])
    decision = first.decision
    assert (decision.worker, decision.overlap_blocks, decision.load.active_prefill_tokens) == ((7, 0), 0, 0)
    assert decision.cost > 0 and decision.hashes.tokens == len(prompt) and len(decision.hashes.local) == 4
    assert router.sequences.active_prefill_tokens((7, 0)) == len(prompt)
    first.tokens_arrived()
    first.tokens_arrived()
    assert router.sequences.active_prefill_tokens((7, 0)) == 0 and "r" in router.sequences
    first.free()
    assert "r" not in router.sequences
    with router.select("r", prompt + [1], [7]) as again:  # the same id, routed again
        assert again.decision.overlap_blocks == 4  # its own earlier decision, in approximate mode
        first.free()
        assert "r" in router.sequences
    assert "r" not in router.sequences


def test_data_parallel_worker_ranks_are_routed_by_their_own_caches(tmp_path: Path, smollm2: str, routing: str) -> None:
    """One mocker worker with 4 dp ranks: each rank has its own cache (a prompt cached on rank 2 misses
    on rank 3), and the KV router sends a prompt to the rank holding it, named in routing.dp_rank."""
    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker",
                            engines=[[*MOCKER, "--data-parallel-size", "4"]], frontend_args=_router_args(routing))
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
        if routing == EVENTS_ONLY:
            deployment.wait_for_kv_events()  # every rank's events
        for turn in range(4):  # only rank 1 holds it: a router blind to ranks would miss 3 times in 4
            assert cached(f"{second} turn {turn}") > 0, turn
    finally:
        deployment.stop()


async def _durable_worker(runtime, namespace: str, dropped: set[int] = frozenset()):  # type: ignore[no-untyped-def]
    """A worker publishing KV events durably (those in `dropped` never reach the stream), and the number of
    times routers asked it for its events."""
    from tandem.router.protocols import KV_EVENT_TOPIC, WORKER_KV_INDEXER_QUERY_ENDPOINT
    from tandem.router.publisher import KvEventPublisher, indexer_query_handler

    component = runtime.namespace(namespace).component("backend")
    plane = await component.event_publisher(KV_EVENT_TOPIC, durable=True)

    class Filtered:
        def publish(self, event: dict) -> bool:
            return event["event"]["event_id"] not in dropped and plane.publish(event)

    events = KvEventPublisher(worker_id=runtime.instance_id, publisher=Filtered())
    handler, asked = _counting(indexer_query_handler([events]))
    await component.endpoint(WORKER_KV_INDEXER_QUERY_ENDPOINT).start_serving(handler)
    return events, asked


async def _until_in_the_stream(runtime, namespace: str, count: int) -> None:  # type: ignore[no-untyped-def]
    """Until JetStream holds `count` KV events of the namespace's workers (acknowledged: in their order)."""
    from tandem.router.protocols import KV_EVENT_TOPIC
    from tandem.runtime.event_plane.nats import event_subject, stream_name

    js = runtime.nats.nc.jetstream()
    name = stream_name(event_subject(f"{namespace}/backend", KV_EVENT_TOPIC))
    async with asyncio.timeout(15):
        while (await js.stream_info(name)).state.messages < count:
            await asyncio.sleep(0.02)


def _durable_router(runtime):  # type: ignore[no-untyped-def]
    from prometheus_client import CollectorRegistry

    from tandem.router.config import KvRouterConfig
    from tandem.router.kv_router import KvRouter, RouterMetrics

    return KvRouter(runtime, "m", block_size=BLOCK, metrics=RouterMetrics(CollectorRegistry()),
                    config=KvRouterConfig(predicted_ttl_secs=0, durable_kv_events=True))


async def _until_indexed(router, worker_id: int, blocks: int) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(15):
        while router.indexer.find_matches([100 + n for n in range(blocks)]).scores.get((worker_id, 0)) != blocks:
            await asyncio.sleep(0.02)


async def test_durable_router_replays_workers_from_jetstream_even_before_discovery_lists_them(
        runtimes, namespace, request) -> None:  # type: ignore[no-untyped-def]
    """A router started after two workers published: everything comes from the streams, nothing from the
    workers; the second worker's events, replayed before discovery listed it, wait for it."""
    from tests.support.runtimes import runtimes_on

    on_nats = runtimes_on(runtimes, request, event_plane="nats")
    workers = [await on_nats(), await on_nats(), await on_nats()]
    published = []
    for worker in workers[:2]:
        events, asked = await _durable_worker(worker, namespace)
        for n in range(5):
            events.emit(_stored(n - 1 if n else None, n))
        published.append((events, asked))
    await _until_in_the_stream(workers[0], namespace, 10)
    marker, _ = await _durable_worker(workers[2], namespace)  # its one event is in the stream after all ten
    marker.emit(_stored(None, 0))
    router = _durable_router(await on_nats())
    first, second, third = (worker.instance_id for worker in workers)
    router.sync_workers({first: f"{namespace}.backend.generate", third: f"{namespace}.backend.generate"})
    await _until_indexed(router, first, 5)
    await _until_indexed(router, third, 1)  # so the second worker's events have been replayed too, and kept
    router.sync_workers({worker.instance_id: f"{namespace}.backend.generate" for worker in workers})
    await _until_indexed(router, second, 5)
    assert [asked[0] for _, asked in published] == [0, 0]


async def test_durable_router_asks_the_worker_for_what_the_stream_lacks(runtimes, namespace, request) -> None:  # type: ignore[no-untyped-def]
    """A worker whose first events are not in its stream: the router takes them from the worker's buffer."""
    from tests.support.runtimes import runtimes_on

    on_nats = runtimes_on(runtimes, request, event_plane="nats")
    worker = await on_nats()
    events, asked = await _durable_worker(worker, namespace, dropped={0, 1})
    for n in range(5):
        events.emit(_stored(n - 1 if n else None, n))
    router = _durable_router(await on_nats())
    router.sync_workers({worker.instance_id: f"{namespace}.backend.generate"})
    await _until_indexed(router, worker.instance_id, 5)
    assert asked[0] == 1
