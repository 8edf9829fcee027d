"""The KV-aware router of one model: pick the worker whose cache holds the longest
prefix of a request, weighed against the load this router has put on each worker.

* Prefix index: fed by the workers' KV events on their components' `kv-events` topics (event ids
  checked per worker; a gap is filled from the worker's `worker_kv_indexer_query` ring buffer, a
  worker that appears is dumped the same way, and a worker quiet for `event_catch_up_secs` is asked for
  what it emitted since its last event seen), or, with `use_kv_events` off, by the router's own
  decisions with a TTL (approximate mode).
* Active sequences: the blocks and outstanding prefill tokens of the requests this router sent.
* Cost and selection: `tandem.router.selector`.
* Replica sync (`--router-replica-sync`): routers of several frontends publish their active-sequence
  changes on `active_sequences_events` and apply each other's, so their load views converge.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from tandem.router.config import KvRouterConfig
from tandem.router.hashing import (
    MediaSpan,
    local_block_hashes,
    media_block_hashes,
    request_seed,
    sequence_hashes,
)
from tandem.router.indexer import ApproxIndexer, EventGap, KvIndexer
from tandem.router.protocols import (
    KV_EVENT_TOPIC,
    WORKER_KV_INDEXER_QUERY_ENDPOINT,
    KvEventsAnswer,
    KvEventsQuery,
    RouterEvent,
    router_event_from_builtins,
)
from tandem.router.radix_tree import OverlapScores, WorkerKey
from tandem.router.selector import CostTerms, select_worker, worker_costs
from tandem.router.sequences import ActiveSequences
from tandem.router.tiers import CREDITED_TIERS, DEVICE, LOWER_TIERS, TierOverlaps
from tandem.runtime.keys import parse_endpoint_path

ACTIVE_SEQUENCES_TOPIC = "active_sequences_events"

log = logging.getLogger(__name__)

# Durable mode: replayed events kept per worker not yet in discovery, and for how long after its last one
EARLY_LIMIT = 100_000
EARLY_KEEP = 30.0

_OVERLAP_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_DECISION_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 50e-3)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        labels = ["model"]
        self.decision_seconds = Histogram("dynamo_router_decision_seconds", "Time to choose a worker",
                                          labels, buckets=_DECISION_BUCKETS, registry=registry)
        self.overlap_blocks = Histogram("dynamo_component_router_overlap_blocks",
                                        "Prefix blocks already cached on the chosen worker", labels,
                                        buckets=_OVERLAP_BUCKETS, registry=registry)
        self.prompt_blocks = Counter("dynamo_component_router_prompt_blocks",
                                     "Full prompt blocks of routed requests", labels, registry=registry)
        self.hit_blocks = Counter("dynamo_component_router_estimated_hit_blocks",
                                  "Prompt blocks estimated to hit the chosen worker's cache", labels, registry=registry)
        self.tier_hit_blocks = Counter("dynamo_router_tier_hit_blocks",
                                       "Prompt blocks the chosen worker holds, continuing its device match, in a "
                                       "lower tier (host_pinned, disk)", labels + ["tier"], registry=registry)
        self.tier_credit_blocks = Counter("dynamo_router_tier_credit_blocks",
                                          "Prefill blocks credited to the chosen worker for its cached prompt "
                                          "blocks, per tier (device, host_pinned, disk)", labels + ["tier"],
                                          registry=registry)
        self.events_applied = Counter("dynamo_component_kv_cache_events_applied",
                                      "KV cache events applied to the router's index (live, or fetched from a "
                                      "worker: a gap, or the dump of a worker just seen)", labels, registry=registry)
        self.gaps_recovered = Counter("dynamo_router_event_gaps_recovered",
                                      "Missing KV event ranges fetched from workers", labels, registry=registry)
        self._load_views: list[KvRouter] = []
        if registry is not None:
            registry.register(_WorkerLoadCollector(self._load_views))

    def watch_load(self, router: KvRouter) -> None:
        """Export the load `router` sees on each worker (its own requests, and with replica sync the
        other routers' too) at every scrape."""
        self._load_views.append(router)


class _WorkerLoadCollector:
    """Gauges read from the routers' active sequences when /metrics is scraped."""

    def __init__(self, routers: list[KvRouter]) -> None:
        self.routers = routers

    def describe(self) -> list[Any]:
        return []  # names are only known at collect time; nothing to check at registration

    def collect(self) -> Any:
        labels = ["model", "worker_id", "dp_rank"]
        blocks = GaugeMetricFamily("dynamo_router_worker_active_blocks",
                                   "KV blocks of the requests in flight on a worker, as this router sees them",
                                   labels=labels)
        prefill = GaugeMetricFamily("dynamo_router_worker_active_prefill_tokens",
                                    "Prompt tokens waiting for prefill on a worker, as this router sees them",
                                    labels=labels)
        for router in self.routers:
            for worker in router.worker_ranks():
                values = [router.model, str(worker[0]), str(worker[1])]
                blocks.add_metric(values, router.sequences.active_blocks(worker))
                prefill.add_metric(values, router.sequences.active_prefill_tokens(worker))
        yield blocks
        yield prefill


@dataclass(frozen=True)
class PromptHashes:
    """A prompt's block hashes for one block size and seed (LoRA, cache salt): computed once per request
    and shared by its prefill and decode routing."""

    tokens: int  # prompt length they were computed for (with its images' tokens)
    local: list[int]  # each full block's tokens
    sequence: list[int]  # each block chained to its prefix
    added: int = 0  # tokens the engine adds to the prompt it is sent (its images' expansion)


@dataclass(frozen=True)
class RoutingDecision:
    """Where the router sends a request, and why: the chosen worker's cost terms."""

    worker_id: int
    dp_rank: int
    overlap_blocks: int  # prompt blocks the worker has cached
    load: CostTerms  # the worker's terms as the cost saw them
    cost: float
    hashes: PromptHashes
    config: KvRouterConfig  # with the request's overrides
    scores: OverlapScores  # every candidate's cached blocks
    tiers: TierOverlaps | None = None  # every candidate's blocks continuing them in host memory and on disk

    @property
    def worker(self) -> WorkerKey:
        return self.worker_id, self.dp_rank

    def report(self) -> dict[str, Any]:
        """The decision as an answer's `nvext.routing` shows it: the chosen worker, its cost, its cached prompt
        blocks per tier and the prefill blocks each tier was credited (before any load decay)."""
        load = self.load
        return {
            "worker_id": self.worker_id, "dp_rank": self.dp_rank, "cost": self.cost,
            "prompt_blocks": len(self.hashes.local),
            "cached_blocks": dict(zip(CREDITED_TIERS, (load.overlap_blocks, load.host_blocks, load.disk_blocks),
                                      strict=True)),
            "credit_blocks": dict(zip(CREDITED_TIERS, load.tier_credits(self.config), strict=True)),
        }


class RoutedRequest:
    """A request the router counts as load on its worker, from selection to its end. `tokens_arrived()`
    on an output with tokens (the first ends its prefill); `free()` at the end, or leave the `with`
    block. Both may be called again: only the first call counts."""

    __slots__ = ("router", "request_id", "decision", "_prefilling", "_freed")

    def __init__(self, router: KvRouter, request_id: str, decision: RoutingDecision) -> None:
        self.router = router
        self.request_id = request_id
        self.decision = decision
        self._prefilling = True
        self._freed = False

    def tokens_arrived(self) -> None:
        if self._prefilling:
            self._prefilling = False
            self.router._prefill_done(self.request_id)

    def free(self) -> None:
        if not self._freed:
            self._freed = True
            self.router._free(self.request_id)

    def __enter__(self) -> RoutedRequest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()


class KvRouter:
    """One per served model. `sync_workers` follows the model's instances (call it on every
    discovery change, on the event loop); `select` routes a request and returns the `RoutedRequest`
    that owns its load until freed. A data-parallel worker is one candidate per dp rank (`(worker_id, dp_rank)`): each rank has
    its own cache and load."""

    def __init__(self, runtime: Any, model: str, *, block_size: int, config: KvRouterConfig,
                 metrics: RouterMetrics | None = None, rng: random.Random | None = None) -> None:
        self.runtime = runtime
        self.model = model
        self.block_size = block_size
        self.config = config
        self.rng = rng or random.Random()
        self.indexer = KvIndexer()
        self.approx = ApproxIndexer(config.ttl_secs, config.max_tree_size) if not config.use_kv_events else None
        self.predicted = (ApproxIndexer(config.predicted_ttl_secs, config.max_tree_size)
                          if config.use_kv_events and config.predicted_ttl_secs > 0 else None)
        self.sequences = ActiveSequences(block_size)
        self.metrics = metrics or RouterMetrics(None)
        # this model's children of the per-request metrics, looked up once rather than per request
        self._per_request = tuple(family.labels(model) for family in (
            self.metrics.decision_seconds, self.metrics.overlap_blocks, self.metrics.prompt_blocks,
            self.metrics.hit_blocks))
        self._workers: dict[int, str] = {}  # instance id -> endpoint path
        self._dp_sizes: dict[int, int] = {}  # instance id -> data-parallel ranks it serves (default 1)
        self._subscribed: set[str] = set()  # component scopes
        self._first_live: dict[WorkerKey, int] = {}  # first event id received live, per worker and dp rank
        self._live_at: dict[WorkerKey, float] = {}  # when the last live event of each worker and dp rank came
        self._dumping: set[WorkerKey] = set()  # workers just seen whose recent events are being fetched
        self._catching_up: asyncio.Task[None] | None = None
        self._query_clients: dict[str, Any] = {}  # component scope -> its worker_kv_indexer_query client
        # Durable mode: replayed events of workers discovery has not shown yet (time of the last one, events)
        self._early: dict[int, tuple[float, list[RouterEvent]]] = {}
        # --router-replica-sync: this router's id and its publisher of active-sequence events
        self.router_id = self.rng.getrandbits(63)
        self._sync: Any = None
        self._last_sweep = time.monotonic()

    # -- workers and events --------------------------------------------------------------------
    def sync_workers(self, instances: Mapping[int, str], dp_sizes: Mapping[int, int] | None = None) -> None:
        """The model's current instances (id -> `ns.component.endpoint`) and, for data-parallel ones,
        their number of dp ranks."""
        self._dp_sizes = {w: max(int(n), 1) for w, n in (dp_sizes or {}).items() if w in instances}
        for worker_id in set(self._workers) - set(instances):
            self.indexer.remove_worker(worker_id)
            for side in (self.approx, self.predicted):
                if side is not None:
                    side.remove_worker(worker_id)
            self.sequences.remove_worker(worker_id)
            del self._workers[worker_id]
            for table in (self._first_live, self._live_at):
                for key in [k for k in table if k[0] == worker_id]:
                    del table[key]
            self._dumping = {key for key in self._dumping if key[0] != worker_id}
        now = time.monotonic()
        for worker_id in [w for w, (last, _) in self._early.items() if w not in instances and now - last > EARLY_KEEP]:
            del self._early[worker_id]  # gone, or a worker of another model
        for worker_id, path in instances.items():
            if worker_id in self._workers:
                continue
            self._workers[worker_id] = path
            if self.config.use_kv_events:
                namespace, component, _ = parse_endpoint_path(path)
                scope = f"{namespace}/{component}"
                if scope not in self._subscribed:
                    self._subscribed.add(scope)
                    self.runtime.spawn(self._follow_events(namespace, component))
                if self.config.durable_kv_events:  # its history comes from the stream, not from a dump
                    for event in self._early.pop(worker_id, (0.0, []))[1]:
                        self._apply_live(event)
                else:
                    for rank in range(self._dp_sizes.get(worker_id, 1)):
                        self._dumping.add((worker_id, rank))
                        self.runtime.spawn(self._recover(worker_id, None, rank))
                if self._catching_up is None and self.config.event_catch_up_secs > 0:
                    self._catching_up = self.runtime.spawn(self._catch_up_quiet_workers())
            if self.config.replica_sync:
                namespace, component, _ = parse_endpoint_path(path)
                if f"sync:{namespace}/{component}" not in self._subscribed:
                    self._subscribed.add(f"sync:{namespace}/{component}")
                    self.runtime.spawn(self._follow_replicas(namespace, component))

    async def _follow_events(self, namespace: str, component: str) -> None:
        durable = self.config.durable_kv_events
        scope = self.runtime.namespace(namespace).component(component)
        subscriber = await scope.subscribe(KV_EVENT_TOPIC, durable)
        async for raw in subscriber:
            try:
                event = router_event_from_builtins(raw)
            except Exception as e:  # a malformed event must not stop the router
                log.warning("ignoring malformed KV event from %s.%s: %s", namespace, component, e)
                continue
            if event.worker_id in self._workers:
                self._apply_live(event)
            elif durable:  # replayed before discovery listed its worker: kept for when it does
                _, early = self._early.get(event.worker_id, (0.0, []))
                if len(early) < EARLY_LIMIT:
                    early.append(event)
                self._early[event.worker_id] = (time.monotonic(), early)
            # else: not (or no longer) a worker of this model

    def _apply_live(self, event: RouterEvent) -> None:
        key = (event.worker_id, event.event.dp_rank)
        self._live_at[key] = time.monotonic()
        if key not in self._first_live:
            self._first_live[key] = event.event.event_id
            if self.config.durable_kv_events:
                # The stream replays a worker from its first event. If it lacks the first ones (aged out, or
                # published before the stream existed), they are a gap to fetch from the worker.
                self.indexer.expect_first(key)
        before = self.indexer.events_applied
        gap = self.indexer.apply_event(event)
        self.metrics.events_applied.labels(self.model).inc(self.indexer.events_applied - before)  # 0 for a duplicate
        if gap is not None:
            self.runtime.spawn(self._recover(event.worker_id, gap))

    async def _recover(self, worker_id: int, gap: EventGap | None, dp_rank: int = 0) -> None:
        """Fetch missing events from the worker's ring buffer: a gap, or everything dp rank `dp_rank`
        still has (a worker just seen)."""
        if worker_id not in self._workers:  # gone meanwhile (its index and waiting events went with it)
            return
        query = (KvEventsQuery(dp_rank=dp_rank) if gap is None
                 else KvEventsQuery(gap.first_missing, gap.last_missing, gap.worker[1]))
        answers: list[KvEventsAnswer] = []
        try:
            answers = await self._query(worker_id, query, wait=5.0)
        except Exception as e:  # unreachable, or an answer that is not one
            log.info("no KV event recovery from worker %x (%s): its index fills from new events", worker_id, e)
        events = [event for answer in answers for event in answer.events]
        if gap is None:
            # A dump: only what precedes the live events already applied (an old `removed` must not
            # undo a newer `stored`).
            events = [e for e in events
                      if e.event.event_id < self._first_live.get((e.worker_id, e.event.dp_rank), 1 << 63)]
            applied = self.indexer.apply_dump(events)
            self._dumping.discard((worker_id, dp_rank))
        else:
            applied = self.indexer.fill_gap(gap, events)  # also what waited for it (given up: that alone)
            if answers:
                self.metrics.gaps_recovered.labels(self.model).inc()
            if not answers or not all(answer.complete for answer in answers):
                log.warning("KV events %d-%d of worker %x are gone: its index may miss blocks",
                            gap.first_missing, gap.last_missing, worker_id)
        self.metrics.events_applied.labels(self.model).inc(applied)
        log.debug("applied %d KV events after a recovery from worker %x", applied, worker_id)

    async def _query(self, worker_id: int, query: KvEventsQuery, wait: float) -> list[KvEventsAnswer]:
        """`query` sent to the `worker_kv_indexer_query` endpoint of `worker_id`, waiting at most `wait`
        seconds for discovery to list that endpoint."""
        namespace, component, _ = parse_endpoint_path(self._workers[worker_id])
        scope = f"{namespace}/{component}"
        client = self._query_clients.get(scope)
        if client is None:
            endpoint = self.runtime.namespace(namespace).component(component).endpoint(WORKER_KV_INDEXER_QUERY_ENDPOINT)
            client = self._query_clients[scope] = await endpoint.client()
        await client.wait_for_instance(worker_id, wait)
        return [msgspec.convert(a, KvEventsAnswer) async for a in await client.direct(query, worker_id)]

    async def _catch_up_quiet_workers(self) -> None:
        """Every `event_catch_up_secs`, ask each worker rank no live event came from for that long for the
        events after the last one the index has. PUB/SUB loses what is published while a subscription
        still connects, and a lost event is otherwise found only at the worker's next one."""
        interval = self.config.event_catch_up_secs
        while True:
            await asyncio.sleep(interval)
            if not self._workers:  # the model is gone: the next worker to appear starts this again
                self._catching_up = None
                return
            now = time.monotonic()
            quiet = [key for key in self.worker_ranks()
                     if key not in self._dumping and now - self._live_at.get(key, 0.0) >= interval]
            await asyncio.gather(*(self._catch_up(key) for key in quiet))

    async def _catch_up(self, key: WorkerKey) -> None:
        worker_id, dp_rank = key
        last = self.indexer.last_event_id(key)
        query = KvEventsQuery(start_event_id=0 if last is None else last + 1, dp_rank=dp_rank)
        try:
            async with asyncio.timeout(10):
                answers = await self._query(worker_id, query, wait=0.0)
        except Exception as e:  # not listed (yet), unreachable, or no answer: asked again next time
            log.debug("no KV event catch-up from worker %x (%s)", worker_id, e)
            return
        if worker_id not in self._workers:
            return
        applied = self.indexer.catch_up(key, [event for answer in answers for event in answer.events])
        if applied:
            self.metrics.events_applied.labels(self.model).inc(applied)
            self.metrics.gaps_recovered.labels(self.model).inc()
            log.info("caught up %d KV events of worker %x (dp rank %d) that never arrived live", applied,
                     worker_id, dp_rank)

    # -- replica sync -----------------------------------------------------------
    async def _follow_replicas(self, namespace: str, component: str) -> None:
        """Publish this router's active-sequence changes and apply the other routers' ones."""
        scope = self.runtime.namespace(namespace).component(component)
        if self._sync is None:
            self._sync = await scope.event_publisher(ACTIVE_SEQUENCES_TOPIC)
        subscriber = await scope.subscribe(ACTIVE_SEQUENCES_TOPIC)
        async for event in subscriber:
            try:
                self._apply_replica(event)
            except (KeyError, TypeError, ValueError) as e:
                log.warning("ignoring malformed active-sequence event: %s", e)

    def _apply_replica(self, event: dict[str, Any]) -> None:
        if event["router_id"] == self.router_id:
            return
        request_id, data = str(event["request_id"]), event["data"]
        if isinstance(data, dict) and "add_request" in data:
            add = data["add_request"]
            worker = (int(event["worker"]["worker_id"]), int(event["worker"].get("dp_rank", 0)))
            self.sequences.add_request(request_id, worker, add.get("token_sequence"), int(add["isl"]),
                                       int(add["overlap"]), add.get("expected_output_tokens"))
        elif data == "mark_prefill_completed":
            self.sequences.mark_prefill_completed(request_id)
        elif data == "free":
            self.sequences.free(request_id)

    def _publish_sync(self, request_id: str, worker: WorkerKey, data: Any) -> None:
        if self._sync is not None:
            self._sync.publish({"request_id": request_id, "worker": {"worker_id": worker[0], "dp_rank": worker[1]},
                                "data": data, "router_id": self.router_id})

    # -- routing -------------------------------------------------------------------------------
    def hashes(self, token_ids: Sequence[int], *, lora_name: str | None = None, cache_salt: str | None = None,
               media: Sequence[MediaSpan] = (), added: int = 0) -> PromptHashes:
        """The block hashes of a prompt as the engine computes it: `token_ids` with its images expanded
        (`added` tokens more than the request's), `media` where each image sits in them."""
        seed = request_seed(lora_name, cache_salt)
        mm = media_block_hashes(media, len(token_ids) // self.block_size, self.block_size) if media else None
        local = local_block_hashes(token_ids, self.block_size, seed, mm_hashes=mm)
        return PromptHashes(len(token_ids), local, sequence_hashes(local), added)

    def overlaps(self, hashes: PromptHashes) -> tuple[OverlapScores, TierOverlaps | None]:
        """Per worker, the prompt blocks it holds in its pool and, once some worker reports lower tiers, those
        continuing them in host memory and on disk.

        With recent decisions predicted (`predicted_ttl_secs`), a worker's pool match is the longer of what its
        events say and what was just routed to it, unless its events reach as far on its lower tiers: then the
        prediction is older than those events (its blocks were computed, then evicted), and the events count."""
        index = self.approx if self.approx is not None else self.indexer.tree
        scores = index.find_matches(hashes.local)
        lower = self.indexer.lower
        tiers = lower.overlaps(hashes.sequence, scores.scores) if lower and self.approx is None else None
        if self.predicted is not None:
            device = scores.scores
            for worker, blocks in self.predicted.find_matches(hashes.local).scores.items():
                held = device.get(worker, 0)
                if blocks <= held:
                    continue
                if tiers is not None and held + sum(tiers.of(worker)) >= blocks:
                    continue  # the events know these blocks: on a lower tier now
                device[worker] = blocks
                if tiers is not None:
                    tiers.host.pop(worker, None)
                    tiers.disk.pop(worker, None)
        return scores, tiers

    def worker_ranks(self) -> list[WorkerKey]:
        """Every (instance, dp rank) this router routes to."""
        return self.candidate_ranks(list(self._workers))

    def candidate_ranks(self, candidates: Sequence[int], dp_rank: int | None = None) -> list[WorkerKey]:
        """Every (instance, dp rank) of `candidates`; only rank `dp_rank` when the request names one."""
        keys = [(w, rank) for w in candidates for rank in range(self._dp_sizes.get(w, 1))]
        if dp_rank is not None:
            keys = [key for key in keys if key[1] == dp_rank]
            if not keys:
                raise ValueError(f"no candidate worker has data-parallel rank {dp_rank}")
        return keys

    def best_worker(self, token_ids: Sequence[int], candidates: Sequence[int], *, lora_name: str | None = None,
                    cache_salt: str | None = None, override: Mapping[str, Any] | None = None,
                    dp_rank: int | None = None, hashes: PromptHashes | None = None,
                    session: str | None = None) -> RoutingDecision:
        """The cheapest (instance, dp rank) of `candidates` (instance ids) for this prompt; nothing is
        tracked. `hashes` (of these tokens, from `hashes()`) saves computing them again; `session`: the
        agent session the request belongs to, which breaks ties (`select_worker`)."""
        config = self.config.with_overrides(dict(override)) if override else self.config
        if hashes is None or hashes.tokens != len(token_ids) + hashes.added:
            hashes = self.hashes(token_ids, lora_name=lora_name, cache_salt=cache_salt)
        scores, tiers = self.overlaps(hashes)
        use_overlap = config.overlap_score_weight != 0
        loads = {}
        for worker in self.candidate_ranks(candidates, dp_rank):
            decode = self.sequences.active_blocks(worker)
            if config.track_active_blocks:
                decode += self.sequences.new_blocks(worker, hashes.sequence)
            terms = CostTerms(worker, scores.scores.get(worker, 0) if use_overlap else 0,
                              self.sequences.active_prefill_tokens(worker), decode,
                              self.sequences.active_requests(worker))
            if tiers is not None and use_overlap:
                terms.host_blocks, terms.disk_blocks = tiers.of(worker)
            loads[worker] = terms
        costs = worker_costs(list(loads.values()), hashes.tokens, self.block_size, config)
        chosen = select_worker(costs, config.temperature, self.rng, session)
        return RoutingDecision(chosen[0], chosen[1], loads[chosen].overlap_blocks, loads[chosen], costs[chosen],
                               hashes, config, scores, tiers)

    def select(self, request_id: str, token_ids: Sequence[int], candidates: Sequence[int], *,
               lora_name: str | None = None, cache_salt: str | None = None,
               override: Mapping[str, Any] | None = None, dp_rank: int | None = None,
               hashes: PromptHashes | None = None, session: str | None = None) -> RoutedRequest:
        """Choose among `candidates` (instance ids) and count the request as load there until the
        returned `RoutedRequest` is freed."""
        started = time.perf_counter()
        decision = self.best_worker(token_ids, candidates, lora_name=lora_name, cache_salt=cache_salt,
                                    override=override, dp_rank=dp_rank, hashes=hashes, session=session)
        chosen, overlap, config = decision.worker, decision.overlap_blocks, decision.config
        tracked_blocks = decision.hashes.sequence if config.track_active_blocks else None
        isl = decision.hashes.tokens if config.track_prefill_tokens else 0
        self.sequences.add_request(request_id, chosen, tracked_blocks, isl, overlap)
        self._publish_sync(request_id, chosen, {"add_request": {"token_sequence": tracked_blocks, "isl": isl,
                                                                "overlap": overlap}})
        for side in (self.approx, self.predicted):
            if side is not None:
                side.process_routing_decision(chosen, decision.hashes.local, decision.hashes.sequence)
        decision_seconds, overlap_blocks, prompt_blocks, hit_blocks = self._per_request
        decision_seconds.observe(time.perf_counter() - started)
        overlap_blocks.observe(overlap)
        prompt_blocks.inc(len(decision.hashes.local))
        hit_blocks.inc(overlap)
        if decision.tiers is not None:
            self._count_tiers(decision)
        self._maybe_sweep()
        return RoutedRequest(self, request_id, decision)

    def _count_tiers(self, decision: RoutingDecision) -> None:
        """The chosen worker's blocks and credit per tier (counted once some worker has lower tiers)."""
        load, model, metrics = decision.load, self.model, self.metrics
        device, host, disk = load.tier_credits(decision.config)
        metrics.tier_credit_blocks.labels(model, DEVICE).inc(device)
        for tier, held, credit in zip(LOWER_TIERS, (load.host_blocks, load.disk_blocks), (host, disk), strict=True):
            if held:
                metrics.tier_hit_blocks.labels(model, tier).inc(held)
                metrics.tier_credit_blocks.labels(model, tier).inc(credit)

    def _prefill_done(self, request_id: str) -> None:
        worker = self.sequences.request_worker(request_id)
        if worker is not None:
            self.sequences.mark_prefill_completed(request_id)
            self._publish_sync(request_id, worker, "mark_prefill_completed")

    def _free(self, request_id: str) -> None:
        worker = self.sequences.request_worker(request_id)
        if worker is not None:
            self.sequences.free(request_id)
            self._publish_sync(request_id, worker, "free")

    def _maybe_sweep(self) -> None:
        now = time.monotonic()
        if now - self._last_sweep >= 60:
            self._last_sweep = now
            stale = self.sequences.sweep(self.config.active_request_expiry_secs)
            if stale:
                log.warning("freed %d routed requests with no end seen for %.0f s", len(stale),
                            self.config.active_request_expiry_secs)
