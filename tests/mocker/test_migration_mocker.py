"""Migration end to end on mocker workers (real processes, the official `openai` client, the frontend's
default `--migration-limit 3`): the worker serving a stream dies mid-way (SIGKILL), or shuts itself down
(SIGTERM), and the client still gets one whole stream, equal token for token to a run nobody interrupted.
The mocker continues a resumed request exactly as an unbroken one (see its synthetic tokens), as a
greedy model does, so equality is the claim, not luck. Aggregated and disaggregated deployments."""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.deployment import MODEL, Deployment, metric_sum
from tests.support.ports import free_port
from tests.support.processes import TandemProcess

# 200 tokens at the simulated speed take about two seconds: long enough to act mid-stream whatever the
# machine (the mocker's clock is simulated, not the hardware's).
MOCKER = ("--speedup-ratio", "1", "--block-size", "16")
TOKENS = 200
REQUEST = {"model": MODEL, "prompt": "Tell me the longest story you know.", "max_tokens": TOKENS, "temperature": 0}


@dataclass
class Worker:
    process: TandemProcess
    system_url: str

    def serving(self) -> bool:
        metrics = httpx.get(f"{self.system_url}/metrics", timeout=10).text
        return metric_sum(metrics, "dynamo_component_inflight_requests", dynamo_endpoint="generate") > 0


def _start(deployment: Deployment, *args: str, env: dict[str, str] | None = None) -> Worker:
    port = free_port()
    process = deployment.add_engine(*MOCKER, *args, env={"DYN_SYSTEM_PORT": str(port), **(env or {})})
    return Worker(process, f"http://127.0.0.1:{port}")


@pytest.fixture
def deployments(tmp_path: Path, smollm2: str) -> Iterator:
    made: list[Deployment] = []

    def make(frontend_args: tuple[str, ...] = ()) -> Deployment:
        deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker", engines=[],
                                frontend_args=list(frontend_args))
        made.append(deployment)
        return deployment

    yield make
    for deployment in made:
        deployment.stop()


def _migrations(deployment: Deployment) -> float:
    return metric_sum(deployment.metrics(), "dynamo_frontend_model_migration_total")


def _interrupted(deployment: Deployment, candidates: list[Worker], interrupt: int) -> tuple[str, Worker]:
    """Stream REQUEST; after a few chunks send `interrupt` to the worker serving it; return the whole text
    the client received and that worker."""
    stream = iter(deployment.client(timeout=120).completions.create(
        **REQUEST, stream=True, stream_options={"include_usage": True}))
    pieces = [choice.text for chunk in itertools.islice(stream, 5) for choice in chunk.choices]
    serving = [worker for worker in candidates if worker.serving()]
    assert len(serving) == 1
    os.kill(serving[0].process.proc.pid, interrupt)
    usage = None
    for chunk in stream:
        pieces.extend(choice.text for choice in chunk.choices)
        usage = chunk.usage or usage
    assert usage is not None and usage.completion_tokens == TOKENS, usage
    return "".join(pieces), serving[0]


def _unbroken(deployment: Deployment) -> str:
    reply = deployment.client(timeout=120).completions.create(**REQUEST)
    assert reply.usage is not None and reply.usage.completion_tokens == TOKENS
    return reply.choices[0].text


def test_sigkill_mid_stream_migrates_token_for_token(deployments) -> None:  # type: ignore[no-untyped-def]
    deployment = deployments()
    workers = [_start(deployment), _start(deployment)]
    deployment.wait_for_instances(2)
    expected = _unbroken(deployment)
    before = _migrations(deployment)
    text, victim = _interrupted(deployment, workers, signal.SIGKILL)
    assert text == expected
    assert _migrations(deployment) - before == 1
    assert victim.process.proc.wait(10) == -signal.SIGKILL


def test_a_worker_shutting_down_hands_its_stream_over(deployments) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM: the worker leaves discovery, and (its `--migration-limit` says its requests may move) ends
    its streams without finishing them; the frontend moves each to the other worker. The worker exits 0."""
    deployment = deployments()
    env = {"DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0"}
    workers = [_start(deployment, "--migration-limit", "3", env=env) for _ in range(2)]
    deployment.wait_for_instances(2)
    expected = _unbroken(deployment)
    before = _migrations(deployment)
    text, leaving = _interrupted(deployment, workers, signal.SIGTERM)
    assert text == expected
    assert _migrations(deployment) - before == 1
    assert leaving.process.proc.wait(30) == 0, leaving.process.stderr()


def test_sigkill_of_the_decode_worker_migrates_a_disaggregated_stream(deployments) -> None:  # type: ignore[no-untyped-def]
    deployment = deployments(("--router-mode", "kv"))
    _start(deployment, "--disaggregation-mode", "prefill")
    decoders = [_start(deployment, "--disaggregation-mode", "decode") for _ in range(2)]
    deployment.wait_for_instances(2)
    deployment.wait_for_instances(1, kind="prefill_instances")
    expected = _unbroken(deployment)
    remote = metric_sum(deployment.metrics(), "dynamo_frontend_remote_prefills_total", outcome="ok")
    assert remote == 1  # the reference run was disaggregated too
    before = _migrations(deployment)
    text, _ = _interrupted(deployment, decoders, signal.SIGKILL)
    assert text == expected
    assert _migrations(deployment) - before == 1
    # One remote prefill for the interrupted request: the KV it handed over was for the first decode worker,
    # so the other one computed the prompt plus the tokens so far itself.
    assert metric_sum(deployment.metrics(), "dynamo_frontend_remote_prefills_total", outcome="ok") == remote + 1


def test_without_migration_the_client_sees_the_stream_fail(deployments) -> None:  # type: ignore[no-untyped-def]
    """The control: the same kill with `--migration-limit 0` cuts the client's stream."""
    deployment = deployments(("--migration-limit", "0"))
    workers = [_start(deployment), _start(deployment)]
    deployment.wait_for_instances(2)
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        _interrupted(deployment, workers, signal.SIGKILL)
