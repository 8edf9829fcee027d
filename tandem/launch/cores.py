"""CPU cores for engine processes: each engine gets its own, so engines on one machine do not fight
over the same cores (vLLM's CPU backend spins one OpenMP thread per core it is given)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence

_CORE_LIST_RE = re.compile(r"^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$")


def available_cores() -> list[int]:
    """The cores this process may run on (its affinity mask, which may be smaller than the machine)."""
    return sorted(os.sched_getaffinity(0))


def parse_cores(text: str) -> tuple[int, ...]:
    """`"0,2-3"` -> (0, 2, 3). Raises ValueError on anything else."""
    text = text.replace(" ", "")
    if not _CORE_LIST_RE.match(text):
        raise ValueError(f"{text!r} is not a core list (examples: 0 / 0,2 / 2-3)")
    cores: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        low, high = int(first), int(last or first)
        if high < low:
            raise ValueError(f"{part!r}: a core range must go upwards")
        cores.update(range(low, high + 1))
    return tuple(sorted(cores))


def format_cores(cores: Iterable[int]) -> str:
    """(0, 1, 2, 5) -> `"0-2,5"`: the form vLLM's --cpu-cores and `parse_cores` accept."""
    parts: list[str] = []
    run: list[int] = []
    for core in sorted(set(cores)):
        if run and core != run[-1] + 1:
            parts.append(_span(run))
            run = []
        run.append(core)
    if run:
        parts.append(_span(run))
    return ",".join(parts)


def _span(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def round_robin(slot: int, per_worker: int, available: Sequence[int]) -> tuple[tuple[int, ...], bool]:
    """The cores of engine `slot` (0, 1, ...) when each takes `per_worker` consecutive cores, and whether
    they wrap around, i.e. are shared with another engine because there are more engines than cores."""
    if not available:
        raise ValueError("no CPU cores available")
    start = slot * per_worker
    cores = {available[(start + j) % len(available)] for j in range(per_worker)}
    return tuple(sorted(cores)), start + per_worker > len(available)
