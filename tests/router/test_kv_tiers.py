"""KV blocks below the device tier: the router's lower-tier index, per-tier credit in the cost and the
selection, the tier flags, and the worker-side consolidator (property-tested against a naive model)."""

from __future__ import annotations

import argparse
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.router.config import KvRouterConfig, add_router_args, config_from_args
from tandem.router.consolidator import KvEventConsolidator
from tandem.router.hashing import local_block_hashes, sequence_hashes
from tandem.router.indexer import KvIndexer
from tandem.router.kv_router import KvRouter, RouterMetrics
from tandem.router.protocols import (
    KvBlock,
    KvCacheEventData,
    KvRemoved,
    KvStored,
    RouterEvent,
    cleared_event,
    removed_event,
    router_event_from_builtins,
    stored_event,
    to_builtins,
)
from tandem.router.selector import CostTerms, worker_costs

B = 4
PROMPT = list(range(B * 12))  # 12 blocks
LOCAL = local_block_hashes(PROMPT, B)
SEQ = sequence_hashes(LOCAL)


def _blocks(first: int, last: int) -> list[KvBlock]:
    """Prompt blocks first..last-1, with the engine's hash = the router's sequence hash (as the mocker's)."""
    return [KvBlock(SEQ[i], LOCAL[i]) for i in range(first, last)]


class _Worker:
    """Numbered tier-tagged events of one worker, applied to an indexer."""

    def __init__(self, indexer: KvIndexer, worker_id: int) -> None:
        self.indexer, self.worker_id, self.next_id = indexer, worker_id, 0

    def store(self, tier: str, first: int, last: int) -> None:
        parent = SEQ[first - 1] if first else None
        self._send(tier, stored_event(self.next_id, parent, _blocks(first, last)))

    def remove(self, tier: str, first: int, last: int) -> None:
        self._send(tier, removed_event(self.next_id, SEQ[first:last]))

    def clear(self, tier: str) -> None:
        self._send(tier, cleared_event(self.next_id))

    def _send(self, tier: str, event: object) -> None:
        # through the wire format, as the router receives it
        wire = to_builtins(RouterEvent(self.worker_id, event, tier))  # type: ignore[arg-type]
        assert self.indexer.apply_event(router_event_from_builtins(wire)) is None
        self.next_id += 1


def _overlaps(indexer: KvIndexer) -> tuple[dict, dict, dict]:
    device = indexer.find_matches(LOCAL).scores
    tiers = indexer.lower.overlaps(SEQ, device)
    return device, tiers.host, tiers.disk


# --- the lower-tier index ---------------------------------------------------------------------------


def test_host_then_disk_continue_the_device_match() -> None:
    indexer = KvIndexer()
    worker = _Worker(indexer, 1)
    worker.store("device", 0, 3)
    worker.store("host_pinned", 3, 7)  # parent (block 2) on the device tier only
    worker.store("disk", 7, 9)  # parent on the host tier
    assert _overlaps(indexer) == ({(1, 0): 3}, {(1, 0): 4}, {(1, 0): 2})


def test_a_lower_tier_counts_only_from_where_the_match_above_stops() -> None:
    indexer = KvIndexer()
    worker = _Worker(indexer, 1)
    worker.store("host_pinned", 0, 8)  # write-through: host holds the device blocks too
    worker.store("device", 0, 5)
    worker.store("disk", 0, 10)
    # host continues the 5 device blocks with 3; disk the 8 with 2
    assert _overlaps(indexer) == ({(1, 0): 5}, {(1, 0): 3}, {(1, 0): 2})
    worker.remove("host_pinned", 6, 7)  # a hole: host stops at block 6, disk takes over there
    assert _overlaps(indexer) == ({(1, 0): 5}, {(1, 0): 1}, {(1, 0): 4})


def test_blocks_with_no_device_match_still_count_from_the_first() -> None:
    indexer = KvIndexer()
    worker = _Worker(indexer, 2)
    worker.store("host_pinned", 0, 4)
    worker.store("external", 4, 6)  # external storage is credited as disk
    assert _overlaps(indexer) == ({}, {(2, 0): 4}, {(2, 0): 2})


def test_removed_cleared_and_gone_workers_leave_the_lower_tiers() -> None:
    indexer = KvIndexer()
    a, b = _Worker(indexer, 1), _Worker(indexer, 2)
    a.store("host_pinned", 0, 6)
    b.store("host_pinned", 0, 6)
    b.store("disk", 6, 8)
    a.remove("host_pinned", 2, 4)
    assert _overlaps(indexer)[1] == {(1, 0): 2, (2, 0): 6}
    b.clear("host_pinned")  # clears that tier alone
    assert _overlaps(indexer)[1:] == ({(1, 0): 2}, {})  # b's disk blocks start at block 6: nothing from 0
    indexer.remove_worker(1)
    assert indexer.lower.num_blocks("host_pinned") == 0 and indexer.lower.num_blocks("disk") == 2


def test_a_chain_under_a_parent_no_tier_holds_is_dropped_and_counted() -> None:
    indexer = KvIndexer()
    _Worker(indexer, 1).store("host_pinned", 4, 6)
    assert indexer.lower.blocks_dropped == 2 and not indexer.lower


def test_device_clear_keeps_the_lower_tiers() -> None:
    indexer = KvIndexer()
    worker = _Worker(indexer, 1)
    worker.store("device", 0, 4)
    worker.store("host_pinned", 0, 4)
    worker.clear("device")
    assert _overlaps(indexer) == ({}, {(1, 0): 4}, {})


def test_an_unknown_storage_tier_is_a_malformed_event() -> None:
    wire = to_builtins(RouterEvent(1, stored_event(0, None, _blocks(0, 1)), "device"))
    wire["storage_tier"] = "tape"
    with pytest.raises(Exception, match="storage_tier"):
        router_event_from_builtins(wire)


def test_a_gap_filled_from_the_worker_carries_its_tiers() -> None:
    indexer = KvIndexer()
    worker = _Worker(indexer, 1)
    worker.store("device", 0, 2)
    lost = RouterEvent(1, stored_event(1, SEQ[1], _blocks(2, 5)), "host_pinned")
    live = RouterEvent(1, stored_event(2, SEQ[4], _blocks(5, 7)), "disk")
    gap = indexer.apply_event(live)
    assert gap is not None and (gap.first_missing, gap.last_missing) == (1, 1)
    assert _overlaps(indexer)[1:] == ({}, {})  # the disk chain waits for its parent
    indexer.fill_gap(gap, [lost])
    assert _overlaps(indexer) == ({(1, 0): 2}, {(1, 0): 3}, {(1, 0): 2})


def test_a_dump_and_a_catch_up_carry_their_tiers() -> None:
    """A worker just seen is dumped from its ring buffer; a quiet one is caught up: tier-tagged events apply to
    their tiers either way."""
    indexer = KvIndexer()
    dump = [RouterEvent(1, stored_event(0, None, _blocks(0, 3)), "device"),
            RouterEvent(1, stored_event(1, SEQ[2], _blocks(3, 6)), "host_pinned")]
    indexer.apply_dump(dump)
    assert _overlaps(indexer) == ({(1, 0): 3}, {(1, 0): 3}, {})
    later = [RouterEvent(1, stored_event(2, SEQ[5], _blocks(6, 9)), "disk"),
             RouterEvent(1, removed_event(3, SEQ[4:6]), "host_pinned")]
    assert indexer.catch_up((1, 0), later) == 2
    assert _overlaps(indexer) == ({(1, 0): 3}, {(1, 0): 1}, {})  # the disk chain now starts past a hole
    assert indexer.lower.num_blocks("disk", (1, 0)) == 3


# --- cost and selection -----------------------------------------------------------------------------


def test_each_tier_is_credited_at_its_weight() -> None:
    config = KvRouterConfig()
    terms = CostTerms((1, 0), overlap_blocks=4, active_prefill_tokens=0, decode_blocks=0, host_blocks=4, disk_blocks=4)
    assert terms.tier_credits(config) == (4, 0.75 * 4, 0.25 * 4)
    costs = worker_costs([terms], 12 * B, B, config)
    assert costs[(1, 0)] == pytest.approx(12 - 8)


def _router(config: KvRouterConfig | None = None) -> KvRouter:
    return KvRouter(None, "m", block_size=B, config=config or KvRouterConfig(predicted_ttl_secs=0),
                    metrics=RouterMetrics(None), rng=random.Random(0))


def test_a_prefix_in_host_memory_beats_recomputing_and_loses_to_the_device() -> None:
    router = _router()
    _Worker(router.indexer, 1).store("host_pinned", 0, 10)  # worker 2 holds nothing
    decision = router.best_worker(PROMPT, [1, 2])
    assert (decision.worker_id, decision.load.host_blocks, decision.load.overlap_blocks) == (1, 10, 0)
    assert decision.tiers is not None and decision.tiers.host == {(1, 0): 10}
    _Worker(router.indexer, 3).store("device", 0, 10)
    assert router.best_worker(PROMPT, [1, 2, 3]).worker_id == 3
    # disk beats nothing, loses to host
    _Worker(router.indexer, 4).store("disk", 0, 10)
    assert router.best_worker(PROMPT, [2, 4]).worker_id == 4
    assert router.best_worker(PROMPT, [1, 4]).worker_id == 1


def test_a_prediction_older_than_the_lower_tier_events_gives_way_to_them() -> None:
    """With recent decisions predicted, a prompt just routed counts as held in the pool. Once its blocks'
    events place them on a lower tier (computed, then evicted) the events count; a prediction reaching
    beyond what the events know still counts as held in the pool."""
    router = _router(KvRouterConfig(predicted_ttl_secs=5))
    router.select("first", PROMPT, [1]).free()  # predicted: 12 blocks in worker 1's pool
    decision = router.best_worker(PROMPT, [1])
    assert (decision.load.overlap_blocks, decision.load.host_blocks, decision.tiers) == (12, 0, None)
    worker = _Worker(router.indexer, 1)
    worker.store("device", 0, 2)
    worker.store("host_pinned", 2, 12)  # the rest was evicted to host memory
    decision = router.best_worker(PROMPT, [1])
    assert (decision.load.overlap_blocks, decision.load.host_blocks) == (2, 10)
    worker.remove("host_pinned", 6, 12)  # the events now know less than the prediction
    decision = router.best_worker(PROMPT, [1])
    assert (decision.load.overlap_blocks, decision.load.host_blocks) == (12, 0)


def test_device_only_weights_ignore_the_lower_tiers_and_overrides_set_them() -> None:
    router = _router(KvRouterConfig(predicted_ttl_secs=0, host_cache_hit_weight=0, disk_cache_hit_weight=0))
    _Worker(router.indexer, 1).store("host_pinned", 0, 10)
    costs = {w: router.best_worker(PROMPT, [w]).cost for w in (1, 2)}
    assert costs[1] == costs[2]
    override = {"host_cache_hit_weight": 0.5}
    assert router.best_worker(PROMPT, [1], override=override).cost == costs[1] - 5


def test_the_chosen_workers_credit_is_counted_per_tier() -> None:
    router = _router()
    worker = _Worker(router.indexer, 1)
    worker.store("device", 0, 2)
    worker.store("host_pinned", 2, 6)
    worker.store("disk", 6, 8)
    router.select("r1", PROMPT, [1])
    metrics = router.metrics

    def value(counter: object, tier: str) -> float:
        return counter.labels("m", tier)._value.get()  # type: ignore[attr-defined]

    assert value(metrics.tier_hit_blocks, "host_pinned") == 4 and value(metrics.tier_hit_blocks, "disk") == 2
    assert value(metrics.tier_credit_blocks, "device") == 2
    assert value(metrics.tier_credit_blocks, "host_pinned") == 3 and value(metrics.tier_credit_blocks, "disk") == 0.5


def test_tier_weight_flags_env_and_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    assert (KvRouterConfig().host_cache_hit_weight, KvRouterConfig().disk_cache_hit_weight) == (0.75, 0.25)
    config = config_from_args(parser.parse_args(["--router-host-cache-hit-weight", "0.5"]))
    assert config.host_cache_hit_weight == 0.5
    monkeypatch.setenv("DYN_ROUTER_DISK_CACHE_HIT_WEIGHT", "0.1")
    assert config_from_args(parser.parse_args([])).disk_cache_hit_weight == 0.1
    with pytest.raises(ValueError, match="--router-host-cache-hit-weight"):
        config_from_args(parser.parse_args(["--router-host-cache-hit-weight", "-1"]))
    with pytest.raises(ValueError, match="disk_cache_hit_weight"):
        KvRouterConfig().with_overrides({"disk_cache_hit_weight": -0.5})


# --- the consolidator -------------------------------------------------------------------------------

SOURCES = ("pool", "tiers", "manager")
TIERS = ("device", "host_pinned", "disk")
_op = st.tuples(
    st.sampled_from(SOURCES), st.sampled_from(TIERS), st.sampled_from(("store", "remove", "clear")),
    st.lists(st.integers(0, 7), min_size=1, max_size=5, unique=True),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_op, max_size=40))
def test_the_consolidator_matches_per_tier_sets_of_its_sources(ops: list) -> None:
    emitted: list[tuple[KvCacheEventData, str]] = []
    consolidator = KvEventConsolidator(lambda data, tier: emitted.append((data, tier)))
    model: dict[tuple[str, str], set[int]] = {}  # (source, tier) -> blocks: the naive model
    seen: dict[str, set[int]] = {tier: set() for tier in TIERS}  # what the emitted events say, per tier
    for source, tier, op, blocks in ops:
        emitted.clear()
        if op == "store":
            consolidator.apply(source, tier, KvCacheEventData(stored=KvStored(None, [KvBlock(b, b) for b in blocks])))
            model.setdefault((source, tier), set()).update(blocks)
        elif op == "remove":
            consolidator.apply(source, tier, KvCacheEventData(removed=KvRemoved(blocks)))
            model.setdefault((source, tier), set()).difference_update(blocks)
        else:
            consolidator.apply(source, tier, "cleared")
            model.pop((source, tier), None)
        for data, event_tier in emitted:
            if data.stored is not None:
                stored = [b.block_hash for b in data.stored.blocks]
                assert not seen[event_tier] & set(stored), "a block stored twice on one tier"
                seen[event_tier].update(stored)
            else:
                assert data.removed is not None and data.removed.block_hashes
                assert set(data.removed.block_hashes) <= seen[event_tier], "a block removed that was not stored"
                seen[event_tier].difference_update(data.removed.block_hashes)
        for t in TIERS:
            expected = set().union(*(held for (s, tt), held in model.items() if tt == t))
            assert seen[t] == expected == consolidator.held(t)  # type: ignore[arg-type]


def test_a_stored_chain_split_by_blocks_already_held_keeps_its_parents() -> None:
    emitted: list[tuple[KvCacheEventData, str]] = []
    consolidator = KvEventConsolidator(lambda data, tier: emitted.append((data, tier)))
    consolidator.apply("manager", "device", KvCacheEventData(stored=KvStored(10, [KvBlock(12, 2)])))
    emitted.clear()
    chain = [KvBlock(h, h - 10) for h in (11, 12, 13, 14)]
    consolidator.apply("pool", "device", KvCacheEventData(stored=KvStored(10, chain)))
    runs = [(data.stored.parent_hash, [b.block_hash for b in data.stored.blocks]) for data, _ in emitted]  # type: ignore[union-attr]
    assert runs == [(10, [11]), (12, [13, 14])]
    emitted.clear()
    consolidator.apply("pool", "device", KvCacheEventData(removed=KvRemoved([11, 12])))
    assert [(d.removed.block_hashes, t) for d, t in emitted] == [([11], "device")]  # type: ignore[union-attr]
