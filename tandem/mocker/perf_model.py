"""Step timing models of the mocker (Dynamo `lib/mocker/src/common/perf_model.rs`).

A scheduler step costs `prefill_ms(new tokens computed in the step) + decode_ms(...)` when tokens
are sampled. Two models:

* `PolynomialPerfModel`: Dynamo's default fit (`T` = uncached prompt tokens of the whole batch,
  `p` = active KV tokens / total KV tokens).
* `InterpolatedPerfModel`: measured points, as in Dynamo's `--planner-profile-data` NPZ files:
  prefill is a 1-D linear interpolation of `prefill_ttft_ms` over `prefill_isl`; decode a bilinear
  interpolation of `decode_itl[i, j]` over (`decode_active_kv_tokens[i]`, `decode_context_length[j]`).
  Both extrapolate linearly from the edge segment/cell outside the measured range (like Rust's
  `ndarray_interp` with `extrapolate(true)`); prefill is clamped at 0 ms, decode at 1 ms.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

PERF_MODEL_KEYS = (
    "prefill_isl",
    "prefill_ttft_ms",
    "decode_active_kv_tokens",
    "decode_context_length",
    "decode_itl",
)

# A decode step emits tokens, so it must take some time (Dynamo: "token-emitting decode steps
# should not collapse onto the same timestamp").
MIN_DECODE_MS = 1.0


class PerfModel(Protocol):
    def prefill_ms(self, new_tokens: int) -> float:
        """Prefill part of one step; `new_tokens` = uncached tokens computed in the step (whole batch)."""
        ...

    def decode_ms(self, active_kv_tokens: int, total_kv_tokens: int, context_length: float) -> float:
        """Decode part of one step; `context_length` = mean context of the sampling requests."""
        ...


class PolynomialPerfModel:
    """Dynamo's default timing fit."""

    def prefill_ms(self, new_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        t = float(new_tokens)
        return 4.209989e-07 * t * t + 1.518344e-02 * t + 16.50142

    def decode_ms(self, active_kv_tokens: int, total_kv_tokens: int, context_length: float) -> float:
        p = active_kv_tokens / total_kv_tokens if total_kv_tokens > 0 else 0.0
        return max(MIN_DECODE_MS, -25.74 * p * p + 54.01 * p + 5.74)


def _cell(axis: np.ndarray, x: float) -> tuple[int, float]:
    """Index `i` of the segment `[axis[i], axis[i+1]]` used for `x` (the edge one outside the
    range) and the position of `x` in it (< 0 or > 1 when extrapolating)."""
    i = int(np.searchsorted(axis, x, side="right")) - 1
    i = min(max(i, 0), len(axis) - 2)
    return i, (x - axis[i]) / (axis[i + 1] - axis[i])


class InterpolatedPerfModel:
    """Timing interpolated from measured points (see the module docstring for the layout)."""

    def __init__(
        self,
        prefill_isl: Any,
        prefill_ttft_ms: Any,
        decode_active_kv_tokens: Any,
        decode_context_length: Any,
        decode_itl: Any,
    ) -> None:
        self.prefill_isl = _axis("prefill_isl", prefill_isl)
        self.prefill_ttft_ms = _array("prefill_ttft_ms", prefill_ttft_ms, ndim=1)
        self.decode_active_kv_tokens = _axis("decode_active_kv_tokens", decode_active_kv_tokens)
        self.decode_context_length = _axis("decode_context_length", decode_context_length)
        self.decode_itl = _array("decode_itl", decode_itl, ndim=2)
        if self.prefill_ttft_ms.shape != self.prefill_isl.shape:
            raise ValueError(
                f"prefill_ttft_ms has {len(self.prefill_ttft_ms)} values but prefill_isl has {len(self.prefill_isl)}"
            )
        expected = (len(self.decode_active_kv_tokens), len(self.decode_context_length))
        if self.decode_itl.shape != expected:
            raise ValueError(
                f"decode_itl must have shape (len(decode_active_kv_tokens), len(decode_context_length)) "
                f"= {expected}, got {self.decode_itl.shape}"
            )

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> InterpolatedPerfModel:
        missing = [key for key in PERF_MODEL_KEYS if key not in data]
        if missing:
            raise ValueError(f"perf model data is missing {', '.join(repr(k) for k in missing)}")
        return cls(*(data[key] for key in PERF_MODEL_KEYS))

    def prefill_ms(self, new_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        xs, ys = self.prefill_isl, self.prefill_ttft_ms
        i, t = _cell(xs, float(new_tokens))
        return max(0.0, float(ys[i] + t * (ys[i + 1] - ys[i])))

    def decode_ms(self, active_kv_tokens: int, total_kv_tokens: int, context_length: float) -> float:
        z = self.decode_itl
        i, tx = _cell(self.decode_active_kv_tokens, float(active_kv_tokens))
        j, ty = _cell(self.decode_context_length, float(context_length))
        low = z[i, j] + tx * (z[i + 1, j] - z[i, j])
        high = z[i, j + 1] + tx * (z[i + 1, j + 1] - z[i, j + 1])
        return max(MIN_DECODE_MS, float(low + ty * (high - low)))


def _array(name: str, value: Any, *, ndim: int) -> np.ndarray:
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must hold numbers: {e}") from None
    if array.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-D array, got shape {array.shape}")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} holds a non-finite value")
    return array


def _axis(name: str, value: Any) -> np.ndarray:
    axis = _array(name, value, ndim=1)
    if len(axis) < 2:
        raise ValueError(f"{name} needs at least 2 points to interpolate, got {len(axis)}")
    if not np.all(np.diff(axis) > 0):
        raise ValueError(f"{name} must be strictly increasing")
    return axis


def load_perf_model(path: str | None) -> PerfModel:
    """`None` -> the polynomial model; a `.npz` (Dynamo's profile format) or `.json` file (an
    object with the same five keys, as lists) -> the interpolated model."""
    if path is None:
        return PolynomialPerfModel()
    suffix = Path(path).suffix.lower()
    if suffix == ".npz":
        with np.load(path, allow_pickle=False) as npz:
            return InterpolatedPerfModel.from_mapping({key: npz[key] for key in npz.files})
    if suffix == ".json":
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object with keys {', '.join(PERF_MODEL_KEYS)}")
        return InterpolatedPerfModel.from_mapping(data)
    raise ValueError(f"{path}: unsupported perf model file (expected .npz or .json)")
