"""The KV router's decision alone: `KvRouter.best_worker` latency (overlap in the prefix index, the lower
tiers when some worker reports any, load, cost, selection) for one prompt among many workers.

    .venv/bin/python bench/router_decision_micro.py                                # this tree
    .venv/bin/python bench/router_decision_micro.py --baseline-tree /tmp/base --alternations 5

Index: --conversations conversations of --prompt tokens (blocks of 16); each of --workers workers holds
one conversation's prefix on its device tier, a random share of it (at least 64 blocks). `--tiers`: each
worker also holds the rest of its conversation in host memory (the lower-tier walk runs for every worker).
Queries: the full conversations, the prompt hashes computed once (as the frontend does), --queries per
round, 7 rounds; the median round's mean is reported. With `--baseline-tree`, each alternation runs this
tree and the other checkout in turn, each in its own process (PYTHONPATH set to its tree), and the
ratio is of the medians over alternations. Scenarios a tree cannot run (`--tiers` before tiers existed)
are skipped for it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BLOCK = 16


def measure(args: argparse.Namespace) -> float | None:
    """Median over rounds of the mean `best_worker` time, µs; None when this tree has no lower tiers."""
    from tandem.router.config import KvRouterConfig
    from tandem.router.hashing import local_block_hashes, sequence_hashes
    from tandem.router.kv_router import KvRouter, RouterMetrics
    from tandem.router.protocols import KvBlock, RouterEvent, stored_event

    rng = random.Random(0)
    router = KvRouter(None, "m", block_size=BLOCK, config=KvRouterConfig(predicted_ttl_secs=0),
                      metrics=RouterMetrics(None), rng=rng)
    if args.tiers and not hasattr(router.indexer, "lower"):
        return None
    conversations = []
    for c in range(args.conversations):
        prompt = [c * 1_000_000 + i for i in range(args.prompt)]
        local = local_block_hashes(prompt, BLOCK)
        conversations.append((prompt, local, sequence_hashes(local)))
    for worker in range(args.workers):
        _, local, seq = conversations[worker % args.conversations]
        held = rng.randint(min(64, len(local)), len(local))
        blocks = [KvBlock(s, t) for s, t in zip(seq, local, strict=True)]
        router.indexer.apply_event(RouterEvent(worker, stored_event(0, None, blocks[:held])))
        if args.tiers and held < len(blocks):
            router.indexer.apply_event(RouterEvent(worker, stored_event(1, seq[held - 1], blocks[held:]), "host_pinned"))
    candidates = list(range(args.workers))
    prompts = [prompt for prompt, _, _ in conversations]
    hashes = [router.hashes(prompt) for prompt in prompts]
    rounds = []
    for _ in range(7):
        started = time.perf_counter()
        for i in range(args.queries):
            router.best_worker(prompts[i % len(prompts)], candidates, hashes=hashes[i % len(prompts)])
        rounds.append((time.perf_counter() - started) / args.queries * 1e6)
    return statistics.median(rounds)


def run_tree(tree: Path, argv: list[str]) -> float | None:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", *argv], env=env, cwd=tree,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=8192, help="tokens")
    parser.add_argument("--queries", type=int, default=400)
    parser.add_argument("--tiers", action="store_true", help="workers also hold the rest of their prompt in host memory")
    parser.add_argument("--baseline-tree", type=Path)
    parser.add_argument("--alternations", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    argv = [a for a in sys.argv[1:] if a not in ("--baseline-tree", str(args.baseline_tree))]
    argv = [a for i, a in enumerate(argv) if not (a == "--alternations" or (i and argv[i - 1] == "--alternations"))]
    trees = {"this": REPO} | ({"baseline": args.baseline_tree.resolve()} if args.baseline_tree else {})
    results: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.alternations):
        for name, tree in trees.items():
            value = run_tree(tree, argv)
            if value is not None:
                results[name].append(value)
    medians = {name: statistics.median(values) for name, values in results.items() if values}
    scenario = f"{args.workers} workers, {args.prompt}-token prompts" + (", host tier on every worker" if args.tiers else "")
    print(f"best_worker µs ({scenario}):")
    for name, values in results.items():
        shown = ", ".join(f"{v:.0f}" for v in values) or "not run"
        print(f"  {name}: median {medians.get(name, float('nan')):.0f} (alternations: {shown})")
    if len(medians) == 2:
        print(f"  ratio this/baseline: {medians['this'] / medians['baseline']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
