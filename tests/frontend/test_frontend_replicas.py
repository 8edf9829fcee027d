"""`tandem frontend --num-processes 2`: two frontend processes on one port. Both serve; their KV routers agree
(a follow-up sent to either one hits the cache); one SIGKILLed leaves the other serving, and comes back."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.deployment import KV_EVENTS_APPLIED, MODEL, Deployment, metric_sum

MOCKER = ["--block-size", "16", "--speedup-ratio", "20", "--num-gpu-blocks-override", "2048"]


@pytest.fixture
def replicated(tmp_path, smollm2) -> Iterator[Deployment]:  # type: ignore[no-untyped-def]
    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker", engines=[MOCKER, MOCKER],
                            frontend_args=["--num-processes", "2", "--router-mode", "kv",
                                           "--router-predicted-ttl-secs", "0"])
    yield deployment
    deployment.stop()


def pinned(url: str, count: int = 2, timeout: float = 30) -> dict[str, httpx.Client]:
    """One kept-alive connection to each of `count` replicas, by replica (its /health `frontend` id)."""
    found: dict[str, httpx.Client] = {}
    deadline = time.monotonic() + timeout
    while len(found) < count:
        assert time.monotonic() < deadline, f"reached only {len(found)} replicas on {url}"
        client = httpx.Client(base_url=url, timeout=30)
        replica = client.get("/health").json().get("frontend")
        if replica and replica not in found:
            found[replica] = client
        else:
            client.close()
    return found


def openai_over(connection: httpx.Client) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{str(connection.base_url).rstrip('/')}/v1", api_key="none", max_retries=0,
                         http_client=connection)


def test_both_replicas_serve_and_their_kv_routers_agree(replicated: Deployment) -> None:
    replicas = pinned(replicated.url)
    (a, first), (b, second) = replicas.items()
    assert a != b
    prefix = "a conversation for two replicas: " + " ".join(f"word{i}" for i in range(120))
    reply = openai_over(first).completions.create(model=MODEL, prompt=prefix, max_tokens=2)
    assert reply.usage.completion_tokens == 2
    emitted = replicated.kv_events_emitted()
    for connection in (first, second):  # each replica's router has every worker event
        deadline = time.monotonic() + 15
        while metric_sum(connection.get("/metrics").text, KV_EVENTS_APPLIED) < emitted:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    for turn in range(3):  # the other replica sends the follow-ups where the first one put the prefix
        follow_up = openai_over(second).completions.create(model=MODEL, prompt=f"{prefix} turn {turn}", max_tokens=2)
        assert follow_up.usage.prompt_tokens_details.cached_tokens > 0, turn


def test_a_killed_replica_leaves_the_other_serving_and_comes_back(replicated: Deployment) -> None:
    parent = replicated.frontend.proc.pid  # type: ignore[union-attr]
    children = _children(parent)
    assert len(children) == 2
    os.kill(children[0], signal.SIGKILL)
    _wait_dead(children[0])  # a connection the kernel gave the dying replica's socket is reset, as for any client
    client = replicated.client()
    for n in range(10):  # new connections go to the live replica only
        assert client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": f"one replica down {n}"}]).usage.completion_tokens == 2
    replacement = pinned(replicated.url, timeout=60)  # the supervisor started it again
    assert len(replacement) == 2 and len(_children(parent)) == 2


def _wait_dead(pid: int, timeout: float = 10) -> None:
    """Until `pid` has exited (a zombie its supervisor has not reaped yet, or gone): its sockets are closed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except FileNotFoundError:
            return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} did not exit within {timeout} s of SIGKILL")


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(child) for child in f.read().split()]
    return found


def test_a_replica_that_cannot_start_stops_the_whole_frontend(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "tandem.frontend", "--num-processes", "2", "--http-host", "127.0.0.1",
                           "--http-port", "0", "--discovery-backend", "file", "--tls-cert-path", str(tmp_path / "none"),
                           "--tls-key-path", str(tmp_path / "none")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DYN_FILE_KV": str(tmp_path)})
    assert done.returncode == 1
    assert "exited before it was ready" in done.stderr and "READY" not in done.stdout
