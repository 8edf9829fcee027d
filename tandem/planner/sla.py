"""The SLA planner's decision: from one interval of frontend metrics to the replicas each pool needs.

Each adjustment interval:
1. **Observe** the interval: requests, mean ISL and OSL, mean TTFT and ITL, mean request duration.
2. **Correct** the profiles by what the deployment really does (unless `no_correction`):
   `prefill_correction = observed TTFT / profiled TTFT at the observed ISL` (queueing makes it > 1), and
   `decode_correction = observed ITL / profiled ITL at the observed per-worker concurrency and context`,
   concurrency being `requests / decode workers * mean request duration / interval` and context
   `ISL + OSL / 2`. An interval without traffic (or with NaN metrics) changes nothing.
3. **Predict** requests, ISL and OSL (`predictors.py`) for the interval that starts once a worker started
   now is ready: `1 + ceil(start-up time / interval)` intervals ahead (the next one when workers start at
   once). Sizing for now would leave every rise in load to queue for a start-up time.
4. **Size** the pools:
   - prefill: `load = requests * ISL / interval * min(1, prefill_correction)` prompt tokens/s, and
     `ceil(load / profiled prefill throughput per GPU at ISL / GPUs per prefill engine)` workers;
   - decode: the profiled throughput per GPU at the highest load whose ITL meets
     `itl / decode_correction` (a correction <= 0 leaves the target as it is) for context ISL + OSL / 2, and
     `ceil(requests * OSL / interval / that throughput / GPUs per decode engine)` workers;
   - aggregated workers do both, so their busy fractions add:
     `ceil(prefill load / prefill capacity + decode load / decode capacity)` workers;
   - then the limits (`limits.py`): each pool's min and max endpoints, and the GPU budget;
   - `max_replica_change` caps how far a pool moves in one decision.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from tandem.planner.config import PlannerConfig, PlannerMode
from tandem.planner.limits import Replicas, within_limits
from tandem.planner.perf import DecodeProfile, PrefillProfile
from tandem.planner.predictors import LoadPredictor, make_predictor
from tandem.planner.trace import interval_history
from tandem.runtime.config import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IntervalMetrics:
    """What the frontends saw during one adjustment interval (means over its requests)."""

    requests: float
    isl: float
    osl: float
    ttft_ms: float
    itl_ms: float
    request_duration_s: float
    interval_s: float

    def has_traffic(self) -> bool:
        values = (self.requests, self.isl, self.osl, self.ttft_ms, self.itl_ms, self.request_duration_s)
        return self.requests > 0 and all(math.isfinite(v) for v in values)


@dataclass(frozen=True)
class Forecast:
    requests: float
    isl: float
    osl: float
    steps: int = 1  # intervals ahead


@dataclass(frozen=True)
class Decision:
    target: Replicas
    forecast: Forecast
    prefill_correction: float
    decode_correction: float
    wanted: Replicas  # before the budget and the per-step cap

    def describe(self, current: Replicas) -> str:
        ahead = f", {self.forecast.steps} intervals ahead" if self.forecast.steps > 1 else ""
        return (f"predicted {self.forecast.requests:.1f} requests (ISL {self.forecast.isl:.0f}, OSL "
                f"{self.forecast.osl:.0f}{ahead}); corrections prefill {self.prefill_correction:.2f} decode "
                f"{self.decode_correction:.2f}; wanted prefill {self.wanted.prefill} decode {self.wanted.decode}; "
                f"prefill {current.prefill} -> {self.target.prefill}, decode {current.decode} -> {self.target.decode}")


class SlaPlanner:
    """Keeps the predictors and the correction factors from one interval to the next."""

    def __init__(self, config: PlannerConfig, prefill: PrefillProfile | None, decode: DecodeProfile | None) -> None:
        if config.mode in (PlannerMode.DISAGG, PlannerMode.PREFILL, PlannerMode.AGG) and prefill is None:
            raise ConfigError(f"planner mode {config.mode.value} needs a prefill profile")
        if config.mode in (PlannerMode.DISAGG, PlannerMode.DECODE, PlannerMode.AGG) and decode is None:
            raise ConfigError(f"planner mode {config.mode.value} needs a decode profile")
        self.config = config
        self.prefill = prefill
        self.decode = decode
        self.requests: LoadPredictor = make_predictor(config)
        self.isl: LoadPredictor = make_predictor(config)
        self.osl: LoadPredictor = make_predictor(config)
        self.prefill_correction = 1.0
        self.decode_correction = 1.0

    @classmethod
    def from_config(cls, config: PlannerConfig) -> SlaPlanner:
        """The planner with the profiles of `profile_results_dir` and its predictors warmed up from
        `load_predictor_warmup_trace` (raises ConfigError)."""
        if config.profile_results_dir is None:
            raise ConfigError("planner setting profile_results_dir is required: the workers' profile "
                              "(`tandem profile`)")
        folder = config.profile_results_dir
        planner = cls(config, PrefillProfile.load(folder), DecodeProfile.load(folder))
        if config.load_predictor_warmup_trace is not None:
            planner.warm_up(interval_history(config.load_predictor_warmup_trace, config.adjustment_interval))
        return planner

    def warm_up(self, history: list[tuple[float, float, float]]) -> None:
        """Feed (requests, ISL, OSL) per past interval, e.g. from a trace, before the live ones."""
        for requests, isl, osl in history:
            self.requests.add(requests)
            self.isl.add(isl)
            self.osl.add(osl)
        for predictor in (self.requests, self.isl, self.osl):
            predictor.restart_idle_skip()

    def observe(self, metrics: IntervalMetrics, current: Replicas) -> bool:
        """Take one interval in; False when it had no traffic (then nothing is decided for it)."""
        self.requests.add(metrics.requests)
        self.isl.add(metrics.isl)
        self.osl.add(metrics.osl)
        if not metrics.has_traffic():
            return False
        if not self.config.no_correction:
            self._correct(metrics, current)
        return True

    def _correct(self, m: IntervalMetrics, current: Replicas) -> None:
        if self.prefill is not None:
            expected = self.prefill.ttft(m.isl)
            if expected > 0:
                self.prefill_correction = m.ttft_ms / expected
        if self.decode is not None and current.decode > 0:
            concurrency = m.requests / current.decode * m.request_duration_s / m.interval_s
            expected = self.decode.itl(concurrency, m.isl + m.osl / 2)
            if expected > 0:
                self.decode_correction = m.itl_ms / expected

    def forecast(self, steps: int = 1) -> Forecast:
        return Forecast(self.requests.predict(steps), self.isl.predict(steps), self.osl.predict(steps), steps)

    def decide(self, current: Replicas, interval_s: float | None = None, startup_s: float = 0.0) -> Decision:
        """The replicas for the load of the interval in which a worker started now is ready (`interval_s`: the
        intervals' length, default the configured one; `startup_s`: a worker's start-up time)."""
        interval = interval_s or self.config.adjustment_interval
        forecast = self.forecast(1 + math.ceil(max(startup_s, 0.0) / interval))
        wanted = self._wanted(forecast, interval)
        target = self._capped(within_limits(wanted, self.config), current)
        return Decision(target, forecast, self.prefill_correction, self.decode_correction, wanted)

    # -- sizing ------------------------------------------------------------------------------------
    def prefill_load(self, f: Forecast, interval: float) -> float:
        """Prompt tokens/s the prefill work will need."""
        return f.requests * f.isl / interval * min(1.0, self.prefill_correction)

    def prefill_workers(self, f: Forecast, interval: float) -> float:
        assert self.prefill is not None
        capacity = self.prefill.throughput_per_gpu(f.isl) * self.config.prefill_engine_num_gpu
        return self.prefill_load(f, interval) / capacity

    def decode_workers(self, f: Forecast, interval: float) -> float:
        assert self.decode is not None
        itl_target = self.config.itl / self.decode_correction if self.decode_correction > 0 else self.config.itl
        throughput, _, _ = self.decode.best_throughput_per_gpu(itl_target, f.isl + f.osl / 2)
        capacity = throughput * self.config.decode_engine_num_gpu
        return f.requests * f.osl / interval / capacity

    def _wanted(self, f: Forecast, interval: float) -> Replicas:
        """The workers the load needs, before the limits (each pool's floor, the budget)."""
        mode = self.config.mode
        if mode is PlannerMode.AGG:
            return Replicas(0, math.ceil(self.prefill_workers(f, interval) + self.decode_workers(f, interval)))
        prefill = math.ceil(self.prefill_workers(f, interval)) if mode is not PlannerMode.DECODE else 0
        decode = math.ceil(self.decode_workers(f, interval)) if mode is not PlannerMode.PREFILL else 0
        return Replicas(prefill, decode)

    def _capped(self, target: Replicas, current: Replicas) -> Replicas:
        cap = self.config.max_replica_change
        if cap is None:
            return target

        def step(new: int, old: int) -> int:
            return new if new == 0 else max(old - cap, min(old + cap, new))

        return replace(target, prefill=step(target.prefill, current.prefill), decode=step(target.decode, current.decode))
