"""Load history from a request trace, to warm the predictors up before the live intervals.

The trace is Mooncake's JSONL format (one request a line: `timestamp` in ms from the trace's start,
`input_length`, `output_length`; other fields are ignored), the format `bench/router_bench.py` replays.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tandem.runtime.config import ConfigError


def interval_history(path: str | Path, interval_s: float) -> list[tuple[float, float, float]]:
    """(requests, mean ISL, mean OSL) for each `interval_s` of the trace, from its first request to its
    last; an interval without requests is (0, 0, 0)."""
    buckets: dict[int, list[tuple[int, int]]] = {}
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                at, isl, osl = float(record["timestamp"]), int(record["input_length"]), int(record["output_length"])
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"{path}:{number}: not a Mooncake trace record "
                                  f"(timestamp, input_length, output_length): {e}") from None
            if not math.isfinite(at) or at < 0:
                raise ConfigError(f"{path}:{number}: timestamp must be a number of ms >= 0, got {at}")
            buckets.setdefault(int(at / 1000.0 // interval_s), []).append((isl, osl))
    if not buckets:
        return []
    history = []
    for index in range(min(buckets), max(buckets) + 1):
        requests = buckets.get(index, [])
        if requests:
            history.append((float(len(requests)), sum(r[0] for r in requests) / len(requests),
                            sum(r[1] for r in requests) / len(requests)))
        else:
            history.append((0.0, 0.0, 0.0))
    return history
