"""System status server: health, liveness, metrics, engine routes."""

from __future__ import annotations

import aiohttp

from tandem.runtime import Context


async def test_health_metrics_and_engine_routes(runtimes, namespace):
    runtime = await runtimes(system_port=0)
    base = f"http://127.0.0.1:{runtime.system_server.port}"

    async def generate(request):
        yield {"echo": request}

    async def sleep_route(body):
        if not isinstance(body, dict) or "level" not in body:
            raise ValueError("body must be a JSON object with 'level'")
        return {"status": "ok", "level": body["level"]}

    runtime.register_engine_route("sleep", sleep_route)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base}/health") as r:
            assert r.status == 503
            assert (await r.json())["status"] == "notready"
        endpoint = runtime.namespace(namespace).component("backend").endpoint("generate")
        await endpoint.start_serving(generate, metrics_labels={"model": "tiny"})
        runtime.set_ready()
        async with http.get(f"{base}/health") as r:
            body = await r.json()
            assert r.status == 200
            assert body["status"] == "ready" and body["endpoints"] == {"generate": "ready"}
        async with http.get(f"{base}/live") as r:
            assert r.status == 200

        client = await endpoint.client()
        await client.wait_for_instances(1, timeout=5)
        for _ in range(3):
            stream = await client.generate({"x": 1}, Context())
            assert [item async for item in stream] == [{"echo": {"x": 1}}]
        async with http.get(f"{base}/metrics") as r:
            text = await r.text()
        labels = f'dynamo_component="backend",dynamo_endpoint="generate",dynamo_namespace="{namespace}",model="tiny"'
        assert f"dynamo_component_requests_total{{{labels}}} 3.0" in text
        assert f"dynamo_component_inflight_requests{{{labels}}} 0.0" in text
        assert f'dynamo_component_request_duration_seconds_count{{{labels}}} 3.0' in text
        assert "dynamo_component_system_uptime_seconds" in text

        async with http.post(f"{base}/engine/sleep", json={"level": 1}) as r:
            assert r.status == 200 and await r.json() == {"status": "ok", "level": 1}
        async with http.post(f"{base}/engine/sleep", data=b"{not json") as r:
            assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
        async with http.post(f"{base}/engine/sleep", json=[1]) as r:
            assert r.status == 400 and "level" in (await r.json())["error"]["message"]
        async with http.post(f"{base}/engine/nope", json={}) as r:
            assert r.status == 404


async def test_required_endpoints_decide_readiness(runtimes, namespace, monkeypatch):
    runtime = await runtimes(system_port=0, system_use_endpoint_health_status=["generate"])
    base = f"http://127.0.0.1:{runtime.system_server.port}"

    async def generate(request):
        yield {}

    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base}/health") as r:
            assert r.status == 503
        await runtime.namespace(namespace).component("backend").endpoint("generate").start_serving(generate)
        async with http.get(f"{base}/health") as r:
            assert r.status == 200


async def test_canary_health_check_marks_a_hung_endpoint_notready(runtimes, namespace):
    import asyncio

    runtime = await runtimes(system_port=0, health_check_enabled=True, canary_wait_time=0.2,
                             health_check_request_timeout=0.3)
    hang = asyncio.Event()
    canaries = []

    async def generate(request):
        canaries.append(request)
        if request.get("_HEALTH_CHECK") and hang.is_set():
            await asyncio.sleep(3600)
        yield {"ok": True}

    runtime.set_ready()
    await runtime.namespace(namespace).component("backend").endpoint("generate").start_serving(
        generate, health_check_payload={"_HEALTH_CHECK": True}
    )
    async with asyncio.timeout(10):  # a second canary: the first one's answer has been recorded
        while len(canaries) < 2:
            await asyncio.sleep(0.01)
    assert runtime.health.report()["endpoints"] == {"generate": "ready"}
    hang.set()
    for _ in range(50):
        if runtime.health.report()["status"] == "notready":
            break
        await asyncio.sleep(0.1)
    assert runtime.health.report() | {"uptime": None} == {
        "status": "notready", "uptime": None, "endpoints": {"generate": "notready"}
    }


async def test_taken_system_port_fails_start_and_releases_the_request_plane(namespace):
    import socket

    import pytest

    from tandem.runtime import ConfigError, DistributedRuntime
    from tests.support.runtimes import runtime_config

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        runtime = DistributedRuntime(runtime_config(system_port=port, system_host="127.0.0.1"))
        with pytest.raises(ConfigError, match=f"DYN_SYSTEM_PORT: cannot listen on 127.0.0.1:{port}: "):
            await runtime.start()
    assert not runtime.request_server._server.is_serving()  # the request plane was released too


async def test_leave_and_rejoin_discovery(runtimes, namespace):
    runtime = await runtimes()

    async def generate(request):
        yield {}

    endpoint = runtime.namespace(namespace).component("backend").endpoint("generate")
    served = await endpoint.start_serving(generate)
    await runtime.register_key(f"v1/mdc/{namespace}/backend/generate/{runtime.instance_id:x}", b"card")
    prefix = "v1/"
    before = {k: v for k, v in (await runtime.store.get_prefix(prefix)).items() if namespace in k}
    assert served.key in before and len(before) == 2
    await runtime.leave_discovery()
    assert not [k for k in await runtime.store.get_prefix(prefix) if namespace in k]
    await runtime.rejoin_discovery()
    assert {k: v for k, v in (await runtime.store.get_prefix(prefix)).items() if namespace in k} == before


# -- which routes need the key ---------------------------------------------------------------------
async def _statuses(runtime, headers: dict[str, str] | None = None) -> dict[str, int]:
    """Status of each kind of route: open ones (health, live, metrics) and guarded ones (engine, custom)."""
    base = f"http://127.0.0.1:{runtime.system_server.port}"
    out = {}
    async with aiohttp.ClientSession(headers=headers) as http:
        for name, method, path in (("health", "GET", "/health"), ("live", "GET", "/live"),
                                   ("metrics", "GET", "/metrics"), ("engine", "POST", "/engine/sleep"),
                                   ("custom", "POST", "/v1/loras")):
            async with http.request(method, f"{base}{path}", json={}) as r:
                out[name] = r.status
                if r.status in (401, 403):
                    assert (await r.json())["error"]["message"]
    return out


async def _guarded_runtime(runtimes, **config):
    runtime = await runtimes(system_port=0, system_starting_health_status="ready", **config)

    async def sleep_route(body):
        return {"status": "ok"}

    async def loras(body, params):
        return 200, {"status": "ok"}

    runtime.register_engine_route("sleep", sleep_route)
    runtime.register_system_route("POST", "/v1/loras", loras)
    return runtime


OPEN = {"health": 200, "live": 200, "metrics": 200}


async def test_non_loopback_bind_without_key_refuses_state_changing_routes(runtimes):
    runtime = await _guarded_runtime(runtimes, system_host="0.0.0.0")
    assert await _statuses(runtime) == OPEN | {"engine": 403, "custom": 403}


async def test_the_key_opens_them_on_any_bind(runtimes):
    runtime = await _guarded_runtime(runtimes, system_host="0.0.0.0", system_api_key="k3y")
    assert await _statuses(runtime) == OPEN | {"engine": 401, "custom": 401}
    assert await _statuses(runtime, {"Authorization": "Bearer wrong"}) == OPEN | {"engine": 401, "custom": 401}
    assert await _statuses(runtime, {"Authorization": "Bearer k3y"}) == OPEN | {"engine": 200, "custom": 200}
    assert await _statuses(runtime, {"Authorization": "bearer k3y"}) == OPEN | {"engine": 200, "custom": 200}


async def test_loopback_bind_is_open_and_the_opt_out_restores_the_old_behaviour(runtimes):
    loopback = await _guarded_runtime(runtimes, system_host="127.0.0.1")
    assert await _statuses(loopback) == OPEN | {"engine": 200, "custom": 200}
    opted_out = await _guarded_runtime(runtimes, system_host="0.0.0.0", system_allow_unauthenticated=True)
    assert await _statuses(opted_out) == OPEN | {"engine": 200, "custom": 200}


def test_keys_come_from_the_environment(monkeypatch):
    from tandem.runtime import RuntimeConfig

    monkeypatch.setenv("DYN_API_KEY", "frontend-key")
    assert RuntimeConfig.from_env().system_api_key == "frontend-key"
    monkeypatch.setenv("DYN_SYSTEM_API_KEY", "system-key")
    assert RuntimeConfig.from_env().system_api_key == "system-key"
    monkeypatch.setenv("DYN_SYSTEM_ALLOW_UNAUTHENTICATED", "true")
    assert RuntimeConfig.from_env().system_allow_unauthenticated
