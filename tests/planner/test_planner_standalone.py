"""`tandem planner`: the planner beside a deployment it did not start. Against a real `tandem run` of mocker
workers, observing only, it reads the traffic and the workers from the frontend, decides what the pools should
be, and changes nothing; bad settings are refused with the setting named."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tandem.planner.observe import parse_page
from tandem.planner.sla import Replicas
from tests.planner.test_planner_run import instances, write_profiles
from tests.support.load import Load

METRICS = """# TYPE dynamo_frontend_model_workers gauge
dynamo_frontend_model_workers{model="a"} 3.0
dynamo_frontend_model_workers{model="b"} 1.0
# TYPE dynamo_frontend_model_prefill_workers gauge
dynamo_frontend_model_prefill_workers{model="a"} 2.0
"""


def test_the_workers_are_read_from_the_frontends_gauges() -> None:
    assert parse_page(METRICS, "a").workers == Replicas(prefill=2, decode=3)
    assert parse_page(METRICS, "b").workers == Replicas(prefill=0, decode=1)
    assert parse_page(METRICS).workers == Replicas(prefill=2, decode=4)


def planner(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tandem.planner", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_the_planner_observes_a_run_and_reports_what_it_would_do_without_doing_it(launch, tmp_path: Path) -> None:
    write_profiles(tmp_path)
    run = launch("--workers", "2", "--router-mode", "kv")
    url = run.serving()
    watcher = planner("--frontend-url", url, "--no-operation", "--mode", "agg", "--profile-results-dir", str(tmp_path),
                      "--adjustment-interval", "1", "--load-predictor", "constant", "--no-correction",
                      "--max-gpu-budget", "3", "--control-api-port", "0")
    assert watcher.stdout is not None
    lines: list[str] = []
    heavy = Load(url, clients=6, pause=0)
    try:
        deadline = time.monotonic() + 60
        while not any(re.search(r"decode 2 -> 3 \(observe_only\)", line) for line in lines):
            assert time.monotonic() < deadline and watcher.poll() is None, "".join(lines)
            lines.append(watcher.stdout.readline())
        assert instances(url) == 2  # it changed nothing
    finally:
        heavy.stop()
        watcher.terminate()
        watcher.wait(10)
        run.stop()
    assert heavy.failures == []
    assert any("SLA planner every 1 s, constant predictor (agg): TTFT 500 ms, ITL 50 ms; observing only" in line
               for line in lines)


@pytest.mark.parametrize(("args", "message"), [
    (["--profile-results-dir", "PROFILES", "--mode", "agg"], "name the worker Deployment to scale: --worker-deployment"),
    (["--no-operation", "--profile-results-dir", "PROFILES", "--control-api-port", "70000"],
     "--control-api-port must be a port number"),
    (["--no-operation", "--enable-loadbased-scaling", "--loadbased-scaling-down-sensitivity", "120"],
     "load_scaling_down_sensitivity must be an integer from 0 to 100"),
    (["--no-operation", "--itl", "-1"], "planner setting itl must be a number > 0"),
    (["--no-operation"], "planner setting profile_results_dir is required"),
    (["--no-operation", "--profile-results-dir", "/nonexistent"], "profile_results_dir: /nonexistent does not exist"),
])
def test_bad_settings_are_refused_naming_the_setting(args: list[str], message: str, tmp_path: Path) -> None:
    write_profiles(tmp_path)
    given = [*args, "--profile-results-dir", str(tmp_path)] if "--itl" in args else args
    given = [str(tmp_path) if arg == "PROFILES" else arg for arg in given]
    done = subprocess.run([sys.executable, "-m", "tandem.planner", "--frontend-url", "http://127.0.0.1:9", *given],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr


def test_the_frontend_reports_prefill_and_decode_workers(launch) -> None:
    run = launch("--prefill-workers", "1", "--decode-workers", "1")
    try:
        url = run.serving()
        assert parse_page(httpx.get(f"{url}/metrics", timeout=5).text).workers == Replicas(prefill=1, decode=1)
    finally:
        run.stop()


async def test_the_planner_hands_load_decisions_to_an_orchestrator_through_discovery(launch) -> None:
    """`tandem planner --environment virtual` with load-based scaling alone, beside a run it did not start: it
    follows the engines on the run's event plane and writes its decision into the run's discovery store, where
    an orchestrator (here the test) picks it up, carries it out and acknowledges it."""
    import asyncio

    from tandem.planner.virtual import VirtualConnectorClient
    from tandem.runtime.discovery import FileStore

    run = launch("--workers", "1", "--namespace", "virtual-test", "--", "--speedup-ratio", "5")
    url = run.serving()
    kv = run.wait_for(r"discovery: (\S+) \(namespace virtual-test\)").group(1)
    env = {"DYN_FILE_KV": kv, "DYN_NAMESPACE": "virtual-test"}
    planning = subprocess.Popen(
        [sys.executable, "-m", "tandem.planner", "--environment", "virtual", "--enable-loadbased-scaling",
         "--disable-throughput-scaling", "--mode", "agg", "--ttft", "20", "--itl", "8",
         "--loadbased-adjustment-interval", "1", "--max-gpu-budget", "3", "--control-api-port", "0",
         "--discovery-backend", "file", "--virtual-timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **env})
    store = FileStore(kv, poll_interval=0.05, ttl=5)
    await store.start()
    heavy = Load(url, clients=12, pause=0, words=400)
    try:
        orchestrator = VirtualConnectorClient(store, "virtual-test")
        decision = await asyncio.wait_for(orchestrator.wait(), timeout=90)
        assert (decision.num_prefill_workers, decision.num_decode_workers) == (0, 2)  # one more than the run has
        await orchestrator.complete(decision)  # (a real orchestrator would start a worker first)
    finally:
        heavy.stop()
        await store.close()
        planning.terminate()
        output, _ = planning.communicate(timeout=30)
        run.stop()
    assert heavy.failures == []
    assert "load-based every 1 s, scale-down under 80% (agg): TTFT 20 ms, ITL 8 ms; scaling through virtual" in output
    assert re.search(r"-> up; prefill 0 -> 0, decode 1 -> 2 \(scaled\)", output), output
