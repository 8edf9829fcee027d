"""A real `tandem vllm` in checkpoint mode, without CRIU: the checkpoint job creates its engine before the
runtime, writes the ready file and waits; it joins discovery only when SIGCONT says it was restored, then
serves as a cold-started worker does (tests/vllm/test_vllm_lifecycle.py covers each step with fakes).

Between the ready file and SIGCONT the worker has no runtime: its system port is closed and a frontend
started after the ready file lists no instance. SIGCONT is the positive control sent after that: the same
observers then see the worker register, answer a chat request, and report its KV cache load.

One engine, started by the test itself on the engines' usual flags (tests/support/engines.py); no shared group.
"""

from __future__ import annotations

import contextlib
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.deployment import MODEL, metric_sum
from tests.support.engines import ENGINE_TIMEOUT, EngineGroup, EngineSpec, wait_until
from tests.support.launcher import children

pytestmark = pytest.mark.slow


def _worker(namespace: str) -> tuple[int, dict[str, str]] | None:
    """The `tandem vllm` process this test started (a child of the test process: TandemProcess's Popen) and
    its environment. By its namespace: the session's shared engine groups are children of this process too."""
    for pid in children(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"tandem.vllm" not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                variables = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        environment = dict(v.split("=", 1) for v in variables if "=" in v)
        if environment.get("DYN_NAMESPACE") == namespace:
            return pid, environment
    return None


def _refused(url: str) -> bool:
    try:
        httpx.get(url, timeout=5)
    except httpx.ConnectError:
        return True
    return False


def test_a_checkpoint_job_registers_only_when_restored(tmp_path: Path, smollm2: str) -> None:
    ready_file = tmp_path / "ready" / "for-checkpoint"
    # DYN_CHECKPOINT_LOCATION makes the worker the checkpoint job; its checkpoint does not exist yet.
    spec = EngineSpec((), 0, ("--max-model-len", "1024", "--connector", "none"),
                      env=(("DYN_READY_FOR_CHECKPOINT_FILE", str(ready_file)),
                           ("DYN_CHECKPOINT_LOCATION", str(tmp_path / "checkpoint"))))
    group = EngineGroup("checkpoint", tmp_path / "engines", smollm2, (spec,))
    pool = ThreadPoolExecutor(1)
    started = pool.submit(group.start, spec)  # returns once the worker prints READY: after it registered
    deployment = None
    worker = None
    try:
        wait_until(lambda: _worker(group.namespace) is not None or started.done(), "the worker process runs",
                   timeout=30)
        worker = _worker(group.namespace)
        assert worker is not None, started.exception()
        pid, environment = worker
        wait_until(ready_file.exists, "the worker writes its ready file", timeout=ENGINE_TIMEOUT)
        assert ready_file.read_text() == "ready"

        # Waiting for the watcher: no runtime yet (its system port is closed), nothing in discovery (a
        # frontend started after the ready file lists no instance and no model), no READY line.
        system_url = f"http://127.0.0.1:{environment['DYN_SYSTEM_PORT']}"
        assert _refused(f"{system_url}/health")
        deployment = group.deployment()
        assert httpx.get(f"{deployment.url}/health").json()["instances"] == []
        assert httpx.get(f"{deployment.url}/v1/models").json()["data"] == []
        assert not started.done()

        os.kill(pid, signal.SIGCONT)  # "restored": wake the engine, start the runtime, register, serve
        engine = started.result(timeout=ENGINE_TIMEOUT)
        deployment.wait_for_instances(1)
        assert httpx.get(f"{system_url}/health").json()["status"] == "ready"
        reply = deployment.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=8,
            temperature=0)
        assert reply.choices[0].message.content and reply.usage is not None and reply.usage.completion_tokens > 0
        # vLLM's stat loggers, made with the engine before the runtime existed, report for this worker: the
        # KV load gauges a cold-started worker keeps (the same loggers publish its load to the routers).
        metrics = engine.metrics()
        assert metric_sum(metrics, "dynamo_component_kvstats_total_blocks") > 0, metrics
    finally:
        if deployment is not None:
            deployment.stop()
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker[0], signal.SIGKILL)  # its own session: the engine core too
        pool.shutdown(wait=True)  # group.start ends once the worker is gone
        group.stop()
