"""Errors raised by the runtime. Each one names what went wrong and, where useful, what to do."""

from __future__ import annotations


class TandemError(Exception):
    """Base class of tandem runtime errors."""


class NoInstancesError(TandemError):
    """No live instance serves the endpoint (or the requested instance id is unknown)."""


class InstanceUnreachableError(TandemError):
    """The chosen instance could not be reached or did not accept the request in time.

    Nothing was generated, so the request can be sent to another instance (migration "new_request").
    """


class StreamIncompleteError(TandemError):
    """A response stream was cut off before its end marker (worker died, connection dropped,
    or the handler raised EngineShutdown). Items received so far are valid; the frontend may migrate.
    """


class RemoteError(TandemError):
    """The remote handler raised; `code` follows HTTP conventions (400 bad request, 404 no such
    endpoint, 413 too large, 500 handler failure, 503 shutting down)."""

    def __init__(self, message: str, code: int = 500) -> None:
        super().__init__(message)
        self.code = code


class InvalidRequestError(TandemError):
    """A request does not have the shape its endpoint takes; the caller gets a 400 naming the field (or the
    `code` given: 413 for a part over a size limit)."""

    def __init__(self, message: str, code: int = 400) -> None:
        super().__init__(message)
        self.code = code


class MessageTooLargeError(TandemError):
    """A message exceeds the request plane's maximum size; `hint` says which setting raises it."""

    def __init__(self, size: int, limit: int, hint: str = "raise DYN_TCP_MAX_MESSAGE_SIZE") -> None:
        super().__init__(f"message of {size} bytes exceeds the maximum of {limit} bytes ({hint})")
        self.size = size
        self.limit = limit


class EngineShutdown(Exception):
    """Raised by a handler that is going away mid-stream: the stream closes as incomplete so the
    caller can migrate it to another worker (Dynamo's `dynamo.llm.exceptions.EngineShutdown`)."""
