"""`tandem planner`: the SLA planner beside a deployment it did not start, observing only. Against a real
`tandem run` of mocker workers it reads the traffic and the workers from the frontend, decides what the pools
should be, and changes nothing; bad settings are refused with the setting named."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tandem.planner.observe import parse_page
from tandem.planner.sla import Replicas
from tests.load import Load
from tests.test_planner_run import instances, write_profiles

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
                      "--max-gpu-budget", "3")
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
    assert any("SLA planner (agg, observing" in line for line in lines)


@pytest.mark.parametrize(("args", "message"), [
    ([], "tandem planner only observes in this release: give --no-operation"),
    (["--no-operation", "--itl", "-1"], "planner setting itl must be a number > 0"),
    (["--no-operation"], "planner setting profile_results_dir is required"),
    (["--no-operation", "--profile-results-dir", "/nonexistent"], "profile_results_dir: /nonexistent does not exist"),
])
def test_bad_settings_are_refused_naming_the_setting(args: list[str], message: str, tmp_path: Path) -> None:
    write_profiles(tmp_path)
    given = [*args, "--profile-results-dir", str(tmp_path)] if "--itl" in args else args
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
