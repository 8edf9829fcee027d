"""Load predictors: given one value per adjustment interval (requests, mean ISL, mean OSL), the next one.

Shared behaviour, as the reference planner's: a reading that is not finite counts as 0; the zeros before the
first non-zero reading (a deployment idle since it started) are skipped; with fewer points than a
predictor needs, the last value is the prediction. `log1p` predictors fit log(1 + load), which tames spiky
series, and answer in the original scale.
"""

from __future__ import annotations

import logging
import math
import warnings
from abc import ABC, abstractmethod
from collections import deque

import numpy as np

from tandem.planner.config import PlannerConfig, PredictorKind
from tandem.runtime.config import ConfigError

log = logging.getLogger(__name__)


class LoadPredictor(ABC):
    minimum_points = 1

    def __init__(self, log1p: bool = False, history: int = 512) -> None:
        self.log1p = log1p
        self.values: deque[float] = deque(maxlen=history)  # in the original scale
        self._seen_load = False

    def add(self, value: float) -> None:
        if not math.isfinite(value):
            value = 0.0
        value = max(value, 0.0)
        if value == 0.0 and not self._seen_load:
            return  # still idle since the start
        self._seen_load = self._seen_load or value > 0.0
        self.values.append(value)
        self._added(value)

    def restart_idle_skip(self) -> None:
        """After a warm-up from a trace: skip the live deployment's own idle start too."""
        self._seen_load = False

    def last(self) -> float:
        return self.values[-1] if self.values else 0.0

    def predict(self, steps: int = 1) -> float:
        """The value `steps` intervals ahead (1: the next interval), >= 0."""
        if len(self.values) < self.minimum_points:
            return self.last()
        return max(self._predict(steps), 0.0)

    def _added(self, value: float) -> None:  # noqa: B027 - a hook: only stateful predictors override it
        """A new point (original scale); for predictors that keep state."""

    def _scaled(self) -> np.ndarray:
        series = np.asarray(self.values, dtype=float)
        return np.log1p(series) if self.log1p else series

    def _unscaled(self, value: float) -> float:
        return math.expm1(value) if self.log1p else value

    @abstractmethod
    def _predict(self, steps: int) -> float: ...


class ConstantPredictor(LoadPredictor):
    def _predict(self, steps: int) -> float:
        return self.last()


class MovingAveragePredictor(LoadPredictor):
    def __init__(self, window: int, log1p: bool = False) -> None:
        super().__init__(log1p)
        self.window = window

    def _predict(self, steps: int) -> float:
        return self._unscaled(float(np.mean(self._scaled()[-self.window:])))


class ArimaPredictor(LoadPredictor):
    """ARIMA(p, d, q) refitted each interval on the recent history, the order chosen by AIC among
    p, q in 0..2 and d in 0..1 (statsmodels). If the best raw fit has no AR or MA term (a random walk: it
    would only repeat the last value), log1p(load) is tried as well, as the reference does for spiky series."""

    minimum_points = 5
    ORDERS = [(p, d, q) for d in (0, 1) for p in range(3) for q in range(3)]

    def __init__(self, log1p: bool = False, history: int = 200) -> None:
        super().__init__(log1p, history)
        try:
            import statsmodels.tsa.arima.model  # noqa: F401
        except ImportError:
            raise ConfigError("load_predictor arima needs the statsmodels package (pip install 'tandem[planner]')") \
                from None

    def _predict(self, steps: int) -> float:
        series = np.asarray(self.values, dtype=float)
        if np.all(series == series[0]):
            return float(series[0])
        order, forecast = self._best(np.log1p(series) if self.log1p else series, steps)
        if not self.log1p and order is not None and order[0] == 0 and order[2] == 0:
            log_order, log_forecast = self._best(np.log1p(series), steps)
            if log_order is not None:
                return math.expm1(log_forecast)
        if order is None:
            return self.last()
        return math.expm1(forecast) if self.log1p else forecast

    def _best(self, series: np.ndarray, steps: int) -> tuple[tuple[int, int, int] | None, float]:
        from statsmodels.tsa.arima.model import ARIMA

        best: tuple[float, tuple[int, int, int], float] | None = None
        for order in self.ORDERS:
            if len(series) <= sum(order) + 1:
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    fitted = ARIMA(series, order=order).fit()
                aic, forecast = float(fitted.aic), float(fitted.forecast(steps)[-1])
            except (ValueError, np.linalg.LinAlgError):
                continue
            if math.isfinite(aic) and math.isfinite(forecast) and (best is None or aic < best[0]):
                best = (aic, order, forecast)
        if best is None:
            log.warning("ARIMA: no order could be fitted to %d points; predicting the last value", len(series))
            return None, self.last()
        return best[1], best[2]


class KalmanPredictor(LoadPredictor):
    """A local linear trend (level and slope), updated with each point; predicts the next level.
    State x = [level, slope], x' = F x with F = [[1, 1], [0, 1]]; process noise diag(q_level, q_trend),
    measurement noise r."""

    def __init__(self, q_level: float, q_trend: float, r: float, min_points: int, log1p: bool = False) -> None:
        super().__init__(log1p)
        self.minimum_points = min_points
        self.F = np.array([[1.0, 1.0], [0.0, 1.0]])
        self.Q = np.diag([max(q_level, 1e-12), max(q_trend, 1e-12)])
        self.r = max(r, 1e-9)
        self.x: np.ndarray | None = None
        self.P = np.eye(2) * 1000.0

    def _added(self, value: float) -> None:
        z = math.log1p(value) if self.log1p else value
        if self.x is None:
            self.x = np.array([z, 0.0])
            return
        x = self.F @ self.x  # predict this step, then correct it with the reading
        P = self.F @ self.P @ self.F.T + self.Q
        gain = P[:, 0] / (P[0, 0] + self.r)
        self.x = x + gain * (z - x[0])
        self.P = P - np.outer(gain, P[0, :])

    def _predict(self, steps: int) -> float:
        assert self.x is not None
        level, slope = self.x
        return self._unscaled(float(level + steps * slope))


class ProphetPredictor(LoadPredictor):
    """Prophet fitted on the last `window` points, one point per interval."""

    minimum_points = 5

    def __init__(self, window: int, interval: float, log1p: bool = False) -> None:
        super().__init__(log1p, history=window)
        self.interval = interval
        try:
            import prophet  # noqa: F401
        except ImportError:
            raise ConfigError("load_predictor prophet needs the prophet package (pip install prophet)") from None
        for name in ("prophet", "cmdstanpy"):
            logging.getLogger(name).setLevel(logging.WARNING)

    def _predict(self, steps: int) -> float:
        import pandas as pd
        from prophet import Prophet

        start = pd.Timestamp("2026-01-01")
        at = pd.to_timedelta(np.arange(len(self.values) + steps) * self.interval, unit="s")
        frame = pd.DataFrame({"ds": start + at[:len(self.values)], "y": self._scaled()})
        model = Prophet()
        model.fit(frame)
        forecast = model.predict(pd.DataFrame({"ds": [start + at[-1]]}))
        return self._unscaled(float(forecast["yhat"].iloc[0]))


def make_predictor(config: PlannerConfig) -> LoadPredictor:
    """A new predictor of the configured kind (one per series: requests, ISL, OSL)."""
    kind, log1p = config.load_predictor, config.load_predictor_log1p
    if kind is PredictorKind.CONSTANT:
        return ConstantPredictor(log1p)
    if kind is PredictorKind.MOVING_AVERAGE:
        return MovingAveragePredictor(config.moving_average_window, log1p)
    if kind is PredictorKind.ARIMA:
        return ArimaPredictor(log1p)
    if kind is PredictorKind.KALMAN:
        return KalmanPredictor(config.kalman_q_level, config.kalman_q_trend, config.kalman_r,
                               config.kalman_min_points, log1p)
    return ProphetPredictor(config.prophet_window_size, config.adjustment_interval, log1p)
