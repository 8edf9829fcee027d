"""The planner's settings: Dynamo's SLA-planner fields and defaults, from flags, env vars or a JSON/YAML file.

Every field is checked when the config is built; a bad one is a `ConfigError` that names the field (and the
file it came from), never a crash later in the planning loop.
"""

from __future__ import annotations

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
    max_gpu_budget: int = 8  # GPUs all planned workers may use together
    prefill_engine_num_gpu: int = 1
    decode_engine_num_gpu: int = 1
    max_replica_change: int | None = None  # replicas a pool may gain or lose per decision (None: any)
    # Seconds from starting a worker to its serving; None: as the connector measures it (0 if it cannot).
    worker_startup_time: float | None = None
    no_correction: bool = False  # do not scale the profiles by the observed/expected latency ratios
    no_operation: bool = False  # observe, predict and log decisions, but change nothing

    _POSITIVE = ("ttft", "itl", "adjustment_interval", "kalman_r")
    _AT_LEAST_ONE = ("moving_average_window", "prophet_window_size", "kalman_min_points", "min_endpoint",
                     "max_gpu_budget", "prefill_engine_num_gpu", "decode_engine_num_gpu")

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
        if self.max_replica_change is not None and not (
                isinstance(self.max_replica_change, int) and self.max_replica_change >= 1):
            raise ConfigError(f"planner setting max_replica_change must be an integer >= 1, got "
                              f"{self.max_replica_change!r}")
        smallest = self.min_endpoint * (
            (self.prefill_engine_num_gpu if self.mode in (PlannerMode.DISAGG, PlannerMode.PREFILL) else 0)
            + (self.decode_engine_num_gpu if self.mode is not PlannerMode.PREFILL else 0))
        if smallest > self.max_gpu_budget:
            raise ConfigError(f"planner setting max_gpu_budget ({self.max_gpu_budget}) is below what min_endpoint "
                              f"({self.min_endpoint}) workers of each pool need ({smallest} GPUs)")
        for name in ("load_predictor_warmup_trace", "profile_results_dir"):
            path = getattr(self, name)
            if path is not None and not Path(path).exists():
                raise ConfigError(f"planner setting {name}: {path} does not exist")
        return self

    @classmethod
    def from_mapping(cls, values: dict[str, Any], where: str = "the planner config") -> PlannerConfig:
        """A config from a mapping of field names (dashes or underscores) to values, as JSON or YAML gives."""
        known = {f.name: f for f in fields(cls) if not f.name.startswith("_")}
        config = cls()
        for raw_name, value in values.items():
            name = raw_name.replace("-", "_")
            if name not in known:
                raise ConfigError(f"{where}: unknown planner setting {raw_name!r} (known: {', '.join(sorted(known))})")
            setattr(config, name, _coerce(name, value, where))
        return config.validate()

    @classmethod
    def from_file(cls, path: str | Path) -> PlannerConfig:
        return cls.from_mapping(read_settings(path), where=str(path))


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


_ENUMS: dict[str, type[StrEnum]] = {"mode": PlannerMode, "load_predictor": PredictorKind}
_BOOLS = ("load_predictor_log1p", "no_correction", "no_operation")
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
        if value is None and name == "max_replica_change":
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: planner setting {name} must be an integer, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: planner setting {name} must be a number, got {value!r}")
    return float(value)

