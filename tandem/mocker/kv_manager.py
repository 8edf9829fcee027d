"""Simulated KV block pool with prefix caching (Dynamo mocker's vLLM KV manager).

The pool has `num_blocks` blocks of `block_size` tokens. Each sequence holds a list of blocks:
first its *registered* full blocks, then *private* ones (the partial tail, or full blocks whose
tokens are not computed yet; with prefix caching disabled every block stays private).

* A registered block is keyed by its sequence hash (`tandem.router.hashing`, so the router's
  hashes match ours) and records its local (tokens) hash and its parent's sequence hash.
  Sequences sharing a prefix share its blocks, ref-counted.
* When its last reference goes, a registered block becomes *inactive*: still cached, reusable by a
  later prefix hit, evictable. Private blocks are freed at once.
* A *copy*: a full block a sequence computes although its hash is cached (the last prompt block,
  which is never a hit, or two requests prefilling the same prompt at once). As in vLLM, the sequence
  keeps it (the pool holds both blocks) and a prefix hit finds the cached block. Released, a copy is
  a *free copy*: evictable in its turn, and evicting it removes nothing. Evicting a cached block
  that has copies keeps its hash: the oldest registered copy stands in for it (the block vLLM's next
  hit would find), a held one by becoming its sequence's reference to the cached block.
* Eviction ("Lineage", Dynamo's default): inactive blocks without cached children (or with copies)
  and free copies are candidates, least recently released first, so a leaf always goes before its
  parent. Since a sequence frees its blocks tail first, this is also vLLM's order.
* Events: a block registered under a hash not yet cached emits `stored` (consecutive blocks of one
  registration are batched in one event); evictions emit `removed` (after `on_evict` has the evicted
  blocks, for the offload tiers); `clear()` emits `"cleared"`. Reusing a cached block emits nothing.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from tandem.router.protocols import KvBlock, KvCacheEventData, KvRemoved, KvStored

KvEvent = KvCacheEventData | Literal["cleared"]
"""What `on_event` receives: the `data` of a router `KvCacheEvent`."""


@dataclass(slots=True)
class _CachedBlock:
    seq_hash: int
    local_hash: int
    parent: int | None
    refs: int = 0
    children: int = 0  # cached blocks whose parent is this one
    released_at: int = 0  # tick at which refs last dropped to 0 (LRU key)
    # Free copies (see the module doc): release tick -> registration order; None until it has one
    # (copies are rare, blocks are not).
    spare: dict[int, int] | None = None


@dataclass
class _SeqBlocks:
    registered: list[int] = field(default_factory=list)  # sequence hashes, in order
    # Indexes in `registered` of blocks that are its own copies of a cached block (counted as private).
    copies: set[int] = field(default_factory=set)
    private: int = 0  # blocks held after the registered ones

    @property
    def num_blocks(self) -> int:
        return len(self.registered) + self.private


class KvManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        on_event: Callable[[KvEvent], None] | None = None,
        on_evict: Callable[[list[tuple[int, int, int | None]]], None] | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._on_event = on_event
        # Evicted blocks as (sequence hash, local hash, parent's sequence hash), leaves first: offload tiers
        self._on_evict = on_evict
        self._cached: dict[int, _CachedBlock] = {}
        self._seqs: dict[str, _SeqBlocks] = {}
        self._num_private = 0
        # Hash -> (registration order, sequence id, block index) of the copies sequences hold of that
        # cached block, oldest first.
        self._copies: dict[int, list[tuple[int, str, int]]] = {}
        self._num_copies = 0  # copies registered so far: the order of the next one
        self._num_spare = 0  # free copies
        self._num_inactive = 0
        # (released_at, seq_hash) of released blocks and free copies; stale entries are skipped when popped.
        self._leaves: list[tuple[int, int]] = []
        self._tick = 0

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_active(self) -> int:
        """Blocks referenced by at least one sequence."""
        return len(self._cached) - self._num_inactive + self._num_private

    @property
    def num_inactive(self) -> int:
        """Cached blocks no sequence references (evictable; free copies of cached blocks not counted)."""
        return self._num_inactive

    @property
    def num_free(self) -> int:
        """Blocks available to a new allocation: free plus evictable."""
        return self.num_blocks - self.num_active

    @property
    def usage(self) -> float:
        """Active blocks / pool size."""
        return self.num_active / self.num_blocks

    def match_prefix(self, seq_hashes: Sequence[int]) -> int:
        """How many leading blocks of `seq_hashes` are cached (active or inactive)."""
        if not self.enable_prefix_caching:
            return 0
        n = 0
        for h in seq_hashes:
            if h not in self._cached:
                break
            n += 1
        return n

    def num_blocks_of(self, seq_id: str) -> int:
        """Blocks the sequence holds."""
        seq = self._seqs.get(seq_id)
        return seq.num_blocks if seq else 0

    def fits(self, seq_id: str, num_tokens: int, prefix: Sequence[int] = (), *, reserve: int = 0) -> bool:
        """Whether `allocate` with these arguments would succeed (changes nothing)."""
        return self._fresh_blocks(seq_id, num_tokens, prefix, reserve) is not None

    # -- per-sequence operations -----------------------------------------------------------------
    def allocate(self, seq_id: str, num_tokens: int, prefix: Sequence[int] = (), *, reserve: int = 0) -> bool:
        """Make `seq_id` hold enough blocks for its first `num_tokens` tokens.

        `prefix` (only on a sequence's first allocation) = sequence hashes of its leading blocks to
        reuse from the cache, as found by `match_prefix`. The allocation must leave at least
        `reserve` blocks free (the admission watermark). All or nothing: returns False, changing
        nothing, if the pool cannot provide the blocks even after evicting.
        """
        fresh = self._fresh_blocks(seq_id, num_tokens, prefix, reserve)
        if fresh is None:
            return False
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = _SeqBlocks()
        for h in prefix:  # before evicting, so that the hits are not evicted
            self._acquire(self._cached[h])
            seq.registered.append(h)
        free = self.num_blocks - len(self._cached) - self._num_private - self._num_spare
        evicted = [block for block in (self._evict_one() for _ in range(fresh - free)) if block is not None]
        if evicted:
            if self._on_evict is not None:  # (before the removal: where they go is stored first)
                self._on_evict([(block.seq_hash, block.local_hash, block.parent) for block in evicted])
            self._emit(KvCacheEventData(removed=KvRemoved([block.seq_hash for block in evicted])))
        seq.private += fresh
        self._num_private += fresh
        return True

    def register(
        self, seq_id: str, num_full: int, seq_hashes: Sequence[int], local_hashes: Sequence[int]
    ) -> None:
        """The sequence's first `num_full` blocks are full and computed: cache those still private.
        `seq_hashes` and `local_hashes` hold (at least) their hashes.

        A block whose hash is already cached (computed again) stays this sequence's own copy.
        """
        if not self.enable_prefix_caching:
            return
        seq = self._seqs[seq_id]
        registered = seq.registered
        start = len(registered)
        if num_full - start > seq.private:
            raise ValueError(f"sequence {seq_id!r} has no block {start + seq.private} to register")
        cached = self._cached
        events = self._on_event is not None  # the blocks of an event are built only when someone listens
        run: list[KvBlock] = []  # freshly stored blocks, consecutive
        run_parent: int | None = None
        parent = seq_hashes[start - 1] if start else None
        for i in range(start, num_full):
            h = seq_hashes[i]
            registered.append(h)
            block = cached.get(h)
            if block is not None:  # computed again: a copy, as vLLM keeps it (both stay in the pool)
                self._num_copies += 1
                self._copies.setdefault(h, []).append((self._num_copies, seq_id, i))
                seq.copies.add(i)
                if block.refs == 0:  # evictable now whatever its children (evicting it loses no hash)
                    heapq.heappush(self._leaves, (block.released_at, h))
                if run:
                    self._emit(KvCacheEventData(stored=KvStored(run_parent, run)))
                    run = []
            else:
                self._num_private -= 1
                cached[h] = _CachedBlock(h, local_hashes[i], parent, refs=1)
                if parent is not None:
                    cached[parent].children += 1
                if events:
                    if not run:
                        run_parent = parent
                    run.append(KvBlock(block_hash=h, tokens_hash=local_hashes[i]))
            parent = h
        seq.private -= max(0, num_full - start)
        if run:
            self._emit(KvCacheEventData(stored=KvStored(run_parent, run)))

    def free(self, seq_id: str) -> None:
        """Release every block of the sequence (unknown id: no-op)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        self._num_private -= seq.private
        # Tail first, as vLLM frees them: a child is released (and so evicted) before its parent.
        for i in reversed(range(len(seq.registered))):
            h = seq.registered[i]
            block = self._cached[h]
            if i in seq.copies:  # a free copy now, evictable in its turn
                order = self._take_copy(h, seq_id, i)
                self._num_private -= 1
                self._tick += 1
                if block.spare is None:
                    block.spare = {}
                block.spare[self._tick] = order
                self._num_spare += 1
                heapq.heappush(self._leaves, (self._tick, h))
                continue
            block.refs -= 1
            if block.refs == 0:
                self._tick += 1
                block.released_at = self._tick
                self._num_inactive += 1
                heapq.heappush(self._leaves, (block.released_at, h))

    def clear(self) -> None:
        """Drop every inactive block and free copy (the worker's clear_kv_blocks); active blocks stay."""
        for h, block in list(self._cached.items()):
            if block.spare:
                self._num_spare -= len(block.spare)
            block.spare = None
            if block.refs == 0 and h in self._copies:
                self._adopt_copy(block)
            elif block.refs == 0:
                self._drop(h)
        self._leaves.clear()
        self._emit("cleared")

    # -- internals -------------------------------------------------------------------------------
    def _fresh_blocks(self, seq_id: str, num_tokens: int, prefix: Sequence[int], reserve: int) -> int | None:
        """New blocks `allocate` would take, or None if the pool cannot give them and keep `reserve` free."""
        seq = self._seqs.get(seq_id)
        if prefix and seq is not None and seq.num_blocks:
            raise ValueError(
                f"sequence {seq_id!r} already holds blocks: a prefix is only for its first allocation"
            )
        held = seq.num_blocks if seq else 0
        fresh = max(0, -(-num_tokens // self.block_size) - held - len(prefix))
        # Reactivated inactive hits leave the evictable pool, like fresh blocks.
        inactive_hits = sum(1 for h in prefix if self._cached[h].refs == 0)
        return fresh if fresh + inactive_hits <= self.num_free - reserve else None

    def _acquire(self, block: _CachedBlock) -> None:
        if block.refs == 0:
            self._num_inactive -= 1  # its heap entry goes stale
        block.refs += 1

    def _evict_one(self) -> _CachedBlock | None:
        """Free one block, least recently released first; returns the block whose hash left the cache, if
        one did."""
        while True:
            released_at, h = heapq.heappop(self._leaves)
            block = self._cached.get(h)
            if block is None:
                continue
            spare = block.spare
            if spare and released_at in spare:  # a free copy: the hash stays with the cached block
                del spare[released_at]
                self._num_spare -= 1
                return None
            if block.refs or block.released_at != released_at:
                continue  # stale
            held = self._copies.get(h)
            if spare or held:
                # The hash stays: the oldest registered copy stands in for the evicted block (the one
                # vLLM's next prefix hit finds), a held one taken over by its sequence, a free one at
                # its own release tick.
                if held and (not spare or held[0][0] < min(spare.values())):
                    self._adopt_copy(block)
                elif spare:
                    tick = min(spare, key=spare.__getitem__)
                    block.released_at = tick
                    del spare[tick]
                    self._num_spare -= 1
                return None
            if block.children:
                continue  # not a leaf: pushed again when its last child goes
            parent = self._drop(h)
            if parent is not None and parent.refs == 0 and parent.children == 0:
                heapq.heappush(self._leaves, (parent.released_at, parent.seq_hash))
            return block

    def _adopt_copy(self, block: _CachedBlock) -> None:
        """The oldest copy a sequence holds of inactive `block` becomes that sequence's reference to
        `block`, whose hash stays cached: one block is freed (vLLM's evicted one)."""
        _, holder, index = self._copies[block.seq_hash][0]
        self._take_copy(block.seq_hash, holder, index)
        self._seqs[holder].copies.remove(index)
        self._num_private -= 1
        self._acquire(block)

    def _take_copy(self, h: int, seq_id: str, index: int) -> int:
        """Forget the copy `seq_id` holds as its block `index`; returns its registration order."""
        copies = self._copies[h]
        entry = next(c for c in copies if c[1:] == (seq_id, index))
        copies.remove(entry)
        if not copies:
            del self._copies[h]
        return entry[0]

    def _drop(self, h: int) -> _CachedBlock | None:
        """Remove an inactive block from the cache; returns its parent if still cached."""
        block = self._cached.pop(h)
        self._num_inactive -= 1
        parent = self._cached.get(block.parent) if block.parent is not None else None
        if parent is not None:
            parent.children -= 1
        return parent

    def _emit(self, event: KvEvent) -> None:
        if self._on_event is not None:
            self._on_event(event)
