"""Request abort on cancellation or worker shutdown.

Every `generate` call runs inside `abort_monitor(...)`. A background task waits for the first of

* `context.async_killed_or_stopped()`: the client went away, the frontend cancelled, or asked to stop;
* `shutdown_event.wait()`: the worker is shutting down;

then calls `await engine_client.abort(request_id)`.

How the handler's stream ends (the design): the handler iterates vLLM's output through
`monitor.stream(...)`::

    async with abort_monitor(engine_client, context, request_id, shutdown_event) as monitor:
        async for output in monitor.stream(engine_client.generate(prompt, params, request_id)):
            yield convert(output)

* Shutdown: the stream stops at once and `EngineShutdown` is raised out of the `async for` (and so
  out of the `async with` body and the handler): any output not yet handed out, including vLLM's
  final "abort" output, is dropped, so the stream ends WITHOUT a finish reason and the runtime marks
  it incomplete -- the frontend migrates the request. If the handler is blocked inside the stream
  waiting for the next output, the monitor cancels exactly that wait (it only does so while the
  handler's task is awaiting inside `monitor.stream`, where the cancellation is caught, un-counted
  with `Task.uncancel()` and turned into `EngineShutdown`); it never cancels a task that is
  elsewhere (e.g. suspended at the handler's `yield`), because a cancellation there would land in
  the request plane's code instead. A handler not blocked in the stream sees the flag on its next
  step.
* Kill / stop: the items keep flowing until vLLM's stream ends, which it does promptly after the
  abort with a final output whose finish reason is "abort" (shown to the client as "cancelled",
  like Dynamo). Should the stream not end within `abort_grace` seconds (a source that ignores the
  abort), the monitor ends it the same way as above, but quietly: the `async for` just finishes.
  A negative `abort_grace` disables this.
* Without `monitor.stream`, a plain `async for` over vLLM's output also ends (vLLM ends aborted
  streams), and on shutdown `EngineShutdown` is still raised when the body leaves the `async with`
  normally -- but vLLM's final "abort" output will have been yielded first.

On exit the monitor task is cancelled if still running. Exceptions of the monitor itself (e.g. a
failing `abort`) are logged, never raised; a shutdown still ends the stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from tandem.runtime.errors import EngineShutdown

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_ABORT_GRACE = 1.0
SHUTDOWN_MESSAGE = "Engine was shut down during generation."


class AbortMonitor:
    """State of one request's abort monitor; see the module docstring."""

    def __init__(
        self, engine_client: Any, context: Any, request_id: str, shutdown_event: asyncio.Event,
        *, abort_grace: float = DEFAULT_ABORT_GRACE,
    ) -> None:
        self.engine_client = engine_client
        self.context = context
        self.request_id = request_id
        self.shutdown_event = shutdown_event
        self.abort_grace = abort_grace
        self.fired = False  # a stop/kill or the shutdown was seen
        self.shutdown = False  # ... and it was the shutdown
        self.aborted = False  # engine_client.abort(request_id) returned
        self._ended = False  # the stream must end now (shutdown, or the grace after a kill ran out)
        self._waiter: asyncio.Task[Any] | None = None  # the task awaiting inside stream(), if any
        self._cancelled: asyncio.Task[Any] | None = None  # the waiter this monitor cancelled
        self.task: asyncio.Task[None] | None = None

    # -- the background task ---------------------------------------------------------------------
    async def run(self) -> None:
        stop = asyncio.ensure_future(self.context.async_killed_or_stopped())
        shut = asyncio.ensure_future(self.shutdown_event.wait())
        try:
            done, _ = await asyncio.wait({stop, shut}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in (stop, shut):
                if not waiter.done():
                    waiter.cancel()
        self.fired = True
        # Both at once: a killed client gets nothing more anyway, so only migrate live requests.
        self.shutdown = shut in done and not _is_killed(self.context)
        if self.shutdown:
            # End the stream first: even if the abort fails, the request must migrate.
            self._end_stream()
            log.info("request %s: worker shutting down, aborting it for migration", self.request_id)
        else:
            log.debug("request %s: %s, aborting", self.request_id,
                      "killed" if _is_killed(self.context) else "stopped")
        try:
            await self.engine_client.abort(self.request_id)
            self.aborted = True
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning("request %s: abort failed", self.request_id, exc_info=True)
        if not self.shutdown and self.abort_grace >= 0:
            await asyncio.sleep(self.abort_grace)
            if not self._ended:
                log.debug("request %s: stream still running %ss after abort; ending it",
                          self.request_id, self.abort_grace)
                self._end_stream()

    def _end_stream(self) -> None:
        self._ended = True
        waiter = self._waiter
        if waiter is not None and not waiter.done() and self._cancelled is None:
            self._cancelled = waiter
            waiter.cancel(msg="tandem abort monitor")

    # -- the handler side ------------------------------------------------------------------------
    def check(self) -> None:
        """Raise EngineShutdown if the worker is shutting down (for handlers that do not use stream())."""
        if self.shutdown:
            raise EngineShutdown(SHUTDOWN_MESSAGE)

    async def stream(self, source: AsyncIterator[T]) -> AsyncIterator[T]:
        """Yield `source`'s items until it ends or the monitor ends it (see the module docstring)."""
        iterator = aiter(source)
        try:
            while True:
                if self._ended:
                    self.check()
                    return
                task = asyncio.current_task()
                self._waiter = task
                try:
                    item = await anext(iterator)
                except StopAsyncIteration:
                    if self.shutdown:
                        raise EngineShutdown(SHUTDOWN_MESSAGE) from None
                    return
                except asyncio.CancelledError:
                    if task is None or self._cancelled is not task:
                        raise
                    self._cancelled = None
                    if task.uncancel() > 0:
                        raise  # someone else cancelled this task too
                    if self.shutdown:
                        raise EngineShutdown(SHUTDOWN_MESSAGE) from None
                    return
                finally:
                    self._waiter = None
                if self._cancelled is task and task is not None:
                    # The source swallowed our cancellation and produced an item anyway.
                    self._cancelled = None
                    task.uncancel()
                    self.check()
                    return
                # On shutdown the item is dropped: no finish reason may reach the client.
                self.check()
                yield item
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:
                    log.debug("request %s: error closing the engine stream", self.request_id, exc_info=True)


def _is_killed(context: Any) -> bool:
    is_killed = getattr(context, "is_killed", None)
    return bool(is_killed()) if callable(is_killed) else False


@asynccontextmanager
async def abort_monitor(
    engine_client: Any, context: Any, request_id: str, shutdown_event: asyncio.Event,
    *, abort_grace: float = DEFAULT_ABORT_GRACE,
) -> AsyncIterator[AbortMonitor]:
    """Abort `request_id` in the engine when `context` is stopped/killed or `shutdown_event` is set.

    Yields an `AbortMonitor`; iterate vLLM's output through `monitor.stream(...)`. On shutdown,
    `EngineShutdown` propagates out of the `async with` (also when the body ended normally), so the
    stream ends without a finish reason and the frontend migrates the request.
    """
    monitor = AbortMonitor(engine_client, context, request_id, shutdown_event, abort_grace=abort_grace)
    monitor.task = asyncio.create_task(monitor.run(), name=f"abort-monitor-{request_id}")
    try:
        yield monitor
    finally:
        task = monitor.task
        if not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                # Our cancel of the monitor, or the current task is being cancelled: tell them apart.
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
            except Exception:
                log.warning("request %s: abort monitor failed", request_id, exc_info=True)
        elif not task.cancelled() and task.exception() is not None:
            log.warning("request %s: abort monitor failed", request_id, exc_info=task.exception())
    if monitor.shutdown:
        # Reached only when the body finished without an exception.
        raise EngineShutdown(SHUTDOWN_MESSAGE)
