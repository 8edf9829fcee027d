"""The indexers that keep the router's prefix index (`RadixTree`, radix_tree.py) up to date:
`KvIndexer` applies the workers' KV events, with the per-worker event-id bookkeeping that detects
lost events; `ApproxIndexer` indexes the router's own routing decisions when workers publish no
events."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tandem.router.hashing import sequence_hashes
from tandem.router.protocols import RouterEvent
from tandem.router.radix_tree import OverlapScores, RadixTree, WorkerKey
from tandem.router.tiers import DEVICE, LowerTiers


@dataclass(frozen=True)
class EventGap:
    """Event ids `first_missing..last_missing` (inclusive) of `worker` were never received."""

    worker: WorkerKey
    first_missing: int
    last_missing: int



class KvIndexer:
    """RadixTree (the device tier) and the lower tiers (`LowerTiers`: host memory, disk), plus
    per-(worker, dp rank) event-id bookkeeping. A worker numbers its events once across its tiers.

    While a worker's missing events are being fetched, its newer live events wait: a block stored
    under a block of the gap would otherwise find no parent and be dropped. Once every gap of the
    worker is filled (or given up), the fetched and the waiting events are applied in id order."""

    def __init__(self) -> None:
        self.tree = RadixTree()
        self.lower = LowerTiers(self._device_sequence_hash)
        self._last: dict[WorkerKey, int] = {}
        self._open_gaps: dict[WorkerKey, int] = {}  # gaps being fetched, per worker
        self._waiting: dict[WorkerKey, list[RouterEvent]] = {}  # live and fetched events held meanwhile
        # counters for metrics
        self.events_applied = 0
        self.blocks_applied = 0  # stored + removed blocks
        self.gaps_detected = 0
        self.events_recovered = 0

    def expect_first(self, worker: WorkerKey, event_id: int = 0) -> None:
        """`worker`'s events are expected from `event_id` on: if its first event has a later id, the ones
        before it are a gap (fetched and applied first), not a history silently missing."""
        self._last.setdefault(worker, event_id - 1)

    def apply_event(self, event: RouterEvent) -> EventGap | None:
        """Apply a live event. A duplicate (id <= last seen) is ignored; an id beyond last + 1 opens a
        gap, returned so the caller fetches the missing ids from the worker's ring buffer and passes them
        to `fill_gap`; until then this worker's events wait."""
        kv = event.event
        worker = (event.worker_id, kv.dp_rank)
        event_id = kv.event_id
        last = self._last.get(worker)
        if last is not None and event_id <= last:
            return None
        self._last[worker] = event_id
        gap = None
        if last is not None and event_id > last + 1:
            self.gaps_detected += 1
            self._open_gaps[worker] = self._open_gaps.get(worker, 0) + 1
            gap = EventGap(worker, last + 1, event_id - 1)
        if worker in self._open_gaps:
            self._waiting.setdefault(worker, []).append(event)
        else:
            self._apply(event)
        return gap

    def fill_gap(self, gap: EventGap, events: Sequence[RouterEvent]) -> int:
        """The events fetched for `gap` (none if the worker could not give them). Returns how many events
        were applied: none while another gap of the worker is open, else everything that waited."""
        worker = gap.worker
        self.events_recovered += len(events)
        waiting = self._waiting.setdefault(worker, [])
        waiting.extend(events)
        self._open_gaps[worker] -= 1
        if self._open_gaps[worker] > 0:
            return 0
        del self._open_gaps[worker], self._waiting[worker]
        applied, seen = 0, set()
        for event in sorted(waiting, key=lambda e: e.event.event_id):
            if event.event.event_id not in seen:
                seen.add(event.event.event_id)
                self._apply(event)
                applied += 1
        return applied

    def catch_up(self, worker: WorkerKey, events: Sequence[RouterEvent]) -> int:
        """Events `worker` emitted after the last one seen, fetched because none arrived for a while: those
        still newer than the last seen are applied in id order, unless a gap of the worker is being fetched
        meanwhile (that fetch brings them). Returns how many were applied."""
        if worker in self._open_gaps:
            return 0
        applied = 0
        for event in sorted(events, key=lambda e: e.event.event_id):
            last = self._last.get(worker)
            if last is not None and event.event.event_id <= last:
                continue
            self._last[worker] = event.event.event_id
            self._apply(event)
            applied += 1
        self.events_recovered += applied
        return applied

    def apply_dump(self, events: Sequence[RouterEvent]) -> int:
        """Apply what a worker just seen still has in its buffer, in id order, whatever the last seen id
        (the caller keeps only what precedes the live events applied); last seen only moves forward.
        Returns how many were applied."""
        for event in sorted(events, key=lambda e: e.event.event_id):
            worker = (event.worker_id, event.event.dp_rank)
            last = self._last.get(worker)
            if last is None or event.event.event_id > last:
                self._last[worker] = event.event.event_id
            self._apply(event)
        self.events_recovered += len(events)
        return len(events)

    def _apply(self, event: RouterEvent) -> None:
        if event.storage_tier == DEVICE:
            self.tree.apply(event)
        else:
            self.lower.apply((event.worker_id, event.event.dp_rank), event.storage_tier, event.event.data)
        self.events_applied += 1
        data = event.event.data
        if data != "cleared":
            stored = data.stored  # type: ignore[union-attr]
            self.blocks_applied += len(stored.blocks) if stored is not None else len(data.removed.block_hashes)  # type: ignore[union-attr]

    def _device_sequence_hash(self, worker: WorkerKey, block_hash: int) -> int | None:
        path = self.tree.path(worker, block_hash)
        return sequence_hashes(path)[-1] if path else None

    def remove_worker(self, worker_id: int) -> None:
        """Forget the worker's blocks, event ids and waiting events (every dp rank)."""
        self.tree.remove_worker(worker_id)
        self.lower.remove_worker(worker_id)
        for table in (self._last, self._open_gaps, self._waiting):
            for key in [key for key in table if key[0] == worker_id]:
                del table[key]

    def last_event_id(self, worker: WorkerKey) -> int | None:
        return self._last.get(worker)

    def find_matches(self, local_hashes: Sequence[int], early_exit: bool = False) -> OverlapScores:
        return self.tree.find_matches(local_hashes, early_exit)


class ApproxIndexer:
    """`--no-router-kv-events`: index the router's own decisions (Dynamo's approximate mode).

    Each routed block is held by its worker for `ttl_secs` after the last decision that used it.
    Since the TTL is constant, expiries come in insertion order: one OrderedDict (oldest first,
    refreshed entries moved to the end) serves both expiry and size pruning."""

    def __init__(self, ttl_secs: float = 120.0, max_tree_size: int = 2**20, prune_target_ratio: float = 0.8,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tree = RadixTree()
        self.ttl_secs = ttl_secs
        self.max_tree_size = max_tree_size
        self.prune_target_ratio = prune_target_ratio
        self._clock = clock
        self._expiry: OrderedDict[tuple[WorkerKey, int], float] = OrderedDict()  # (worker, seq hash)

    def process_routing_decision(self, worker: WorkerKey, local_hashes: Sequence[int],
                                 sequence_hashes: Sequence[int]) -> None:
        """Index the request's blocks as held by `worker` until now + ttl (refreshing them)."""
        now = self._clock()
        self._expire(now)
        self.tree.store(worker, None, list(zip(sequence_hashes, local_hashes, strict=True)))
        expiry = now + self.ttl_secs
        entries = self._expiry
        for seq_hash in sequence_hashes:
            key = (worker, seq_hash)
            entries[key] = expiry
            entries.move_to_end(key)
        if len(entries) > self.max_tree_size:
            self._evict_oldest(len(entries) - int(self.max_tree_size * self.prune_target_ratio))

    def find_matches(self, local_hashes: Sequence[int], early_exit: bool = False) -> OverlapScores:
        self._expire(self._clock())
        return self.tree.find_matches(local_hashes, early_exit)

    def remove_worker(self, worker_id: int) -> None:
        self.tree.remove_worker(worker_id)
        for key in [key for key in self._expiry if key[0][0] == worker_id]:
            del self._expiry[key]

    def workers(self) -> set[WorkerKey]:
        return self.tree.workers()

    def num_blocks(self, worker: WorkerKey | None = None) -> int:
        return self.tree.num_blocks(worker)

    def _expire(self, now: float) -> None:
        entries = self._expiry
        expired: list[tuple[WorkerKey, int]] = []
        for key, expiry in entries.items():
            if expiry > now:
                break
            expired.append(key)
        if expired:
            for key in expired:
                del entries[key]
            self._remove_from_tree(expired)

    def _evict_oldest(self, count: int) -> None:
        entries = self._expiry
        self._remove_from_tree([entries.popitem(last=False)[0] for _ in range(min(count, len(entries)))])

    def _remove_from_tree(self, keys: Iterable[tuple[WorkerKey, int]]) -> None:
        by_worker: dict[WorkerKey, list[int]] = {}
        for worker, seq_hash in keys:
            by_worker.setdefault(worker, []).append(seq_hash)
        for worker, hashes in by_worker.items():
            self.tree.remove(worker, hashes)
