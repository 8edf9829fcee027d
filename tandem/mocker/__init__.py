"""Mocker: a GPU-free simulated vLLM engine (Dynamo's mocker).

The simulation core is synchronous and deterministic: `scheduler.Scheduler` runs vLLM v1-style
steps over a `kv_manager.KvManager` block pool (prefix caching, router-compatible KV events) and
prices each step with a `perf_model.PerfModel`; the engine turns steps into timed token streams.
"""

from tandem.mocker.kv_manager import KvEvent, KvManager
from tandem.mocker.perf_model import InterpolatedPerfModel, PerfModel, PolynomialPerfModel, load_perf_model
from tandem.mocker.scheduler import (
    Scheduler,
    SchedulerConfig,
    SchedulerLoad,
    SimRequest,
    StepOutput,
    StepResult,
)

__all__ = [
    "InterpolatedPerfModel",
    "KvEvent",
    "KvManager",
    "PerfModel",
    "PolynomialPerfModel",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerLoad",
    "SimRequest",
    "StepOutput",
    "StepResult",
    "load_perf_model",
]
