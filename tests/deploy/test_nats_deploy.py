"""Deployments on NATS (a real nats-server on loopback): the OpenAI client through a frontend to mocker workers
over etcd discovery and the NATS request and event planes; a NATS restart under load; durable KV events that
a frontend started late replays from JetStream; `tandem run` on NATS."""

from __future__ import annotations

import threading
import time

import httpx
import openai

from tests.support.deployment import KV_EVENTS_APPLIED, MODEL, Deployment, metric_sum, streamed_outcome
from tests.support.ports import free_port

MOCKER = ["--block-size", "16", "--speedup-ratio", "20", "--num-gpu-blocks-override", "2048"]


def nats_env(nats) -> dict[str, str]:
    return {"DYN_REQUEST_PLANE": "nats", "DYN_EVENT_PLANE": "nats", "NATS_SERVER": nats.url}


def test_mocker_deployment_on_etcd_and_nats_serves_the_openai_client(tmp_path, smollm2, etcd, nats):
    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker", engines=[MOCKER, MOCKER],
                            discovery="etcd", env=nats_env(nats), frontend_args=["--router-mode", "kv"])
    try:
        client = deployment.client()
        prompt = "a shared system prompt that spans several KV blocks " * 8
        replies = [client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": f"{prompt} question {i}"}]) for i in range(4)]
        assert all(r.usage.completion_tokens == 4 for r in replies)
        chunks = list(client.chat.completions.create(model=MODEL, max_tokens=6, stream=True, messages=[
            {"role": "user", "content": "stream over NATS"}]))
        assert chunks[-1].choices[0].finish_reason == "length"
        # The workers' KV events reached the KV router over NATS: all of them.
        emitted = deployment.wait_for_kv_events()
        assert emitted > 0
        keys = etcd.call("/v3/kv/range", {"key": "djEv", "range_end": "djEw", "keys_only": True})
        assert int(keys.get("count", 0)) >= 4  # instances and model cards live in etcd
    finally:
        deployment.stop()


def test_nats_restart_under_load_migrates_every_stream_and_serves_again(tmp_path, smollm2, nats):
    """In-flight streams are cut when NATS goes, and each one completes: migrated once NATS is back (a
    migration waits for the connection, up to DYN_NATS_REQUEST_TIMEOUT_SECS); new requests are served again
    within seconds of NATS coming back."""
    slow = ["--block-size", "16", "--speedup-ratio", "0.5", "--num-gpu-blocks-override", "2048"]
    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker", engines=[slow, slow],
                            env=nats_env(nats))
    try:
        client = deployment.client(timeout=60)
        outcomes: list[str] = []
        underway = threading.Semaphore(0)

        def one() -> None:
            try:
                stream = client.chat.completions.create(model=MODEL, max_tokens=300, stream=True, messages=[
                    {"role": "user", "content": "a stream that NATS restarts under"}])
                outcomes.append(streamed_outcome(stream, underway))
            except openai.APIError as e:
                outcomes.append(f"error:{type(e).__name__}")

        threads = [threading.Thread(target=one) for _ in range(6)]
        for thread in threads:
            thread.start()
        for _ in threads:  # however slow the machine, the streams are under way before NATS goes
            assert underway.acquire(timeout=60), "a stream never started"
        nats.stop(kill=True)
        time.sleep(0.5)
        nats.start()
        for thread in threads:
            thread.join(90)
        assert not any(thread.is_alive() for thread in threads), "a stream hung"
        assert outcomes == ["completed"] * 6
        # the restart cut every stream in flight (each process's connection dropped), and each moved on
        assert metric_sum(deployment.metrics(), "dynamo_frontend_model_migration_total") >= 6
        deadline = time.monotonic() + 15
        while True:
            try:
                reply = client.chat.completions.create(model=MODEL, max_tokens=3, messages=[
                    {"role": "user", "content": "after the restart"}])
                assert reply.usage.completion_tokens == 3
                break
            except openai.APIError:
                assert time.monotonic() < deadline, "not served again within 15 s of NATS coming back"
                time.sleep(0.2)
    finally:
        deployment.stop()


def test_frontend_started_late_replays_durable_kv_events_instead_of_asking_workers(tmp_path, smollm2, nats):
    """Workers with --durable-kv-events; a KV-routing frontend with --router-durable-kv-events that starts after
    they served: its index holds every event they emitted, and no worker was asked for a dump."""
    ports = [free_port(), free_port()]
    # The routers' catch-up of quiet workers off: it queries the same endpoint every 2 s, so a count taken
    # across it would depend on how long the test took; every query a worker serves is then a dump.
    env = {**nats_env(nats), "DYN_DURABLE_KV_EVENTS": "1", "DYN_ROUTER_EVENT_CATCH_UP_SECS": "0"}
    first = Deployment(tmp_path, smollm2, engine_module="tandem.mocker", engines=[], env=env,
                       frontend_args=["--router-mode", "kv"])
    late = None
    try:
        for port in ports:
            first.add_engine(*MOCKER, env={"DYN_SYSTEM_PORT": str(port)})
        first.wait_for_instances(2)
        client = first.client()
        for i in range(12):
            client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
                {"role": "user", "content": f"conversation {i}: " + "context " * 60}])
        emitted = first.wait_for_kv_events()
        assert emitted > 0
        queries_before = [_dumps_served(port) for port in ports]
        late = Deployment(tmp_path, smollm2, engine_module="tandem.mocker", engines=[],
                          env={**env, "DYN_NAMESPACE": first.namespace, "DYN_FILE_KV": first.env["DYN_FILE_KV"]},
                          frontend_args=["--router-mode", "kv", "--router-durable-kv-events"], instances=2)
        deadline = time.monotonic() + 20
        while (applied := metric_sum(httpx.get(f"{late.url}/metrics").text, KV_EVENTS_APPLIED)) < emitted:
            assert time.monotonic() < deadline, f"the late frontend applied {applied:g} of {emitted} events"
            time.sleep(0.05)
        assert applied == emitted
        assert [_dumps_served(port) for port in ports] == queries_before  # replayed, not dumped
    finally:
        if late is not None:
            late.stop()
        first.stop()


def _dumps_served(port: int) -> float:
    """Requests a worker's `worker_kv_indexer_query` endpoint served (routers asking for its events)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return metric_sum(text, "dynamo_component_requests_total", dynamo_endpoint="worker_kv_indexer_query")


def test_tandem_run_on_nats(launch, nats):
    run = launch("--workers", "2", "--request-plane", "nats", "--event-plane", "nats", env={"NATS_SERVER": nats.url})
    url = run.serving()
    assert run.wait_for(r"NATS at (\S+) \(NATS_SERVER\)").group(1) == nats.url
    assert run.client(url).chat.completions.create(model=MODEL, max_tokens=2, messages=[
        {"role": "user", "content": "over NATS"}]).usage.completion_tokens == 2
