"""Losing a process without losing requests. A worker dying under load with the frontend's default flags:
no request that had not started fails, streams cut mid-way move to another worker (default
--migration-limit 3) with exactly the tokens asked for, and no client sees an internal address. A frontend
stopped with SIGTERM finishes its streams first."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import threading
import time

import httpx

from tests.support.deployment import MODEL, Deployment, metric_sum
from tests.support.engines import wait_until
from tests.support.ports import free_port

MOCKER = ["--speedup-ratio", "1", "--block-size", "16"]  # streams of 100 tokens last about a second


def _stream(url: str, prompt: str, max_tokens: int) -> tuple[int, int, str | None, str]:
    """(status, tokens streamed, finish reason, raw body) of one streamed completion."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        raw = r.read().decode()
    tokens, finish = 0, None
    for line in raw.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or ():
                finish = choice.get("finish_reason") or finish
    return r.status_code, tokens, finish, raw


def test_a_worker_killed_under_load_fails_no_request(tmp_path, smollm2):
    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker", engines=[MOCKER] * 2)
    try:
        port = free_port()
        victim = deployment.add_engine(*MOCKER, env={"DYN_SYSTEM_PORT": str(port)})
        deployment.wait_for_instances(3)
        results: list[tuple[int, int, str | None, str]] = []
        lock = threading.Lock()
        stop = threading.Event()
        killed = threading.Event()
        served_after_the_kill = [0] * 12  # per client: requests it started after the kill, finished

        def client(n: int) -> None:
            i = 0
            while not stop.is_set():  # new requests keep arriving before, during and after the kill
                after = killed.is_set()
                result = _stream(deployment.url, f"client {n} request {i} tell me a story", 100)
                with lock:
                    results.append(result)
                    served_after_the_kill[n] += after
                i += 1

        def victim_streams() -> float:
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            return metric_sum(metrics, "dynamo_component_inflight_requests", dynamo_endpoint="generate")

        with concurrent.futures.ThreadPoolExecutor(len(served_after_the_kill)) as pool:
            futures = [pool.submit(client, n) for n in range(len(served_after_the_kill))]
            try:
                deadline = time.monotonic() + 60
                while victim_streams() == 0:  # however slow the machine, the kill cuts streams
                    assert time.monotonic() < deadline, "no stream reached the victim"
                    time.sleep(0.05)
                victim.proc.kill()  # SIGKILL: its streams are cut, its discovery entries stay until their lease ends
                killed.set()
                wait_until(lambda: min(served_after_the_kill) > 0, "every client had a request served after the kill", 60)
            finally:
                stop.set()
            for future in futures:
                future.result()
        assert len(results) >= 24
        failed = [r for r in results if r[0] != 200 or r[2] != "length" or r[1] != 100]
        assert not failed, failed[:3]
        assert not any("127.0.0.1" in raw or "error" in raw for *_, raw in results)
        # the kill did cut streams, and they moved on
        assert metric_sum(deployment.metrics(), "dynamo_frontend_model_migration_total",
                          migration_type="ongoing_request") > 0
    finally:
        deployment.stop()


def test_a_frontend_alone_drains_on_sigterm(tmp_path, smollm2):
    """`tandem frontend` on SIGTERM: streams in flight finish, new requests get 503, the process exits 0."""
    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker", engines=[MOCKER])
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(_stream, deployment.url, f"drain {n}", 100) for n in range(4)]
            deadline = time.monotonic() + 30
            while metric_sum(deployment.metrics(), "dynamo_frontend_inflight_requests") < 4:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            deployment.frontend.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while (late := httpx.post(f"{deployment.url}/v1/completions", timeout=10,
                                      json={"model": MODEL, "prompt": "late", "max_tokens": 2})).status_code == 200:
                assert time.monotonic() < deadline
            assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
            assert [(s.result()[1], s.result()[2]) for s in streams] == [(100, "length")] * 4
        assert deployment.frontend.proc.wait(30) == 0
    finally:
        deployment.stop()
