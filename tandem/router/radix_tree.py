"""The router's global prefix index (Dynamo's `lib/kv-router/src/indexer` radix tree).

`RadixTree` holds, for every block any worker reported stored, one node keyed by the block's
local hash (`tokens_hash`) under its parent; `find_matches` walks a request's local hashes from
the root and scores each worker by the number of consecutive prefix blocks it holds. The indexers
that feed it are in indexer.py.

Performance notes (this runs on the frontend's event loop): workers are bits of an int mask over
a dense worker index. A node's children are split into plain ones (held by every worker holding
the node) and boundary ones (`RadixTree`), so the match walk compares masks only at the few
boundary edges; and down the paths stored as chains (lanes, `RadixTree`) it compares a prompt's
blocks with the path's a list slice at a time, not one dict lookup per block. Workers dropping out
(rare) are the only per-worker work. Nodes holding equal masks share one int object
(`RadixTree._share`), which saves memory and lets updates reuse a computed mask. Nodes are int ids
into flat lists, and each node's children a dict of ints: the index holds no container the garbage
collector tracks per node (a tree of 1M node objects made each full collection pause the loop for
~0.5 s); a lane is a few such containers for a whole chain.
"""

from __future__ import annotations

import bisect
import logging
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat

from tandem.router.protocols import RouterEvent

log = logging.getLogger(__name__)

WorkerKey = tuple[int, int]
"""(worker_id, dp_rank)"""


@dataclass
class OverlapScores:
    scores: dict[WorkerKey, int] = field(default_factory=dict)
    """Consecutive prefix blocks matched, only for workers with at least one."""
    tree_sizes: dict[WorkerKey, int] = field(default_factory=dict)
    """Blocks indexed per matched worker."""

    @property
    def frequencies(self) -> list[int]:
        """`frequencies[d]`: number of workers holding the first `d + 1` blocks of the request (from
        `scores`, when asked: the walk does not build a list as long as the prompt)."""
        ends = [0] * (max(self.scores.values(), default=0) + 1)  # workers whose match ends at each depth
        for blocks in self.scores.values():
            ends[blocks] += 1
        out, held = [], len(self.scores)
        for depth in range(len(ends) - 1):
            held -= ends[depth]
            out.append(held)
        return out


ROOT = 0  # node id of the root
NO_LANE = -1  # lane head of a node in no lane

# Blocks in the first slice `_shared_run` compares.
_RUN_CHUNK = 32

# Blocks a store must bring to start a lane: a shorter chain walks as fast block by block, and a lane
# is a few containers the garbage collector tracks.
_LANE_MIN_BLOCKS = 32


class _Lane:
    """A path of nodes below a head node, each the child of the one before: `find_matches` compares a
    prompt's blocks against `hashes` one list slice at a time (`nodes` is an array: nothing in it for
    the garbage collector). `stops`: the positions (ascending) whose edge from the node before is a
    boundary edge, where the walk compares masks."""

    __slots__ = ("hashes", "nodes", "stops")

    def __init__(self) -> None:
        self.hashes: list[int] = []  # local hashes of `nodes`
        self.nodes = array("q")
        self.stops: list[int] = []


def _shared_run(query: list[int], start: int, hashes: list[int]) -> int:
    """How many of `hashes` the prompt `query` repeats from `start` on: slices of doubling length, then
    halving ones around the first difference, so the cost follows the length shared."""
    if query[start] != hashes[0]:
        return 0
    size = min(len(hashes), len(query) - start)
    low, step = 1, _RUN_CHUNK  # the first `low` are shared
    while low < size:
        high = min(low + step, size)
        if query[start + low:start + high] != hashes[low:high]:
            break
        low, step = high, step * 2
    else:
        return size
    while high - low > 8:
        middle = (low + high) // 2
        if query[start + low:start + middle] == hashes[low:middle]:
            low = middle
        else:
            high = middle
    while query[start + low] == hashes[low]:
        low += 1
    return low


# Children of every leaf: shared, never mutated (saves a dict per leaf).
_NO_CHILDREN: dict[int, int] = {}

# Distinct mask values kept shared (`RadixTree._share`) before the table starts over.
_MAX_SHARED_MASKS = 1 << 14


class RadixTree:
    """Global prefix index: nodes keyed by the router's local block hash (tokens_hash) under their
    parent; each node knows the workers holding it; per worker a lookup external block_hash -> node.

    A worker holds a node while any of its engine hashes there is stored. A node nobody holds
    stays while it has children, so a re-stored middle block reconnects the chain below it;
    childless empty nodes are dropped (their ids are reused).

    A node's children are split: those held by every worker holding the node (a superset mask)
    are its plain children (`_children`), the others its boundary children (`_boundary`). Going
    down a plain edge nobody drops out of a match, so `find_matches` only looks at masks where it
    crosses a boundary edge; every mask change re-places the edges it can flip (`_restep`).

    Lanes: a node created below the last node of a lane extends that lane, else, when the store
    brings at least `_LANE_MIN_BLOCKS` blocks, it starts one headed by its parent (unless the parent
    heads one already); children of the root are in none.
    A lane follows tree edges, plain or boundary (its `stops`), so it stays valid while its nodes
    live: a node freed (childless) is the last of its lane and leaves it, and an edge changing
    sides moves a stop. A prompt stored as one chain is then one or a few lanes however its
    holders split it."""

    def __init__(self) -> None:
        # per node id: workers holding it (bit mask), parent, local hash, children {local hash: id}
        self._masks: list[int] = [0]
        self._parents: list[int] = [ROOT]
        self._locals: list[int] = [0]
        self._children: list[dict[int, int]] = [_NO_CHILDREN]
        self._free_ids: list[int] = []
        self._num_nodes = 0
        self._shared: dict[int, int] = {}  # mask value -> the one object nodes hold for it
        # node -> {local hash: id} of its boundary children (see the class notes), only where there are any
        self._boundary: dict[int, dict[int, int]] = {}
        # (worker index, node) -> extra engine hashes the worker holds there beyond the first (rare)
        self._aliases: dict[tuple[int, int], int] = {}
        self._index: dict[WorkerKey, int] = {}  # worker -> bit index
        self._by_index: list[WorkerKey | None] = []  # bit index -> worker (None: free)
        self._lookups: list[dict[int, int]] = []  # bit index -> {block_hash: node id}
        self._free: list[int] = []
        self._lanes: dict[int, _Lane] = {}  # head node -> its lane
        # per node: the head of its lane (NO_LANE: none) and its position there; left stale when the
        # node leaves the lane, so `_lane_of` checks them against the lane
        self._lane_heads: list[int] = [NO_LANE]
        self._lane_positions: list[int] = [0]

    # -- workers ---------------------------------------------------------------------------------
    def _worker_index(self, worker: WorkerKey) -> int:
        idx = self._index.get(worker)
        if idx is None:
            if self._free:
                idx = self._free.pop()
                self._by_index[idx] = worker
                self._lookups[idx] = {}
            else:
                idx = len(self._by_index)
                self._by_index.append(worker)
                self._lookups.append({})
            self._index[worker] = idx
        return idx

    def workers(self) -> set[WorkerKey]:
        return set(self._index)

    def num_blocks(self, worker: WorkerKey | None = None) -> int:
        """Blocks indexed for `worker`, or the number of nodes in the tree."""
        if worker is None:
            return self._num_nodes
        idx = self._index.get(worker)
        return 0 if idx is None else len(self._lookups[idx])

    def path(self, worker: WorkerKey, block_hash: int) -> list[int] | None:
        """The local hashes from the root down to the worker's block `block_hash` (None: it holds none)."""
        idx = self._index.get(worker)
        node = None if idx is None else self._lookups[idx].get(block_hash)
        if node is None:
            return None
        path = []
        while node != ROOT:
            path.append(self._locals[node])
            node = self._parents[node]
        path.reverse()
        return path

    # -- updates ---------------------------------------------------------------------------------
    def store(self, worker: WorkerKey, parent_hash: int | None, blocks: Sequence[tuple[int, int]]) -> int:
        """Add `(block_hash, tokens_hash)` blocks, a chain below the worker's block `parent_hash`
        (None: the root). Returns the number of blocks stored: 0 when the parent is unknown."""
        idx = self._worker_index(worker)
        lookup = self._lookups[idx]
        if parent_hash is None:
            node = ROOT
        else:
            found = lookup.get(parent_hash)
            if found is None:
                log.warning("worker %s: stored blocks under unknown parent %d dropped", worker, parent_hash)
                return 0
            node = found
        bit = 1 << idx
        children, masks, free_ids, boundary = self._children, self._masks, self._free_ids, self._boundary
        restep = self._restep
        heads, positions = self._lane_heads, self._lane_positions
        before = after = None  # the last mask taken from and the mask it became
        gained = False  # whether `node` took the worker's bit in this call
        lane: _Lane | None = None  # the lane `node` was just appended to, headed by `head`
        head = NO_LANE
        starts = len(blocks) >= _LANE_MIN_BLOCKS  # whether this chain may start a lane
        placed = False  # whether a new node came yet: the later ones are below it (its lane, or one they start)
        for block_hash, local_hash in blocks:
            siblings = children[node]
            child = found = siblings.get(local_hash)
            if child is None and node in boundary:
                child = boundary[node].get(local_hash)
            stepped = child is not None and found is None  # an existing boundary child
            if child is None:  # a new node (inline: most stored blocks in a busy index are new)
                self._num_nodes += 1
                if free_ids:
                    child = free_ids.pop()
                    masks[child] = 0
                    self._parents[child] = node
                    self._locals[child] = local_hash
                    children[child] = _NO_CHILDREN
                    heads[child] = NO_LANE
                else:
                    child = len(masks)
                    masks.append(0)
                    self._parents.append(node)
                    self._locals.append(local_hash)
                    children.append(_NO_CHILDREN)
                    heads.append(NO_LANE)
                    positions.append(0)
                above = masks[node]
                stop = above != 0 and above != bit  # the new node (the worker alone) misses one of its parent's
                if stop:
                    boundary.setdefault(node, {})[local_hash] = child
                elif siblings is _NO_CHILDREN:
                    children[node] = {local_hash: child}
                else:
                    siblings[local_hash] = child
                if lane is not None:  # (`_lane_add` inline: `node` ends `lane`)
                    heads[child] = head
                    positions[child] = position = len(lane.nodes)
                    if stop:
                        lane.stops.append(position)
                    lane.hashes.append(local_hash)
                    lane.nodes.append(child)
                elif starts or not placed:
                    lane = self._lane_add(node, child, local_hash, stop, starts)
                    head = heads[child]
                    placed = True
            else:
                lane = None
            # The split of `node`'s children: when `node` took the bit, its other plain children lacking
            # it now miss one of its workers; `child`'s edge flips only if `child` took the bit and `node`
            # did not (both taking it changes nothing). `child`'s own children wait for the next block.
            if gained and len(siblings) > (found is not None):
                for other in [other for other in children[node].values() if other != child]:
                    restep(other)
            previous = lookup.get(block_hash)
            took = False
            if previous != child:  # (a re-stored block needs nothing)
                mask = masks[child]
                if mask & bit:  # a second engine hash for a block the worker holds
                    key = (idx, child)
                    self._aliases[key] = self._aliases.get(key, 0) + 1
                else:
                    if mask is not before:
                        before, after = mask, self._share(mask | bit)
                    masks[child] = after
                    took = True
                    # Both `node` and `child` taking the bit keeps `child`'s edge, unless `child` was put at
                    # the boundary after `node` took it (the engine reused a hash there: `_release` below).
                    if not gained or stepped:
                        restep(child)
                if previous is not None:  # the engine reused a hash for another chain
                    self._release(idx, (previous,))
                lookup[block_hash] = child
            node = child
            gained = took
        if gained:
            for other in list(children[node].values()):
                restep(other)
        return len(blocks)

    def _restep(self, node: int) -> None:
        """Put `node` with its parent's plain children if it has every worker of the parent, else
        with its boundary children."""
        parent = self._parents[node]
        local = self._locals[node]
        above = self._masks[parent]
        plain = self._children[parent]
        if self._masks[node] & above == above:
            if local not in plain:
                steps = self._boundary[parent]
                del steps[local]
                if not steps:
                    del self._boundary[parent]
                if plain is _NO_CHILDREN:
                    self._children[parent] = {local: node}
                else:
                    plain[local] = node
                lane, position = self._lane_of(node)
                if lane is not None:
                    lane.stops.remove(position)
        elif local in plain:
            del plain[local]
            if not plain:
                self._children[parent] = _NO_CHILDREN
            self._boundary.setdefault(parent, {})[local] = node
            lane, position = self._lane_of(node)
            if lane is not None:
                bisect.insort(lane.stops, position)

    # -- lanes -----------------------------------------------------------------------------------
    def _lane_of(self, node: int) -> tuple[_Lane | None, int]:
        """The lane holding `node` and its position there; (None, 0) when none does."""
        lane = self._lanes.get(self._lane_heads[node])
        if lane is not None:
            position = self._lane_positions[node]
            if position < len(lane.nodes) and lane.nodes[position] == node:
                return lane, position
        return None, 0

    def _lane_add(self, parent: int, child: int, local: int, stop: bool, start: bool) -> _Lane | None:
        """`child` is new below `parent` (over a boundary edge if `stop`): it extends the lane ending at
        `parent`, else (if `start`) starts one headed by `parent` unless `parent` heads one. Returns
        its lane. (`child`'s lane head is NO_LANE already: a new node's.)"""
        if parent == ROOT:
            return None
        lane, position = self._lane_of(parent)
        if lane is not None and position == len(lane.nodes) - 1:
            head = self._lane_heads[parent]
        elif not start or parent in self._lanes:
            return None
        else:
            head, lane = parent, _Lane()
            self._lanes[parent] = lane
        self._lane_heads[child] = head
        self._lane_positions[child] = len(lane.nodes)
        if stop:
            lane.stops.append(len(lane.nodes))
        lane.hashes.append(local)
        lane.nodes.append(child)
        return lane

    def _share(self, mask: int) -> int:
        """The one object held for the value `mask`: a chain of nodes held by the same workers
        then holds one object (less memory, and `store` / `_release` reuse the mask computed for
        the block before). Sharing is only an optimisation: the table starts over when it grows."""
        shared = self._shared
        held = shared.get(mask)
        if held is None:
            if len(shared) >= _MAX_SHARED_MASKS:
                shared.clear()
            held = shared[mask] = mask
        return held

    def remove(self, worker: WorkerKey, block_hashes: Sequence[int]) -> int:
        """Remove the worker's blocks `block_hashes` (unknown ones are ignored); returns how many
        were removed."""
        idx = self._index.get(worker)
        if idx is None:
            return 0
        nodes = [node for node in map(self._lookups[idx].pop, block_hashes, repeat(None)) if node is not None]
        self._release(idx, nodes)
        return len(nodes)

    def _release(self, idx: int, nodes: Iterable[int]) -> None:
        """One of worker `idx`'s block hashes at each of `nodes` is gone: take the worker off the
        node unless another one remains, then drop the nodes left empty and childless."""
        masks, children, aliases, boundary = self._masks, self._children, self._aliases, self._boundary
        parents, locals_ = self._parents, self._locals
        lanes, heads = self._lanes, self._lane_heads
        keep = ~(1 << idx)
        before = after = None  # the last mask taken from and the mask it became
        lost = []  # the nodes the worker is off now
        freed = set()
        for node in nodes:
            if aliases:
                key = (idx, node)
                count = aliases.get(key)
                if count is not None:
                    if count == 1:
                        del aliases[key]
                    else:
                        aliases[key] = count - 1
                    continue
            mask = masks[node]
            if mask is not before:
                before, after = mask, self._share(mask & keep)
            masks[node] = after
            lost.append(node)
            while node != ROOT and not masks[node] and not children[node] and node not in boundary:
                parent, local = parents[node], locals_[node]
                siblings = children[parent]
                if local in siblings:
                    del siblings[local]
                    if not siblings:
                        children[parent] = _NO_CHILDREN
                else:
                    steps = boundary[parent]
                    del steps[local]
                    if not steps:
                        del boundary[parent]
                # A freed node is childless: the last of its lane, if any (the lane ends before it).
                head = heads[node]
                lane = lanes.get(head)
                if lane is not None and lane.nodes[-1] == node:
                    lane.nodes.pop()
                    lane.hashes.pop()
                    if lane.stops and lane.stops[-1] == len(lane.nodes):
                        lane.stops.pop()
                    if not lane.nodes:
                        del lanes[head]
                freed.add(node)
                self._free_ids.append(node)
                self._num_nodes -= 1
                node = parent
        if not lost:
            return
        # The split: a node off the bit may now miss a worker of its parent, unless the parent is off
        # it too; its plain children keep every worker it has, its boundary children may not miss any.
        off = set(lost)
        for node in lost:
            if freed and node in freed:
                continue
            if parents[node] not in off:
                self._restep(node)
            if node in boundary:
                for child in [child for child in boundary[node].values() if child not in off]:
                    self._restep(child)

    def clear(self, worker: WorkerKey) -> None:
        """Remove every block of `worker` (one dp rank); the worker stays known."""
        idx = self._index.get(worker)
        if idx is None:
            return
        lookup = self._lookups[idx]
        self._release(idx, list(lookup.values()))
        lookup.clear()

    def remove_worker(self, worker_id: int) -> None:
        """Forget every dp rank of `worker_id`."""
        for key in [key for key in self._index if key[0] == worker_id]:
            self.clear(key)
            idx = self._index.pop(key)
            self._by_index[idx] = None
            self._lookups[idx] = {}
            self._free.append(idx)

    def apply(self, event: RouterEvent) -> None:
        """Apply a worker's stored / removed / cleared event."""
        kv = event.event
        worker = (event.worker_id, kv.dp_rank)
        data = kv.data
        if data == "cleared":
            self._worker_index(worker)
            self.clear(worker)
        elif data.stored is not None:  # type: ignore[union-attr]
            stored = data.stored  # type: ignore[union-attr]
            self.store(worker, stored.parent_hash, [(b.block_hash, b.tokens_hash) for b in stored.blocks])
        else:
            self._worker_index(worker)
            self.remove(worker, data.removed.block_hashes)  # type: ignore[union-attr]

    # -- queries ---------------------------------------------------------------------------------
    def find_matches(self, local_hashes: Sequence[int], early_exit: bool = False) -> OverlapScores:
        """Score each worker by the number of consecutive prefix blocks of `local_hashes` it holds.
        `early_exit`: stop walking once a single worker is left (its score is then a lower bound)."""
        if not local_hashes:
            return OverlapScores()
        children, masks = self._children, self._masks
        node = children[ROOT].get(local_hashes[0])
        if node is None or not masks[node]:
            return OverlapScores()
        active = masks[node]
        by_index, lookups = self._by_index, self._lookups
        scores: dict[WorkerKey, int] = {}
        tree_sizes: dict[WorkerKey, int] = {}
        matched = 1  # blocks the workers still active hold

        def score(workers: int, depth: int) -> None:
            """Give every worker whose bit is set in `workers` the score `depth`."""
            while workers:
                low = workers & -workers
                i = low.bit_length() - 1
                scores[by_index[i]] = depth  # type: ignore[index]
                tree_sizes[by_index[i]] = len(lookups[i])  # type: ignore[index]
                workers ^= low

        def cross(child: int, depth: int) -> bool:
            """The walk goes down a boundary edge to `child`, the prompt's block `depth`: workers
            lacking it score `depth`. True when the walk ends there."""
            nonlocal active, matched
            still = masks[child] & active
            if still != active:
                score(active ^ still, depth)
                active = still
                if not active or (early_exit and active & (active - 1) == 0):
                    matched = depth + 1  # the remaining worker holds this block too
                    return True
            return False

        if not early_exit or active & (active - 1):
            # The walk is the hot loop (a 32k-token prompt is 2,048 blocks). Along a lane, the blocks the
            # prompt shares with it are one slice compare, and masks are compared only at its stops; off
            # lanes, one dict lookup per block, comparing masks only at boundary edges.
            query = local_hashes if type(local_hashes) is list else list(local_hashes)
            total = matched = len(query)
            lanes, boundary = self._lanes, self._boundary
            depth = 1  # blocks matched so far, the last at `node`
            while depth < total:
                lane = lanes.get(node)
                if lane is not None:
                    run = _shared_run(query, depth, lane.hashes)
                    if run:
                        for stop in lane.stops:
                            if stop >= run or cross(lane.nodes[stop], depth + stop):
                                break
                        else:
                            stop = run
                        if stop < run:  # the walk ended at a stop
                            break
                        node = lane.nodes[run - 1]
                        depth += run
                        continue
                local_hash = query[depth]
                child = children[node].get(local_hash)
                if child is None:
                    steps = boundary.get(node)
                    child = None if steps is None else steps.get(local_hash)
                    if child is None:
                        matched = depth
                        break
                    if cross(child, depth):
                        break
                node = child
                depth += 1
        if active:
            score(active, matched)
        return OverlapScores(scores, tree_sizes)
