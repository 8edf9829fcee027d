"""Router indexer micro-benchmark: `find_matches` latency, KV event throughput and memory per
indexed block of `tandem.router.indexer` (over `tandem.router.radix_tree`) on a synthetic index of
shared-prefix conversations.

    .venv/bin/python bench/router_micro.py                       # 1M blocks, full matrix
    .venv/bin/python bench/router_micro.py --blocks 200000 --workers 64 --prompts 8192
    # 32k-token prompts (2,048 blocks of 16), three rounds, against another checkout's indexer
    .venv/bin/python bench/router_micro.py --workers 64 --prompts 32768 --block-sizes 16 --rounds 3 \
        --baseline-tree /tmp/router-base

Index: conversations of `prompt` tokens, each a shared system prompt (a quarter of the
conversation, one of 16) followed by unique blocks, stored on `--holders` random workers; each
holder keeps a random-length prefix (at least the system prompt), so matches end at scattered
depths. Blocks arrive as stored events of `--batch` blocks; conversations are added until the
tree has about `--blocks` nodes (worker-blocks, counting each holder, are about 2.5x that).
Queries are full conversations from the index (the worst case: the walk goes as deep as the
deepest holder). Event throughput is measured through `KvIndexer.apply_event` on pre-built
`RouterEvent`s (decoding excluded), with the garbage collector on as in the frontend.

Each configuration's events are built once; every round applies them to a fresh index (one per
indexer under test, alternated), times the queries and then the removals. `--baseline-tree` loads
`tandem/router/indexer.py` (and `radix_tree.py`, where the checkout has it) of another checkout (e.g.
a `git worktree` of an older commit) as a second indexer, so both are measured in one process on the
same events; it imports this tree's `tandem.router.protocols`. Memory per indexed block: tracemalloc's traced bytes after building
the index from freshly built events and dropping the events, minus before (the index keeps the
hash ints it was given), per tree node and per worker-block; one build per indexer, untimed.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import random
import resource
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from types import ModuleType

from tandem.router import indexer as current_indexer
from tandem.router.protocols import KvBlock, RouterEvent, removed_event, stored_event

SYSTEM_PROMPTS = 16


def build_events(num_blocks: int, workers: int, conv_blocks: int, holders: int, batch: int,
                 rng: random.Random) -> tuple[list[RouterEvent], list[list[int]], list[RouterEvent]]:
    """Stored events filling the index, the conversations (local hashes) and removed events
    for a fifth of the stored blocks."""
    prefix_len = max(1, conv_blocks // 4)
    prefixes = [[(rng.getrandbits(63), rng.getrandbits(63)) for _ in range(prefix_len)] for _ in range(SYSTEM_PROMPTS)]
    next_id = [0] * workers
    stored: list[RouterEvent] = []
    removed: list[RouterEvent] = []
    conversations: list[list[int]] = []
    nodes = SYSTEM_PROMPTS * prefix_len
    while nodes < num_blocks:
        conv = rng.choice(prefixes) + [(rng.getrandbits(63), rng.getrandbits(63)) for _ in range(conv_blocks - prefix_len)]
        conversations.append([local for _, local in conv])
        nodes += conv_blocks - prefix_len  # the first holder stores the whole conversation
        for n, worker in enumerate(rng.sample(range(workers), min(holders, workers))):
            length = conv_blocks if n == 0 else rng.randint(prefix_len, conv_blocks)
            parent = None
            for start in range(0, length, batch):
                chunk = conv[start:min(start + batch, length)]
                blocks = [KvBlock(block_hash, local) for block_hash, local in chunk]
                stored.append(RouterEvent(worker, stored_event(next_id[worker], parent, blocks)))
                next_id[worker] += 1
                parent = chunk[-1][0]
            tail = conv[max(prefix_len, length - length // 5):length]  # evict the newest fifth
            for start in range(0, len(tail), batch):
                hashes = [block_hash for block_hash, _ in tail[start:start + batch]]
                removed.append(RouterEvent(worker, removed_event(0, hashes)))
    for worker_events in _by_worker(removed, workers):  # removal ids follow each worker's stores
        for event in worker_events:
            event.event.event_id = next_id[event.worker_id]
            next_id[event.worker_id] += 1
    return stored, conversations, removed


def _by_worker(events: list[RouterEvent], workers: int) -> list[list[RouterEvent]]:
    out: list[list[RouterEvent]] = [[] for _ in range(workers)]
    for event in events:
        out[event.worker_id].append(event)
    return out


def event_blocks(events: list[RouterEvent]) -> int:
    return sum(len(e.event.stored.blocks) if e.event.stored else len(e.event.removed.block_hashes)  # type: ignore[union-attr]
               for e in events)


def apply_all(indexer: current_indexer.KvIndexer, events: list[RouterEvent]) -> float:
    """Blocks per second applying `events`."""
    apply = indexer.apply_event
    start = time.perf_counter()
    for event in events:
        apply(event)
    elapsed = time.perf_counter() - start
    return event_blocks(events) / elapsed


def time_queries(indexer: current_indexer.KvIndexer, conversations: list[list[int]], queries: int,
                 rng: random.Random) -> tuple[float, float, float]:
    """p50, p99 (µs) of find_matches, and the mean number of blocks matched."""
    find = indexer.tree.find_matches
    samples = []
    depth = 0
    for _ in range(queries):
        query = rng.choice(conversations)
        start = time.perf_counter()
        result = find(query)
        samples.append((time.perf_counter() - start) * 1e6)
        depth += max(result.scores.values(), default=0)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99)], depth / queries


def load_indexer(tree: Path) -> ModuleType:
    """`tandem/router/indexer.py` of the checkout at `tree`, as a module of its own; the checkout's
    `radix_tree.py`, where it has one (older ones kept the tree in indexer.py), is what it imports."""
    folder = tree / "tandem" / "router"
    own_tree = folder / "radix_tree.py"
    saved = sys.modules.get("tandem.router.radix_tree")
    try:
        if own_tree.exists():
            sys.modules["tandem.router.radix_tree"] = _load("baseline_radix_tree", own_tree)
        return _load("baseline_indexer", folder / "indexer.py")
    finally:
        if saved is not None:
            sys.modules["tandem.router.radix_tree"] = saved
        else:
            sys.modules.pop("tandem.router.radix_tree", None)


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def index_memory(module: ModuleType, args: argparse.Namespace, workers: int, conv_blocks: int) -> int:
    """Bytes the index holds once built: traced before and after, with the events built inside."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        stored, conversations, removed = build_events(
            args.blocks, workers, conv_blocks, args.holders, args.batch, random.Random(args.seed))
        indexer = module.KvIndexer()
        for event in stored:
            indexer.apply_event(event)
        del stored, conversations, removed
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=1_000_000, help="blocks (tree nodes) in the index")
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--prompts", type=int, nargs="+", default=[1024, 8192, 32768], help="tokens")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--holders", type=int, default=4, help="workers holding each conversation")
    parser.add_argument("--batch", type=int, default=32, help="blocks per stored/removed event")
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=1, help="fresh index, queries and removals per round")
    parser.add_argument("--baseline-tree", type=Path, help="another checkout whose indexer runs alongside")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory builds")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    indexers: list[tuple[str, ModuleType]] = [("current", current_indexer)]
    if args.baseline_tree:
        indexers.insert(0, ("baseline", load_indexer(args.baseline_tree)))
    print(f"index: ~{args.blocks:,} blocks (tree nodes), {args.holders} holders per conversation, "
          f"{args.batch} blocks per event, {args.queries:,} queries and {args.rounds} round(s) per row"
          + (f"; baseline: {args.baseline_tree}" if args.baseline_tree else "") + "\n")
    print("| prompt tokens | block size | blocks/prompt | workers | indexer | round | tree nodes | worker-blocks | "
          "matched | find_matches p50 µs | p99 µs | store blocks/s | remove blocks/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    summary: list[str] = []
    for prompt in args.prompts:
        for block_size in args.block_sizes:
            conv_blocks = prompt // block_size
            for workers in args.workers:
                stored, conversations, removed = build_events(
                    args.blocks, workers, conv_blocks, args.holders, args.batch, random.Random(args.seed))
                runs: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name, _ in indexers}
                shape = ""
                for round_ in range(1, args.rounds + 1):
                    for name, module in indexers:
                        indexer = module.KvIndexer()
                        store_rate = apply_all(indexer, stored)
                        nodes = indexer.tree.num_blocks()
                        worker_blocks = sum(indexer.tree.num_blocks(w) for w in indexer.tree.workers())
                        gc.collect()
                        p50, p99, depth = time_queries(indexer, conversations, args.queries,
                                                       random.Random(args.seed + round_))
                        remove_rate = apply_all(indexer, removed)
                        runs[name].append((p50, p99, store_rate, remove_rate))
                        shape = f"{nodes:,} | {worker_blocks:,}"
                        print(f"| {prompt} | {block_size} | {conv_blocks} | {workers} | {name} | {round_} | "
                              f"{shape} | {depth:.0f} | {p50:.1f} | {p99:.1f} | {store_rate:,.0f} | "
                              f"{remove_rate:,.0f} |", flush=True)
                        del indexer
                        gc.collect()
                del stored, removed, conversations
                gc.collect()
                for name, module in indexers:
                    memory = ""
                    if not args.no_memory:
                        nodes, worker_blocks = (int(x.replace(",", "")) for x in shape.split(" | "))
                        used = index_memory(module, args, workers, conv_blocks)
                        memory = f" | {used / 2**20:,.0f} | {used / nodes:,.0f} | {used / worker_blocks:,.0f}"
                    p50s, p99s, stores, removes = zip(*runs[name], strict=True)
                    summary.append(f"| {prompt} | {block_size} | {workers} | {name} | {median(p50s):.1f} | "
                                   f"{median(p99s):.1f} | {max(p99s):.1f} | {median(stores):,.0f} | "
                                   f"{median(removes):,.0f}{memory} |")
    print(f"\nmedian of {args.rounds} round(s); memory from tracemalloc (one build per indexer)\n")
    print("| prompt tokens | block size | workers | indexer | p50 µs | p99 µs | worst p99 µs | store blocks/s | "
          "remove blocks/s" + ("" if args.no_memory else " | index MiB | bytes/tree node | bytes/worker-block") + " |")
    print("|---|---|---|---|---|---|---|---|---" + ("" if args.no_memory else "|---|---|---") + "|")
    print("\n".join(summary))
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\npeak RSS {peak_mib:,.0f} MiB (indices plus the pre-built events)")


if __name__ == "__main__":
    main()
