"""The bounds every decision ends in, whichever mode took it: each pool's min and max endpoints, then the GPU
budget.

Over `max_gpu_budget`, both pools shrink in proportion (`round`, never under their floors), the decode pool
taking what the prefill pool leaves. Under `min_gpu_budget`, both grow in proportion until the budget is
used. A budget of -1 is no limit. The settings are read at every decision, so a change through the control
API applies at the next one.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from tandem.planner.config import PlannerConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replicas:
    """Workers per pool. Aggregated deployments count theirs as `decode`; a pool the mode does not plan is 0."""

    prefill: int = 0
    decode: int = 0


def within_limits(wanted: Replicas, config: PlannerConfig) -> Replicas:
    """`wanted` (a pool the mode does not plan is 0) within the endpoints and the budget of `config`."""
    bounded = Replicas(*(_bounded(pool, getattr(wanted, pool), config) if pool in config.pools else 0
                         for pool in ("prefill", "decode")))
    bounded = _under_budget(bounded, config)
    return _over_floor(bounded, config)


def _bounded(pool: str, count: int, config: PlannerConfig) -> int:
    high = config.max_replicas(pool)
    count = max(count, config.min_replicas(pool))
    return count if high is None else min(count, high)


def gpus(replicas: Replicas, config: PlannerConfig) -> int:
    return replicas.prefill * config.prefill_engine_num_gpu + replicas.decode * config.decode_engine_num_gpu


def _under_budget(wanted: Replicas, c: PlannerConfig) -> Replicas:
    total = gpus(wanted, c)
    if c.max_gpu_budget == -1 or total <= c.max_gpu_budget:
        return wanted
    p_gpu, d_gpu = c.prefill_engine_num_gpu, c.decode_engine_num_gpu
    p_min, d_min = c.min_replicas("prefill"), c.min_replicas("decode")
    if wanted.prefill == 0:
        result = Replicas(0, max(d_min, c.max_gpu_budget // d_gpu))
    elif wanted.decode == 0:
        result = Replicas(max(p_min, c.max_gpu_budget // p_gpu), 0)
    else:
        scale = c.max_gpu_budget / total
        prefill = max(p_min, round(wanted.prefill * scale))
        result = Replicas(prefill, max(d_min, round((c.max_gpu_budget - prefill * p_gpu) / d_gpu)))
    log.warning("the wanted replicas (prefill %d, decode %d) need %d GPUs, over max_gpu_budget %d: prefill %d, "
                "decode %d", wanted.prefill, wanted.decode, total, c.max_gpu_budget, result.prefill, result.decode)
    return result


def _over_floor(wanted: Replicas, c: PlannerConfig) -> Replicas:
    total = gpus(wanted, c)
    if c.min_gpu_budget == -1 or total >= c.min_gpu_budget:
        return wanted
    p_gpu, d_gpu = c.prefill_engine_num_gpu, c.decode_engine_num_gpu
    if wanted.prefill == 0:
        return Replicas(0, math.ceil(c.min_gpu_budget / d_gpu))
    if wanted.decode == 0:
        return Replicas(math.ceil(c.min_gpu_budget / p_gpu), 0)
    prefill = math.ceil(wanted.prefill * c.min_gpu_budget / total)
    return Replicas(prefill, max(wanted.decode, math.ceil((c.min_gpu_budget - prefill * p_gpu) / d_gpu)))
