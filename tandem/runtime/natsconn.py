"""One NATS connection per process, shared by the NATS request plane and the NATS event plane.

The connection reconnects by itself for as long as the process lives (the client restores the
subscriptions); the planes listen for its disconnects, since what was in flight may be lost.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import nats
import nats.errors
from nats.aio.client import Client

from tandem.runtime.config import ConfigError, RuntimeConfig

log = logging.getLogger(__name__)

RECONNECT_WAIT = 0.25  # seconds between attempts to reach a server


class NatsConnection:
    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        self.servers = [s.strip() for s in config.nats_server.split(",") if s.strip()]
        self._nc: Client | None = None
        self._starting: asyncio.Task[None] | None = None
        self._up = asyncio.Event()
        self.reconnected_at = float("-inf")  # monotonic time of the last reconnect
        self._disconnect_listeners: list[Callable[[], None]] = []

    @property
    def nc(self) -> Client:
        assert self._nc is not None, "NatsConnection.start() first"
        return self._nc

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    def on_disconnect(self, listener: Callable[[], None]) -> None:
        self._disconnect_listeners.append(listener)

    async def start(self) -> None:
        """Connect (once, however many planes ask). Raises ConfigError when the server cannot be reached
        within the connect timeout, or the auth settings cannot be used."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._connect())
        await asyncio.shield(self._starting)

    def _options(self) -> dict[str, object]:
        config = self.config
        options: dict[str, object] = {}
        if config.nats_user is not None or config.nats_password is not None:
            options.update(user=config.nats_user or "", password=config.nats_password or "")
        if config.nats_token is not None:
            options["token"] = config.nats_token
        if config.nats_nkey is not None or config.nats_credentials_file is not None:
            try:
                import nkeys  # noqa: F401  (nats-py signs with it)
            except ImportError:
                raise ConfigError("NATS_AUTH_NKEY / NATS_AUTH_CREDENTIALS_FILE need the `nkeys` package: "
                                  "pip install nkeys") from None
            if config.nats_nkey is not None:
                options["nkeys_seed"] = config.nats_nkey
            if config.nats_credentials_file is not None:
                options["user_credentials"] = config.nats_credentials_file
        return options

    def _login(self) -> str:
        """How this process logged in, for an error message."""
        config = self.config
        given = [what for what, used in (
            (f"as user {config.nats_user or ''!r} (NATS_AUTH_USERNAME / NATS_AUTH_PASSWORD)",
             config.nats_user is not None or config.nats_password is not None),
            ("with NATS_AUTH_TOKEN", config.nats_token is not None),
            ("with NATS_AUTH_NKEY", config.nats_nkey is not None),
            ("with NATS_AUTH_CREDENTIALS_FILE", config.nats_credentials_file is not None)) if used]
        return " and ".join(given) or ("without credentials (NATS_AUTH_USERNAME / NATS_AUTH_PASSWORD, "
                                       "NATS_AUTH_TOKEN, NATS_AUTH_NKEY or NATS_AUTH_CREDENTIALS_FILE)")

    async def _connect(self) -> None:
        for server in self.servers:
            if urlsplit(server).scheme not in ("nats", "tls", "ws", "wss"):
                raise ConfigError(f"NATS_SERVER={self.config.nats_server!r}: expected nats://host:port[,...]")

        async def disconnected() -> None:
            self._up.clear()
            log.warning("lost the connection to NATS; reconnecting")
            for listener in self._disconnect_listeners:
                listener()

        async def reconnected() -> None:
            self.reconnected_at = time.monotonic()
            self._up.set()
            log.info("reconnected to NATS at %s", self.nc.connected_url.netloc if self.nc.connected_url else "?")

        connecting = True
        first_errors: list[Exception] = []

        async def error(e: Exception) -> None:
            if connecting:  # the first connect's failures are reported once, below
                first_errors.append(e)
            else:
                log.warning("NATS: %s", e)

        timeout = self.config.nats_connect_timeout
        try:
            # Retries for about the connect timeout at first; once connected it reconnects forever.
            async with asyncio.timeout(timeout + 5):
                self._nc = await nats.connect(
                    self.servers, connect_timeout=timeout, allow_reconnect=True,
                    max_reconnect_attempts=max(1, int(timeout / RECONNECT_WAIT)), reconnect_time_wait=RECONNECT_WAIT,
                    disconnected_cb=disconnected, reconnected_cb=reconnected, error_cb=error, name="tandem",
                    **self._options(),  # type: ignore[arg-type]
                )
        except (OSError, TimeoutError, nats.errors.Error) as e:
            refusal = _refusal(first_errors)
            if refusal is not None:
                raise ConfigError(f"NATS at {self.config.nats_server} (NATS_SERVER) refused the login "
                                  f"{self._login()}: {refusal}") from None
            cause = first_errors[-1] if first_errors else e
            raise ConfigError(f"cannot reach NATS at {self.config.nats_server} (NATS_SERVER) within {timeout:g} s "
                              f"(DYN_NATS_CONNECT_TIMEOUT_SECS): {type(cause).__name__}: {cause}") from None
        connecting = False
        self._nc.options["max_reconnect_attempts"] = -1
        self._up.set()

    async def wait_connected(self, timeout: float) -> bool:
        """Wait up to `timeout` for the connection to be up; whether it is."""
        if not self._up.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._up.wait()
        return self.connected

    @property
    def max_payload(self) -> int:
        return self.nc.max_payload

    async def close(self) -> None:
        """Flush what is pending and close; at once when NATS is unreachable (nothing could be flushed)."""
        nc = self._nc
        if nc is None or nc.is_closed:
            return
        if nc.is_connected:
            try:
                async with asyncio.timeout(5):
                    await nc.drain()
                return
            except (nats.errors.Error, TimeoutError, OSError):
                pass
        try:
            await nc.close()
        except asyncio.CancelledError:
            # nats-py closing during a reconnect attempt awaits that attempt's cancelled writer; only a
            # cancellation of this task itself goes on.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise


class Outbox:
    """Messages published in order by one task, so that senders never wait. `writable` is cleared while
    `high` messages wait (for senders that hold back) and set again below half of it."""

    def __init__(self, connection: NatsConnection, high: int) -> None:
        self._connection = connection
        self._high = high
        self._queue: collections.deque[tuple[str, bytes]] = collections.deque()
        self._wakeup = asyncio.Event()
        self.writable = asyncio.Event()
        self.writable.set()
        self.failed = 0  # messages NATS refused (e.g. its reconnect buffer was full)
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, subject: str, data: bytes) -> None:
        self._queue.append((subject, data))
        if len(self._queue) >= self._high:
            self.writable.clear()
        self._wakeup.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="nats-outbox")

    async def _send(self, subject: str, data: bytes) -> None:
        try:
            await self._connection.nc.publish(subject, data)
        except nats.errors.Error as e:  # lost, as core NATS may lose a message; the receivers notice
            self.failed += 1
            log.debug("NATS refused a message to %s: %s", subject, e)

    async def _run(self) -> None:
        queue = self._queue
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while queue:
                await self._send(*queue.popleft())
                if len(queue) < self._high // 2:
                    self.writable.set()

    async def close(self, linger: float = 0.0) -> None:
        """Stop sending, after up to `linger` seconds for what is queued to leave."""
        deadline = asyncio.get_running_loop().time() + linger
        while self._queue and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        if self._task is not None:
            self._task.cancel()
        self.writable.set()


def _refusal(errors: list[Exception]) -> str | None:
    """The server's authorization refusal among a first connect's errors (its `-ERR 'Authorization
    Violation'`), if any. The server closes the connection as it refuses, so a reset often follows the
    refusal: the last error alone would name the reset, and the reason would depend on a race."""
    for e in errors:
        if isinstance(e, nats.errors.Error) and ("authoriz" in str(e).lower() or "authentic" in str(e).lower()):
            return str(e).removeprefix("nats: ").strip("'")
    return None
