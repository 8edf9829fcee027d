"""Router prefix index: hand cases, RadixTree against a naive reference over random
operation sequences, KvIndexer event ids and gap recovery, ApproxIndexer TTL and pruning."""

from __future__ import annotations

import array
import contextlib
import random
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.router import radix_tree as tree_module
from tandem.router.indexer import ApproxIndexer, EventGap, KvIndexer
from tandem.router.protocols import (
    KvBlock,
    RouterEvent,
    cleared_event,
    removed_event,
    stored_event,
)
from tandem.router.radix_tree import RadixTree, WorkerKey

A: WorkerKey = (1, 0)
B: WorkerKey = (2, 0)
C: WorkerKey = (3, 0)


def chain(path: tuple[int, ...]) -> list[tuple[int, int]]:
    """(block_hash, tokens_hash) pairs for a path of local hashes; the engine hash is
    position-aware, as a real engine's sequence hash."""
    return [(hash(("blk", path[: i + 1])) & (2**63 - 1), local) for i, local in enumerate(path)]


def engine_hash(path: tuple[int, ...]) -> int:
    return chain(path)[-1][0]


# -- RadixTree by hand ---------------------------------------------------------------------------
def test_shared_prefix_and_divergence() -> None:
    tree = RadixTree()
    assert tree.store(A, None, chain((1, 2, 3, 4))) == 4
    tree.store(B, None, chain((1, 2, 5)))
    tree.store(C, None, chain((9,)))
    result = tree.find_matches([1, 2, 3, 4, 7])
    assert result.scores == {A: 4, B: 2}
    assert result.frequencies == [2, 2, 1, 1]
    assert result.tree_sizes == {A: 4, B: 3}
    assert tree.find_matches([1, 2, 5]).scores == {A: 2, B: 3}
    assert tree.find_matches([2, 3]).scores == {}
    assert tree.find_matches([]).scores == {}
    # shared (parent, local) nodes: 1, 2, 3, 4, 5, 9
    assert tree.num_blocks() == 6
    assert tree.num_blocks(A) == 4 and tree.num_blocks(C) == 1
    assert tree.workers() == {A, B, C}


def test_store_continues_under_parent() -> None:
    tree = RadixTree()
    blocks = chain((1, 2, 3))
    tree.store(A, None, blocks[:1])
    assert tree.store(A, blocks[0][0], blocks[1:]) == 2
    assert tree.find_matches([1, 2, 3]).scores == {A: 3}


def test_unknown_parent_dropped() -> None:
    tree = RadixTree()
    tree.store(A, None, chain((1,)))
    assert tree.store(A, 12345, chain((1, 2))[1:]) == 0
    # parents are per worker: B cannot hang blocks under A's block
    assert tree.store(B, engine_hash((1,)), chain((1, 2))[1:]) == 0
    assert tree.num_blocks() == 1
    assert tree.find_matches([1, 2]).scores == {A: 1}


def test_removal_in_the_middle() -> None:
    tree = RadixTree()
    tree.store(A, None, chain((1, 2, 3)))
    tree.store(B, None, chain((1, 2, 3)))
    assert tree.remove(A, [engine_hash((1, 2))]) == 1
    assert tree.find_matches([1, 2, 3]).scores == {A: 1, B: 3}
    tree.remove(B, [engine_hash((1, 2))])
    # nobody holds block 2 any more, but 3 below it is still indexed
    assert tree.find_matches([1, 2, 3]).scores == {A: 1, B: 1}
    assert tree.num_blocks() == 3
    # re-storing the middle block reconnects the chain
    tree.store(A, engine_hash((1,)), chain((1, 2))[1:])
    assert tree.find_matches([1, 2, 3]).scores == {A: 3, B: 1}
    assert tree.remove(A, [999]) == 0


def test_empty_subtrees_are_dropped() -> None:
    tree = RadixTree()
    tree.store(A, None, chain((1, 2, 3)))
    tree.remove(A, [engine_hash((1, 2, 3)), engine_hash((1, 2))])
    assert tree.num_blocks() == 1
    tree.remove(A, [engine_hash((1,))])
    assert tree.num_blocks() == 0 and tree.num_blocks(A) == 0
    assert tree.find_matches([1]).scores == {}


def test_clear_and_remove_worker_and_dp_ranks() -> None:
    tree = RadixTree()
    a1: WorkerKey = (1, 1)
    tree.store(A, None, chain((1, 2)))
    tree.store(a1, None, chain((1, 2, 3)))
    tree.store(B, None, chain((1,)))
    assert tree.find_matches([1, 2, 3]).scores == {A: 2, a1: 3, B: 1}
    tree.clear(a1)
    assert tree.find_matches([1, 2, 3]).scores == {A: 2, B: 1}
    assert a1 in tree.workers() and tree.num_blocks(a1) == 0
    tree.store(a1, None, chain((1, 2, 3)))
    tree.remove_worker(1)
    assert tree.workers() == {B}
    assert tree.find_matches([1, 2, 3]).scores == {B: 1}
    assert tree.num_blocks() == 1
    # freed worker slots are reused without leaking the old worker's blocks
    tree.store(C, None, chain((4,)))
    assert tree.find_matches([1]).scores == {B: 1}
    assert tree.find_matches([4]).scores == {C: 1}


def test_early_exit() -> None:
    tree = RadixTree()
    tree.store(A, None, chain((1, 2, 3, 4)))
    tree.store(B, None, chain((1, 2)))
    assert tree.find_matches([1, 2, 3, 4]).scores == {A: 4, B: 2}
    # once only A is left (at block 3), the walk stops; A's score is a lower bound
    assert tree.find_matches([1, 2, 3, 4], early_exit=True).scores == {A: 3, B: 2}
    tree.remove_worker(2)
    assert tree.find_matches([1, 2, 3, 4], early_exit=True).scores == {A: 1}


def test_reused_engine_hash_moves_the_block() -> None:
    tree = RadixTree()
    tree.store(A, None, [(7, 1)])
    tree.store(A, None, [(7, 2)])
    assert tree.find_matches([1]).scores == {}
    assert tree.find_matches([2]).scores == {A: 1}
    assert tree.num_blocks() == 1


def test_two_engine_hashes_for_one_block() -> None:
    tree = RadixTree()
    tree.store(A, None, [(7, 1)])
    tree.store(A, None, [(8, 1)])
    assert tree.num_blocks(A) == 2 and tree.num_blocks() == 1
    tree.remove(A, [7])
    assert tree.find_matches([1]).scores == {A: 1}  # still held through hash 8
    tree.remove(A, [8])
    assert tree.find_matches([1]).scores == {}
    assert tree.num_blocks() == 0


def test_freed_nodes_reused_under_the_same_parent() -> None:
    """Ids freed by a removal and reused by another chain under the same parent, held by the same
    worker (the same mask object), are not reached through the old local hashes."""
    tree = RadixTree()
    tree.store(A, None, chain((1, 2, 3, 4, 5)))
    assert tree.find_matches([1, 2, 3, 4, 5]).scores == {A: 5}
    tree.remove(A, [engine_hash((1, 2, 3, 4, 5)), engine_hash((1, 2, 3, 4)), engine_hash((1, 2, 3))])
    assert tree.num_blocks() == 2
    tree.store(A, engine_hash((1, 2)), chain((1, 2, 6, 7, 8))[2:])  # the freed ids again
    assert tree.num_blocks() == 5
    assert tree.find_matches([1, 2, 3, 4, 5]).scores == {A: 2}
    assert tree.find_matches([1, 2, 6, 7, 8]).scores == {A: 5}
    tree.store(B, None, chain((1, 2, 6, 7)))
    assert tree.find_matches([1, 2, 6, 7, 8]).scores == {A: 5, B: 4}
    assert tree.find_matches((1, 2, 6, 7, 8), early_exit=True).scores == {A: 5, B: 4}


def test_apply_router_events() -> None:
    tree = RadixTree()
    blocks = [KvBlock(h, local) for h, local in chain((1, 2))]
    tree.apply(RouterEvent(5, stored_event(0, None, blocks, dp_rank=2)))
    assert tree.find_matches([1, 2]).scores == {(5, 2): 2}
    tree.apply(RouterEvent(5, removed_event(1, [blocks[1].block_hash], dp_rank=2)))
    assert tree.find_matches([1, 2]).scores == {(5, 2): 1}
    tree.apply(RouterEvent(5, cleared_event(2, dp_rank=2)))
    assert tree.find_matches([1, 2]).scores == {}
    assert tree.workers() == {(5, 2)}


# -- RadixTree against a naive reference ---------------------------------------------------------
class NaiveIndex:
    """Per worker: block_hash -> path of local hashes (fixed when stored)."""

    def __init__(self) -> None:
        self.blocks: dict[WorkerKey, dict[int, tuple[int, ...]]] = {}

    def store(self, worker: WorkerKey, parent_hash: int | None, blocks: list[tuple[int, int]]) -> None:
        held = self.blocks.setdefault(worker, {})
        if parent_hash is None:
            path: tuple[int, ...] = ()
        elif parent_hash in held:
            path = held[parent_hash]
        else:
            return
        for block_hash, local in blocks:
            path = (*path, local)
            held[block_hash] = path

    def remove(self, worker: WorkerKey, hashes: list[int]) -> None:
        for block_hash in hashes:
            self.blocks.get(worker, {}).pop(block_hash, None)

    def clear(self, worker: WorkerKey) -> None:
        if worker in self.blocks:
            self.blocks[worker] = {}

    def remove_worker(self, worker_id: int) -> None:
        for key in [key for key in self.blocks if key[0] == worker_id]:
            del self.blocks[key]

    def scores(self, query: list[int]) -> dict[WorkerKey, int]:
        out = {}
        for worker, held in self.blocks.items():
            paths = set(held.values())
            depth = 0
            while depth < len(query) and tuple(query[: depth + 1]) in paths:
                depth += 1
            if depth:
                out[worker] = depth
        return out

    def num_nodes(self) -> int:
        """Nodes: every held path and its prefixes that have a held path below them."""
        paths = {path for held in self.blocks.values() for path in held.values()}
        return len({path[:i] for path in paths for i in range(1, len(path) + 1)})


WORKERS = [(1, 0), (1, 1), (2, 0), (3, 0)]
LOCALS = st.integers(min_value=1, max_value=3)  # few local hashes: lots of shared prefixes
PATHS = st.lists(LOCALS, min_size=1, max_size=6).map(tuple)
OPS = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(WORKERS), PATHS, st.integers(0, 5)),
    st.tuples(st.just("remove"), st.sampled_from(WORKERS), PATHS),
    # engine hashes from a tiny pool: one hash reused for several chains, several hashes for a block
    st.tuples(st.just("store_raw"), st.sampled_from(WORKERS), PATHS, st.lists(st.integers(0, 7), min_size=6, max_size=6)),
    st.tuples(st.just("remove_raw"), st.sampled_from(WORKERS), st.lists(st.integers(0, 7), max_size=3)),
    st.tuples(st.just("clear"), st.sampled_from(WORKERS)),
    st.tuples(st.just("remove_worker"), st.sampled_from([1, 2, 3])),
)


@contextlib.contextmanager
def lanes_from(blocks: int) -> Iterator[None]:
    """Stores of at least `blocks` blocks start lanes (the index's threshold is longer than these chains)."""
    default = tree_module._LANE_MIN_BLOCKS
    tree_module._LANE_MIN_BLOCKS = blocks
    try:
        yield
    finally:
        tree_module._LANE_MIN_BLOCKS = default


@pytest.mark.parametrize("lane_min_blocks", [1, 3])
@settings(max_examples=500, deadline=None)
@given(ops=st.lists(OPS, max_size=40), queries=st.lists(PATHS, min_size=1, max_size=5))
def test_radix_tree_matches_naive_reference(ops: list[tuple], queries: list[tuple[int, ...]],
                                            lane_min_blocks: int) -> None:
    with lanes_from(lane_min_blocks):
        check_against_naive_reference(ops, queries)


def check_against_naive_reference(ops: list[tuple], queries: list[tuple[int, ...]]) -> None:
    tree, naive = RadixTree(), NaiveIndex()
    for op in ops:
        if op[0] == "store":
            _, worker, path, split = op
            # store the path's tail below its prefix (an unknown parent when the worker lacks it)
            split = min(split, len(path) - 1)
            parent = engine_hash(path[:split]) if split else None
            blocks = chain(path)[split:]
            tree.store(worker, parent, blocks)
            naive.store(worker, parent, blocks)
        elif op[0] == "remove":
            _, worker, path = op
            hashes = [h for h, _ in chain(path)][-2:]
            tree.remove(worker, hashes)
            naive.remove(worker, hashes)
        elif op[0] == "store_raw":
            _, worker, path, hashes = op
            raw = [(block_hash, local) for block_hash, local in zip(hashes, path, strict=False)]
            tree.store(worker, None, raw)
            naive.store(worker, None, raw)
        elif op[0] == "remove_raw":
            tree.remove(op[1], op[2])
            naive.remove(op[1], op[2])
        elif op[0] == "clear":
            tree.clear(op[1])
            naive.clear(op[1])
        else:
            tree.remove_worker(op[1])
            naive.remove_worker(op[1])
        assert tree.num_blocks() == naive.num_nodes()
        assert_children_split(tree)
    for query in queries:
        expected = naive.scores(list(query))
        result = tree.find_matches(list(query))
        assert result.scores == expected
        assert result.tree_sizes == {w: len(naive.blocks[w]) for w in expected}
        depth = max(expected.values(), default=0)
        assert result.frequencies == [sum(s > d for s in expected.values()) for d in range(depth)]
        early = tree.find_matches(list(query), early_exit=True).scores
        assert early.keys() == expected.keys()
        assert all(early[w] <= expected[w] for w in early)


def assert_children_split(tree: RadixTree) -> None:
    """Each child is with its parent's plain children exactly when it has every worker of the parent
    (the walk looks at no mask down a plain edge), else with its boundary children."""
    masks = tree._masks
    for parent, plain in enumerate(tree._children):
        for local, child in plain.items():
            assert masks[child] & masks[parent] == masks[parent]
            assert tree._parents[child] == parent and tree._locals[child] == local
    for parent, steps in tree._boundary.items():
        assert steps
        for local, child in steps.items():
            assert masks[child] & masks[parent] != masks[parent]
            assert tree._parents[child] == parent and tree._locals[child] == local
            assert local not in tree._children[parent]
    assert_lanes(tree)


def assert_lanes(tree: RadixTree) -> None:
    """Each lane is a path of live nodes below its head, each node the child (by its local hash) of the one
    before, with a stop exactly where that edge is a boundary edge; a node is in at most one lane."""
    live = set(range(len(tree._masks))) - set(tree._free_ids)
    seen: set[int] = set()
    for head, lane in tree._lanes.items():
        assert head in live and head != 0 and lane.nodes
        assert len(lane.hashes) == len(lane.nodes)
        parent = head
        for position, (local, node) in enumerate(zip(lane.hashes, lane.nodes, strict=True)):
            assert node in live and node not in seen
            seen.add(node)
            assert tree._parents[node] == parent and tree._locals[node] == local
            assert tree._lane_of(node) == (lane, position)
            at_boundary = local in tree._boundary.get(parent, {})
            assert at_boundary or tree._children[parent].get(local) == node
            assert (position in lane.stops) == at_boundary
            parent = node
        assert lane.stops == sorted(set(lane.stops))


def early_exit_scores(scores: dict[WorkerKey, int]) -> dict[WorkerKey, int]:
    """`find_matches(early_exit=True)` for the full `scores`: the walk stops at the first depth where at
    most one worker is left, and that worker scores one block more than the depth."""
    depth = 0
    while len(left := [w for w, s in scores.items() if s > depth]) > 1:
        depth += 1
    return {w: (depth + 1 if w in left else s) for w, s in scores.items()}


@pytest.mark.parametrize("seed,shared_masks,lane_min_blocks", [(0, None, 16), (1, None, 1), (2, 3, 4), (3, 1, 16)])
def test_find_matches_at_scale_matches_reference(seed: int, shared_masks: int | None, lane_min_blocks: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Long chains over 70 workers (masks wider than a machine word) with branches, stores in chunks below
    their parent, removals of ranges, reused engine hashes, clears and departures: scores, tree sizes and
    frequencies equal the naive reference's, with and without early exit, for lists, tuples and other
    sequences. `shared_masks` shrinks the table of shared mask objects so it starts over often;
    `lane_min_blocks`: the stores that start lanes."""
    if shared_masks is not None:
        monkeypatch.setattr(tree_module, "_MAX_SHARED_MASKS", shared_masks)
    monkeypatch.setattr(tree_module, "_LANE_MIN_BLOCKS", lane_min_blocks)
    rng = random.Random(seed)
    workers = [(w, rank) for w in range(35) for rank in range(2)]
    prefixes = [tuple(rng.randint(1, 4) for _ in range(rng.randint(3, 30))) for _ in range(4)]
    conversations = [rng.choice(prefixes) + tuple(rng.randint(1, 4) for _ in range(rng.randint(0, 120)))
                     for _ in range(12)]
    tree, naive = RadixTree(), NaiveIndex()
    for step in range(400):
        worker, path = rng.choice(workers), rng.choice(conversations)
        op = rng.random()
        if op < 0.55:  # a prefix, stored in chunks each below the last
            path = path[: rng.randint(1, len(path))]
            blocks, start = chain(path), 0
            while start < len(path):
                end = min(len(path), start + rng.randint(1, 40))
                parent = blocks[start - 1][0] if start else None
                tree.store(worker, parent, blocks[start:end])
                naive.store(worker, parent, blocks[start:end])
                start = end
        elif op < 0.8:  # a range of the chain's blocks, in order or backwards
            start = rng.randrange(len(path))
            hashes = [h for h, _ in chain(path)[start:start + rng.randint(1, 30)]]
            if rng.random() < 0.5:
                hashes.reverse()
            tree.remove(worker, hashes)
            naive.remove(worker, hashes)
        elif op < 0.85:  # engine hashes from a small pool: moved blocks and second hashes
            raw = [(rng.randint(0, 9), local) for local in path[: rng.randint(1, 8)]]
            tree.store(worker, None, raw)
            naive.store(worker, None, raw)
        elif op < 0.93:
            tree.clear(worker)
            naive.clear(worker)
        else:
            tree.remove_worker(worker[0])
            naive.remove_worker(worker[0])
        if step % 20 == 19:
            assert tree.num_blocks() == naive.num_nodes()
            assert_children_split(tree)
            for query in [*rng.sample(conversations, 3), rng.choice(conversations)[: rng.randint(1, 40)],
                          (*rng.choice(prefixes), 9, 1)]:
                expected = naive.scores(list(query))
                sequence = rng.choice([list, tuple, lambda q: array.array("Q", q)])(query)
                result = tree.find_matches(sequence)
                assert result.scores == expected
                assert result.tree_sizes == {w: len(naive.blocks[w]) for w in expected}
                depth = max(expected.values(), default=0)
                assert result.frequencies == [sum(s > d for s in expected.values()) for d in range(depth)]
                early = tree.find_matches(sequence, early_exit=True)
                assert early.scores == early_exit_scores(expected)
                depth = max(early.scores.values(), default=0)
                assert early.frequencies == [sum(s > d for s in early.scores.values()) for d in range(depth)]


# -- KvIndexer -------------------------------------------------------------------------------------
def conversation_events(worker_id: int) -> list[RouterEvent]:
    """Stores, a removal in the middle and a clear, numbered from 0."""
    events = []
    data = [
        ("store", None, (1, 2)),
        ("store", (1, 2), (1, 2, 3, 4)),
        ("store", None, (5, 6)),
        ("remove", (1, 2)),
        ("store", None, (7,)),
        ("clear",),
        ("store", None, (1, 2, 3)),
        ("remove", (1, 2, 3)),
        ("store", (1, 2), (1, 2, 8)),
    ]
    for event_id, item in enumerate(data):
        if item[0] == "store":
            _, parent, path = item
            start = len(parent) if parent else 0
            blocks = [KvBlock(h, local) for h, local in chain(path)[start:]]
            kv = stored_event(event_id, engine_hash(parent) if parent else None, blocks)
        elif item[0] == "remove":
            kv = removed_event(event_id, [engine_hash(item[1])])
        else:
            kv = cleared_event(event_id)
        events.append(RouterEvent(worker_id, kv))
    return events


def index_state(indexer: KvIndexer) -> list[dict[WorkerKey, int]]:
    queries = [[1, 2, 3, 4], [1, 2, 8], [5, 6], [7]]
    return [indexer.find_matches(q).scores for q in queries]


def indexed(events: list[RouterEvent]) -> KvIndexer:
    """An index that received `events` live."""
    indexer = KvIndexer()
    for event in events:
        indexer.apply_event(event)
    return indexer


def test_kv_indexer_in_order_and_duplicates() -> None:
    indexer = KvIndexer()
    events = conversation_events(1)
    for event in events:
        assert indexer.apply_event(event) is None
    assert indexer.last_event_id((1, 0)) == len(events) - 1
    before = index_state(indexer)
    assert before == [{(1, 0): 2}, {(1, 0): 3}, {}, {}]
    assert indexer.apply_event(events[2]) is None  # duplicate: ignored
    assert index_state(indexer) == before
    assert indexer.events_applied == len(events)
    assert indexer.blocks_applied == 2 + 2 + 2 + 1 + 1 + 3 + 1 + 1
    assert indexer.gaps_detected == 0


def test_kv_indexer_gap_recovery_matches_no_gap() -> None:
    events = conversation_events(1)
    reference = indexed(events)
    indexer = indexed(events[:2])
    # events 2 and 3 are lost: event 4 reveals the gap and waits for it, and so does event 5
    gap = indexer.apply_event(events[4])
    assert gap == EventGap((1, 0), 2, 3)
    assert indexer.gaps_detected == 1
    assert indexer.last_event_id((1, 0)) == 4
    assert indexer.apply_event(events[5]) is None
    assert indexer.events_applied == 2
    # the fetched events (in any order) fill the gap; then the waiting ones apply, all in id order
    assert indexer.fill_gap(gap, [events[3], events[2]]) == 4
    assert indexer.last_event_id((1, 0)) == 5
    assert indexer.events_recovered == 2
    for event in events[6:]:
        assert indexer.apply_event(event) is None
    assert index_state(indexer) == index_state(reference)
    assert indexer.tree.num_blocks() == reference.tree.num_blocks()


def test_kv_indexer_two_gaps_and_a_gap_given_up() -> None:
    events = conversation_events(1)
    reference = indexed(events)
    indexer = indexed(events[:1])
    first = indexer.apply_event(events[2])  # 1 lost
    second = indexer.apply_event(events[4])  # 3 lost while the first gap is open
    assert (first, second) == (EventGap((1, 0), 1, 1), EventGap((1, 0), 3, 3))
    assert indexer.fill_gap(second, [events[3]]) == 0  # the first gap is still open: all of it waits
    assert indexer.fill_gap(first, [events[1]]) == 4
    for event in events[5:]:
        indexer.apply_event(event)
    assert index_state(indexer) == index_state(reference)
    # A gap the worker cannot fill: what waited applies anyway (the index may miss the lost blocks).
    given_up = KvIndexer()
    given_up.apply_event(events[0])
    gap = given_up.apply_event(events[2])
    assert gap is not None and given_up.fill_gap(gap, []) == 1
    assert given_up.apply_event(events[3]) is None and given_up.events_applied == 3


def test_kv_indexer_catch_up_applies_only_what_is_newer() -> None:
    events = conversation_events(1)
    reference = indexed(events)
    indexer = indexed(events[:3])
    # the rest never arrived live; the worker's answer may repeat what was seen, in any order
    assert indexer.catch_up((1, 0), list(reversed(events[1:]))) == len(events) - 3
    assert indexer.last_event_id((1, 0)) == len(events) - 1
    assert index_state(indexer) == index_state(reference)
    assert indexer.catch_up((1, 0), events) == 0  # nothing newer
    assert indexer.events_applied == len(events) and indexer.events_recovered == len(events) - 3
    # A worker never heard from: everything applies.
    fresh = KvIndexer()
    assert fresh.catch_up((1, 0), events) == len(events)
    assert index_state(fresh) == index_state(reference)
    # While a gap of the worker is being fetched, the fetch brings the events: a catch-up applies none.
    gapped = KvIndexer()
    gapped.apply_event(events[0])
    gap = gapped.apply_event(events[2])
    assert gap is not None and gapped.catch_up((1, 0), events[1:4]) == 0
    assert gapped.fill_gap(gap, [events[1]]) == 2 and gapped.last_event_id((1, 0)) == 2


def test_kv_indexer_full_dump_and_remove_worker() -> None:
    reference = KvIndexer()
    events = conversation_events(1)
    for event in events:
        reference.apply_event(event)
    dumped = KvIndexer()
    assert dumped.apply_dump(events) == len(events)
    assert index_state(dumped) == index_state(reference)
    assert dumped.last_event_id((1, 0)) == len(events) - 1
    assert dumped.apply_event(events[-1]) is None  # already seen
    dumped.remove_worker(1)
    assert dumped.last_event_id((1, 0)) is None
    assert index_state(dumped) == [{}, {}, {}, {}]
    assert dumped.tree.workers() == set()


def test_kv_indexer_dp_ranks_have_separate_ids() -> None:
    indexer = KvIndexer()
    rank0 = RouterEvent(1, stored_event(0, None, [KvBlock(10, 1)], dp_rank=0))
    rank1 = RouterEvent(1, stored_event(0, None, [KvBlock(11, 1)], dp_rank=1))
    assert indexer.apply_event(rank0) is None
    assert indexer.apply_event(rank1) is None
    assert indexer.find_matches([1]).scores == {(1, 0): 1, (1, 1): 1}
    gap = indexer.apply_event(RouterEvent(1, removed_event(3, [11], dp_rank=1)))
    assert gap == EventGap((1, 1), 1, 2)
    assert indexer.find_matches([1]).scores == {(1, 0): 1, (1, 1): 1}  # rank 1's removal waits for its gap
    indexer.fill_gap(gap, [])
    assert indexer.find_matches([1]).scores == {(1, 0): 1}


# -- ApproxIndexer ---------------------------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_approx_indexer_ttl_and_refresh() -> None:
    clock = FakeClock()
    approx = ApproxIndexer(ttl_secs=10.0, clock=clock)
    approx.process_routing_decision(A, [1, 2, 3], [101, 102, 103])
    clock.now += 5
    approx.process_routing_decision(B, [1, 2], [101, 102])
    assert approx.find_matches([1, 2, 3]).scores == {A: 3, B: 2}
    clock.now += 4
    approx.process_routing_decision(A, [1], [101])  # refreshes A's first block only
    clock.now += 2  # A's blocks 2, 3 expired
    assert approx.find_matches([1, 2, 3]).scores == {A: 1, B: 2}
    assert approx.num_blocks(A) == 1
    clock.now += 10
    assert approx.find_matches([1, 2, 3]).scores == {}
    assert approx.num_blocks() == 0


def test_approx_indexer_size_pruning_and_remove_worker() -> None:
    clock = FakeClock()
    approx = ApproxIndexer(ttl_secs=100.0, max_tree_size=10, prune_target_ratio=0.5, clock=clock)
    for i in range(4):  # 4 chains of 3 blocks, one per second
        clock.now += 1
        approx.process_routing_decision((i, 0), [i * 10 + 1, i * 10 + 2, i * 10 + 3], [i * 100 + 1, i * 100 + 2, i * 100 + 3])
    # the 12th block exceeded 10: the oldest 7 were dropped, down to 5
    assert sum(approx.num_blocks(w) for w in approx.workers()) == 5
    assert approx.find_matches([1]).scores == {}
    assert approx.find_matches([21, 22, 23]).scores == {}  # leading block pruned first
    assert approx.find_matches([31, 32, 33]).scores == {(3, 0): 3}
    approx.remove_worker(3)
    assert approx.find_matches([31, 32, 33]).scores == {}
    assert approx.num_blocks((2, 0)) == 2
    assert approx.num_blocks() == 3  # worker 2's blocks 22, 23 still hang under the empty node 21


def test_a_reused_hash_moving_a_block_under_a_parent_that_took_the_worker():
    """The engine reuses hashes across chains: a store that takes a block over from another chain can put the
    block below at the boundary (it lost the worker), then give it the worker back; it is plain again."""
    tree = RadixTree()
    tree.store((1, 0), None, list(zip([7, 0, 1, 4, 4, 7], [1, 1, 1, 3, 1, 3], strict=True)))
    tree.store((1, 0), None, list(zip([0, 5, 3], [1, 1, 3], strict=True)))
    assert_children_split(tree)
    assert tree.find_matches([1, 1, 3]).scores == {(1, 0): 3}
