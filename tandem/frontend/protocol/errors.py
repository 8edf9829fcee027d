"""Errors the frontend answers a client with: `RequestError` (a status, the field it names, OpenAI's
error body), built from msgspec's validation errors or by hand (`fail`). Each API writes it in its own
shape; this is the shape of the OpenAI routes."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import msgspec

from tandem.frontend.protocol.sse import sse

_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                429: "rate_limit_error", 501: "not_implemented_error", 503: "service_unavailable"}  # fmt: skip


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "internal_server_error")


class RequestError(Exception):
    """A request the frontend refuses; `body()` is OpenAI's error JSON."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, type: str | None = None,
                 code: str | int | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or error_type(status)
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def sse(self) -> bytes:
        return sse(self.body())

    @classmethod
    def model_not_found(cls, model: str) -> RequestError:
        # OpenAI's exact answer for an unknown model (404, but type invalid_request_error).
        return cls(f"The model `{model}` does not exist.", status=404, param="model",
                   type="invalid_request_error", code="model_not_found")  # fmt: skip


_AT = re.compile(r"^(.*?)(?: - at `\$(.*)`)?$", re.S)


def from_validation(err: msgspec.ValidationError, prefix: str = "") -> RequestError:
    """msgspec's "Expected `float | null`, got `str` - at `$.a[0].b`" -> param "a[0].b"."""
    m = _AT.match(str(err))
    reason, path = (m.group(1), m.group(2) or "") if m else (str(err), "")
    path = (prefix + path).lstrip(".")
    missing = re.match(r"Object missing required field `(.*)`$", reason)
    if missing:
        param = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return RequestError(f"Missing required parameter: '{param}'.", param=param)
    unknown = re.match(r"Object contains unknown field `(.*)`$", reason)  # a Struct that forbids unknown fields
    if unknown:
        param = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        return RequestError(f"'{param}' is not supported.", param=param)
    if not path:
        return RequestError(f"The request body must be a JSON object ({reason}).")
    reason = reason.replace(" | null`", "`")
    return RequestError(f"Invalid value for '{path}': {reason[:1].lower()}{reason[1:]}.", param=path)


def fail(param: str | None, message: str) -> RequestError:
    return RequestError(message, param=param)


def refuse_given(raw: Any, unserved: Iterable[tuple[str, str]]) -> None:
    """A 400 naming the first field of `unserved` (name, why it is not served) that the body `raw` gives: a
    field a route does not honour is refused, never ignored."""
    for name, why in unserved:
        if getattr(raw, name) is not None:
            raise fail(name, f"'{name}' is not supported: {why}.")
