"""Simulated KV offload tiers of the mocker: host memory (G2) and disk (G3) below the engine's pool.

* Offload on eviction: a block the pool evicts goes to the host tier; a block the host tier evicts (least
  recently used first) goes to disk; one the disk evicts is gone.
* Onboarding: a request admitted with its device prefix match continues the match in host memory,
  then on disk (consecutive blocks, as an engine loads them). The blocks found are copied back to the
  pool (they stay in their tier) at `block_bytes / bandwidth` each, instead of being computed.
* Events: each tier reports its blocks as the engine does (stored with the chain's parent, removed),
  tagged `host_pinned` or `disk`; stored events come before the pool's removal of the same blocks, so a
  router can place a block's parent while it still holds it.
* Counters with KVBM's names (`KvbmMetrics`, per engine `RankMetrics`): blocks offloaded device→host and host→disk, onboarded
  host→device and disk→device, tokens matched, and each tier's hit rate (blocks found over blocks looked
  up there).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from tandem.router.protocols import KvBlock, KvCacheEventData, KvRemoved, KvStored, StorageTier

Block = tuple[int, int, "int | None"]
"""(sequence hash, local hash, parent's sequence hash) of a block."""

TierEvent = Callable[[KvCacheEventData, StorageTier], None]


@dataclass(frozen=True)
class OffloadConfig:
    host_blocks: int = 0
    """Blocks of the host tier (G2); 0: no offload tiers."""
    disk_blocks: int = 0
    """Blocks of the disk tier (G3, below the host tier); 0: none."""
    host_bandwidth_gbps: float = 14.0
    """Host → device onboarding bandwidth, GB/s."""
    disk_bandwidth_gbps: float = 2.0
    """Disk → device onboarding bandwidth, GB/s."""
    block_bytes: int = 0
    """KV bytes of one block (0: onboarding is free)."""

    def __post_init__(self) -> None:
        if self.host_blocks < 0 or self.disk_blocks < 0:
            raise ValueError("tier sizes must not be negative")
        if self.disk_blocks and not self.host_blocks:
            raise ValueError("a disk tier needs a host tier above it (--num-g2-blocks)")
        if self.host_bandwidth_gbps <= 0 or self.disk_bandwidth_gbps <= 0:
            raise ValueError("tier bandwidths must be positive")

    @property
    def enabled(self) -> bool:
        return self.host_blocks > 0


@dataclass(frozen=True)
class Onboard:
    """What a request's admission loads from the tiers."""

    host: int  # blocks from host memory
    disk: int  # blocks from disk, after them
    ms: float  # the time it takes

    @property
    def blocks(self) -> int:
        return self.host + self.disk


class KvbmMetrics:
    """The offload counters of a worker's engines, as KVBM names them, labelled by dp rank (`of`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["dp_rank"], registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["dp_rank"], registry=registry)

        self._offload_d2h = counter("kvbm_offload_blocks_d2h", "Blocks offloaded from device to host memory")
        self._offload_h2d = counter("kvbm_offload_blocks_h2d", "Blocks offloaded from host memory to disk")
        self._onboard_h2d = counter("kvbm_onboard_blocks_h2d", "Blocks onboarded from host memory to device")
        self._onboard_d2d = counter("kvbm_onboard_blocks_d2d", "Blocks onboarded from disk to device")
        self._matched_tokens = counter("kvbm_matched_tokens", "Prompt tokens found in the offload tiers")
        self._host_hit_rate = gauge("kvbm_host_cache_hit_rate", "Blocks found in host memory / blocks looked up there")
        self._disk_hit_rate = gauge("kvbm_disk_cache_hit_rate", "Blocks found on disk / blocks looked up there")

    def of(self, dp_rank: int) -> RankMetrics:
        rank = str(dp_rank)
        return RankMetrics(self._offload_d2h.labels(rank), self._offload_h2d.labels(rank),
                           self._onboard_h2d.labels(rank), self._onboard_d2d.labels(rank),
                           self._matched_tokens.labels(rank), self._host_hit_rate.labels(rank),
                           self._disk_hit_rate.labels(rank))


@dataclass(frozen=True)
class RankMetrics:
    """One engine's offload counters (`KvbmMetrics.of`)."""

    offload_d2h: Counter
    offload_h2d: Counter
    onboard_h2d: Counter
    onboard_d2d: Counter
    matched_tokens: Counter
    host_hit_rate: Gauge
    disk_hit_rate: Gauge


class _Tier:
    """One tier: blocks by sequence hash, least recently used first."""

    def __init__(self, name: StorageTier, capacity: int, emit: TierEvent | None) -> None:
        self.name = name
        self.capacity = capacity
        self.blocks: OrderedDict[int, Block] = OrderedDict()
        self._emit = emit
        self.looked_up = 0
        self.found = 0

    def put(self, blocks: Sequence[Block]) -> list[Block]:
        """Store `blocks` (parents first; beyond the tier's capacity the last ones are not kept); returns
        the blocks evicted to make room, least recently used first. A chain's blocks are used from its
        first, so its later ones are the less recent: they leave first, and what stays is a prefix."""
        held = self.blocks
        fresh = [block for block in blocks if block[0] not in held][:self.capacity]
        for block in reversed(blocks):
            if block[0] in held:
                held.move_to_end(block[0])
        evicted = [held.popitem(last=False)[1] for _ in range(len(held) + len(fresh) - self.capacity)]
        for block in reversed(fresh):
            held[block[0]] = block
        if self._emit is not None:
            for parent, run in _chains(fresh):
                self._emit(KvCacheEventData(stored=KvStored(parent, run)), self.name)
        return evicted

    def removed(self, blocks: Sequence[Block]) -> None:
        if self._emit is not None and blocks:
            self._emit(KvCacheEventData(removed=KvRemoved([block[0] for block in blocks])), self.name)

    def match(self, seq_hashes: Sequence[int]) -> int:
        """Consecutive blocks of `seq_hashes` held, from the first (changes nothing)."""
        n = 0
        for h in seq_hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def load(self, seq_hashes: Sequence[int], found: int) -> None:
        """The first `found` of `seq_hashes` were looked up and loaded: they become the most recent (those
        still here: the pool's evictions making room for them may have pushed some out since)."""
        held = self.blocks
        for h in reversed(seq_hashes[:found]):  # the first ones the most recent (see `put`)
            if h in held:
                held.move_to_end(h)
        self.looked_up += len(seq_hashes)
        self.found += found

    @property
    def hit_rate(self) -> float:
        return self.found / self.looked_up if self.looked_up else 0.0


def _chains(blocks: Sequence[Block]) -> list[tuple[int | None, list[KvBlock]]]:
    """`blocks` as runs each child of the one before: (parent of the run, its blocks)."""
    runs: list[tuple[int | None, list[KvBlock]]] = []
    last = None
    for seq_hash, local, parent in blocks:
        if runs and parent == last:
            runs[-1][1].append(KvBlock(seq_hash, local))
        else:
            runs.append((parent, [KvBlock(seq_hash, local)]))
        last = seq_hash
    return runs


class OffloadTiers:
    """The host and disk tiers of one simulated engine; `emit` takes their tier-tagged events."""

    def __init__(self, config: OffloadConfig, block_size: int, emit: TierEvent | None = None,
                 metrics: RankMetrics | None = None) -> None:
        self.config = config
        self.block_size = block_size
        self.host = _Tier("host_pinned", config.host_blocks, emit)
        self.disk = _Tier("disk", config.disk_blocks, emit) if config.disk_blocks else None
        self.metrics = metrics

    def offload(self, evicted: Sequence[Block]) -> None:
        """Blocks the pool evicted (leaves first, as it evicts them) go to host memory; what host memory
        evicts goes to disk."""
        blocks = list(reversed(evicted))  # parents first
        dropped = self.host.put(blocks)
        if self.metrics is not None:
            self.metrics.offload_d2h.inc(len(blocks))
        if dropped and self.disk is not None:
            gone = self.disk.put(dropped[::-1])  # (parents first) stored on disk before host memory lets them go
            self.disk.removed(gone)
            if self.metrics is not None:
                self.metrics.offload_h2d.inc(len(dropped))
        self.host.removed(dropped)

    def lookup(self, seq_hashes: Sequence[int]) -> Onboard:
        """What loading `seq_hashes` (the prompt's blocks after its device match) would take from host
        memory, then from disk, and the time it takes (changes nothing: `load` does once admitted)."""
        host = self.host.match(seq_hashes)
        disk = self.disk.match(seq_hashes[host:]) if self.disk is not None and host < len(seq_hashes) else 0
        config = self.config
        ms = config.block_bytes * (host / config.host_bandwidth_gbps + disk / config.disk_bandwidth_gbps) / 1e6
        return Onboard(host, disk, ms)

    def load(self, seq_hashes: Sequence[int], onboard: Onboard) -> None:
        """The request `lookup` answered `onboard` for is admitted: its blocks are loaded."""
        self.host.load(seq_hashes, onboard.host)
        if self.disk is not None and onboard.host < len(seq_hashes):
            self.disk.load(seq_hashes[onboard.host:], onboard.disk)
        metrics = self.metrics
        if metrics is not None:
            metrics.onboard_h2d.inc(onboard.host)
            metrics.onboard_d2d.inc(onboard.disk)
            metrics.matched_tokens.inc(onboard.blocks * self.block_size)
            metrics.host_hit_rate.set(self.host.hit_rate)
            if self.disk is not None:
                metrics.disk_hit_rate.set(self.disk.hit_rate)
