"""Router indexer micro-benchmark: `find_matches` latency and KV event throughput of
`tandem.router.indexer` on a synthetic index of shared-prefix conversations.

    .venv/bin/python bench/router_micro.py                       # 1M blocks, full matrix
    .venv/bin/python bench/router_micro.py --blocks 200000 --workers 64 --prompts 8192

Index: conversations of `prompt` tokens, each a shared system prompt (a quarter of the
conversation, one of 16) followed by unique blocks, stored on `--holders` random workers; each
holder keeps a random-length prefix (at least the system prompt), so matches end at scattered
depths. Blocks arrive as stored events of `--batch` blocks; conversations are added until the
tree has about `--blocks` nodes (worker-blocks, counting each holder, are about 2.5x that).
Queries are full conversations from the index (the worst case: the walk goes as deep as the
deepest holder). Event throughput is measured through `KvIndexer.apply_event` on pre-built
`RouterEvent`s (decoding excluded), with the garbage collector on as in the frontend.
"""

from __future__ import annotations

import argparse
import gc
import random
import resource
import statistics
import time

from tandem.router.indexer import KvIndexer
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


def apply_all(indexer: KvIndexer, events: list[RouterEvent]) -> float:
    """Blocks per second applying `events`."""
    apply = indexer.apply_event
    start = time.perf_counter()
    for event in events:
        apply(event)
    elapsed = time.perf_counter() - start
    return event_blocks(events) / elapsed


def time_queries(indexer: KvIndexer, conversations: list[list[int]], queries: int,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=1_000_000, help="blocks (tree nodes) in the index")
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--prompts", type=int, nargs="+", default=[1024, 8192, 32768], help="tokens")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--holders", type=int, default=4, help="workers holding each conversation")
    parser.add_argument("--batch", type=int, default=32, help="blocks per stored/removed event")
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    print(f"index: ~{args.blocks:,} blocks (tree nodes), {args.holders} holders per conversation, "
          f"{args.batch} blocks per event\n")
    print("| prompt tokens | block size | blocks/prompt | workers | tree nodes | worker-blocks | matched | "
          "find_matches p50 µs | p99 µs | store blocks/s | remove blocks/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for prompt in args.prompts:
        for block_size in args.block_sizes:
            conv_blocks = prompt // block_size
            for workers in args.workers:
                rng = random.Random(args.seed)
                stored, conversations, removed = build_events(
                    args.blocks, workers, conv_blocks, args.holders, args.batch, rng)
                indexer = KvIndexer()
                store_rate = apply_all(indexer, stored)
                nodes = indexer.tree.num_blocks()
                worker_blocks = sum(indexer.tree.num_blocks(w) for w in indexer.tree.workers())
                gc.collect()
                p50, p99, depth = time_queries(indexer, conversations, args.queries, rng)
                remove_rate = apply_all(indexer, removed)
                print(f"| {prompt} | {block_size} | {conv_blocks} | {workers} | {nodes:,} | {worker_blocks:,} | {depth:.0f} | "
                      f"{p50:.1f} | {p99:.1f} | {store_rate:,.0f} | {remove_rate:,.0f} |", flush=True)
                del indexer, stored, removed, conversations
                gc.collect()
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\npeak RSS {peak_mib:,.0f} MiB (index plus the pre-built events)")


if __name__ == "__main__":
    main()
