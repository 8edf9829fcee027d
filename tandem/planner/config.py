"""The planner's settings: Dynamo's SLA-planner fields and defaults, from flags, env vars or a JSON/YAML file.

Every field is checked when the config is built; a bad one is a `ConfigError` that names the field (and the
file it came from), never a crash later in the planning loop.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

from tandem.runtime.config import ConfigError


class PlannerMode(StrEnum):
    """Which worker pools the planner sizes."""

    DISAGG = "disagg"  # prefill and decode pools, each sized for its own SLA
    AGG = "agg"  # one pool that does both
    PREFILL = "prefill"  # only the prefill pool of a disaggregated deployment
    DECODE = "decode"  # only the decode pool


class Environment(StrEnum):
    """Where the workers a standalone planner scales run (`tandem run --planner` scales its own)."""

    KUBERNETES = "kubernetes"  # the chart's worker Deployments, through the Kubernetes API
    VIRTUAL = "virtual"  # an external orchestrator, told through the discovery store


class PredictorKind(StrEnum):
    CONSTANT = "constant"
    MOVING_AVERAGE = "moving-average"
    ARIMA = "arima"
    KALMAN = "kalman"
    PROPHET = "prophet"


@dataclass
class PlannerConfig:
    mode: PlannerMode = PlannerMode.DISAGG
    ttft: float = 500.0  # ms: the time-to-first-token target
    itl: float = 50.0  # ms: the inter-token-latency target
    adjustment_interval: float = 180.0  # s between decisions
    load_predictor: PredictorKind = PredictorKind.ARIMA
    load_predictor_log1p: bool = False  # fit log1p(load): spiky series
    load_predictor_warmup_trace: Path | None = None  # a Mooncake-format trace replayed into the predictors
    moving_average_window: int = 5
    prophet_window_size: int = 50
    kalman_q_level: float = 1.0
    kalman_q_trend: float = 0.1
    kalman_r: float = 10.0
    kalman_min_points: int = 5
    profile_results_dir: Path | None = None  # `tandem profile` (or Dynamo's profiler) output
    min_endpoint: int = 1  # replicas each pool keeps at least
    prefill_min_endpoint: int | None = None  # the prefill pool's own floor (None: min_endpoint)
    decode_min_endpoint: int | None = None  # the decode (or aggregated) pool's own floor (None: min_endpoint)
    max_endpoint: int | None = None  # replicas each pool may have at most (None: only the budget bounds them)
    prefill_max_endpoint: int | None = None
    decode_max_endpoint: int | None = None
    max_gpu_budget: int = 8  # GPUs all planned workers may use together (-1: no limit)
    min_gpu_budget: int = -1  # GPUs all planned workers use at least (-1: no floor)
    prefill_engine_num_gpu: int = 1
    decode_engine_num_gpu: int = 1
    max_replica_change: int | None = None  # replicas a pool may gain or lose per decision (None: any)
    # Seconds from starting a worker to its serving; None: as the connector measures it (0 if it cannot).
    worker_startup_time: float | None = None
    no_correction: bool = False  # do not scale the profiles by the observed/expected latency ratios
    no_operation: bool = False  # observe, predict and log decisions, but change nothing
    # Throughput-based (SLA) scaling every adjustment_interval, from profiles and predicted traffic.
    enable_throughput_scaling: bool = True
    # Load-based scaling every load_adjustment_interval, from the engines' forward-pass metrics: one worker
    # more when every engine of a pool would miss its target, one fewer when all are well within it. With
    # both, throughput scaling sets the floor load scaling moves above.
    enable_load_scaling: bool = False
    load_adjustment_interval: float = 5.0  # s between load-based decisions
    load_scaling_down_sensitivity: int = 80  # 0-100: scale down when every estimate is under this % of its target
    load_min_observations: int = 5  # steps a pool's step-time fit needs before it decides
    max_num_fpm_samples: int = 64  # steps kept per pool for the fit
    fpm_sample_bucket_size: int = 16  # buckets (a perfect square) that keep the kept steps spread over the load
    environment: Environment = Environment.KUBERNETES  # for `tandem planner`

    _POSITIVE = ("ttft", "itl", "adjustment_interval", "kalman_r", "load_adjustment_interval")
    _AT_LEAST_ONE = ("moving_average_window", "prophet_window_size", "kalman_min_points", "min_endpoint",
                     "prefill_engine_num_gpu", "decode_engine_num_gpu", "load_min_observations",
                     "max_num_fpm_samples", "fpm_sample_bucket_size")
    _OPTIONAL_AT_LEAST_ONE = ("max_replica_change", "prefill_min_endpoint", "decode_min_endpoint", "max_endpoint",
                              "prefill_max_endpoint", "decode_max_endpoint")

    def validate(self) -> PlannerConfig:
        for name in self._POSITIVE:
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(f"planner setting {name} must be a number > 0, got {value!r}")
        for name in ("kalman_q_level", "kalman_q_trend"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"planner setting {name} must be a number >= 0, got {value!r}")
        for name in self._AT_LEAST_ONE:
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ConfigError(f"planner setting {name} must be an integer >= 1, got {value!r}")
        if self.worker_startup_time is not None and not (
                isinstance(self.worker_startup_time, int | float) and 0 <= self.worker_startup_time < math.inf):
            raise ConfigError(f"planner setting worker_startup_time must be a number of seconds >= 0, got "
                              f"{self.worker_startup_time!r}")
        for name in self._OPTIONAL_AT_LEAST_ONE:
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ConfigError(f"planner setting {name} must be an integer >= 1 (or null), got {value!r}")
        for name in ("max_gpu_budget", "min_gpu_budget"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and (value == -1 or value >= 1)):
                raise ConfigError(f"planner setting {name} must be an integer >= 1, or -1 for no limit, got {value!r}")
        if not (isinstance(self.load_scaling_down_sensitivity, int) and 0 <= self.load_scaling_down_sensitivity <= 100):
            raise ConfigError(f"planner setting load_scaling_down_sensitivity must be an integer from 0 to 100, got "
                              f"{self.load_scaling_down_sensitivity!r}")
        if math.isqrt(self.fpm_sample_bucket_size) ** 2 != self.fpm_sample_bucket_size:
            raise ConfigError(f"planner setting fpm_sample_bucket_size must be a perfect square (4, 9, 16, ...), got "
                              f"{self.fpm_sample_bucket_size}")
        if not (self.enable_throughput_scaling or self.enable_load_scaling):
            raise ConfigError("planner settings enable_throughput_scaling and enable_load_scaling are both off: "
                              "nothing would scale")
        if self.enable_throughput_scaling and self.enable_load_scaling and (
                self.load_adjustment_interval >= self.adjustment_interval):
            raise ConfigError(f"planner setting load_adjustment_interval ({self.load_adjustment_interval:g} s) must "
                              f"be shorter than adjustment_interval ({self.adjustment_interval:g} s)")
        for pool in self.pools:
            low, high = self.min_replicas(pool), self.max_replicas(pool)
            if high is not None and high < low:
                raise ConfigError(f"planner settings: the {pool} pool's max endpoint ({high}) is below its min "
                                  f"endpoint ({low})")
        smallest = sum(self.min_replicas(pool) * self.gpus_per_engine(pool) for pool in self.pools)
        if self.max_gpu_budget != -1 and smallest > self.max_gpu_budget:
            raise ConfigError(f"planner setting max_gpu_budget ({self.max_gpu_budget}) is below what the min endpoints "
                              f"of the pools need ({smallest} GPUs)")
        if -1 not in (self.min_gpu_budget, self.max_gpu_budget) and self.min_gpu_budget > self.max_gpu_budget:
            raise ConfigError(f"planner setting min_gpu_budget ({self.min_gpu_budget}) is above max_gpu_budget "
                              f"({self.max_gpu_budget})")
        for name in ("load_predictor_warmup_trace", "profile_results_dir"):
            path = getattr(self, name)
            if path is not None and not Path(path).exists():
                raise ConfigError(f"planner setting {name}: {path} does not exist")
        return self

    def describe(self) -> str:
        """The planner's settings in one line, as it starts."""
        modes = []
        if self.enable_throughput_scaling:
            modes.append(f"SLA planner every {self.adjustment_interval:g} s, {self.load_predictor.value} predictor")
        if self.enable_load_scaling:
            modes.append(f"load-based every {self.load_adjustment_interval:g} s, scale-down under "
                         f"{self.load_scaling_down_sensitivity}%")
        return f"{' + '.join(modes)} ({self.mode.value}): TTFT {self.ttft:g} ms, ITL {self.itl:g} ms"

    @property
    def pools(self) -> tuple[str, ...]:
        """The pools this mode plans: `prefill` and/or `decode` (aggregated workers count as decode)."""
        return {PlannerMode.DISAGG: ("prefill", "decode"), PlannerMode.PREFILL: ("prefill",)}.get(
            self.mode, ("decode",))

    def min_replicas(self, pool: str) -> int:
        own = self.prefill_min_endpoint if pool == "prefill" else self.decode_min_endpoint
        return self.min_endpoint if own is None else own

    def max_replicas(self, pool: str) -> int | None:
        own = self.prefill_max_endpoint if pool == "prefill" else self.decode_max_endpoint
        return self.max_endpoint if own is None else own

    def gpus_per_engine(self, pool: str) -> int:
        return self.prefill_engine_num_gpu if pool == "prefill" else self.decode_engine_num_gpu

    @classmethod
    def from_mapping(cls, values: dict[str, Any], where: str = "the planner config") -> PlannerConfig:
        """A config from a mapping of field names (dashes or underscores) to values, as JSON or YAML gives."""
        known = {f.name: f for f in fields(cls) if not f.name.startswith("_")}
        config = cls()
        for raw_name, value in values.items():
            name = raw_name.replace("-", "_")
            name = ALIASES.get(name, name)
            if name not in known:
                raise ConfigError(f"{where}: unknown planner setting {raw_name!r} (known: {', '.join(sorted(known))})")
            setattr(config, name, _coerce(name, value, where))
        return config.validate()

    @classmethod
    def from_file(cls, path: str | Path) -> PlannerConfig:
        return cls.from_mapping(read_settings(path), where=str(path))


def add_load_scaling_args(group: argparse._ActionsContainer, enable_help: str) -> None:
    """The load-based mode's flags (Dynamo's names), for `tandem planner` and `tandem run`: each sets the planner
    setting its `dest` names."""
    group.add_argument("--enable-loadbased-scaling", action="store_true", default=None, help=enable_help)
    group.add_argument("--loadbased-adjustment-interval", dest="load_adjustment_interval", type=float, metavar="S",
                       help="seconds between load-based decisions [5]")
    group.add_argument("--loadbased-scaling-down-sensitivity", dest="load_scaling_down_sensitivity", type=int,
                       metavar="PCT", help="scale down when every engine is under this %% of the targets [80]")
    group.add_argument("--loadbased-min-observations", dest="load_min_observations", type=int, metavar="N",
                       help="engine steps a pool's fit needs before it decides [5]")


def read_settings(path: str | Path) -> dict[str, Any]:
    """A planner config file (JSON, or YAML): its mapping of settings, not yet checked."""
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror}") from None
    try:
        values = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: not valid {'JSON' if str(path).endswith('.json') else 'YAML'}: {e}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: the planner config must be a mapping of settings")
    return values


# Dynamo's newer names for the same settings.
ALIASES = {"ttft_ms": "ttft", "itl_ms": "itl", "throughput_adjustment_interval_seconds": "adjustment_interval",
           "throughput_adjustment_interval": "adjustment_interval",
           "load_adjustment_interval_seconds": "load_adjustment_interval"}
_ENUMS: dict[str, type[StrEnum]] = {"mode": PlannerMode, "load_predictor": PredictorKind, "environment": Environment}
_BOOLS = ("load_predictor_log1p", "no_correction", "no_operation", "enable_throughput_scaling", "enable_load_scaling")
_PATHS = ("load_predictor_warmup_trace", "profile_results_dir")
_INTS = {f.name for f in fields(PlannerConfig) if f.type in ("int", "int | None")}


def _coerce(name: str, value: Any, where: str) -> Any:
    if name in _ENUMS:
        choices = [e.value for e in _ENUMS[name]]
        if value not in choices:
            raise ConfigError(f"{where}: planner setting {name} must be one of {', '.join(choices)}, got {value!r}")
        return _ENUMS[name](value)
    if name in _BOOLS:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: planner setting {name} must be true or false, got {value!r}")
        return value
    if name in _PATHS:
        return None if value is None else Path(value)
    if name == "worker_startup_time" and value is None:
        return None
    if name in _INTS:
        if value is None and name in PlannerConfig._OPTIONAL_AT_LEAST_ONE:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: planner setting {name} must be an integer, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: planner setting {name} must be a number, got {value!r}")
    return float(value)

