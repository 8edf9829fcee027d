"""Choosing a worker instance for a request: the frontend's router modes and load-based rejection.

Modes (`--router-mode`): round-robin (default), random, power-of-two (two random instances, the
one with fewer requests in flight from this frontend), least-loaded (fewest in flight), direct (the
caller names the instance: header `x-worker-instance-id` or `nvext.backend_instance_id`).
`kv` routes token requests with the KV-aware router (`tandem.router.kv_router`, used by the
pipeline); the selectors here cover the other modes.

A request of an agent session (`routing.session_id`: a session header, `nvext.agent_context`, or the
Responses API's `prompt_cache_key`) goes to one worker in every mode but `kv` and `direct`: the one its
session hashes to among the candidates (`by_session`), so its turns find their prefix cached there. The
KV router finds that worker by the cached prefix itself; the session only breaks its ties.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from tandem.router.protocols import active_load_from_builtins
from tandem.router.selector import session_weight
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


def session_of(request: Any) -> str | None:
    """The agent session a request belongs to, if any."""
    routing = getattr(request, "routing", None)
    return routing.session_id if routing is not None else None


def by_session(candidates: list[int], session: str) -> int:
    """The session's worker among `candidates` (rendezvous hashing: the same one while it is a candidate)."""
    return max(candidates, key=lambda c: session_weight(session, c))


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
    """Busy when used KV blocks / total > `decode_blocks` or prompt tokens awaiting prefill > `prefill_tokens`
    (or > `prefill_tokens_frac` of the worker's `max_num_batched_tokens`)."""

    decode_blocks: float | None = None
    prefill_tokens: int | None = None
    prefill_tokens_frac: float | None = None

    @property
    def enabled(self) -> bool:
        return any(v is not None for v in (self.decode_blocks, self.prefill_tokens, self.prefill_tokens_frac))


class PendingPrefill:
    """A request's prompt tokens counted against its worker until `done()` (idempotent): at its first token,
    or at its end without one."""

    __slots__ = ("_counts", "_worker", "_tokens")

    def __init__(self, counts: dict[int, int], worker: int, tokens: int) -> None:
        self._counts, self._worker, self._tokens = counts, worker, tokens
        if tokens:
            counts[worker] = counts.get(worker, 0) + tokens

    def done(self) -> None:
        if self._tokens:
            left = self._counts[self._worker] - self._tokens
            if left:
                self._counts[self._worker] = left
            else:
                del self._counts[self._worker]
            self._tokens = 0


@dataclass
class LoadMonitor:
    """Whether a worker is busy: the KV blocks each of its data-parallel ranks uses, from the `kv_metrics`
    events workers publish, and the prompt tokens this frontend sent it that have not had their first token
    yet (prefill work queued or running there; no worker reports that, the frontend knows it of its own
    requests)."""

    thresholds: LoadThresholds
    kv_used_blocks: dict[tuple[int, int], int] = field(default_factory=dict)  # (worker, dp rank) -> blocks
    prefill_tokens: dict[int, int] = field(default_factory=dict)

    def apply(self, event: Any) -> None:
        """One `kv_metrics` event (an `ActiveLoad`, as the event plane delivers it); others are ignored."""
        try:
            active = active_load_from_builtins(event)
        except msgspec.ValidationError:
            return
        used = active.kv_used_blocks if active.kv_used_blocks is not None else active.active_decode_blocks
        if used is not None:
            self.kv_used_blocks[(active.worker_id, active.dp_rank)] = used

    def prefill(self, worker: int, tokens: int) -> PendingPrefill:
        """Count `tokens` prompt tokens sent to `worker` until the returned handle's `done()`."""
        return PendingPrefill(self.prefill_tokens, worker, tokens)

    def is_busy(self, worker: int, total_blocks: int | None, max_batched_tokens: int | None,
                dp_size: int = 1) -> bool:
        """`total_blocks`: a rank's KV blocks. Over the blocks threshold only when each of the worker's
        `dp_size` ranks is (one that has not reported counts as free)."""
        t = self.thresholds
        if t.decode_blocks is not None and total_blocks and all(
                self.kv_used_blocks.get((worker, rank), 0) / total_blocks > t.decode_blocks for rank in range(dp_size)):
            return True
        pending = self.prefill_tokens.get(worker, 0)
        if t.prefill_tokens is not None and pending > t.prefill_tokens:
            return True
        return bool(t.prefill_tokens_frac is not None and max_batched_tokens
                    and pending > t.prefill_tokens_frac * max_batched_tokens)
