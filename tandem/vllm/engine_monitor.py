"""Engine monitor of the vLLM worker.

Two background tasks:

* health loop: every `health_interval` seconds `await engine_client.check_health()`, bounded by
  `check_timeout`. Any exception (vLLM raises `vllm.v1.engine.exceptions.EngineDeadError` once the
  engine core died) or a timeout counts as engine death: the traceback is logged, the engine is shut
  down (in a thread, bounded by `shutdown_timeout`, so it works off the main thread where SIGALRM
  cannot be used), then the runtime (bounded too), and the process exits with status 1 (`exit`,
  `os._exit` by default, injectable for tests).
* stats loop: every `VLLM_LOG_STATS_INTERVAL` seconds (default 10; invalid -> warning + 10; <= 0
  disables; skipped when `engine_client.log_stats` is false) `await engine_client.do_log_stats()`,
  which drives vLLM's periodic stat loggers (including the worker's publisher). Errors at debug.

Both loops wait on the shutdown event for at most their interval, so they end promptly once the
worker's shutdown event is set; `stop()` cancels them.

Settings: an explicit constructor argument wins, then the environment (`DYN_ENGINE_HEALTH_CHECK_INTERVAL`,
`DYN_ENGINE_HEALTH_CHECK_TIMEOUT`, `DYN_ENGINE_HEALTH_SHUTDOWN_TIMEOUT`, `VLLM_LOG_STATS_INTERVAL`), then
the defaults (2 s, 30 s, 30 s, 10 s). A check timeout or shutdown timeout <= 0 means "unbounded".
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

HEALTH_INTERVAL_ENV = "DYN_ENGINE_HEALTH_CHECK_INTERVAL"
CHECK_TIMEOUT_ENV = "DYN_ENGINE_HEALTH_CHECK_TIMEOUT"
SHUTDOWN_TIMEOUT_ENV = "DYN_ENGINE_HEALTH_SHUTDOWN_TIMEOUT"
STATS_INTERVAL_ENV = "VLLM_LOG_STATS_INTERVAL"

DEFAULT_HEALTH_INTERVAL = 2.0
DEFAULT_CHECK_TIMEOUT = 30.0
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
DEFAULT_STATS_INTERVAL = 10.0


def env_seconds(name: str, default: float) -> float:
    """A float from the environment; unset/empty -> default; invalid -> warning + default."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return float(raw)
    except ValueError:
        log.warning("invalid %s value %r, using the default %s", name, raw, default)
        return default


def _bound(seconds: float) -> float | None:
    """A timeout setting as `asyncio.timeout` takes it: <= 0 means unbounded."""
    return seconds if seconds > 0 else None


def _is_engine_dead(error: BaseException) -> bool:
    # Checked without importing vLLM (slow): a real engine has loaded the module already.
    exceptions = sys.modules.get("vllm.v1.engine.exceptions")
    dead = getattr(exceptions, "EngineDeadError", None)
    return dead is not None and isinstance(error, dead)


class VllmEngineMonitor:
    """Watches a vLLM `AsyncLLM`; on engine death shuts everything down and exits the process."""

    def __init__(
        self,
        runtime: Any,
        engine_client: Any,
        shutdown_event: asyncio.Event,
        *,
        health_interval: float | None = None,
        check_timeout: float | None = None,
        shutdown_timeout: float | None = None,
        stats_interval: float | None = None,
        exit: Callable[[int], Any] = os._exit,
    ) -> None:
        self.runtime = runtime
        self.engine_client = engine_client
        self.shutdown_event = shutdown_event
        self.health_interval = (
            health_interval if health_interval is not None
            else env_seconds(HEALTH_INTERVAL_ENV, DEFAULT_HEALTH_INTERVAL)
        )
        if self.health_interval <= 0:
            log.warning("engine health check interval %s <= 0; using %s", self.health_interval,
                        DEFAULT_HEALTH_INTERVAL)
            self.health_interval = DEFAULT_HEALTH_INTERVAL
        self.check_timeout = (
            check_timeout if check_timeout is not None else env_seconds(CHECK_TIMEOUT_ENV, DEFAULT_CHECK_TIMEOUT)
        )
        self.shutdown_timeout = (
            shutdown_timeout if shutdown_timeout is not None
            else env_seconds(SHUTDOWN_TIMEOUT_ENV, DEFAULT_SHUTDOWN_TIMEOUT)
        )
        self.stats_interval = (
            stats_interval if stats_interval is not None
            else env_seconds(STATS_INTERVAL_ENV, DEFAULT_STATS_INTERVAL)
        )
        self._exit = exit
        self._health_task: asyncio.Task[None] | None = None
        self._stats_task: asyncio.Task[None] | None = None
        self.dead_error: BaseException | None = None  # set once engine death was detected

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Start both loops (idempotent). Needs a running event loop."""
        if self._health_task is None:
            self._health_task = asyncio.create_task(self._health_loop(), name="vllm-engine-health")
        if self._stats_task is None:
            self._stats_task = asyncio.create_task(self._stats_loop(), name="vllm-engine-stats")
        log.info(
            "vLLM engine monitor started (health every %ss, check timeout %ss, stats every %ss)",
            self.health_interval, self.check_timeout,
            self.stats_interval if self.stats_interval > 0 else "-",
        )

    async def stop(self) -> None:
        """Cancel both loops and wait for them. Once engine death was detected the health loop is
        left to finish its shutdown-and-exit sequence instead of being cancelled."""
        current = asyncio.current_task()
        tasks = [t for t in (self._health_task, self._stats_task) if t is not None and t is not current]
        for task in tasks:
            if task is self._health_task and self.dead_error is not None:
                continue
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def running(self) -> bool:
        return any(t is not None and not t.done() for t in (self._health_task, self._stats_task))

    # -- health ------------------------------------------------------------------------------------
    async def _check_once(self) -> None:
        result = self.engine_client.check_health()
        if inspect.isawaitable(result):
            async with asyncio.timeout(_bound(self.check_timeout)):
                await result

    async def _wait_shutdown(self, interval: float) -> bool:
        """Sleep `interval` seconds or until the shutdown event; True if it is set."""
        try:
            async with asyncio.timeout(interval):
                await self.shutdown_event.wait()
            return True
        except TimeoutError:
            return False

    async def _health_loop(self) -> None:
        try:
            while not self.shutdown_event.is_set():
                try:
                    await self._check_once()
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    await self._on_engine_dead(e)
                    return
                if await self._wait_shutdown(self.health_interval):
                    break
            log.info("shutdown event set: engine health monitoring stopped")
        except asyncio.CancelledError:
            log.debug("engine health monitoring cancelled")

    async def _on_engine_dead(self, error: BaseException) -> None:
        self.dead_error = error
        if isinstance(error, TimeoutError):
            log.error("vLLM engine health check did not answer within %ss", self.check_timeout, exc_info=error)
        elif _is_engine_dead(error):
            log.error("vLLM engine core is dead: %s", error, exc_info=error)
        else:
            log.error("vLLM engine health check failed: %r", error, exc_info=error)
        log.warning("engine is unusable: shutting down the engine and the runtime, then exiting")
        if self._stats_task is not None and self._stats_task is not asyncio.current_task():
            self._stats_task.cancel()
        try:
            await self._shutdown_engine()
        except Exception:
            log.warning("vLLM engine shutdown failed", exc_info=True)
        try:
            await self._shutdown_runtime()
        except Exception:
            log.warning("runtime shutdown failed", exc_info=True)
        self._exit(1)

    async def _shutdown_engine(self) -> None:
        """`engine_client.shutdown()` (sync) in a daemon thread, waited for at most `shutdown_timeout`."""
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()

        def settle() -> None:
            if not finished.done():
                finished.set_result(None)

        def run() -> None:
            try:
                self.engine_client.shutdown()
            except Exception as e:
                log.warning("vLLM engine shutdown failed: %r", e)
            finally:
                try:
                    loop.call_soon_threadsafe(settle)
                except RuntimeError:  # the loop is gone: nobody waits any more
                    pass

        threading.Thread(target=run, name="vllm-engine-shutdown", daemon=True).start()
        try:
            async with asyncio.timeout(_bound(self.shutdown_timeout)):
                await finished
        except TimeoutError:
            log.warning("vLLM engine shutdown did not finish within %ss; going on", self.shutdown_timeout)

    async def _shutdown_runtime(self) -> None:
        result = self.runtime.shutdown()
        if not inspect.isawaitable(result):
            return
        try:
            async with asyncio.timeout(_bound(self.shutdown_timeout)):
                await result
        except TimeoutError:
            log.warning("runtime shutdown did not finish within %ss; exiting anyway", self.shutdown_timeout)

    # -- stats -------------------------------------------------------------------------------------
    async def _stats_loop(self) -> None:
        interval = self.stats_interval
        if interval <= 0:
            log.debug("periodic vLLM stats logging disabled (%s=%s)", STATS_INTERVAL_ENV, interval)
            return
        if not getattr(self.engine_client, "log_stats", True):
            log.debug("vLLM stats logging is off on the engine; no periodic do_log_stats()")
            return
        try:
            while not self.shutdown_event.is_set():
                if await self._wait_shutdown(interval):
                    break
                try:
                    await self.engine_client.do_log_stats()
                except Exception:
                    log.debug("periodic vLLM stats logging failed", exc_info=True)
        except asyncio.CancelledError:
            log.debug("periodic vLLM stats logging cancelled")
