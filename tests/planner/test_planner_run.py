"""`tandem run --planner sla` on mocker workers: under heavy load the planner grows the workers from 1 to its
budget of 3, under light load it shrinks them back to 1, and no request fails on the way (stopped workers
drain, the frontend migrates what is left). The profiles are made up so that the load decides plainly: a
worker prefills 1,000 prompt tokens/s."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import numpy as np
import yaml

from tandem.planner.perf import DECODE_NPZ, PREFILL_NPZ
from tests.support.load import Load


def write_profiles(folder: Path) -> None:
    isl = np.array([64.0, 256, 1024, 4096])
    (folder / PREFILL_NPZ).parent.mkdir(parents=True)
    np.savez(folder / PREFILL_NPZ, prefill_isl=isl, prefill_ttft=5 + 0.01 * isl, prefill_thpt_per_gpu=np.full(4, 1000.0))
    usage, context = (a.ravel() for a in np.meshgrid([0.0, 0.5, 1.0], [0.0, 2048, 8192]))
    (folder / DECODE_NPZ).parent.mkdir(parents=True)
    np.savez(folder / DECODE_NPZ, x_kv_usage=usage, y_context_length=context, z_itl=10 + 40 * usage,
             z_thpt_per_gpu=10 + 1000 * usage, max_kv_tokens=np.array([100_000.0]))


def instances(url: str) -> int:
    return len(httpx.get(f"{url}/health", timeout=5).json().get("instances", []))


def wait_instances(url: str, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while instances(url) != count:
        assert time.monotonic() < deadline, f"not {count} workers within {timeout} s (have {instances(url)})"
        time.sleep(0.2)


def test_the_planner_scales_a_run_up_under_load_and_down_without_failing_a_request(launch, tmp_path) -> None:
    write_profiles(tmp_path)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"planner": {
        "profile_results_dir": str(tmp_path), "adjustment_interval": 2, "load_predictor": "constant",
        "no_correction": True, "max_gpu_budget": 3}}))
    run = launch("-f", str(tmp_path / "run.yaml"), "--workers", "1", "--router-mode", "kv")
    try:
        url = run.serving()
        run.wait_for(r"SLA planner every 2 s, constant predictor \(agg\): TTFT 500 ms, ITL 50 ms")
        heavy = Load(url, clients=6, pause=0)
        try:
            wait_instances(url, 3, timeout=60)  # thousands of prompt tokens/s: 1 -> the budget of 3
            run.wait_for(r"decode 1 -> 3 \(scaled\)")
            # Sized for when new workers are serving: the start-up time measured on this run's workers.
            run.wait_for(r"OSL 8, \d+ intervals ahead\)")
        finally:
            heavy.stop()
        light = Load(url, clients=1, pause=1.0)  # a few hundred prompt tokens/s: one worker is enough
        try:
            run.wait_for(r"decode 3 -> 1 \(scaled\)", timeout=60)
            wait_instances(url, 1, timeout=60)
            served = light.served
            deadline = time.monotonic() + 30
            while light.served < served + 2 and time.monotonic() < deadline:
                time.sleep(0.1)  # served on after the scale-down
        finally:
            light.stop()
        assert heavy.failures == [] and light.failures == []
        assert heavy.served > 0 and light.served >= served + 2
    finally:
        assert run.stop() == 0


# -- the settings of `tandem run --planner` ------------------------------------------------------------------

def test_planner_settings_come_from_the_file_then_the_config_then_the_flags(tmp_path) -> None:
    import pytest

    from tandem.launch.spec import SpecError, build_spec
    from tandem.planner.config import PlannerMode, PredictorKind

    write_profiles(tmp_path)
    (tmp_path / "planner.yaml").write_text("itl: 20\nload-predictor: kalman\n")
    spec = build_spec({"planner": "sla", "planner_config": str(tmp_path / "planner.yaml"), "ttft": 300.0,
                       "profile_results_dir": str(tmp_path), "prefill_workers": 1, "decode_workers": 1},
                      {"planner": {"itl": 10, "ttft": 900, "adjustment_interval": 30}}, available_cores=[0, 1])
    planner = spec.planner
    assert planner is not None and planner.mode is PlannerMode.DISAGG  # from the workers
    assert (planner.ttft, planner.itl, planner.adjustment_interval, planner.load_predictor) == \
        (300.0, 20.0, 30.0, PredictorKind.KALMAN)
    for flags, document, message in [
        ({"ttft": 100.0}, None, "--ttft is a planner setting: add --planner sla"),
        ({"planner": "sla"}, None, "the SLA planner needs the workers' profiles: --profile-results-dir"),
        ({"planner": "sla", "profile_results_dir": str(tmp_path), "no_frontend": True, "discovery_backend": "etcd"}, None,
         "--no-frontend starts none"),
        ({"profile_results_dir": str(tmp_path), "workers": 2}, {"planner": {"mode": "disagg"}},
         "planner mode disagg does not fit the workers (agg)"),
        ({"planner": "sla", "profile_results_dir": str(tmp_path), "itl": -5.0}, None,
         "planner setting itl must be a number > 0"),
        ({"planner_metrics_port": 9091}, None, "--planner-metrics-port: no planner runs"),
        ({"planner": "load"}, {"planner": {"environment": "kubernetes"}},
         "planner setting environment is for `tandem planner`"),
        ({"planner": "sla", "profile_results_dir": str(tmp_path), "frontend_args": "--num-processes 2"}, None,
         "leave out --num-processes"),
    ]:
        with pytest.raises(SpecError, match=None) as refused:
            build_spec(flags, document, available_cores=[0, 1])
        assert message in str(refused.value)


async def test_each_decision_is_logged_and_counted_and_no_operation_changes_nothing() -> None:
    from prometheus_client import CollectorRegistry

    from tandem.planner.config import PlannerConfig, PredictorKind
    from tandem.planner.loop import PlannerLoop
    from tandem.planner.sla import IntervalMetrics, Replicas, SlaPlanner
    from tests.planner.test_planner_core import decode_profile, prefill_profile

    class Observer:
        async def sample(self, seconds: float) -> IntervalMetrics:
            return IntervalMetrics(600, 1000, 100, 120, 14, 2.0, seconds)

    class Connector:
        def __init__(self) -> None:
            self.now, self.asked = Replicas(1, 1), []

        async def replicas(self) -> Replicas:
            return self.now

        async def scale(self, target: Replicas) -> None:
            self.asked.append(target)
            self.now = target

        def startup_seconds(self) -> float | None:
            return None

    def loop(**settings: object) -> tuple[PlannerLoop, Connector, CollectorRegistry]:
        config = PlannerConfig(itl=30, adjustment_interval=60, load_predictor=PredictorKind.CONSTANT,
                               no_correction=True, **settings).validate()
        connector, registry = Connector(), CollectorRegistry()
        sla = SlaPlanner(config, prefill_profile(), decode_profile())
        return PlannerLoop(config, connector, sla=sla, observer=Observer(), registry=registry), connector, registry

    acting, connector, registry = loop()
    decision = await acting.step(60)
    assert decision is not None and decision.target == Replicas(3, 2)  # as in test_planner_core
    for _ in range(3):
        await asyncio.sleep(0)  # the change runs in the background
    await acting.step(60)  # done by now: the same target is "unchanged"
    assert connector.asked == [Replicas(3, 2)]
    assert registry.get_sample_value("tandem_planner_decisions_total", {"action": "scaled"}) == 1
    assert registry.get_sample_value("tandem_planner_decisions_total", {"action": "unchanged"}) == 1
    assert registry.get_sample_value("tandem_planner_target_replicas", {"pool": "prefill"}) == 3

    ahead, connector, _ = loop(worker_startup_time=120)
    assert (await ahead.step(60)).forecast.steps == 3  # 1 + ceil(120 / 60)

    watching, connector, registry = loop(no_operation=True)
    await watching.step(60)
    assert connector.asked == []
    assert registry.get_sample_value("tandem_planner_decisions_total", {"action": "observe_only"}) == 1
