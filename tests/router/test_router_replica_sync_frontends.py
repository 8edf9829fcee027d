"""`--router-replica-sync` between two real frontends on mocker workers: the load one frontend places on a
worker appears in the other's view of that worker (`dynamo_router_worker_active_blocks`), and leaves it
when the requests end. Without the flag each frontend sees only its own load."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.deployment import MODEL, Deployment, metric_sum
from tests.support.engines import wait_until
from tests.support.processes import TandemProcess

MOCKER = ["--speedup-ratio", "1", "--block-size", "16"]  # a 3000-token stream stays in flight for ~30 s


def _active_blocks(url: str) -> float:
    return metric_sum(httpx.get(f"{url}/metrics", timeout=10).text, "dynamo_router_worker_active_blocks")


def _frontend(deployment: Deployment, flags: list[str]) -> str:
    other = TandemProcess("tandem.frontend", "--http-host", "127.0.0.1", "--http-port", "0", "--discovery-backend",
                          "file", *flags, env=deployment.env)
    deployment.engines.append(other)  # stopped with the deployment
    url = other.ready[0]
    wait_until(lambda: httpx.get(f"{url}/health").json().get("instances"), "the second frontend sees the worker", 30)
    return url


@pytest.mark.parametrize("sync", [True, False], ids=["replica-sync", "no-sync"])
def test_a_frontend_sees_the_load_the_other_placed(tmp_path: Path, smollm2: str, sync: bool) -> None:
    flags = ["--router-mode", "kv", *(["--router-replica-sync"] if sync else [])]
    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker", engines=[MOCKER], frontend_args=flags)
    streams: list[openai.Stream] = []
    try:
        placing, watching = deployment.url, _frontend(deployment, flags)
        client = deployment.client(timeout=120)

        def place() -> None:  # one more long stream through the first frontend, left in flight
            prompt = f"Long story number {len(streams)}: " + "once upon a time " * 40  # some 160 tokens: 10 blocks
            stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3000, stream=True)
            streams.append(stream)
            next(iter(stream))  # the worker has it: the router counted its blocks

        place()
        assert _active_blocks(placing) > 0
        if sync:
            # Publish/subscribe drops what precedes the subscription: place more until the view arrives.
            deadline = time.monotonic() + 30
            while _active_blocks(watching) == 0:
                assert time.monotonic() < deadline, "the second frontend never saw the first one's load"
                place()
                try:
                    wait_until(lambda: _active_blocks(watching) > 0, "the load view arrives", timeout=1)
                except AssertionError:
                    continue
        else:
            # The chances the synced frontends take to see the load (a placement, then a second to see it), three
            # times over: the watching frontend routed nothing, so it never has load of its own to show.
            for _ in range(3):
                place()
                with pytest.raises(AssertionError, match="timed out"):
                    wait_until(lambda: _active_blocks(watching) > 0, "a load view arrives", timeout=1)
            assert _active_blocks(placing) > 0
        for stream in streams:
            stream.close()
        wait_until(lambda: _active_blocks(placing) == 0, "the first frontend freed its requests", 60)
        if sync:
            wait_until(lambda: _active_blocks(watching) == 0, "the second frontend saw them freed", 60)
    finally:
        for stream in streams:
            stream.close()
        deployment.stop()
