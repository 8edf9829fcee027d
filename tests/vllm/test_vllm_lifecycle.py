"""Worker lifecycle pieces with fakes only (no engine): health-check payloads, the engine monitor,
the per-request abort monitor and the checkpoint/restore lifecycle."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tandem.runtime import Context, EngineShutdown
from tandem.vllm.abort import abort_monitor
from tandem.vllm.bos_token import bos_token_id_of
from tandem.vllm.checkpoint_restore import CheckpointConfig, get_checkpoint_config
from tandem.vllm.engine_monitor import VllmEngineMonitor
from tandem.worker.health import health_check_payload

STOP = {"max_tokens": 1, "stop": None, "stop_token_ids": None, "include_stop_str_in_output": False,
        "ignore_eos": False}


async def eventually(predicate: Any, timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


# -- health-check payloads ----------------------------------------------------------------------------
def test_token_payload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_HEALTH_CHECK_PAYLOAD", raising=False)
    assert health_check_payload(7) == {
        "token_ids": [7], "sampling_options": {"temperature": 0.0}, "stop_conditions": STOP, "_HEALTH_CHECK": True,
    }
    assert health_check_payload(None)["token_ids"] == [1]
    assert health_check_payload(7, embedding=True) == {"token_ids": [[7]], "_HEALTH_CHECK": True}


def test_text_payload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_HEALTH_CHECK_PAYLOAD", raising=False)
    assert health_check_payload(7, text_mode=True) == {
        "prompt": "Test", "temperature": 0.0, **STOP, "_HEALTH_CHECK": True,
    }


def test_payload_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_HEALTH_CHECK_PAYLOAD", json.dumps({"token_ids": [5, 6]}))
    assert health_check_payload(7) == {"token_ids": [5, 6], "_HEALTH_CHECK": True}
    assert health_check_payload(7, text_mode=True) == {"token_ids": [5, 6], "_HEALTH_CHECK": True}
    monkeypatch.setenv("DYN_HEALTH_CHECK_PAYLOAD", "{not json")
    with pytest.raises(ValueError, match="DYN_HEALTH_CHECK_PAYLOAD is not valid JSON"):
        health_check_payload(7)
    monkeypatch.setenv("DYN_HEALTH_CHECK_PAYLOAD", "[1, 2]")
    with pytest.raises(ValueError, match="must be a JSON object"):
        health_check_payload(7)


async def test_bos_token_id_of() -> None:
    hf = SimpleNamespace(bos_token_id=11)
    assert await bos_token_id_of(SimpleNamespace(tokenizer=hf)) == 11  # vLLM 0.32: the tokenizer itself
    assert await bos_token_id_of(SimpleNamespace(tokenizer=SimpleNamespace(tokenizer=hf))) == 11  # old group

    async def get_tokenizer() -> Any:
        return SimpleNamespace(bos_token_id=12)

    assert await bos_token_id_of(SimpleNamespace(get_tokenizer=get_tokenizer)) == 12

    def no_tokenizer() -> Any:
        raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`")

    assert await bos_token_id_of(SimpleNamespace(tokenizer=None, get_tokenizer=no_tokenizer)) is None
    assert await bos_token_id_of(None) is None


# -- engine monitor -----------------------------------------------------------------------------------
class FakeEngine:
    def __init__(self, fail_after: int | None = None, hang_after: int | None = None, log_stats: bool = True) -> None:
        self.fail_after = fail_after
        self.hang_after = hang_after
        self.log_stats = log_stats
        self.checks = 0
        self.stats_calls = 0
        self.shutdown_calls = 0
        self.shutdown_thread: str | None = None

    async def check_health(self) -> None:
        self.checks += 1
        if self.fail_after is not None and self.checks > self.fail_after:
            raise RuntimeError("EngineCore encountered an issue")
        if self.hang_after is not None and self.checks > self.hang_after:
            await asyncio.sleep(3600)

    async def do_log_stats(self) -> None:
        self.stats_calls += 1

    def shutdown(self) -> None:
        self.shutdown_calls += 1
        self.shutdown_thread = threading.current_thread().name


class FakeRuntime:
    def __init__(self) -> None:
        self.shutdowns = 0

    async def shutdown(self) -> None:
        await asyncio.sleep(0)
        self.shutdowns += 1


def make_monitor(engine: FakeEngine, **kwargs: Any) -> tuple[VllmEngineMonitor, FakeRuntime, list[int]]:
    runtime, exits = FakeRuntime(), list[int]()
    kwargs.setdefault("health_interval", 0.01)
    kwargs.setdefault("stats_interval", 0)
    monitor = VllmEngineMonitor(runtime, engine, asyncio.Event(), exit=exits.append, **kwargs)
    return monitor, runtime, exits


async def test_monitor_engine_death_shuts_down_and_exits() -> None:
    engine = FakeEngine(fail_after=3)
    monitor, runtime, exits = make_monitor(engine, shutdown_timeout=2.0)
    monitor.start()
    await eventually(lambda: exits)
    assert exits == [1]
    assert engine.checks == 4
    assert engine.shutdown_calls == 1 and engine.shutdown_thread == "vllm-engine-shutdown"
    assert runtime.shutdowns == 1
    assert isinstance(monitor.dead_error, RuntimeError)
    await monitor.stop()


async def test_monitor_check_timeout_counts_as_death() -> None:
    engine = FakeEngine(hang_after=1)
    monitor, runtime, exits = make_monitor(engine, check_timeout=0.05)
    monitor.start()
    await eventually(lambda: exits)
    assert exits == [1] and engine.shutdown_calls == 1 and runtime.shutdowns == 1
    assert isinstance(monitor.dead_error, TimeoutError)


async def test_monitor_bounded_engine_shutdown() -> None:
    engine = FakeEngine(fail_after=0)
    release = threading.Event()
    engine.shutdown = lambda: release.wait(5)  # type: ignore[method-assign, assignment]
    monitor, runtime, exits = make_monitor(engine, shutdown_timeout=0.05)
    monitor.start()
    await eventually(lambda: exits)
    release.set()
    assert exits == [1] and runtime.shutdowns == 1


async def test_monitor_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_ENGINE_HEALTH_CHECK_INTERVAL", "0.5")
    monkeypatch.setenv("DYN_ENGINE_HEALTH_CHECK_TIMEOUT", "7")
    monkeypatch.setenv("DYN_ENGINE_HEALTH_SHUTDOWN_TIMEOUT", "9")
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "bogus")
    monitor = VllmEngineMonitor(FakeRuntime(), FakeEngine(), asyncio.Event())
    assert (monitor.health_interval, monitor.check_timeout, monitor.shutdown_timeout) == (0.5, 7.0, 9.0)
    assert monitor.stats_interval == 10.0
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "0.25")
    assert VllmEngineMonitor(FakeRuntime(), FakeEngine(), asyncio.Event(), health_interval=3).health_interval == 3
    assert VllmEngineMonitor(FakeRuntime(), FakeEngine(), asyncio.Event()).stats_interval == 0.25


async def test_monitor_stats_loop() -> None:
    engine = FakeEngine()
    monitor, _, exits = make_monitor(engine, stats_interval=0.01)
    monitor.start()
    await eventually(lambda: engine.stats_calls >= 3)
    await monitor.stop()
    assert not monitor.running and not exits


@pytest.mark.parametrize("interval, log_stats", [(0.0, True), (-1.0, True), (0.01, False)])
async def test_monitor_stats_disabled(interval: float, log_stats: bool) -> None:
    engine = FakeEngine(log_stats=log_stats)
    monitor, _, _ = make_monitor(engine, stats_interval=interval)
    monitor.start()
    await asyncio.sleep(0.1)
    assert engine.stats_calls == 0 and engine.checks > 0
    await monitor.stop()


async def test_monitor_stop_and_shutdown_event() -> None:
    engine = FakeEngine()
    monitor, _, exits = make_monitor(engine, health_interval=60, stats_interval=60)
    monitor.start()
    await eventually(lambda: engine.checks == 1)
    await asyncio.wait_for(monitor.stop(), 1.0)
    assert not monitor.running and not exits

    engine = FakeEngine()
    monitor, _, exits = make_monitor(engine, health_interval=60, stats_interval=60)
    monitor.start()
    await eventually(lambda: engine.checks == 1)
    monitor.shutdown_event.set()
    await eventually(lambda: not monitor.running)
    assert engine.checks == 1 and engine.stats_calls == 0 and not exits


# -- abort monitor ------------------------------------------------------------------------------------
class FakeVllm:
    """Streams outputs until aborted; an abort ends the stream with a final "abort" output (as vLLM)."""

    def __init__(self, ignore_abort: bool = False) -> None:
        self.aborted: list[str] = []
        self.ignore_abort = ignore_abort
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        if not self.ignore_abort:
            self._queue.put_nowait("abort")

    async def generate(self, n: int | None = None, delay: float = 0.01) -> Any:
        i = 0
        while n is None or i < n:
            try:
                item = await asyncio.wait_for(self._queue.get(), delay)
            except TimeoutError:
                item = i
            yield item
            if item == "abort":
                return
            i += 1


async def test_abort_on_kill_ends_the_loop() -> None:
    engine, context = FakeVllm(), Context("req-1")
    seen: list[Any] = []
    async with abort_monitor(engine, context, "req-1", asyncio.Event()) as monitor:
        async for item in monitor.stream(engine.generate()):
            seen.append(item)
            if len(seen) == 3:
                context.kill()
    assert engine.aborted == ["req-1"]
    assert seen[-1] == "abort"  # vLLM's final output still flows: finish reason "cancelled"
    assert monitor.fired and not monitor.shutdown


async def test_abort_on_kill_without_the_stream_wrapper() -> None:
    engine, context = FakeVllm(), Context("req-1")
    seen: list[Any] = []
    async with abort_monitor(engine, context, "req-1", asyncio.Event()):
        async for item in engine.generate():
            seen.append(item)
            if len(seen) == 2:
                context.stop_generating()
    assert engine.aborted == ["req-1"] and seen[-1] == "abort"


async def test_abort_kill_with_a_source_that_ignores_it() -> None:
    """The handler is blocked in a source that never ends by itself: after the grace the wait is
    cancelled, the loop ends quietly and the handler's task is not left cancelled."""
    engine, task_context = FakeVllm(ignore_abort=True), Context("req-3")

    async def handler() -> list[Any]:
        out = []
        async with abort_monitor(engine, task_context, "req-3", asyncio.Event(), abort_grace=0.05) as mon:
            async for item in mon.stream(engine.generate(delay=60)):
                out.append(item)
        return out

    task = asyncio.create_task(handler())
    await asyncio.sleep(0.02)
    task_context.kill()
    assert await asyncio.wait_for(task, 2.0) == []
    assert engine.aborted == ["req-3"]
    assert task.cancelling() == 0


async def test_abort_on_shutdown_raises_engine_shutdown() -> None:
    engine, context, shutdown = FakeVllm(), Context("req-4"), asyncio.Event()
    seen: list[Any] = []
    with pytest.raises(EngineShutdown):
        async with abort_monitor(engine, context, "req-4", shutdown) as monitor:
            async for item in monitor.stream(engine.generate()):
                seen.append(item)
                if len(seen) == 2:
                    shutdown.set()
    assert engine.aborted == ["req-4"]
    assert "abort" not in seen  # no finish reason reaches the client
    assert monitor.shutdown


async def test_abort_on_shutdown_while_blocked_in_the_stream() -> None:
    engine, context, shutdown = FakeVllm(ignore_abort=True), Context("req-5"), asyncio.Event()

    async def handler() -> Any:
        async with abort_monitor(engine, context, "req-5", shutdown) as mon:
            async for item in mon.stream(engine.generate(delay=60)):
                yield item

    async def consume() -> list[Any]:
        return [item async for item in handler()]

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.02)
    shutdown.set()
    with pytest.raises(EngineShutdown):
        await asyncio.wait_for(task, 2.0)
    assert engine.aborted == ["req-5"]


async def test_abort_on_shutdown_without_the_stream_wrapper() -> None:
    engine, context, shutdown = FakeVllm(), Context("req-6"), asyncio.Event()
    with pytest.raises(EngineShutdown):
        async with abort_monitor(engine, context, "req-6", shutdown):
            async for item in engine.generate():
                if item == 1:
                    shutdown.set()
    assert engine.aborted == ["req-6"]


async def test_no_abort_on_normal_completion() -> None:
    engine, context = FakeVllm(), Context("req-7")
    async with abort_monitor(engine, context, "req-7", asyncio.Event()) as monitor:
        items = [item async for item in monitor.stream(engine.generate(n=3, delay=0.001))]
    assert items == [0, 1, 2]
    await asyncio.sleep(0.01)
    context.kill()  # after the end: nothing may happen any more
    await asyncio.sleep(0.01)
    assert engine.aborted == [] and not monitor.fired and monitor.task is not None and monitor.task.done()


async def test_abort_failure_is_only_logged(caplog: pytest.LogCaptureFixture) -> None:
    class Failing(FakeVllm):
        async def abort(self, request_id: str) -> None:
            raise RuntimeError("engine gone")

    engine, context = Failing(), Context("req-8")
    async with abort_monitor(engine, context, "req-8", asyncio.Event(), abort_grace=0.02) as monitor:
        context.kill()
        items = [item async for item in monitor.stream(engine.generate(delay=60))]
    assert items == [] and "abort failed" in caplog.text


async def test_external_cancellation_still_propagates() -> None:
    engine, context = FakeVllm(), Context("req-9")

    async def handler() -> None:
        async with abort_monitor(engine, context, "req-9", asyncio.Event()) as mon:
            async for _ in mon.stream(engine.generate(delay=60)):
                pass

    task = asyncio.create_task(handler())
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.aborted == []


# -- checkpoint / restore -----------------------------------------------------------------------------
CHECKPOINT_ENV = ("DYN_READY_FOR_CHECKPOINT_FILE", "DYN_CHECKPOINT_LOCATION", "DYN_CHECKPOINT_PATH",
                  "DYN_CHECKPOINT_HASH", "DYN_CHECKPOINT_STORAGE_TYPE")


@pytest.fixture
def ckpt_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    for name in CHECKPOINT_ENV:
        monkeypatch.delenv(name, raising=False)

    def set_env(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    return set_env


def test_checkpoint_config_matrix(ckpt_env: Any, tmp_path: Path) -> None:
    ready = str(tmp_path / "ready")
    existing = tmp_path / "ckpts" / "abc"
    existing.mkdir(parents=True)
    missing = tmp_path / "ckpts" / "def"

    assert get_checkpoint_config() == (False, None)  # not in checkpoint mode

    ckpt_env(DYN_READY_FOR_CHECKPOINT_FILE=ready)
    with pytest.raises(EnvironmentError, match="DYN_CHECKPOINT_LOCATION"):
        get_checkpoint_config()
    ckpt_env(DYN_CHECKPOINT_PATH=str(tmp_path / "ckpts"))
    with pytest.raises(EnvironmentError):
        get_checkpoint_config()  # PATH without HASH

    # Checkpoint job, checkpoint already there: exit at once.
    ckpt_env(DYN_CHECKPOINT_LOCATION=str(existing))
    assert get_checkpoint_config() == (True, None)
    # ... on s3/oci nothing "exists" locally: run the lifecycle.
    ckpt_env(DYN_CHECKPOINT_STORAGE_TYPE="s3")
    early, cfg = get_checkpoint_config()
    assert not early and cfg is not None and cfg.is_checkpoint_job and cfg.storage_type == "s3"
    ckpt_env(DYN_CHECKPOINT_STORAGE_TYPE="pvc")
    # Checkpoint job, no checkpoint yet: run the lifecycle.
    ckpt_env(DYN_CHECKPOINT_LOCATION=str(missing))
    early, cfg = get_checkpoint_config()
    assert not early and cfg == CheckpointConfig(ready, str(missing), "pvc", True)

    # Regular worker (PATH + HASH): restore from an existing checkpoint, else cold start.
    os.environ.pop("DYN_CHECKPOINT_LOCATION")
    ckpt_env(DYN_CHECKPOINT_PATH=str(tmp_path / "ckpts") + "/", DYN_CHECKPOINT_HASH="abc")
    early, cfg = get_checkpoint_config()
    assert not early and cfg == CheckpointConfig(ready, str(existing), "pvc", False)
    ckpt_env(DYN_CHECKPOINT_HASH="def")
    assert get_checkpoint_config() == (False, None)
    ckpt_env(DYN_CHECKPOINT_STORAGE_TYPE="oci", DYN_CHECKPOINT_HASH="abc")
    assert get_checkpoint_config() == (False, None)  # remote checkpoints never exist from here


class SleepyEngine:
    def __init__(self, sleep_mode: bool) -> None:
        self.model_config = SimpleNamespace(enable_sleep_mode=sleep_mode)
        self.calls: list[Any] = []

    async def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(("wake_up", tags))
        return True


def handlers_state() -> dict[signal.Signals, Any]:
    return {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGCONT, signal.SIGUSR2)}


async def run_with_signal(tmp_path: Path, engine: SleepyEngine, sig: signal.Signals) -> Any:
    ready = tmp_path / "sub" / "ready"
    cfg = CheckpointConfig(str(ready), str(tmp_path / "ckpt"))
    task = asyncio.create_task(cfg.run_lifecycle(engine, sleep_level=2))
    await eventually(ready.exists)
    assert ready.read_text() == "ready"
    os.kill(os.getpid(), sig)
    return await asyncio.wait_for(task, 3.0)


async def test_lifecycle_checkpoint_done(tmp_path: Path) -> None:
    before = handlers_state()
    engine = SleepyEngine(sleep_mode=True)
    assert await run_with_signal(tmp_path, engine, signal.SIGUSR1) is False
    assert engine.calls == [("sleep", 2)]
    assert handlers_state() == before
    loop = asyncio.get_running_loop()
    assert not loop.remove_signal_handler(signal.SIGUSR1)  # nothing left registered


async def test_lifecycle_restore(tmp_path: Path) -> None:
    before = handlers_state()
    engine = SleepyEngine(sleep_mode=False)  # the CPU case: no sleep, wake_up still called
    assert await run_with_signal(tmp_path, engine, signal.SIGCONT) is True
    assert engine.calls == [("wake_up", None)]
    assert handlers_state() == before


async def test_lifecycle_failure(tmp_path: Path) -> None:
    before = handlers_state()
    engine = SleepyEngine(sleep_mode=True)
    with pytest.raises(RuntimeError, match="SIGUSR2"):
        await run_with_signal(tmp_path, engine, signal.SIGUSR2)
    assert engine.calls == [("sleep", 2)]
    assert handlers_state() == before


async def test_lifecycle_restores_an_earlier_loop_handler(tmp_path: Path) -> None:
    loop = asyncio.get_running_loop()
    got: list[str] = []
    loop.add_signal_handler(signal.SIGUSR2, got.append, "earlier")
    try:
        assert await run_with_signal(tmp_path, SleepyEngine(sleep_mode=False), signal.SIGUSR1) is False
        os.kill(os.getpid(), signal.SIGUSR2)
        await eventually(lambda: got)
        assert got == ["earlier"]
    finally:
        loop.remove_signal_handler(signal.SIGUSR2)


def test_stat_loggers_made_before_the_runtime_report_once_bound() -> None:
    """A checkpointed worker creates its engine, and so vLLM's stat loggers, before its runtime: binding the
    worker's id and registry afterwards gives the same load reports as loggers made with them."""
    from prometheus_client import CollectorRegistry

    from tandem.router.protocols import ActiveLoad
    from tandem.vllm.publisher import KvMetricsStatLogger, StatLoggerFactory

    class Sent:
        def __init__(self) -> None:
            self.items: list[Any] = []

        def publish(self, item: Any) -> bool:
            self.items.append(item)
            return True

    factory = StatLoggerFactory(dp_rank=0)
    logger = factory(None, 0)  # as vLLM calls it while creating the engine
    assert isinstance(logger, KvMetricsStatLogger)
    registry, sent = CollectorRegistry(), Sent()
    factory.bind(0x5eed, registry)
    factory.set_publisher(sent)
    factory.set_num_gpu_blocks(64)
    factory.init_publish()
    logger.record(SimpleNamespace(kv_cache_usage=0.5), None)
    assert [ActiveLoad(**item) for item in sent.items] == [ActiveLoad(0x5eed, 0, 0, None, 0),
                                                          ActiveLoad(0x5eed, 0, 32, None, 32)]
    assert registry.get_sample_value("dynamo_component_kvstats_total_blocks", {"dp_rank": "0"}) == 64
    assert registry.get_sample_value("dynamo_component_kvstats_gpu_cache_usage_percent", {"dp_rank": "0"}) == 0.5
