"""A worker's forward-pass metrics: what each engine step computed and how long it took, published on the
component's `forward_pass_metrics` topic for the load-based planner (the messages: `tandem.llm.forward_pass`).

The planner fits step time against the tokens a step computes (prompt tokens, and the KV tokens the
running requests attend over), then estimates from an engine's queue what TTFT and ITL a request sent to
it now would see. So each report carries the steps since the last one (at most `MAX_PASSES`, the newest)
and the engine's state at the time of the report: the prompt tokens admitted but not yet computed and the
KV tokens its running requests hold.

The report also says how long the engine was busy stepping, so the planner knows how much of an engine's
time the load takes (and what one engine fewer would leave).

Steps are collected as they happen and published in batches (every `interval` seconds while the engine
works, every `idle_interval` while it is idle), since a message per step would cost more than a short step.
The idle reports tell the planner an engine is there and has nothing queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator

import msgspec

from tandem.llm.forward_pass import EngineState, ForwardPass, ForwardPassMetrics
from tandem.router.publisher import SupportsPublish

log = logging.getLogger(__name__)

MAX_PASSES = 64  # steps per report: the newest, when an engine steps faster than reports go out


class ForwardPassRecorder:
    """Collects one engine's steps (`record`, from the engine's loop) and publishes them with the engine's
    state (`state()`, read at each report) from a background task (`start` / `stop`)."""

    def __init__(self, *, worker_id: int, dp_rank: int, publisher: SupportsPublish, state: Callable[[], EngineState],
                 interval: float = 0.5, idle_interval: float = 2.0) -> None:
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.publisher = publisher
        self.state = state
        self.interval = interval
        self.idle_interval = idle_interval
        self._passes: deque[ForwardPass] = deque(maxlen=MAX_PASSES)
        self._busy = 0.0
        self._task: asyncio.Task[None] | None = None
        self._last_report = 0.0

    def record(self, prefill_tokens: int, kv_tokens: int, wall_time: float) -> None:
        """One step that computed something (steps with no tokens say nothing about step time)."""
        if prefill_tokens > 0 or kv_tokens > 0:
            self._passes.append(ForwardPass(int(prefill_tokens), int(kv_tokens), float(wall_time)))
            self._busy += wall_time

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="forward-pass-metrics")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def report(self) -> bool:
        """Publish the steps since the last report and the state now; False if the event plane dropped it."""
        passes, busy = list(self._passes), self._busy
        self._passes.clear()
        self._busy = 0.0
        self._last_report = time.monotonic()
        try:
            event = ForwardPassMetrics(self.worker_id, self.dp_rank, self.state(), passes, busy)
            return self.publisher.publish(msgspec.to_builtins(event)) is not False
        except Exception as e:  # metrics must never disturb the engine
            log.warning("publishing forward-pass metrics failed: %s", e)
            return False

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if self._passes or time.monotonic() - self._last_report >= self.idle_interval:
                self.report()


class PendingPrompts:
    """Prompt tokens of the requests an engine has admitted and not yet answered with a first token: its
    prefill queue, as a worker that cannot see into its engine's scheduler counts it."""

    def __init__(self) -> None:
        self.tokens = 0

    @contextlib.contextmanager
    def prompt(self, tokens: int) -> Iterator[Callable[[], None]]:
        """While a request runs; call the function given once its first token is out."""
        counted = [True]
        self.tokens += tokens

        def first_token() -> None:
            if counted[0]:
                counted[0] = False
                self.tokens -= tokens

        try:
            yield first_token
        finally:
            first_token()
