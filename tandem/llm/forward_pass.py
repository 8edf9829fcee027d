"""The forward-pass metrics an engine publishes on its component's `forward_pass_metrics` topic and the
load-based planner reads: what each engine step computed and how long it took, and the engine's queue.

The publishing side (collecting steps, the reports' cadence) is `tandem.worker.forward_pass`; the planner's fit
is `tandem.planner.load`.
"""

from __future__ import annotations

from typing import Any

import msgspec

FORWARD_PASS_TOPIC = "forward_pass_metrics"


class ForwardPass(msgspec.Struct, array_like=True, frozen=True):
    """One engine step."""

    prefill_tokens: int  # prompt tokens computed in the step
    kv_tokens: int  # KV tokens held by the engine's running requests during the step
    wall_time: float  # seconds the step took


class EngineState(msgspec.Struct, array_like=True, frozen=True):
    """An engine's queue at the time of a report."""

    queued_prefill_tokens: int  # prompt tokens admitted (waiting or in chunked prefill) and not yet computed
    kv_tokens: int  # KV tokens held by the running requests
    max_num_batched_tokens: int  # the most tokens one step computes: the prefill chunk


class ForwardPassMetrics(msgspec.Struct, frozen=True):
    """One report of one engine (one data-parallel rank of a worker)."""

    worker_id: int
    dp_rank: int
    state: EngineState
    passes: list[ForwardPass]  # the newest steps since the last report (at most the recorder's `MAX_PASSES`)
    busy: float = 0.0  # seconds all steps since the last report took (`passes` may hold only some of them)


def forward_pass_metrics_from_builtins(event: Any) -> ForwardPassMetrics:
    """An event as the event plane delivers it; raises msgspec.ValidationError if it is not one."""
    return msgspec.convert(event, ForwardPassMetrics)
