"""The planner's control API (`/v1/min-endpoints`): read and change the endpoints and budgets of a running
planner, with and without a key, on loopback and not; bad changes are refused whole, naming the field; a
change takes effect at the next decision: of a `tandem planner` process too, which then scales a Deployment of
a fake Kubernetes API server."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import httpx
import pytest

from tandem.planner.config import PlannerConfig, PlannerMode
from tandem.planner.control import PATH, ControlServer, ControlSettings
from tandem.planner.limits import Replicas, within_limits
from tests.planner.test_planner_connectors import api_server, scale_path, wait_for_line, write_kubeconfig  # noqa: F401
from tests.planner.test_planner_run import write_profiles
from tests.support.deployment import Deployment
from tests.support.load import Load
from tests.support.ports import free_port


async def serving(config: PlannerConfig, **settings: object) -> tuple[ControlServer, str]:
    server = ControlServer(config, ControlSettings(**{"port": 0, **settings}))  # type: ignore[arg-type]
    await server.start()
    return server, f"http://127.0.0.1:{server.port}{PATH}"


async def test_read_and_change_the_endpoints_and_budgets_of_a_disaggregated_planner() -> None:
    config = PlannerConfig(mode=PlannerMode.DISAGG, min_endpoint=1).validate()
    server, url = await serving(config)
    try:
        async with httpx.AsyncClient() as http:
            assert (await http.get(url)).json() == {
                "mode": "disagg", "prefill_min_endpoint": 1, "decode_min_endpoint": 1, "prefill_max_endpoint": None,
                "decode_max_endpoint": None, "min_gpu_budget": -1, "max_gpu_budget": 8}
            changed = await http.patch(url, json={"decode_min_endpoint": 3, "prefill_max_endpoint": 2,
                                                  "max_gpu_budget": 6})
            assert changed.status_code == 200
            assert changed.json()["decode_min_endpoint"] == 3 and changed.json()["prefill_max_endpoint"] == 2
        # The live config changed: the next decision's limits follow it.
        assert within_limits(Replicas(5, 1), config) == Replicas(2, 3)
        assert within_limits(Replicas(4, 6), config) == Replicas(2, 4)  # 6 GPUs: prefill 2 (its max), decode 4
    finally:
        await server.close()


@pytest.mark.parametrize(("body", "message"), [
    ({"min_endpoint": 2}, "min_endpoint: not a setting of the disagg planner"),
    ({"decode_min_endpoint": "3"}, "decode_min_endpoint: must be an integer, got '3'"),
    ({"decode_min_endpoint": None}, "decode_min_endpoint: must be an integer"),
    ({"decode_min_endpoint": 0}, "decode_min_endpoint must be an integer >= 1"),
    ({"decode_min_endpoint": 5, "prefill_min_endpoint": 5}, "max_gpu_budget (8) is below what the min endpoints"),
    ({"min_gpu_budget": 9}, "min_gpu_budget (9) is above max_gpu_budget (8)"),
    ({"decode_max_endpoint": 1, "decode_min_endpoint": 2}, "max endpoint (1) is below its min endpoint (2)"),
    ([], "the body must be a JSON object"),
])
async def test_a_bad_change_is_refused_whole_naming_the_field(body: object, message: str) -> None:
    config = PlannerConfig(mode=PlannerMode.DISAGG).validate()
    server, url = await serving(config)
    try:
        async with httpx.AsyncClient() as http:
            refused = await http.patch(url, json=body)
            assert refused.status_code == 400
            assert message in refused.json()["error"]["message"]
            assert (await http.patch(url, content=b"{not json")).status_code == 400
        assert (config.decode_min_endpoint, config.prefill_min_endpoint, config.min_gpu_budget) == (None, None, -1)
    finally:
        await server.close()


async def test_an_aggregated_planner_takes_min_endpoint_and_a_null_max_removes_the_cap() -> None:
    config = PlannerConfig(mode=PlannerMode.AGG, decode_min_endpoint=2, max_endpoint=3).validate()
    server, url = await serving(config)
    try:
        async with httpx.AsyncClient() as http:
            assert (await http.get(url)).json()["min_endpoint"] == 2  # the pool's own floor, as it applies
            changed = (await http.patch(url, json={"min_endpoint": 4, "max_endpoint": None})).json()
        assert (changed["min_endpoint"], changed["max_endpoint"]) == (4, None)
        assert within_limits(Replicas(0, 1), config) == Replicas(0, 4)
    finally:
        await server.close()


async def test_with_a_key_every_request_needs_it() -> None:
    config = PlannerConfig(mode=PlannerMode.AGG).validate()
    server, url = await serving(config, api_key="sesame")
    try:
        async with httpx.AsyncClient() as http:
            assert (await http.get(url)).status_code == 401
            assert (await http.patch(url, json={"min_endpoint": 2})).status_code == 401
            assert (await http.patch(url, json={"min_endpoint": 2},
                                     headers={"Authorization": "Bearer wrong"})).status_code == 401
            assert config.min_endpoint == 1
            allowed = await http.patch(url, json={"min_endpoint": 2}, headers={"Authorization": "Bearer sesame"})
            assert allowed.status_code == 200 and config.min_endpoint == 2
    finally:
        await server.close()


async def test_a_non_loopback_bind_without_a_key_refuses_every_request_unless_opted_out() -> None:
    config = PlannerConfig(mode=PlannerMode.AGG).validate()
    server, url = await serving(config, host="0.0.0.0")
    try:
        async with httpx.AsyncClient() as http:
            refused = await http.patch(url, json={"min_endpoint": 2})
            assert refused.status_code == 403 and "PLANNER_CONTROL_API_KEY" in refused.json()["error"]["message"]
            assert (await http.get(url)).status_code == 403
        assert config.min_endpoint == 1
    finally:
        await server.close()
    server, url = await serving(config, host="0.0.0.0", allow_unauthenticated=True)
    try:
        async with httpx.AsyncClient() as http:
            assert (await http.patch(url, json={"min_endpoint": 2})).status_code == 200
        assert config.min_endpoint == 2
    finally:
        await server.close()


async def test_a_change_reaches_the_next_decision_of_a_running_planner(api_server, tmp_path: Path, smollm2) -> None:  # noqa: F811
    """`tandem planner --environment kubernetes` beside a frontend of two processes under a light load: it decides
    every second that one worker is enough and leaves the worker Deployment at 1. Raising `min_endpoint` over
    its control API makes its next decision scale the Deployment to 3, as the API server sees it."""
    profiles = tmp_path / "profiles"
    write_profiles(profiles)
    server = await api_server({"llm-tandem-worker": 1})
    deployment = Deployment(tmp_path, smollm2, frontend_args=["--num-processes", "2"])
    port = free_port()
    planner = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tandem.planner", "--environment", "kubernetes", "--helm-release", "llm",
        "--kubeconfig", str(write_kubeconfig(tmp_path / "kubeconfig", server)), "--mode", "agg",
        "--profile-results-dir", str(profiles), "--adjustment-interval", "1", "--load-predictor", "constant",
        "--no-correction", "--control-api-port", str(port), "--discovery-backend", "file",
        env={**os.environ, **deployment.env}, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    light = Load(deployment.url, clients=1, pause=0.2, words=20)
    try:
        await wait_for_line(planner, "decode 1 -> 1 (unchanged)")  # deciding on the traffic: one worker
        assert server.patches == []
        async with httpx.AsyncClient() as http:
            changed = await http.patch(f"http://127.0.0.1:{port}{PATH}", json={"min_endpoint": 3})
        assert changed.status_code == 200 and changed.json()["min_endpoint"] == 3
        await wait_for_line(planner, "decode 1 -> 3 (scaled)")
        async with asyncio.timeout(30):  # the scaling runs beside the loop
            while not server.patches:
                await asyncio.sleep(0.05)
        assert [(r.path, r.body) for r in server.patches] == [(scale_path("llm-tandem-worker"),
                                                                {"spec": {"replicas": 3}})]
    finally:
        light.stop()
        planner.terminate()
        await planner.wait()
        deployment.stop()
    assert light.failures == []
