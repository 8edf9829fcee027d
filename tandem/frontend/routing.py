"""Choosing a worker instance for a request: the frontend's router modes and load-based rejection.

Modes (`--router-mode`): round-robin (default), random, power-of-two (two random instances, the
one with fewer requests in flight from this frontend), least-loaded (fewest in flight), direct (the
caller names the instance: header `x-worker-instance-id` or `nvext.backend_instance_id`).
`kv` routes token requests with the KV-aware router (`tandem.router.kv_router`, used by the
pipeline); the selectors here cover the other modes.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from tandem.router.protocols import active_load_from_builtins
from tandem.runtime.options import RouterMode

log = logging.getLogger(__name__)


class NoWorkerError(Exception):
    """No instance can take the request; `busy` tells overload (503 "all workers busy") apart."""

    def __init__(self, message: str, busy: bool = False) -> None:
        super().__init__(message)
        self.busy = busy


class Selector(Protocol):
    def select(self, candidates: list[int], request: Any) -> int: ...


class RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def select(self, candidates: list[int], request: Any) -> int:
        self._next += 1
        return candidates[self._next % len(candidates)]


class Random:
    def select(self, candidates: list[int], request: Any) -> int:
        return random.choice(candidates)


class LeastLoaded:
    def __init__(self, inflight: dict[int, int]) -> None:
        self._inflight = inflight

    def select(self, candidates: list[int], request: Any) -> int:
        low = min(self._inflight.get(c, 0) for c in candidates)
        return random.choice([c for c in candidates if self._inflight.get(c, 0) == low])


class PowerOfTwo:
    def __init__(self, inflight: dict[int, int]) -> None:
        self._inflight = inflight

    def select(self, candidates: list[int], request: Any) -> int:
        if len(candidates) == 1:
            return candidates[0]
        a, b = random.sample(candidates, 2)
        return a if self._inflight.get(a, 0) <= self._inflight.get(b, 0) else b


def make_selector(mode: RouterMode, inflight: dict[int, int]) -> Selector:
    """The selector of a mode that picks among workers by themselves; `kv` falls back to round-robin for
    what the KV router does not route (text requests), `direct` for nothing (it needs a named worker)."""
    mode = RouterMode(mode)
    if mode is RouterMode.RANDOM:
        return Random()
    if mode is RouterMode.LEAST_LOADED:
        return LeastLoaded(inflight)
    if mode is RouterMode.POWER_OF_TWO:
        return PowerOfTwo(inflight)
    return RoundRobin()


@dataclass
class LoadThresholds:
    """Busy when used KV blocks / total > `decode_blocks` or active prefill tokens > `prefill_tokens`."""

    decode_blocks: float | None = None
    prefill_tokens: int | None = None
    prefill_tokens_frac: float | None = None

    @property
    def enabled(self) -> bool:
        return any(v is not None for v in (self.decode_blocks, self.prefill_tokens, self.prefill_tokens_frac))


@dataclass
class WorkerLoad:
    kv_used_blocks: int = 0
    active_prefill_tokens: int = 0


@dataclass
class LoadMonitor:
    """Latest load per worker from the `kv_metrics` events workers publish."""

    thresholds: LoadThresholds
    loads: dict[int, WorkerLoad] = field(default_factory=dict)

    def apply(self, event: Any) -> None:
        """One `kv_metrics` event (an `ActiveLoad`, as the event plane delivers it); others are ignored."""
        try:
            active = active_load_from_builtins(event)
        except msgspec.ValidationError:
            return
        load = self.loads.setdefault(active.worker_id, WorkerLoad())
        used = active.kv_used_blocks if active.kv_used_blocks is not None else active.active_decode_blocks
        if used is not None:
            load.kv_used_blocks = used
        if active.active_prefill_tokens is not None:
            load.active_prefill_tokens = active.active_prefill_tokens

    def is_busy(self, worker: int, total_blocks: int | None, max_batched_tokens: int | None) -> bool:
        load = self.loads.get(worker)
        if load is None or not self.thresholds.enabled:
            return False
        t = self.thresholds
        if t.decode_blocks is not None and total_blocks and load.kv_used_blocks / total_blocks > t.decode_blocks:
            return True
        if t.prefill_tokens is not None and load.active_prefill_tokens > t.prefill_tokens:
            return True
        return bool(
            t.prefill_tokens_frac is not None
            and max_batched_tokens
            and load.active_prefill_tokens > t.prefill_tokens_frac * max_batched_tokens
        )

    def forget(self, workers: Collection[int]) -> None:
        for worker in workers:
            self.loads.pop(worker, None)
