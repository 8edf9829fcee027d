"""Load-based scaling: from the engines' forward-pass metrics to one worker more or fewer per pool.

Each engine reports the steps it ran (prompt tokens computed, KV tokens held, seconds) and its queue (prompt
tokens admitted and not yet computed, KV tokens held). Per pool, the planner fits step time by least
squares:

- prefill workers: `seconds = a + b * prompt tokens`;
- decode workers: `seconds = a + c * KV tokens`;
- aggregated workers, whose steps do both: `seconds = a + b * prompt tokens + c * KV tokens`.

From an engine's queue it then estimates what a request sent to it would see, averaged over the reports
since the last decision (a single report catches the queue at one instant):

- TTFT: the queued prompt tokens, and the prompt tokens this engine's prefilling steps carried on average
  (the request's own first step), cut into chunks of `max_num_batched_tokens`, one step each (with the KV
  tokens held, for aggregated engines);
- ITL: one step over the KV tokens held (aggregated engines: plus the prompt tokens their steps carried on
  average, since their decode steps carry other requests' prefill).

Every `load_adjustment_interval` each pool moves by at most one worker: one more when every engine's
estimate is over the target (an aggregated pool: every TTFT over, or every ITL over), one fewer when every
estimate is under `load_scaling_down_sensitivity`% of it (an aggregated pool: both) and the pool's work
would still fit one engine fewer: the busiest engine's busy fraction times n / (n - 1) under the same
percentage. Without that check a pool sized between two counts flaps, since queueing is not linear: n
engines can be far under the targets while n - 1 are far over them.
A pool whose fit has fewer than `load_min_observations` steps does not move.
A pool with fewer engines reporting than workers (some still starting) does not move either: what they
change is not seen yet. Only the engines of workers in discovery count (`members`): a worker being stopped
leaves discovery first, so the next decision already sees the pool without it.

Steps kept per pool are bounded (`max_num_fpm_samples`): when full, the oldest step of the most crowded of
`fpm_sample_bucket_size` load buckets goes, so the fit keeps seeing light and heavy steps alike.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np

from tandem.llm.forward_pass import EngineState, ForwardPassMetrics
from tandem.planner.config import PlannerConfig, PlannerMode
from tandem.planner.limits import Replicas

REPORT_TIMEOUT = 6.0  # s without a report before an engine no longer counts (engines report every 2 s when idle)
MAX_STATES = 256  # queue reports kept per engine between two decisions


class Verdict(StrEnum):
    UP = "up"
    DOWN = "down"
    HOLD = "hold"
    NOT_READY = "not_ready"  # too few steps to fit, or no engine reporting
    WAITING = "waiting"  # would grow, but not every worker reports yet


class StepTimeFit:
    """Step seconds as a linear function of the step's load (1 or 2 features), over a bounded sample."""

    def __init__(self, features: int, max_samples: int, buckets: int) -> None:
        self.features = features
        self.max_samples = max_samples
        self.per_axis = round(buckets ** (1 / features))  # 16 buckets: 16 in one dimension, 4 x 4 in two
        self._samples: list[tuple[tuple[float, ...], float]] = []
        self._highest = [1.0] * features
        self._coefficients: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, load: tuple[float, ...], seconds: float) -> None:
        for i, value in enumerate(load):
            self._highest[i] = max(self._highest[i], value)
        self._samples.append((load, seconds))
        if len(self._samples) > self.max_samples:
            buckets = [self._bucket(x) for x, _ in self._samples]
            crowded, _ = Counter(buckets).most_common(1)[0]
            del self._samples[buckets.index(crowded)]  # the oldest of the most crowded bucket
        self._coefficients = None

    def _bucket(self, load: tuple[float, ...]) -> tuple[int, ...]:
        return tuple(min(int(v / h * self.per_axis), self.per_axis - 1) for v, h in zip(load, self._highest, strict=True))

    def coefficients(self) -> np.ndarray:
        """[intercept, slope per feature], each >= 0: a feature whose slope fits negative is left out (noise)."""
        if self._coefficients is None:
            x = np.array([load for load, _ in self._samples], dtype=float).reshape(len(self._samples), self.features)
            y = np.array([seconds for _, seconds in self._samples], dtype=float)
            used = list(range(self.features))
            while True:
                design = np.column_stack([np.ones(len(y)), x[:, used]])
                fitted, *_ = np.linalg.lstsq(design, y, rcond=None)
                negative = [used[i] for i, slope in enumerate(fitted[1:]) if slope < 0]
                if not negative:
                    break
                used.remove(negative[0])
            coefficients = np.zeros(self.features + 1)
            coefficients[0] = max(fitted[0], 0.0)
            for i, feature in enumerate(used):
                coefficients[feature + 1] = fitted[i + 1]
            self._coefficients = coefficients
        return self._coefficients

    def seconds(self, *load: float) -> float:
        c = self.coefficients()
        return float(c[0] + sum(c[i + 1] * v for i, v in enumerate(load)))


@dataclass(frozen=True)
class EngineRecord:
    """What the planner knows of one engine: its latest states, and its steps since the last decision."""

    pool: str
    states: tuple[EngineState, ...]  # reported since the last decision (or the latest before it, if none since)
    seen: float  # time.monotonic() of its last report
    since: float = 0.0  # time.monotonic() the counts below start from (the last decision, or the first report)
    steps: int = 0  # steps reported since then
    prefill_steps: int = 0  # those that computed prompt tokens
    prefill_tokens: int = 0  # the prompt tokens they computed
    busy: float = 0.0  # seconds the engine spent stepping since then
    carried: bool = False  # `states` is the latest report before the last decision (replaced by the next one)

    def utilization(self, now: float) -> float:
        """The fraction of the time since `since` the engine was busy (a report's steps may end a little before
        the window starts: at most 1)."""
        return min(self.busy / (now - self.since), 1.0) if now > self.since else 0.0

    def prefill_per_step(self) -> float:
        """Prompt tokens a step carries, over all steps: what an aggregated engine's decode steps also do."""
        return self.prefill_tokens / self.steps if self.steps else 0.0

    def prompt_step(self) -> float:
        """Prompt tokens of a step that prefills: the work a request's own first step carries."""
        return self.prefill_tokens / self.prefill_steps if self.prefill_steps else 0.0


@dataclass(frozen=True)
class PoolEstimate:
    """What the engines of one pool would give a request now (ms), and what the pool should do."""

    verdict: Verdict
    engines: int
    ttft_ms: tuple[float, ...] = ()
    itl_ms: tuple[float, ...] = ()
    busiest: float = 0.0  # the highest fraction of time an engine spent stepping

    def describe(self, pool: str) -> str:
        def spread(values: tuple[float, ...]) -> str:
            return f"{min(values):.0f}-{max(values):.0f} ms" if values else "-"

        return (f"{pool}: {self.engines} engines, TTFT {spread(self.ttft_ms)}, ITL {spread(self.itl_ms)}, busiest "
                f"{self.busiest:.0%} -> {self.verdict}")


@dataclass(frozen=True)
class LoadDecision:
    target: Replicas
    estimates: dict[str, PoolEstimate]

    def describe(self, current: Replicas) -> str:
        pools = "; ".join(estimate.describe(pool) for pool, estimate in self.estimates.items())
        return (f"load: {pools}; prefill {current.prefill} -> {self.target.prefill}, decode {current.decode} -> "
                f"{self.target.decode}")


class LoadPlanner:
    """Keeps each pool's step-time fit and each engine's latest queue; decides one step at a time."""

    def __init__(self, config: PlannerConfig, members: Callable[[str], set[int] | None] | None = None) -> None:
        """`members(pool)`: the worker ids a pool has in discovery now (None: not known). A worker being stopped
        leaves discovery first, so its reports stop counting at once; one starting counts once it serves."""
        self.config = config
        self.members = members
        self.aggregated = config.mode is PlannerMode.AGG
        features = 2 if self.aggregated else 1
        self.fits = {pool: StepTimeFit(features, config.max_num_fpm_samples, config.fpm_sample_bucket_size)
                     for pool in config.pools}
        self.engines: dict[tuple[int, int], EngineRecord] = {}

    def ingest(self, pool: str, report: ForwardPassMetrics, now: float | None = None) -> None:
        """One engine's report; `pool` is the pool its worker serves (`prefill`, or `decode` for decode and
        aggregated workers). Reports of a pool the mode does not plan are ignored."""
        fit = self.fits.get(pool)
        if fit is None:
            return
        key = (report.worker_id, report.dp_rank)
        now = time.monotonic() if now is None else now
        first = key not in self.engines
        before = self.engines.get(key) or EngineRecord(pool, (), now, since=now)
        prefills = [step.prefill_tokens for step in report.passes if step.prefill_tokens > 0]
        earlier = () if before.carried else before.states
        # An engine's first report covers time before `since`: its busy time would overstate the fraction.
        busy = before.busy + (0.0 if first else report.busy)
        self.engines[key] = EngineRecord(pool, (*earlier, report.state)[-MAX_STATES:], now, before.since,
                                         before.steps + len(report.passes), before.prefill_steps + len(prefills),
                                         before.prefill_tokens + sum(prefills), busy)
        for step in report.passes:
            if self.aggregated:
                fit.add((step.prefill_tokens, step.kv_tokens), step.wall_time)
            elif pool == "prefill":
                if step.prefill_tokens > 0:
                    fit.add((step.prefill_tokens,), step.wall_time)
            elif step.prefill_tokens == 0:  # a decode worker's own steps (not a local prefill)
                fit.add((step.kv_tokens,), step.wall_time)

    def forget(self, worker_id: int) -> None:
        """A worker that left (its reports stop anyway; this drops it at once)."""
        for key in [key for key in self.engines if key[0] == worker_id]:
            del self.engines[key]

    def engine_counts(self, now: float | None = None) -> Replicas:
        """The workers reporting, per pool: what an observing planner knows of them without a frontend."""
        now = time.monotonic() if now is None else now
        workers = {pool: {key[0] for key, _ in self._reporting(pool, now)} for pool in ("prefill", "decode")}
        return Replicas(len(workers["prefill"]), len(workers["decode"]))

    def reporting(self, pool: str, now: float) -> list[EngineRecord]:
        return [engine for _, engine in self._reporting(pool, now)]

    def _reporting(self, pool: str, now: float) -> list[tuple[tuple[int, int], EngineRecord]]:
        """(worker id, dp rank) and engine, of the engines of `pool` that report and whose worker is a member."""
        members = self.members(pool) if self.members is not None and pool in self.fits else None
        return [(key, e) for key, e in self.engines.items() if e.pool == pool and now - e.seen <= REPORT_TIMEOUT
                and (members is None or key[0] in members)]

    # -- estimates ---------------------------------------------------------------------------------
    def ttft_seconds(self, pool: str, engine: EngineRecord, state: EngineState) -> float:
        """The queued prompt tokens and a typical prompt step of this engine, one chunk per step."""
        fit, chunk = self.fits[pool], max(state.max_num_batched_tokens, 1)
        full, rest = divmod(state.queued_prefill_tokens + engine.prompt_step(), chunk)
        extra = (state.kv_tokens,) if self.aggregated else ()
        total = full * fit.seconds(chunk, *extra)
        return total + (fit.seconds(rest, *extra) if rest else 0.0)

    def itl_seconds(self, pool: str, engine: EngineRecord, state: EngineState) -> float:
        """A step over the KV tokens held (aggregated engines: and the prompt tokens their steps carry)."""
        fit = self.fits[pool]
        if self.aggregated:
            return fit.seconds(engine.prefill_per_step(), state.kv_tokens)
        return fit.seconds(state.kv_tokens)

    def estimate(self, pool: str, replicas: int, now: float) -> PoolEstimate:
        c = self.config
        engines = self.reporting(pool, now)
        if not engines or len(self.fits[pool]) < c.load_min_observations:
            return PoolEstimate(Verdict.NOT_READY, len(engines))
        def mean_ms(estimate: Callable[[str, EngineRecord, EngineState], float], engine: EngineRecord) -> float:
            return 1000 * sum(estimate(pool, engine, state) for state in engine.states) / len(engine.states)

        ttft = tuple(mean_ms(self.ttft_seconds, e) for e in engines) if pool == "prefill" or self.aggregated else ()
        itl = tuple(mean_ms(self.itl_seconds, e) for e in engines) if pool == "decode" else ()
        low = c.load_scaling_down_sensitivity / 100

        def over(values: tuple[float, ...], target: float) -> bool:
            return bool(values) and min(values) > target

        # Scaling down spreads the pool's work over one engine fewer: each would be busy `spread` times longer.
        spread = replicas / (replicas - 1) if replicas > 1 else math.inf
        busiest = max(e.utilization(now) for e in engines)

        def under(values: tuple[float, ...], target: float) -> bool:
            return not values or max(values) < target * low

        if over(ttft, c.ttft) or over(itl, c.itl):
            verdict = Verdict.UP
        elif under(ttft, c.ttft) and under(itl, c.itl) and busiest * spread < low:
            verdict = Verdict.DOWN
        else:
            verdict = Verdict.HOLD
        if verdict is not Verdict.HOLD and len(engines) < replicas:
            verdict = Verdict.WAITING  # workers still starting (or stopping): what they change is not seen yet
        return PoolEstimate(verdict, len(engines), ttft, itl, busiest)

    def decide(self, current: Replicas, floor: Replicas | None = None, now: float | None = None) -> LoadDecision:
        """Each planned pool one worker up or down from `current` (or held), never under `floor` (the throughput
        planner's, when both run); the limits are applied by the caller."""
        now = time.monotonic() if now is None else now
        estimates: dict[str, PoolEstimate] = {}
        counts = {"prefill": current.prefill, "decode": current.decode}
        for pool in self.config.pools:
            estimate = self.estimate(pool, counts[pool], now)
            estimates[pool] = estimate
            step = {Verdict.UP: 1, Verdict.DOWN: -1}.get(estimate.verdict, 0)
            counts[pool] = max(counts[pool] + step, getattr(floor, pool) if floor is not None else 0)
        for key, engine in self.engines.items():  # the next decision averages the reports from now on
            self.engines[key] = replace(engine, states=engine.states[-1:], since=now, steps=0, prefill_steps=0,
                                        prefill_tokens=0, busy=0.0, carried=True)
        return LoadDecision(Replicas(counts["prefill"], counts["decode"]), estimates)
