"""Load-based scaling: the step-time fit, the per-pool verdicts against queues worked out by hand, the
forward-pass metrics as workers publish them, and `tandem run --planner load` on mocker workers under a step
load (one worker more while the load is high, back to one after it, no request failed)."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from tandem.llm.forward_pass import (
    EngineState,
    ForwardPass,
    ForwardPassMetrics,
    forward_pass_metrics_from_builtins,
)
from tandem.planner.config import PlannerConfig, PlannerMode
from tandem.planner.limits import Replicas
from tandem.planner.load import LoadPlanner, StepTimeFit, Verdict
from tandem.worker.forward_pass import ForwardPassRecorder
from tests.support.load import Load

# -- the fit ---------------------------------------------------------------------------------------------------

def test_the_fit_recovers_a_line_and_a_plane() -> None:
    line = StepTimeFit(1, 64, 16)
    for x in range(0, 4000, 100):
        line.add((x,), 0.002 + 1e-5 * x)
    assert line.seconds(1000) == pytest.approx(0.012)
    plane = StepTimeFit(2, 64, 16)
    for p in range(0, 2000, 250):
        for k in range(0, 8000, 1000):
            plane.add((p, k), 0.001 + 2e-5 * p + 1e-6 * k)
    assert plane.seconds(1000, 4000) == pytest.approx(0.001 + 0.02 + 0.004)


def test_a_slope_that_fits_negative_is_left_out() -> None:
    fit = StepTimeFit(2, 64, 16)
    for p in range(0, 1000, 200):  # steps that took less time with more KV tokens: noise, not a cost
        for k in range(0, 5000, 1000):
            fit.add((p, k), 0.005 + 1e-5 * p - 1e-7 * k)
    intercept, prefill, kv = fit.coefficients()
    assert kv == 0 and prefill == pytest.approx(1e-5) and intercept > 0


def test_a_full_sample_keeps_the_rare_heavy_steps() -> None:
    fit = StepTimeFit(1, 16, 16)
    fit.add((8000,), 0.1)  # one heavy step, then a flood of light ones
    for _ in range(500):
        fit.add((10,), 0.001)
    assert len(fit) == 16
    assert any(load == (8000,) for load, _ in fit._samples)  # evicted from the crowded bucket, not by age


# -- the verdicts ------------------------------------------------------------------------------------------------

def report(worker: int, queued: int = 0, kv: int = 0, passes: list[ForwardPass] | None = None,
           busy: float = 0.0) -> ForwardPassMetrics:
    return ForwardPassMetrics(worker, 0, EngineState(queued, kv, 1000), passes or [], busy)


def trained(mode: PlannerMode, **settings: object) -> LoadPlanner:
    """A planner whose fits say: a step takes 1 ms + 10 us per prompt token + 1 us per 1,000 KV tokens."""
    planner = LoadPlanner(PlannerConfig(mode=mode, ttft=100, itl=10, enable_load_scaling=True,
                                        enable_throughput_scaling=False, **settings).validate())
    steps = [ForwardPass(p, k, 0.001 + 1e-5 * p + 1e-6 * k) for p in (0, 100, 200, 500, 1000, 2000) for k in (0, 1000, 2000, 5000, 9000)]
    for pool in planner.config.pools:
        if mode is PlannerMode.AGG:
            planner.ingest(pool, report(99, passes=steps), now=0.0)
        elif pool == "prefill":
            planner.ingest(pool, report(99, passes=[s for s in steps if s.prefill_tokens and not s.kv_tokens]), now=0.0)
        else:
            planner.ingest(pool, report(99, passes=[s for s in steps if not s.prefill_tokens]), now=0.0)
        planner.forget(99)
    return planner


def test_disaggregated_pools_grow_when_every_engine_misses_and_hold_when_one_does_not() -> None:
    planner = trained(PlannerMode.DISAGG)
    # Prefill engines with 20,000 queued prompt tokens: 20 chunks of 11 ms = 220 ms > 100 ms; one with none.
    planner.ingest("prefill", report(1, queued=20_000, busy=1.0), now=1.0)
    planner.ingest("prefill", report(2, queued=20_000, busy=1.0), now=1.0)
    # Decode engines holding 12,000 KV tokens: 1 + 12 = 13 ms > 10 ms.
    planner.ingest("decode", report(3, kv=12_000, busy=1.0), now=1.0)
    decision = planner.decide(Replicas(2, 1), now=1.5)
    assert decision.estimates["prefill"].ttft_ms == pytest.approx((220.0, 220.0))
    assert decision.estimates["decode"].itl_ms == pytest.approx((13.0,))
    assert decision.target == Replicas(3, 2)
    planner.ingest("prefill", report(2, queued=0, busy=1.0), now=2.0)  # one engine is fine: hold
    planner.ingest("prefill", report(1, queued=20_000, busy=1.0), now=2.0)
    planner.ingest("decode", report(3, kv=12_000, busy=1.0), now=2.0)
    assert planner.decide(Replicas(2, 2), now=2.5).estimates["prefill"].verdict is Verdict.HOLD


def test_a_pool_waits_for_its_starting_workers_and_shrinks_only_if_the_rest_can_take_the_load() -> None:
    planner = trained(PlannerMode.DECODE)
    planner.ingest("decode", report(3, kv=12_000), now=1.0)
    assert planner.decide(Replicas(0, 2), now=1.5).estimates["decode"].verdict is Verdict.WAITING
    # Two idle-ish engines (ITL 2 ms < 8 ms), each busy 30% of the time: one would be busy 60% < 80%: shrink.
    planner.ingest("decode", report(3, kv=1000, busy=0.15), now=2.0)
    planner.ingest("decode", report(4, kv=1000, busy=0.15), now=2.0)
    assert planner.decide(Replicas(0, 2), now=2.0).target == Replicas(0, 1)
    # Busy 50% each: one would be busy 100%: hold, however low the latencies.
    planner.ingest("decode", report(3, kv=1000, busy=0.25), now=2.5)
    planner.ingest("decode", report(4, kv=1000, busy=0.25), now=2.5)
    assert planner.decide(Replicas(0, 2), now=2.5).estimates["decode"].verdict is Verdict.HOLD


def test_an_aggregated_pool_grows_on_either_target_and_never_under_the_floor() -> None:
    planner = trained(PlannerMode.AGG)
    # ITL fine (1 ms + 1 ms), TTFT over: 20,000 queued tokens with 1,000 KV tokens held.
    planner.ingest("decode", report(1, queued=20_000, kv=1000, busy=0.5), now=1.0)
    assert planner.decide(Replicas(0, 1), now=1.5).target == Replicas(0, 2)
    planner.ingest("decode", report(1, kv=1000), now=2.0)
    planner.ingest("decode", report(2, kv=1000), now=2.0)
    assert planner.decide(Replicas(0, 2), now=2.5).target == Replicas(0, 1)  # both estimates low, idle
    planner.ingest("decode", report(1, kv=1000), now=3.0)
    planner.ingest("decode", report(2, kv=1000), now=3.0)
    assert planner.decide(Replicas(0, 2), floor=Replicas(0, 2), now=3.5).target == Replicas(0, 2)


def test_no_verdict_before_enough_steps_or_without_engines() -> None:
    planner = LoadPlanner(PlannerConfig(mode=PlannerMode.AGG, enable_load_scaling=True,
                                        enable_throughput_scaling=False).validate())
    planner.ingest("decode", report(1, queued=50_000, passes=[ForwardPass(100, 100, 0.01)] * 4), now=0.0)
    assert planner.decide(Replicas(0, 1), now=0.5).estimates["decode"].verdict is Verdict.NOT_READY
    assert planner.decide(Replicas(0, 1), now=60.0).estimates["decode"].engines == 0  # its reports stopped


@pytest.mark.parametrize(("values", "message"), [
    ({"load_scaling_down_sensitivity": 101}, "load_scaling_down_sensitivity must be an integer from 0 to 100"),
    ({"fpm_sample_bucket_size": 10}, "fpm_sample_bucket_size must be a perfect square"),
    ({"enable_throughput_scaling": False}, "both off: nothing would scale"),
    ({"enable_load_scaling": True, "load_adjustment_interval": 200}, "must be shorter than adjustment_interval"),
    ({"max_endpoint": 2, "min_endpoint": 3, "mode": "agg"}, "max endpoint (2) is below its min endpoint (3)"),
    ({"min_gpu_budget": 9}, "min_gpu_budget (9) is above max_gpu_budget (8)"),
    ({"max_gpu_budget": 0}, "max_gpu_budget must be an integer >= 1, or -1 for no limit"),
])
def test_a_bad_load_setting_is_refused_naming_it(values: dict, message: str) -> None:
    from tandem.runtime.config import ConfigError

    with pytest.raises(ConfigError) as refused:
        PlannerConfig.from_mapping(values)
    assert message in str(refused.value)


def test_dynamo_names_of_the_settings_are_accepted() -> None:
    config = PlannerConfig.from_mapping({"ttft_ms": 200, "itl_ms": 20, "throughput_adjustment_interval_seconds": 60,
                                         "load_adjustment_interval_seconds": 3, "enable_load_scaling": True})
    assert (config.ttft, config.itl, config.adjustment_interval, config.load_adjustment_interval) == (200, 20, 60, 3)


def test_only_the_workers_in_discovery_count() -> None:
    """A worker being stopped leaves discovery first: its last reports no longer speak for the pool."""
    planner = trained(PlannerMode.DECODE)
    planner.members = lambda pool: {3}
    planner.ingest("decode", report(3, kv=12_000), now=1.0)
    planner.ingest("decode", report(4, kv=0), now=1.0)  # stopping: idle, would hold the pool back
    assert planner.engine_counts(now=1.5) == Replicas(0, 1)
    assert planner.decide(Replicas(0, 1), now=1.5).target == Replicas(0, 2)


# -- the workers' side -------------------------------------------------------------------------------------------

async def test_the_recorder_publishes_the_steps_and_the_queue_and_idle_engines_still_report() -> None:
    published: list[object] = []

    class Plane:
        def publish(self, event: object) -> bool:
            published.append(msgspec.msgpack.decode(msgspec.msgpack.encode(event)))  # as the wire carries it
            return True

    recorder = ForwardPassRecorder(worker_id=7, dp_rank=1, publisher=Plane(), interval=0.05, idle_interval=0.2,
                                   state=lambda: EngineState(300, 4096, 8192))
    for n in range(100):
        recorder.record(n, 4096, 0.001)
    recorder.record(0, 0, 0.5)  # an empty step says nothing
    recorder.start()
    try:
        deadline = time.monotonic() + 10
        while len(published) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    finally:
        await recorder.stop()
    first = forward_pass_metrics_from_builtins(published[0])
    assert (first.worker_id, first.dp_rank, first.state) == (7, 1, EngineState(300, 4096, 8192))
    assert [p.prefill_tokens for p in first.passes] == list(range(36, 100))  # the newest 64
    assert first.busy == pytest.approx(0.1)  # all 100 steps, not only those sent
    assert forward_pass_metrics_from_builtins(published[1]).passes == []  # idle: the queue only
    with pytest.raises(msgspec.ValidationError):
        forward_pass_metrics_from_builtins({"worker_id": "x"})


# -- a live run --------------------------------------------------------------------------------------------------

def test_load_scaling_grows_a_run_under_a_step_load_and_shrinks_it_after_without_failing_a_request(launch) -> None:
    from tests.planner.test_planner_run import wait_instances

    # Slow mockers (speedup 5) so that twelve clients with long prompts (~3,000 tokens) queue well past a 20 ms TTFT
    # on one worker, however fast this machine serves the clients.
    run = launch("--workers", "1", "--planner", "load", "--ttft", "20", "--itl", "8", "--loadbased-adjustment-interval",
                 "1", "--max-gpu-budget", "3", "--", "--speedup-ratio", "5")
    try:
        url = run.serving()
        run.wait_for(r"load-based every 1 s, scale-down under 80% \(agg\): TTFT 20 ms, ITL 8 ms")
        heavy = Load(url, clients=12, pause=0, words=800)
        try:
            run.wait_for(r"-> up; prefill 0 -> 0, decode 1 -> 2 \(scaled\)", timeout=60)
            wait_instances(url, 2, timeout=60)
            served = heavy.served
            deadline = time.monotonic() + 30
            while heavy.served < served + 50 and time.monotonic() < deadline:
                time.sleep(0.1)  # served on by both workers
        finally:
            heavy.stop()
        run.wait_for(r"-> down; prefill 0 -> 0, decode 2 -> 1 \(scaled\)", timeout=60)
        wait_instances(url, 1, timeout=60)
        light = Load(url, clients=1, pause=0.2)
        try:
            deadline = time.monotonic() + 30
            while light.served < 3 and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            light.stop()
        assert heavy.failures == [] and light.failures == []
        assert heavy.served > served + 50 - 1 and light.served >= 3
    finally:
        assert run.stop() == 0

