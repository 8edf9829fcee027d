"""A worker's measured performance, from profiling, as the SLA planner reads it.

The files are Dynamo's layout, so profiles made by Dynamo's profiler load too:
- `<dir>/selected_prefill_interpolation/raw_data.npz`: `prefill_isl`, `prefill_ttft` (ms) and
  `prefill_thpt_per_gpu` (prompt tokens/s), one entry per measured ISL;
- `<dir>/selected_decode_interpolation/raw_data.npz`: `x_kv_usage` (0..1), `y_context_length`, `z_itl` (ms),
  `z_thpt_per_gpu` (output tokens/s), one entry per measured point, and `max_kv_tokens` (1 element);
- or the same arrays as JSON in `<dir>/prefill_raw_data.json` and `<dir>/decode_raw_data.json`.

Prefill is a cubic interpolation in ISL (clamped to the measured range). Decode is a cubic interpolation
of the scattered points onto a 100 x 100 grid of KV usage (0..1) and context length (0..the longest
measured), holes filled from the nearest measured point.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tandem.runtime.config import ConfigError

PREFILL_NPZ = Path("selected_prefill_interpolation") / "raw_data.npz"
DECODE_NPZ = Path("selected_decode_interpolation") / "raw_data.npz"
PREFILL_JSON = "prefill_raw_data.json"
DECODE_JSON = "decode_raw_data.json"
PREFILL_KEYS = ("prefill_isl", "prefill_ttft", "prefill_thpt_per_gpu")
DECODE_KEYS = ("x_kv_usage", "y_context_length", "z_itl", "z_thpt_per_gpu", "max_kv_tokens")


def _scipy_interpolate():  # type: ignore[no-untyped-def]
    try:
        import scipy.interpolate
    except ImportError:
        raise ConfigError("the SLA planner's profiles need the scipy package (pip install 'tandem[planner]')") \
            from None
    return scipy.interpolate


def _read(folder: Path, npz: Path, json_name: str, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    if (folder / npz).exists():
        with np.load(folder / npz) as data:
            missing = [k for k in keys if k not in data]
            if missing:
                raise ConfigError(f"{folder / npz}: missing arrays {', '.join(missing)}")
            return {k: np.asarray(data[k], dtype=float) for k in keys}
    if (folder / json_name).exists():
        data = json.loads((folder / json_name).read_text())
        missing = [k for k in keys if k not in data]
        if missing:
            raise ConfigError(f"{folder / json_name}: missing arrays {', '.join(missing)}")
        return {k: np.atleast_1d(np.asarray(data[k], dtype=float)) for k in keys}
    raise ConfigError(f"no profile in {folder}: neither {npz} nor {json_name} (run `tandem profile` first)")


@dataclass
class PrefillProfile:
    isl: np.ndarray
    ttft_ms: np.ndarray
    thpt_per_gpu: np.ndarray

    def __post_init__(self) -> None:
        if len(self.isl) < 4 or not (len(self.isl) == len(self.ttft_ms) == len(self.thpt_per_gpu)):
            raise ConfigError("a prefill profile needs at least 4 points, with as many TTFTs and throughputs as ISLs")
        order = np.argsort(self.isl)
        self.isl, self.ttft_ms, self.thpt_per_gpu = self.isl[order], self.ttft_ms[order], self.thpt_per_gpu[order]
        interpolate = _scipy_interpolate()
        self._ttft = interpolate.interp1d(self.isl, self.ttft_ms, kind="cubic")
        self._thpt = interpolate.interp1d(self.isl, self.thpt_per_gpu, kind="cubic")

    @classmethod
    def load(cls, folder: str | Path) -> PrefillProfile:
        data = _read(Path(folder), PREFILL_NPZ, PREFILL_JSON, PREFILL_KEYS)
        return cls(data["prefill_isl"], data["prefill_ttft"], data["prefill_thpt_per_gpu"])

    def _clamped(self, isl: float) -> float:
        return float(np.clip(isl, self.isl[0], self.isl[-1]))

    def ttft(self, isl: float) -> float:
        """Expected TTFT (ms) of one request of `isl` prompt tokens on an idle worker."""
        return float(self._ttft(self._clamped(isl)))

    def throughput_per_gpu(self, isl: float) -> float:
        """Prompt tokens per second per GPU at that ISL."""
        return float(self._thpt(self._clamped(isl)))


@dataclass
class DecodeProfile:
    kv_usage: np.ndarray
    context_length: np.ndarray
    itl_ms: np.ndarray
    thpt_per_gpu: np.ndarray
    max_kv_tokens: float
    resolution: int = 100

    def __post_init__(self) -> None:
        n = len(self.kv_usage)
        if n < 4 or not (n == len(self.context_length) == len(self.itl_ms) == len(self.thpt_per_gpu)):
            raise ConfigError("a decode profile needs at least 4 points, with a context, ITL and throughput each")
        if self.max_kv_tokens <= 0:
            raise ConfigError("a decode profile's max_kv_tokens must be > 0")
        interpolate = _scipy_interpolate()
        self.usage_axis = np.linspace(0.0, 1.0, self.resolution)
        self.context_axis = np.linspace(0.0, float(np.max(self.context_length)), self.resolution)
        grid = tuple(np.meshgrid(self.usage_axis, self.context_axis))  # [context row, usage column]
        points = (self.kv_usage, self.context_length)

        def surface(values: np.ndarray) -> np.ndarray:
            cubic = interpolate.griddata(points, values, grid, method="cubic")
            holes = np.isnan(cubic)
            if holes.any():
                cubic[holes] = interpolate.griddata(points, values, grid, method="nearest")[holes]
            return cubic

        self.itl_grid = surface(self.itl_ms)
        self.thpt_grid = surface(self.thpt_per_gpu)

    @classmethod
    def load(cls, folder: str | Path) -> DecodeProfile:
        data = _read(Path(folder), DECODE_NPZ, DECODE_JSON, DECODE_KEYS)
        return cls(data["x_kv_usage"], data["y_context_length"], data["z_itl"], data["z_thpt_per_gpu"],
                   float(data["max_kv_tokens"].ravel()[0]))

    def _row(self, context_length: float) -> int:
        step = self.context_axis[1] - self.context_axis[0]
        return int(np.clip(np.round((context_length - self.context_axis[0]) / step), 0, self.resolution - 1))

    def _column(self, kv_usage: float) -> int:
        step = self.usage_axis[1] - self.usage_axis[0]
        return int(np.clip(np.round(kv_usage / step), 0, self.resolution - 1))

    def kv_usage_of(self, concurrency: float, context_length: float) -> float:
        return concurrency * context_length / self.max_kv_tokens

    def itl(self, concurrency: float, context_length: float) -> float:
        """Expected ITL (ms) with `concurrency` requests of that context on one worker."""
        return float(self.itl_grid[self._row(context_length), self._column(self.kv_usage_of(concurrency, context_length))])

    def best_throughput_per_gpu(self, itl_target: float, context_length: float) -> tuple[float, float, float]:
        """(throughput per GPU, its ITL, its KV usage) at the highest load whose ITL meets `itl_target` for
        this context; the lowest load's when none does. The interpolated ITL need not rise monotonically
        with load, so the row is scanned from the top rather than bisected."""
        row = self._row(context_length)
        for column in range(self.resolution - 1, -1, -1):
            if self.itl_grid[row, column] <= itl_target:
                break
        else:
            column = 0
        return float(self.thpt_grid[row, column]), float(self.itl_grid[row, column]), float(self.usage_axis[column])
