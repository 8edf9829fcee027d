"""Disaggregated serving end to end with mocker workers (real processes, the official openai client):
xPyD deployments through `tandem run`, prefill failures, cancellation during the prefill, conditional
disaggregation. The pipeline's details in one process: tests/frontend/test_disagg_frontend.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.deployment import MODEL, Deployment, kv_events_emitted, metric_sum, wait_for_kv_events
from tests.support.engines import wait_until
from tests.support.ports import free_port, free_port_range
from tests.support.processes import TandemProcess

BLOCK = 16
MOCKER = ["--block-size", str(BLOCK), "--speedup-ratio", "100"]


def _worker_metric(system_url: str, name: str, **labels: str) -> float:
    return metric_sum(httpx.get(f"{system_url}/metrics").text, name, dynamo_endpoint="generate", **labels)


def _prefixed(n: int, words: int = 60) -> str:
    """A long prompt of its own (about 4 tokens a word)."""
    return f"conversation {n}: " + " ".join(f"topic{n}-{i}" for i in range(words))


def _ask(client: openai.OpenAI, prompt: str, max_tokens: int = 4) -> tuple[int, int]:
    """(cached prompt tokens, prompt tokens) of a completion that must succeed."""
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens)
    assert reply.usage is not None and reply.usage.completion_tokens == max_tokens
    details = reply.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details else 0, reply.usage.prompt_tokens


# -- xPyD through `tandem run` ----------------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("routing", ["events-only", "with-predicted"])
@pytest.mark.parametrize(("prefill", "decode"), [(2, 2), (4, 4)])
def test_xpyd_serves_concurrent_load_through_remote_prefills(launch: Callable, prefill: int, decode: int,
                                                             routing: str) -> None:
    """Every request prefills remotely and none fails; follow-ups of a conversation go to the prefill
    worker that holds its prefix (its cache hits come back in usage), and the load spreads over the
    prefill workers. `events-only`: no predicted index (DYN_ROUTER_PREDICTED_TTL_SECS=0), the follow-ups
    are sent once the frontend applied every KV event of the prefill workers, so only those events tell
    the prefill router where a prefix is."""
    base = free_port_range(prefill + decode)
    run = launch("--prefill-workers", str(prefill), "--decode-workers", str(decode), "--router-mode", "kv",
                 "--system-port-base", str(base), "--", "--block-size", str(BLOCK),
                 env={"DYN_ROUTER_PREDICTED_TTL_SECS": "0" if routing == "events-only" else "5"})
    url = run.serving()  # the frontend knows every worker, prefill workers included
    assert len(httpx.get(f"{url}/health").json()["prefill_instances"]) == prefill
    discovery = run.wait_for(r"discovery: (\S+) \(namespace (\S+)\)")
    client = run.client(url)
    conversations = range(4 * prefill)
    with ThreadPoolExecutor(8) as pool:
        first = list(pool.map(lambda n: _ask(client, _prefixed(n)), conversations))
        if routing == "events-only":
            wait_for_kv_events(url, kv_events_emitted(discovery[1], discovery[2], "prefill", instances=prefill))
        follow_ups = list(pool.map(lambda n: _ask(client, f"{_prefixed(n)} and then {n}?"), conversations))
    assert all(cached == 0 for cached, _ in first)
    for n, (cached, prompt_tokens) in zip(conversations, follow_ups, strict=True):
        # The prefix is cached on the prefill worker chosen: round robin would miss (prefill - 1) / prefill.
        assert cached >= (first[n][1] // BLOCK - 1) * BLOCK, (n, cached, prompt_tokens)
    total = 2 * len(conversations)
    metrics = httpx.get(f"{url}/metrics").text
    assert metric_sum(metrics, "dynamo_frontend_remote_prefills_total") == total
    assert metric_sum(metrics, "dynamo_frontend_remote_prefills_total", outcome="ok") == total
    assert metric_sum(metrics, "dynamo_frontend_requests_total", status="success") == total
    assert metric_sum(metrics, "dynamo_frontend_remote_prefill_duration_seconds_count") == total
    assert metric_sum(metrics, "dynamo_frontend_kv_transfer_seconds_count") == total  # reported by the decode workers
    # Workers: slots 0..P-1 are the prefill workers, then the decode workers.
    served = [_worker_metric(f"http://127.0.0.1:{base + slot}", "dynamo_component_requests_total")
              for slot in range(prefill + decode)]
    assert sum(served[:prefill]) == total and sum(served[prefill:]) == total
    assert sum(1 for count in served[:prefill] if count) >= 2, served


# -- failures -------------------------------------------------------------------------------------------------


def _deployment(root: Path, smollm2: str, prefill_args: Sequence[str], decode_args: Sequence[str],
                frontend_args: Sequence[str]) -> tuple[Deployment, str, str]:
    """A frontend (--router-mode kv and `frontend_args`), one prefill and one decode mocker; returns the
    deployment and the prefill and decode workers' system URLs."""
    deployment = Deployment(root, smollm2, engine_module="tandem.mocker", engines=[],
                            frontend_args=["--router-mode", "kv", *frontend_args])
    urls = []
    try:
        for mode, args in (("prefill", prefill_args), ("decode", decode_args)):
            port = free_port()
            deployment.add_engine(*MOCKER, "--disaggregation-mode", mode, *args, env={"DYN_SYSTEM_PORT": str(port)})
            urls.append(f"http://127.0.0.1:{port}")
        deployment.wait_for_instances(1)
        deployment.wait_for_instances(1, kind="prefill_instances")
    except BaseException:
        deployment.stop()
        raise
    return deployment, urls[0], urls[1]


@pytest.fixture
def one_by_one(tmp_path: Path, smollm2: str) -> Iterator[Callable[..., tuple[Deployment, str, str]]]:
    started: list[Deployment] = []

    def start(prefill_args: Sequence[str] = (), decode_args: Sequence[str] = (),
              frontend_args: Sequence[str] = ()) -> tuple[Deployment, str, str]:
        made = _deployment(tmp_path, smollm2, prefill_args, decode_args, frontend_args)
        started.append(made[0])
        return made

    yield start
    for deployment in started:
        deployment.stop()


def test_prefill_worker_killed_falls_back_or_fails_with_503(one_by_one: Callable) -> None:
    """Without --enforce-disagg the decode worker prefills itself; with it, the request fails with 503."""
    deployment, _, _ = one_by_one()
    strict = TandemProcess("tandem.frontend", "--http-host", "127.0.0.1", "--http-port", "0", "--discovery-backend",
                           "file", "--router-mode", "kv", "--enforce-disagg", env=deployment.env)
    try:
        strict_client = openai.OpenAI(base_url=f"{strict.ready[0]}/v1", api_key="none", max_retries=0)
        client = deployment.client()
        for _ in range(100):  # until the second frontend has seen the prefill worker
            if httpx.get(f"{strict.ready[0]}/health").json().get("prefill_instances"):
                break
            time.sleep(0.1)
        _ask(client, _prefixed(1))
        _ask(strict_client, _prefixed(2))
        deployment.engines[0].stop()  # SIGKILL: still listed in discovery until its lease lapses
        for n in range(3):
            _ask(client, _prefixed(10 + n))
            with pytest.raises(openai.APIStatusError) as failure:
                strict_client.completions.create(model=MODEL, prompt=_prefixed(20 + n), max_tokens=4)
            assert failure.value.status_code == 503 and "--enforce-disagg" in failure.value.message
        relaxed = deployment.metrics()
        assert metric_sum(relaxed, "dynamo_frontend_remote_prefills_total", outcome="ok") == 1
        assert metric_sum(relaxed, "dynamo_frontend_remote_prefills_total", outcome="fallback") >= 1
        enforced = httpx.get(f"{strict.ready[0]}/metrics").text
        assert metric_sum(enforced, "dynamo_frontend_remote_prefills_total", outcome="ok") == 1
        assert metric_sum(enforced, "dynamo_frontend_remote_prefills_total", outcome="error") == 3
        assert metric_sum(enforced, "dynamo_frontend_requests_total", status="error") == 3
    finally:
        strict.stop()


def test_client_cancelling_during_prefill_leaves_nothing_running(one_by_one: Callable) -> None:
    """The client gives up while a slow prefill runs: the prefill worker stops the request at once and
    the decode worker never gets it."""
    # A thousandth of real time: this prompt's prefill would take about 20 s; the client leaves once the
    # prefill worker has it.
    deployment, prefill_url, decode_url = one_by_one(prefill_args=["--speedup-ratio", "0.001"])

    async def leave_during_the_prefill() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            request = asyncio.ensure_future(http.post(f"{deployment.url}/v1/completions", json={
                "model": MODEL, "prompt": _prefixed(1, words=30), "max_tokens": 4}))
            await asyncio.to_thread(wait_until, lambda: _worker_metric(
                prefill_url, "dynamo_component_inflight_requests") == 1, "the prefill worker has the request", 30)
            request.cancel()  # closes the connection
            with contextlib.suppress(asyncio.CancelledError):
                await request

    asyncio.run(leave_during_the_prefill())
    wait_until(lambda: _worker_metric(prefill_url, "dynamo_component_inflight_requests") == 0,
               "the prefill worker stopped the request", 10)
    assert _worker_metric(prefill_url, "dynamo_component_cancellation_total") == 1  # stopped, not finished
    # The frontend counts the outcome as its handler ends: a decode would have been sent by then.
    wait_until(lambda: metric_sum(deployment.metrics(), "dynamo_frontend_inflight_requests") == 0,
               "the frontend finished the request", 10)
    assert metric_sum(deployment.metrics(), "dynamo_frontend_remote_prefills_total", outcome="cancelled") == 1
    assert _worker_metric(decode_url, "dynamo_component_requests_total") == 0


@pytest.mark.parametrize("routing", ["events-only", "with-predicted"])
def test_conditional_disagg_keeps_cached_prompts_on_the_decode_worker(one_by_one: Callable, routing: str) -> None:
    """--router-conditional-disagg: a follow-up whose prefix the decode worker caches prefills there;
    a prompt it does not cache, short or long, still prefills remotely. `events-only`: no predicted
    index, so only the decode worker's KV events tell the router what it caches."""
    ttl = "0" if routing == "events-only" else "5"
    deployment, prefill_url, _ = one_by_one(decode_args=["--enable-conditional-disagg"],
                                            frontend_args=["--router-conditional-disagg", "--router-predicted-ttl-secs", ttl])
    client = deployment.client()
    prompt = _prefixed(1, words=150)
    assert _ask(client, prompt)[0] == 0  # remote prefill; the KV lands in the decode worker's cache
    if routing == "events-only":  # every event applied, the decode worker's and the prefill worker's
        wait_for_kv_events(deployment.url, sum(deployment.kv_events_emitted(component, instances=1)
                                               for component in ("backend", "prefill")))
    cached, prompt_tokens = _ask(client, f"{prompt} and one more thing")
    assert cached >= prompt_tokens - 3 * BLOCK  # prefilled on the decode worker, from its own cache
    _ask(client, "a short question")  # nothing cached: the ratio rule sends it to the prefill worker
    metrics = deployment.metrics()
    assert metric_sum(metrics, "dynamo_frontend_remote_prefills_total", outcome="skipped_conditional") == 1
    assert metric_sum(metrics, "dynamo_frontend_remote_prefills_total", outcome="ok") == 2
    assert _worker_metric(prefill_url, "dynamo_component_requests_total") == 2
