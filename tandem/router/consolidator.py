"""The KV event consolidator of a worker: one event stream from several sources of KV events.

A worker with offload tiers has several sources: its engine's pool (the device tier) and each tier
below it, and more than one source may report the same tier (an engine and an offload manager both
reporting device blocks). The router wants one stream per worker, tagged by tier, with each block
stored once per tier. `KvEventConsolidator` keeps, per tier and block, the sources holding it, and
emits:

* `stored` on a tier when a block enters it (its first source there); a source storing a block again,
  or a second source storing it, emits nothing;
* `removed` on a tier when the last source holding the block there removes it;
* a source's `cleared` on a tier removes each block that source held there (so a block another
  source still holds stays).

A stored chain keeps its order: blocks already on the tier split it, and each emitted run names as
parent the block before it in the chain. The events it emits go to the worker's `KvEventPublisher`,
which numbers them and publishes them on the event plane (ZMQ, or NATS with JetStream when durable).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tandem.router.protocols import KvBlock, KvCacheEventData, KvRemoved, KvStored, StorageTier

Emit = Callable[[KvCacheEventData, StorageTier], None]
"""Where consolidated events go: `KvEventPublisher.emit`-like (event data, tier)."""


class KvEventConsolidator:
    """Consolidates the events of `sources` (named by the caller) of one worker (one dp rank)."""

    def __init__(self, emit: Emit) -> None:
        self._emit = emit
        # (tier, block hash) -> the sources holding it there
        self._holders: dict[tuple[StorageTier, int], set[str]] = {}
        # (source, tier) -> the block hashes it holds there
        self._held: dict[tuple[str, StorageTier], set[int]] = {}

    def held(self, tier: StorageTier) -> set[int]:
        """The blocks some source holds on `tier` (what the router's index should hold)."""
        return {block for (t, block) in self._holders if t == tier}

    def apply(self, source: str, tier: StorageTier, data: KvCacheEventData | str) -> None:
        """One event of `source` about `tier`."""
        if data == "cleared":
            held = self._held.pop((source, tier), set())
            self._release(source, tier, held)
            return
        assert isinstance(data, KvCacheEventData)
        if data.stored is not None:
            self._store(source, tier, data.stored)
        elif data.removed is not None:
            held = self._held.get((source, tier))
            if held is not None:
                gone = [block for block in data.removed.block_hashes if block in held]
                held.difference_update(gone)
                self._release(source, tier, gone)

    def _store(self, source: str, tier: StorageTier, stored: KvStored) -> None:
        held = self._held.setdefault((source, tier), set())
        holders = self._holders
        parent = stored.parent_hash
        run: list[KvBlock] = []
        run_parent = parent
        for block in stored.blocks:
            key = (tier, block.block_hash)
            sources = holders.get(key)
            held.add(block.block_hash)
            if sources is None:
                holders[key] = {source}
                if not run:
                    run_parent = parent
                run.append(block)
            else:
                sources.add(source)
                if run:
                    self._emit(KvCacheEventData(stored=KvStored(run_parent, run)), tier)
                    run = []
            parent = block.block_hash
        if run:
            self._emit(KvCacheEventData(stored=KvStored(run_parent, run)), tier)

    def _release(self, source: str, tier: StorageTier, blocks: Iterable[int]) -> None:
        holders = self._holders
        emptied = []
        for block in blocks:
            key = (tier, block)
            sources = holders.get(key)
            if sources is None:
                continue
            sources.discard(source)
            if not sources:
                del holders[key]
                emptied.append(block)
        if emptied:
            self._emit(KvCacheEventData(removed=KvRemoved(emptied)), tier)
