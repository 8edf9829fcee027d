"""Request plane: how a request reaches a worker's endpoint and how its response stream comes back.

A transport provides a server (many endpoints per process) and a client (streams to any instance).
`tcp` (direct connections) and `nats` (through a NATS server) are built in.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from tandem.runtime.context import Context


class EndpointService(Protocol):
    """What a transport server calls for each request to one served endpoint."""

    def stream(self, request: Any, context: Context) -> AsyncIterator[Any]:
        """Run the handler; yields response items."""
        ...

    def account(self, request_bytes: int, response_bytes: int, seconds: float, outcome: str) -> None:
        """Record a finished request. `outcome` is ok, error, cancelled or incomplete."""
        ...


class RequestPlaneServer(ABC):
    @property
    @abstractmethod
    def transport(self) -> dict[str, str]:
        """How clients reach this server, recorded in each instance's discovery entry ({"tcp": "host:port"})."""

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def add_endpoint(self, path: str, service: EndpointService) -> None:
        """Serve `namespace.component.endpoint` with `service`."""

    @abstractmethod
    async def remove_endpoint(self, path: str) -> None:
        """Stop taking new requests for `path`; streams already running continue."""

    @abstractmethod
    def inflight(self, path: str) -> int:
        """Number of streams of `path` still running."""

    @abstractmethod
    async def close(self) -> None:
        """Stop listening, kill what still runs, close connections."""


class ResponseStream(ABC):
    """An async iterator of response items.

    Ends normally when the server marked the end; raises StreamIncompleteError if it was cut off,
    RemoteError if the handler failed. Killing (context.kill() or aclose()) ends it quietly.
    """

    @abstractmethod
    def __aiter__(self) -> AsyncIterator[Any]: ...

    @abstractmethod
    async def __anext__(self) -> Any: ...

    @abstractmethod
    async def aclose(self) -> None:
        """Kill the request if it is still running."""

    @property
    @abstractmethod
    def completed(self) -> bool:
        """True once the server's end marker arrived."""

    @property
    def buffered(self) -> bool:
        """True when the next item is already here (`__anext__` will not wait): lets a consumer
        batch its own writes."""
        return False


class RequestPlaneClient(ABC):
    @abstractmethod
    async def open_stream(
        self, transport: dict[str, str], endpoint: str, request: Any, context: Context, item_type: type | None = None
    ) -> ResponseStream:
        """Send `request` to `endpoint` on the instance at `transport`; the stream's items are decoded into
        `item_type` (a msgspec Struct; None: plain msgpack values).

        Returns once the instance accepted it. Raises InstanceUnreachableError when it could not be
        reached or did not accept in time (nothing was generated: safe to try another instance).
        """

    @abstractmethod
    async def close(self) -> None: ...


def make_request_plane(
    kind: str, config: Any, connection: Any, instance_id: Callable[[], int]
) -> tuple[RequestPlaneServer, RequestPlaneClient]:
    """`connection`: the process's NatsConnection (None unless a plane uses NATS); `instance_id()`: this
    process's instance id, known once discovery has started."""
    if kind == "tcp":
        from tandem.runtime.request_plane.tcp import TcpClient, TcpServer

        return TcpServer(config), TcpClient(config)
    if kind == "nats":
        from tandem.runtime.request_plane.nats import NatsClient, NatsServer

        return NatsServer(config, connection, instance_id), NatsClient(config, connection)
    raise ValueError(f"unknown request plane {kind!r}")  # RuntimeConfig.validate refuses it first
