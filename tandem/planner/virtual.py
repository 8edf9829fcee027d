"""The virtual connector: the planner's decisions handed to an orchestrator of your own through discovery.

The planner does not change the deployment itself. It writes each decision into the discovery store (file or
etcd, whichever the deployment uses), and an external orchestrator (a script, an operator, a scheduler) reads it,
starts or stops workers as it sees fit, and acknowledges it. As Dynamo's virtual connector, with two keys per
tandem namespace, each a JSON object:

    v1/planner/{namespace}/decision  written by the planner:
        {"num_prefill_workers": 1, "num_decode_workers": 3, "decision_id": 7}
    v1/planner/{namespace}/scaled    written by the orchestrator:
        {"scaled_decision_id": 7}

- `decision_id` counts up from 1 and never goes back: a planner that restarts reads both keys and continues
  after the larger of the stored `decision_id` and `scaled_decision_id`.
- A decision is done once `scaled_decision_id >= decision_id`. The planner's `scale()` waits for that, or for its
  timeout (Dynamo's: 1800 s), after which it logs a warning and returns; the decision stays in the store for the
  orchestrator to carry out late, and the next decision replaces it.
- A new decision replaces one not yet acknowledged (the orchestrator only ever sees the newest, and
  acknowledging it covers the older ones); a target equal to the pending decision is not written again.
- Both keys are written without a lease (`leased=False`): they outlive the process that wrote them, so neither
  vanishes while the other side waits, nor when the planner restarts. In an aggregated deployment the workers
  are `num_decode_workers` and `num_prefill_workers` is 0.

The orchestrator's side is `VirtualConnectorClient`: `wait()` for a decision newer than the last one it
completed, carry it out, then `complete(decision)`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, TypeVar

import msgspec

from tandem.planner.sla import Replicas
from tandem.runtime.discovery.base import KeyValueStore

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 1800.0  # seconds the planner waits for an acknowledgement (Dynamo's SCALING_MAX_WAIT_TIME)

_Count = Annotated[int, msgspec.Meta(ge=0)]
_Id = Annotated[int, msgspec.Meta(ge=1)]


class PlannerDecision(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """The replicas the planner wants; `decision_id` orders decisions (1, 2, ...)."""

    num_prefill_workers: _Count
    num_decode_workers: _Count
    decision_id: _Id

    @property
    def replicas(self) -> Replicas:
        return Replicas(self.num_prefill_workers, self.num_decode_workers)


class ScalingAck(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """The orchestrator's acknowledgement: every decision up to `scaled_decision_id` is carried out."""

    scaled_decision_id: Annotated[int, msgspec.Meta(ge=0)]


def decision_key(namespace: str) -> str:
    return f"v1/planner/{namespace}/decision"


def ack_key(namespace: str) -> str:
    return f"v1/planner/{namespace}/scaled"


T = TypeVar("T")


def _decode(kind: type[T], raw: bytes | None, key: str) -> T | None:
    """The record at `key`, or None if absent or unreadable (logged: a hand-written key may be wrong)."""
    if raw is None:
        return None
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.DecodeError as e:
        log.warning("planner: ignoring %s: not a valid %s record (%s): %r", key, kind.__name__, e, raw[:200])
        return None


async def _read_ack(store: KeyValueStore, namespace: str) -> int:
    key = ack_key(namespace)
    ack = _decode(ScalingAck, await store.get(key), key)
    return ack.scaled_decision_id if ack is not None else 0


class VirtualConnector:
    """The planner's side: `scale()` writes a decision and waits for its acknowledgement (or `timeout`).

    `store` is a started discovery store (the caller closes it); `namespace` the tandem namespace
    (`DYN_NAMESPACE`); `initial` what `replicas()` says before the first acknowledged decision."""

    def __init__(self, store: KeyValueStore, namespace: str, initial: Replicas | None = None, *,
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        if not timeout > 0:
            raise ValueError(f"the acknowledgement timeout must be > 0 seconds, got {timeout!r}")
        self.store = store
        self.namespace = namespace
        self.timeout = timeout
        self._acknowledged = initial or Replicas()  # the replicas of the newest decision carried out
        self._acknowledged_id = 0
        self._latest: PlannerDecision | None = None  # the newest decision written (or found in the store)
        self._unacknowledged: dict[int, Replicas] = {}  # decisions written (or found) and not acknowledged yet
        self._last_id = 0  # decision ids used so far (a stored acknowledgement may be ahead of a lost decision)
        self._loaded = False
        self._lock = asyncio.Lock()

    @property
    def decision_key(self) -> str:
        return decision_key(self.namespace)

    @property
    def ack_key(self) -> str:
        return ack_key(self.namespace)

    @property
    def last_decision_id(self) -> int:
        """The newest decision id written (0: none yet)."""
        return self._last_id

    async def load(self) -> None:
        """Read what an earlier planner left: its last decision id, and that decision's replicas if it was
        acknowledged. The first `replicas()` or `scale()` calls it; calling it first is optional."""
        if self._loaded:
            return
        self._latest = _decode(PlannerDecision, await self.store.get(self.decision_key), self.decision_key)
        if self._latest is not None:
            self._unacknowledged[self._latest.decision_id] = self._latest.replicas
        scaled = await _read_ack(self.store, self.namespace)
        self._last_id = max(self._latest.decision_id if self._latest else 0, scaled)
        self._loaded = True
        self._acknowledge(scaled)

    async def replicas(self) -> Replicas:
        """The replicas of the last acknowledged decision (before any: `initial`)."""
        await self.load()
        return self._acknowledged

    def startup_seconds(self) -> float | None:
        return None  # the orchestrator's workers are not seen from here

    async def scale(self, target: Replicas) -> None:
        """Write `target` as a new decision (unless it is the one pending), then wait until the orchestrator
        acknowledges it, or `timeout` passes (a warning; the decision stays for the orchestrator)."""
        if target.prefill < 0 or target.decode < 0:
            raise ValueError(f"replicas cannot be negative: {target}")
        async with self._lock:
            await self.load()
            latest = self._latest
            if latest is not None and latest.decision_id in self._unacknowledged and latest.replicas == target:
                decision = latest  # already asked for: wait for it again
            else:
                decision = PlannerDecision(target.prefill, target.decode, self._last_id + 1)
                if latest is not None and latest.decision_id in self._unacknowledged:
                    log.info("planner: decision %d replaces decision %d, not acknowledged yet",
                             decision.decision_id, latest.decision_id)
                await self.store.put(self.decision_key, msgspec.json.encode(decision), leased=False)
                self._latest, self._last_id = decision, decision.decision_id
                self._unacknowledged[decision.decision_id] = target
        scaled = await self._wait_for_ack(decision.decision_id)
        if scaled is None:
            log.warning("planner: decision %d (prefill %d, decode %d) not acknowledged within %g s (no "
                        "scaled_decision_id >= %d at %s); going on without it", decision.decision_id,
                        decision.num_prefill_workers, decision.num_decode_workers, self.timeout,
                        decision.decision_id, self.ack_key)
            return
        self._acknowledge(scaled)

    def _acknowledge(self, scaled: int) -> None:
        """Every decision up to `scaled` is carried out: the newest of them known here is the deployment now."""
        done = [decision_id for decision_id in self._unacknowledged if decision_id <= scaled]
        if not done:
            return
        newest = max(done)
        if newest > self._acknowledged_id:
            self._acknowledged, self._acknowledged_id = self._unacknowledged[newest], newest
        for decision_id in done:
            del self._unacknowledged[decision_id]

    async def _wait_for_ack(self, decision_id: int) -> int | None:
        """The acknowledged id once it reaches `decision_id`; None after `timeout`."""
        watch = await self.store.watch_prefix(self.ack_key)
        try:
            async with asyncio.timeout(self.timeout):
                async for event in watch:
                    if event.key != self.ack_key or event.kind != "put":
                        continue
                    ack = _decode(ScalingAck, event.value, event.key)
                    if ack is not None and ack.scaled_decision_id >= decision_id:
                        return ack.scaled_decision_id
                raise ConnectionError(f"the discovery store closed its watch of {self.ack_key}")
        except TimeoutError:
            return None
        finally:
            watch.close()


class VirtualConnectorClient:
    """The orchestrator's side: `wait()` for the next decision, carry it out, `complete()` it.

    `store` is a started discovery store of the same deployment (the caller closes it)."""

    def __init__(self, store: KeyValueStore, namespace: str) -> None:
        self.store = store
        self.namespace = namespace
        self._completed: int | None = None  # the newest decision_id acknowledged (read from the store first)

    async def _last_completed(self) -> int:
        if self._completed is None:
            self._completed = await _read_ack(self.store, self.namespace)
        return self._completed

    async def get(self) -> PlannerDecision | None:
        """The planner's current decision, done or not (None before its first)."""
        key = decision_key(self.namespace)
        return _decode(PlannerDecision, await self.store.get(key), key)

    async def wait(self) -> PlannerDecision:
        """Block until the store holds a decision newer than the last one completed (by this client, or by
        any orchestrator before it), and return it."""
        done = await self._last_completed()
        key = decision_key(self.namespace)
        watch = await self.store.watch_prefix(key)
        try:
            async for event in watch:
                if event.key != key or event.kind != "put":
                    continue
                decision = _decode(PlannerDecision, event.value, event.key)
                if decision is not None and decision.decision_id > done:
                    return decision
        finally:
            watch.close()
        raise ConnectionError(f"the discovery store closed its watch of {key}")

    async def complete(self, decision: PlannerDecision) -> None:
        """Acknowledge `decision` (and every older one): the planner waiting on it goes on."""
        done = max(await self._last_completed(), decision.decision_id)
        await self.store.put(ack_key(self.namespace), msgspec.json.encode(ScalingAck(done)), leased=False)
        self._completed = done


__all__ = ["DEFAULT_TIMEOUT", "PlannerDecision", "ScalingAck", "VirtualConnector", "VirtualConnectorClient",
           "ack_key", "decision_key"]
