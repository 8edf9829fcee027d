"""Settings every worker kind shares."""

from __future__ import annotations

from enum import StrEnum

from tandem.llm.model_card import WorkerType


class DisaggregationMode(StrEnum):
    """Dynamo's `--disaggregation-mode`: whole requests, or one side of disaggregated serving."""

    AGGREGATED = "agg"
    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def worker_type(self) -> WorkerType:
        return {DisaggregationMode.AGGREGATED: WorkerType.Aggregated, DisaggregationMode.PREFILL: WorkerType.Prefill,
                DisaggregationMode.DECODE: WorkerType.Decode}[self]

    @property
    def default_component(self) -> str:
        """Prefill workers are their own component, so the frontend finds them apart from the rest."""
        return "prefill" if self is DisaggregationMode.PREFILL else "backend"
