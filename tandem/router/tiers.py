"""KV blocks held below the device tier (host memory, disk), and how much of a prompt each worker could
load from them.

A worker's engine computes a prompt's prefix from its device cache first; the blocks right after that
prefix may still sit in its host tier, and the ones after those on its disk tier. `LowerTiers` answers,
per worker, how many consecutive blocks of a prompt continue the device match from host memory, and how
many then continue from disk: the router credits them at their tier's weight (`selector.worker_costs`).

The lower tiers index blocks by the router's sequence hash (position-aware, `hashing.sequence_hashes`):
a query is then one set lookup per block continuing a match, with no tree walk, and a tier only lists
what it holds (its blocks' ancestors may be on another tier). A stored event names its chain's parent by
the engine's hash; its sequence hash comes from the blocks this worker holds on any tier, the device
tier's radix tree included.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tandem.router.hashing import sequence_hashes
from tandem.router.protocols import KvCacheEventData, StorageTier
from tandem.router.radix_tree import WorkerKey

log = logging.getLogger(__name__)

DEVICE = "device"
HOST = "host_pinned"
DISK = "disk"
# The lower tiers a match continues through, in the order an engine loads from them.
LOWER_TIERS = (HOST, DISK)
# The tiers a routing decision credits, as its report and the router's metrics name them.
CREDITED_TIERS = (DEVICE, *LOWER_TIERS)
# Where each storage tier of an event (`protocols.StorageTier`) below the device is credited: external
# storage (a shared or remote store) as disk.
_CREDITED_AS = {HOST: HOST, DISK: DISK, "external": DISK}


@dataclass
class TierOverlaps:
    """Per worker, the prompt blocks continuing its device match from each lower tier (only workers with
    at least one)."""

    host: dict[WorkerKey, int] = field(default_factory=dict)
    disk: dict[WorkerKey, int] = field(default_factory=dict)

    def of(self, worker: WorkerKey) -> tuple[int, int]:
        return self.host.get(worker, 0), self.disk.get(worker, 0)


@dataclass
class _WorkerTier:
    """What one worker (dp rank) holds on one lower tier."""

    by_engine_hash: dict[int, int] = field(default_factory=dict)  # engine hash -> sequence hash
    held: dict[int, int] = field(default_factory=dict)  # sequence hash -> engine hashes held for it (usually 1)


ParentLookup = Callable[[WorkerKey, int], "int | None"]
"""The sequence hash of a worker's device block with this engine hash (None when it holds none)."""


class LowerTiers:
    """The host and disk tiers of every worker: `apply` their tier-tagged events, `overlaps` a prompt.
    `device_parent` finds the sequence hash of a parent block held on the device tier only."""

    def __init__(self, device_parent: ParentLookup) -> None:
        self._device_parent = device_parent
        self._tiers: dict[str, dict[WorkerKey, _WorkerTier]] = {tier: {} for tier in LOWER_TIERS}
        self.blocks_dropped = 0  # stored under a parent no tier of the worker held

    def __bool__(self) -> bool:
        return any(self._tiers.values())

    def num_blocks(self, tier: str, worker: WorkerKey | None = None) -> int:
        workers = self._tiers[tier]
        if worker is not None:
            held = workers.get(worker)
            return len(held.by_engine_hash) if held else 0
        return sum(len(held.by_engine_hash) for held in workers.values())

    # -- updates -----------------------------------------------------------------------------------
    def apply(self, worker: WorkerKey, storage_tier: StorageTier, data: KvCacheEventData | str) -> None:
        """Apply one event of `worker` tagged `storage_tier` (not the device tier; the event's decoding
        checked the tier)."""
        tier = _CREDITED_AS[storage_tier]
        if data == "cleared":
            self._tiers[tier].pop(worker, None)
            return
        assert isinstance(data, KvCacheEventData)
        if data.stored is not None:
            self._store(worker, tier, data.stored.parent_hash,
                        [(block.block_hash, block.tokens_hash) for block in data.stored.blocks])
        elif data.removed is not None:
            self._remove(worker, tier, data.removed.block_hashes)

    def _store(self, worker: WorkerKey, tier: str, parent_hash: int | None, blocks: Sequence[tuple[int, int]]) -> None:
        if parent_hash is None:
            chain = sequence_hashes([local for _, local in blocks])
        else:
            parent = self._sequence_hash(worker, parent_hash)
            if parent is None:
                self.blocks_dropped += len(blocks)
                log.debug("worker %s: %d %s blocks stored under unknown parent %d dropped", worker, len(blocks),
                          tier, parent_hash)
                return
            chain = sequence_hashes([parent] + [local for _, local in blocks])[1:]
        held = self._tiers[tier].setdefault(worker, _WorkerTier())
        for (block_hash, _), seq_hash in zip(blocks, chain, strict=True):
            previous = held.by_engine_hash.get(block_hash)
            if previous == seq_hash:
                continue
            if previous is not None:  # the engine reused a hash for another block
                self._forget(held, previous)
            held.by_engine_hash[block_hash] = seq_hash
            held.held[seq_hash] = held.held.get(seq_hash, 0) + 1

    def _remove(self, worker: WorkerKey, tier: str, block_hashes: Sequence[int]) -> None:
        workers = self._tiers[tier]
        held = workers.get(worker)
        if held is None:
            return
        for block_hash in block_hashes:
            seq_hash = held.by_engine_hash.pop(block_hash, None)
            if seq_hash is not None:
                self._forget(held, seq_hash)
        if not held.by_engine_hash:
            del workers[worker]

    @staticmethod
    def _forget(held: _WorkerTier, seq_hash: int) -> None:
        count = held.held[seq_hash]
        if count == 1:
            del held.held[seq_hash]
        else:
            held.held[seq_hash] = count - 1

    def _sequence_hash(self, worker: WorkerKey, block_hash: int) -> int | None:
        for workers in self._tiers.values():
            held = workers.get(worker)
            if held is not None:
                seq_hash = held.by_engine_hash.get(block_hash)
                if seq_hash is not None:
                    return seq_hash
        return self._device_parent(worker, block_hash)

    def remove_worker(self, worker_id: int) -> None:
        for workers in self._tiers.values():
            for key in [key for key in workers if key[0] == worker_id]:
                del workers[key]

    # -- queries -----------------------------------------------------------------------------------
    def overlaps(self, sequence: Sequence[int], device: dict[WorkerKey, int]) -> TierOverlaps:
        """Per worker holding lower-tier blocks: how many blocks of the prompt `sequence` (its sequence
        hashes) continue its device match (`device`: blocks per worker) from host memory, and how many
        then continue from disk."""
        out = TierOverlaps()
        host_tier, disk_tier = self._tiers[HOST], self._tiers[DISK]
        total = len(sequence)
        for worker in host_tier.keys() | disk_tier.keys():
            depth = device.get(worker, 0)
            for tier, found in ((host_tier, out.host), (disk_tier, out.disk)):
                held = tier.get(worker)
                if held is None:
                    continue
                blocks = held.held
                start = depth
                while depth < total and sequence[depth] in blocks:
                    depth += 1
                if depth > start:
                    found[worker] = depth - start
        return out
