"""The SLA planner's parts, each against numbers worked out by hand: the load predictors on known series, the
profile interpolators on profiles whose surfaces are exact, the replica formulas (corrections, budget,
per-step cap, agg), trace warm-up, and the config's errors naming the field."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tandem.planner.config import PlannerConfig, PlannerMode, PredictorKind
from tandem.planner.perf import DECODE_NPZ, PREFILL_NPZ, DecodeProfile, PrefillProfile
from tandem.planner.predictors import (
    ArimaPredictor,
    ConstantPredictor,
    KalmanPredictor,
    MovingAveragePredictor,
    ProphetPredictor,
    make_predictor,
)
from tandem.planner.sla import IntervalMetrics, Replicas, SlaPlanner
from tandem.planner.trace import interval_history
from tandem.runtime.config import ConfigError

# -- predictors ----------------------------------------------------------------------------------------------


def fed(predictor, values):  # type: ignore[no-untyped-def]
    for value in values:
        predictor.add(value)
    return predictor


def test_leading_idle_intervals_are_skipped_and_unreadable_values_count_as_zero() -> None:
    p = fed(ConstantPredictor(), [0, 0, float("nan"), 3, float("inf"), 5])
    assert list(p.values) == [3, 0, 5]
    assert p.predict() == 5


def test_moving_average_of_the_last_window_in_either_scale() -> None:
    assert fed(MovingAveragePredictor(3), [1, 2, 3, 4, 5]).predict() == pytest.approx(4.0)
    logged = fed(MovingAveragePredictor(2, log1p=True), [0.5, 3, 8]).predict()
    assert logged == pytest.approx(math.expm1((math.log1p(3) + math.log1p(8)) / 2))


def test_kalman_follows_a_linear_trend_and_waits_for_its_minimum_points() -> None:
    kalman = KalmanPredictor(q_level=1.0, q_trend=0.1, r=10.0, min_points=5)
    fed(kalman, [10, 20, 30, 40])
    assert kalman.predict() == 40  # fewer than min_points: the last value
    fed(kalman, range(50, 210, 10))
    assert kalman.predict() == pytest.approx(210, abs=3)


def test_arima_predicts_an_ar1_series_and_a_constant_one() -> None:
    rng = np.random.default_rng(7)
    series = [100.0]
    for _ in range(120):
        series.append(100 + 0.8 * (series[-1] - 100) + rng.normal(0, 2))
    expected = 100 + 0.8 * (series[-1] - 100)  # the conditional mean of the next point
    assert fed(ArimaPredictor(), series).predict() == pytest.approx(expected, abs=2.5)
    assert fed(ArimaPredictor(), [42] * 10).predict() == 42
    assert fed(ArimaPredictor(), [1, 2, 3]).predict() == 3  # under 5 points: the last value


def test_prophet_extends_a_linear_series() -> None:
    assert fed(ProphetPredictor(window=50, interval=60), [2 * t + 5 for t in range(50)]).predict() == \
        pytest.approx(105, abs=2)


@pytest.mark.parametrize(("kind", "cls"), [(PredictorKind.CONSTANT, ConstantPredictor),
                                           (PredictorKind.MOVING_AVERAGE, MovingAveragePredictor),
                                           (PredictorKind.ARIMA, ArimaPredictor),
                                           (PredictorKind.KALMAN, KalmanPredictor),
                                           (PredictorKind.PROPHET, ProphetPredictor)])
def test_the_configured_predictor_is_made(kind: PredictorKind, cls: type) -> None:
    assert isinstance(make_predictor(PlannerConfig(load_predictor=kind)), cls)


# -- profiles ------------------------------------------------------------------------------------------------

ISL = np.array([100.0, 500, 1000, 2000, 4000])


def prefill_profile() -> PrefillProfile:
    """TTFT 20 ms + 0.1 ms per prompt token; 4,000 prompt tokens/s at every ISL."""
    return PrefillProfile(ISL, 20 + 0.1 * ISL, np.full(5, 4000.0))


def decode_arrays() -> dict[str, np.ndarray]:
    """ITL 10 ms + 40 ms at a full KV cache, throughput 10 + 1,000 tokens/s per unit of KV usage, whatever
    the context; 100,000 KV tokens."""
    usage, context = np.meshgrid([0.0, 0.25, 0.5, 0.75, 1.0], [0.0, 1000, 2000, 4000])
    usage, context = usage.ravel(), context.ravel()
    return {"x_kv_usage": usage, "y_context_length": context, "z_itl": 10 + 40 * usage,
            "z_thpt_per_gpu": 10 + 1000 * usage, "max_kv_tokens": np.array([100_000.0])}


def decode_profile() -> DecodeProfile:
    d = decode_arrays()
    return DecodeProfile(d["x_kv_usage"], d["y_context_length"], d["z_itl"], d["z_thpt_per_gpu"], 100_000)


def test_prefill_interpolation_is_exact_on_a_linear_profile_and_clamps_outside_it() -> None:
    p = prefill_profile()
    assert p.ttft(1500) == pytest.approx(170)
    assert p.ttft(10_000) == pytest.approx(420)  # clamped to the longest ISL measured
    assert p.ttft(10) == pytest.approx(30)
    assert p.throughput_per_gpu(3000) == pytest.approx(4000)


def test_decode_interpolation_on_its_grid() -> None:
    d = decode_profile()
    # 20 requests of 1,250 tokens: KV usage 0.25 -> grid column round(0.25 * 99) = 25 -> usage 25/99
    assert d.itl(20, 1250) == pytest.approx(10 + 40 * 25 / 99)
    # ITL <= 30 ms up to usage 0.5: the highest grid column under it is 49 (usage 49/99)
    throughput, itl, usage = d.best_throughput_per_gpu(30, 1050)
    assert (throughput, itl, usage) == pytest.approx((10 + 1000 * 49 / 99, 10 + 40 * 49 / 99, 49 / 99))
    assert d.best_throughput_per_gpu(5, 1050)[2] == 0.0  # no load meets it: the lowest one


def test_profiles_load_from_dynamos_npz_layout_and_its_json_fallback(tmp_path) -> None:
    npz, plain = tmp_path / "npz", tmp_path / "json"
    (npz / PREFILL_NPZ).parent.mkdir(parents=True)
    (npz / DECODE_NPZ).parent.mkdir(parents=True)
    np.savez(npz / PREFILL_NPZ, prefill_isl=ISL, prefill_ttft=20 + 0.1 * ISL, prefill_thpt_per_gpu=np.full(5, 4000.0))
    np.savez(npz / DECODE_NPZ, **decode_arrays())
    plain.mkdir()
    (plain / "prefill_raw_data.json").write_text(json.dumps(
        {"prefill_isl": ISL.tolist(), "prefill_ttft": (20 + 0.1 * ISL).tolist(), "prefill_thpt_per_gpu": [4000] * 5}))
    (plain / "decode_raw_data.json").write_text(json.dumps(
        {k: (v.tolist() if k != "max_kv_tokens" else 100_000) for k, v in decode_arrays().items()}))
    for folder in (npz, plain):
        assert PrefillProfile.load(folder).ttft(1500) == pytest.approx(170)
        assert DecodeProfile.load(folder).best_throughput_per_gpu(30, 1050)[2] == pytest.approx(49 / 99)
    with pytest.raises(ConfigError, match="run `tandem profile` first"):
        PrefillProfile.load(tmp_path)


# -- the decision --------------------------------------------------------------------------------------------

DECODE_CAPACITY = 10 + 1000 * 49 / 99  # tokens/s per worker at ITL 30 ms


def planner(**settings: object) -> SlaPlanner:
    config = PlannerConfig(**{"itl": 30, "adjustment_interval": 60, "load_predictor": PredictorKind.CONSTANT,
                              **settings})  # type: ignore[arg-type]
    return SlaPlanner(config.validate(), prefill_profile(), decode_profile())


def interval(ttft_ms: float = 120, itl_ms: float = 14, requests: float = 600) -> IntervalMetrics:
    """10 requests/s for 60 s of 1,000 prompt and 100 output tokens, 2 s each."""
    return IntervalMetrics(requests, 1000, 100, ttft_ms, itl_ms, 2.0, 60)


def test_disaggregated_replicas_from_the_formulas() -> None:
    p = planner(no_correction=True)
    assert p.observe(interval(), Replicas(1, 1))
    decision = p.decide(Replicas(1, 1))
    # prefill: 600 * 1000 / 60 = 10,000 tokens/s over 4,000 per worker -> 2.5 -> 3
    # decode: 600 * 100 / 60 = 1,000 tokens/s over 504.95 per worker -> 1.98 -> 2
    assert decision.target == Replicas(3, 2)
    assert p.decode_workers(decision.forecast, 60) == pytest.approx(1000 / DECODE_CAPACITY)


def test_corrections_scale_the_profiles() -> None:
    p = planner(max_gpu_budget=16)
    # Observed TTFT is half the profile's (120 ms at ISL 1,000): prefill load counts half -> 1.25 -> 2.
    # Per decode worker: 600 / 2 * 2 s / 60 s = 10 requests of context 1,050 -> usage 0.105 -> column 10,
    # profiled ITL 10 + 40 * 10/99 = 14.04 ms; observed twice that -> the ITL target halves to 15 ms
    # -> column 12 -> 10 + 1000 * 12/99 = 131.2 tokens/s -> 1,000 / 131.2 = 7.6 -> 8 decode workers.
    p.observe(interval(ttft_ms=60, itl_ms=2 * (10 + 40 * 10 / 99)), Replicas(1, 2))
    assert p.prefill_correction == pytest.approx(0.5)
    assert p.decode_correction == pytest.approx(2.0)
    assert p.decide(Replicas(1, 2)).target == Replicas(2, 8)
    # Slower than the profile on prefill only queues: its load never counts more than observed.
    p.observe(interval(ttft_ms=240), Replicas(2, 8))
    assert p.prefill_workers(p.forecast(), 60) == pytest.approx(2.5)


def test_the_gpu_budget_shrinks_both_pools_in_proportion() -> None:
    p = planner(max_gpu_budget=8)
    p.observe(interval(ttft_ms=60, itl_ms=2 * (10 + 40 * 10 / 99)), Replicas(1, 2))
    p.prefill_correction = 1.0  # prefill wants 3, decode 8: 11 GPUs
    decision = p.decide(Replicas(1, 2))
    assert decision.wanted == Replicas(3, 8)
    # scale 8/11: prefill round(3 * 0.727) = 2; decode gets the rest: 6
    assert decision.target == Replicas(2, 6)


def test_min_endpoint_and_the_per_step_cap() -> None:
    p = planner(no_correction=True, min_endpoint=2, max_replica_change=1)
    p.observe(interval(requests=6), Replicas(4, 4))  # a trickle: 1 worker each would do
    assert p.decide(Replicas(4, 4)).target == Replicas(3, 3)  # toward min_endpoint, one step at a time
    p.observe(interval(), Replicas(3, 3))
    assert p.decide(Replicas(1, 1)).target == Replicas(2, 2)  # wants 3 and 2: one more each at most


def test_aggregated_workers_add_their_prefill_and_decode_busy_fractions() -> None:
    p = planner(mode=PlannerMode.AGG, no_correction=True)
    p.observe(interval(), Replicas(0, 2))
    assert p.decide(Replicas(0, 2)).target == Replicas(0, math.ceil(2.5 + 1000 / DECODE_CAPACITY))


def test_single_pool_modes_plan_only_their_pool() -> None:
    for mode, expected in ((PlannerMode.PREFILL, Replicas(3, 0)), (PlannerMode.DECODE, Replicas(0, 2))):
        p = planner(mode=mode, no_correction=True)
        p.observe(interval(), Replicas(1, 1))
        assert p.decide(Replicas(1, 1)).target == expected


def test_an_interval_without_traffic_keeps_the_corrections() -> None:
    p = planner()
    p.observe(interval(ttft_ms=60), Replicas(1, 1))
    assert not p.observe(IntervalMetrics(0, math.nan, math.nan, math.nan, math.nan, math.nan, 60), Replicas(1, 1))
    assert p.prefill_correction == pytest.approx(0.5)


def test_a_mode_without_its_profile_is_refused() -> None:
    with pytest.raises(ConfigError, match="planner mode disagg needs a decode profile"):
        SlaPlanner(PlannerConfig(), prefill_profile(), None)


# -- trace warm-up -------------------------------------------------------------------------------------------

def test_a_mooncake_trace_becomes_per_interval_history_that_warms_the_predictors(tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [(0, 100, 10), (30_000, 300, 30), (61_000, 200, 20), (185_000, 400, 40)]
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": [1]})
                             + "\n" for t, i, o in rows))
    history = interval_history(trace, 60)
    assert history == [(2, 200, 20), (1, 200, 20), (0, 0, 0), (1, 400, 40)]
    p = planner()
    p.warm_up(history)
    assert (p.forecast().requests, p.forecast().isl) == (1, 400)
    trace.write_text('{"timestamp": 0, "input_length": 1}\n')
    with pytest.raises(ConfigError, match=r"trace.jsonl:1: not a Mooncake trace record"):
        interval_history(trace, 60)


# -- config --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("values", "message"), [
    ({"ttft": -1}, "planner setting ttft must be a number > 0, got -1"),
    ({"itl": "fast"}, "planner setting itl must be a number, got 'fast'"),
    ({"mode": "hybrid"}, "planner setting mode must be one of disagg, agg, prefill, decode"),
    ({"load-predictor": "lstm"}, "planner setting load_predictor must be one of"),
    ({"min_endpoint": 0}, "planner setting min_endpoint must be an integer >= 1"),
    ({"max_gpu_budget": 1}, "max_gpu_budget (1) is below what the min endpoints of the pools need (2 GPUs)"),
    ({"max_replica_change": 0}, "max_replica_change must be an integer >= 1"),
    ({"worker_startup_time": -3}, "worker_startup_time must be a number of seconds >= 0"),
    ({"no_operation": "yes"}, "planner setting no_operation must be true or false"),
    ({"profile_results_dir": "/nowhere"}, "planner setting profile_results_dir: /nowhere does not exist"),
    ({"adjustment-intervall": 10}, "unknown planner setting 'adjustment-intervall'"),
])
def test_a_bad_setting_is_refused_naming_it(values: dict, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        PlannerConfig.from_mapping(values)
    assert message in str(refused.value)


def test_config_files_in_yaml_and_json(tmp_path) -> None:
    (tmp_path / "p.yaml").write_text("mode: agg\nttft: 200\nload-predictor: kalman\nmax_replica_change: 2\n")
    config = PlannerConfig.from_file(tmp_path / "p.yaml")
    assert (config.mode, config.ttft, config.load_predictor, config.max_replica_change) == \
        (PlannerMode.AGG, 200.0, PredictorKind.KALMAN, 2)
    (tmp_path / "p.json").write_text('{"itl": 20, "no_correction": true}')
    assert PlannerConfig.from_file(tmp_path / "p.json").no_correction
    (tmp_path / "bad.json").write_text("{itl: 20")
    with pytest.raises(ConfigError, match="bad.json: not valid JSON"):
        PlannerConfig.from_file(tmp_path / "bad.json")


# -- planning ahead by the workers' start-up time ------------------------------------------------------------

def test_predictors_look_several_intervals_ahead() -> None:
    kalman = fed(KalmanPredictor(q_level=1.0, q_trend=0.1, r=10.0, min_points=5), range(10, 210, 10))
    assert kalman.predict(3) == pytest.approx(kalman.predict(1) + 20, abs=1)  # two more steps of +10
    assert fed(ConstantPredictor(), [4, 7]).predict(5) == 7
    assert fed(ArimaPredictor(), [float(v) for v in range(10, 210, 10)]).predict(3) == pytest.approx(230, abs=5)


def test_the_forecast_is_for_when_a_worker_started_now_is_ready() -> None:
    rising = planner(no_correction=True, load_predictor=PredictorKind.KALMAN, max_gpu_budget=64)
    for requests in range(100, 1100, 100):
        rising.observe(interval(requests=requests), Replicas(1, 1))
    now, later = rising.decide(Replicas(1, 1), 60), rising.decide(Replicas(1, 1), 60, startup_s=150)
    assert (now.forecast.steps, later.forecast.steps) == (1, 4)  # 1 + ceil(150 / 60)
    assert later.forecast.requests == pytest.approx(now.forecast.requests + 300, abs=30)
    assert later.target.prefill > now.target.prefill
