"""Worker cost and selection for KV-aware routing.

Costs are in blocks: the prefill a worker would still have to do for this request (on top of the
prompts already queued on it) plus the decode blocks it holds. The current formula credits each cached
prefix block against prefill, blocks in host memory or on disk at their tier's weight; the legacy 0.x
formula (`overlap_score_weight` set) weights prefill and counts the device tier alone.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tandem.router.config import KvRouterConfig
from tandem.router.sequences import WorkerKey


@dataclass
class CostTerms:
    """What `worker_costs` weighs for one candidate: its cached prefix and its load."""

    worker: WorkerKey
    overlap_blocks: int  # prefix blocks of the request the worker has cached (from the indexer)
    active_prefill_tokens: int  # prompt tokens queued for prefill (from ActiveSequences)
    decode_blocks: int  # active blocks + this request's new blocks on the worker
    active_requests: int = 0
    host_blocks: int = 0  # prompt blocks continuing `overlap_blocks` from the worker's host memory
    disk_blocks: int = 0  # ... and then from its disk

    def tier_credits(self, config: KvRouterConfig, device_credit: float | None = None) -> tuple[float, float, float]:
        """Prefill blocks the worker's device, host and disk tiers save, each at its weight (`device_credit`:
        the device tier's, `config.overlap_score_credit` when not given)."""
        credit = config.overlap_score_credit if device_credit is None else device_credit
        return (credit * self.overlap_blocks, config.host_cache_hit_weight * self.host_blocks,
                config.disk_cache_hit_weight * self.disk_blocks)


def legacy_cost(prefill_blocks: float, decode_blocks: float, overlap_score_weight: float = 1.0) -> float:
    """The 0.x logit: `overlap_score_weight * prefill_blocks + decode_blocks`."""
    return overlap_score_weight * prefill_blocks + decode_blocks


def worker_costs(
    loads: Sequence[CostTerms], isl_tokens: int, block_size: int, config: KvRouterConfig
) -> dict[WorkerKey, float]:
    """Cost of sending a request of `isl_tokens` prompt tokens to each candidate; lower is better.

    Queued prefill on a worker counts only when `config.track_prefill_tokens` is on.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    track_prefill = config.track_prefill_tokens

    def queued(load: CostTerms) -> int:
        return load.active_prefill_tokens if track_prefill else 0

    if config.overlap_score_weight is not None:
        weight = config.overlap_score_weight
        costs = {}
        for load in loads:
            # weight 0 ignores overlap altogether (the legacy "no indexer" setting)
            uncached = max(isl_tokens - load.overlap_blocks * block_size, 0)
            costs[load.worker] = legacy_cost((queued(load) + uncached) / block_size, load.decode_blocks, weight)
        return costs

    credit = config.overlap_score_credit
    decay = config.overlap_score_credit_decay if track_prefill else 0.0
    request_blocks = max(math.ceil(isl_tokens / block_size), 1)
    # Decay is measured against the least-loaded candidate, so it keeps its full credit.
    min_queued = min((load.active_prefill_tokens for load in loads), default=0)
    host_weight, disk_weight = config.host_cache_hit_weight, config.disk_cache_hit_weight
    costs = {}
    for load in loads:
        raw_prefill_blocks = (queued(load) + isl_tokens) / block_size
        worker_credit = credit
        if decay > 0:
            excess_blocks = (load.active_prefill_tokens - min_queued) / block_size
            worker_credit = credit / (1 + decay * excess_blocks / request_blocks)
        # (`CostTerms.tier_credits` inline: this loop runs for every candidate of every request)
        credit_blocks = worker_credit * load.overlap_blocks
        if load.host_blocks or load.disk_blocks:
            credit_blocks += host_weight * load.host_blocks + disk_weight * load.disk_blocks
        adjusted_prefill_blocks = max(raw_prefill_blocks - credit_blocks, 0.0)
        costs[load.worker] = (
            config.prefill_load_scale * adjusted_prefill_blocks
            + load.decode_blocks
            + config.decode_active_request_weight * load.active_requests
        )
    return costs


def session_weight(session: str, worker: int) -> int:
    """Rendezvous (highest random weight) hashing: among a set of workers, a session goes to the one of
    highest weight, the same one every time while it is in the set; a worker leaving or joining moves only
    the sessions it wins or loses."""
    return int.from_bytes(hashlib.blake2b(f"{worker}:{session}".encode(), digest_size=8).digest(), "little")


def select_worker(costs: Mapping[WorkerKey, float], temperature: float, rng: random.Random,
                  session: str | None = None) -> WorkerKey:
    """Temperature 0: the cheapest worker, ties broken uniformly at random, or by `session_weight` for a
    request of an agent session (so its first turn, which no worker has cached, lands where its later turns
    will go when nothing else tells the workers apart). Temperature T > 0: sample with
    `p_i ∝ exp((min - c_i) / ((max - min) * T))` (uniform when every cost is equal)."""
    if not costs:
        raise ValueError("no candidate workers")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0 and session is not None:
        low = min(costs.values())
        return max((w for w, c in costs.items() if c == low), key=lambda w: session_weight(session, w[0]))
    if temperature == 0:
        # Reservoir sampling over the minimum: the k-th tie replaces the pick with probability 1/k.
        items = iter(costs.items())
        best, best_cost = next(items)
        ties = 1
        for worker, cost in items:
            if cost < best_cost:
                best, best_cost, ties = worker, cost, 1
            elif cost == best_cost:
                ties += 1
                if rng.randrange(ties) == 0:
                    best = worker
        return best

    workers = list(costs)
    lo, hi = min(costs.values()), max(costs.values())
    if lo == hi:
        return workers[rng.randrange(len(workers))]
    scale = (hi - lo) * temperature
    weights = [math.exp((lo - costs[w]) / scale) for w in workers]
    return rng.choices(workers, weights=weights)[0]
