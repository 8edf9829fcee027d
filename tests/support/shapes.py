"""tandem's answers checked against the protocol models that vLLM and the official SDKs ship (installed with
the test dependencies), not against dicts written in the tests.

`conforms(Model, wire)` validates one JSON body in pydantic's strict mode and also refuses every field the
model does not declare (the SDKs' models accept unknown fields, vLLM's drop them: either would hide a typo or a
field a client never reads). `sse_events` splits a server-sent-event stream. `checked_http_client()` is an httpx
client for the official SDKs that checks every Responses and Messages answer on the way in, streamed events as
they pass, so each test of those routes also checks the shapes of all it receives.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import anthropic.types as A
import httpx
import pydantic
from openai.types import responses as R
from openai.types.shared import ErrorObject


def conforms(model: Any, wire: str | bytes, *, extensions: frozenset[str] = frozenset()) -> Any:
    """`wire` (one JSON text) validated as `model` (a class or a type such as a union), strictly; every key of
    every object is a field of its model, except fields tandem adds on purpose (`extensions`: their dotted
    paths, such as `usage.output_tokens_details`). Returns the validated value."""
    value = pydantic.TypeAdapter(model).validate_json(wire, strict=True)
    unknown = [p for p in _unknown_fields(value, json.loads(wire), "") if p.lstrip(".") not in extensions]
    assert not unknown, f"fields {model} does not declare: {unknown} in {wire!r}"
    return value


def _unknown_fields(value: Any, data: Any, path: str) -> Iterator[str]:
    """The paths of keys in `data` that the validated `value` has no field for (walked side by side)."""
    if isinstance(value, pydantic.BaseModel) and isinstance(data, dict):
        by_key = {(f.alias or name): name for name, f in type(value).model_fields.items()}
        for key, item in data.items():
            if key not in by_key:
                yield f"{path}.{key}"
            else:
                yield from _unknown_fields(getattr(value, by_key[key]), item, f"{path}.{key}")
    elif isinstance(value, list | tuple) and isinstance(data, list):
        for i, (v, d) in enumerate(zip(value, data, strict=False)):
            yield from _unknown_fields(v, d, f"{path}[{i}]")
    elif isinstance(value, dict) and isinstance(data, dict):
        for key, item in data.items():
            if key in value:
                yield from _unknown_fields(value[key], item, f"{path}.{key}")


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """A server-sent-event stream as (event name or None, data) pairs."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            field, _, rest = line.partition(":")
            rest = rest.removeprefix(" ")
            if field == "event":
                name = rest
            elif field == "data":
                data.append(rest)
        events.append((name, "\n".join(data)))
    return events


# -- OpenAI's Responses API ------------------------------------------------------------------------------------

def _members(union: Any) -> tuple[Any, ...]:
    if typing.get_origin(union) is typing.Annotated:
        union = typing.get_args(union)[0]
    return typing.get_args(union)


# The SDK's class for each stream event type, from its own union of stream events.
RESPONSE_EVENTS: dict[str, type[pydantic.BaseModel]] = {
    typing.get_args(m.model_fields["type"].annotation)[0]: m for m in _members(R.ResponseStreamEvent)}


# What tandem's Responses answers add to the SDK's models, as OpenAI's service and vLLM send them: the
# Response's `store`, and the function's `name` on response.function_call_arguments.done.
RESPONSE_EXTENSIONS = frozenset({"store"})
RESPONSE_EVENT_EXTENSIONS = frozenset({"response.store", "name"})


class OpenAIError(pydantic.BaseModel):
    """OpenAI's error body: the SDK's error object under `error`."""

    model_config = pydantic.ConfigDict(extra="forbid")
    error: ErrorObject


def response_event(name: str | None, data: str) -> Any:
    """One Responses stream event: the SDK's class for its type (which the SSE event field names too)."""
    kind = json.loads(data)["type"]
    assert name == kind, (name, kind)
    return conforms(RESPONSE_EVENTS[kind], data, extensions=RESPONSE_EVENT_EXTENSIONS)


def response_stream(events: list[Any]) -> None:
    """A whole Responses stream: numbered 0, 1, 2, ..."""
    assert [e.sequence_number for e in events] == list(range(len(events)))


# -- Anthropic's Messages API ----------------------------------------------------------------------------------

class _Ping(pydantic.BaseModel):
    """Anthropic's keep-alive event (documented; the SDK skips it and has no class for it)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    type: typing.Literal["ping"]


def message_event(name: str | None, data: str) -> Any:
    """One Messages stream event: a member of the SDK's stream event union, its error body, or a ping."""
    kind = json.loads(data)["type"]
    assert name == kind, (name, kind)
    if kind == "ping":
        return conforms(_Ping, data)
    if kind == "error":
        return conforms(A.ErrorResponse, data)
    return conforms(A.RawMessageStreamEvent, data)


def message_stream(events: list[Any]) -> None:
    """A whole Messages stream: message_start first; message_stop last, or an error."""
    assert events[0].type == "message_start" and events[-1].type in ("message_stop", "error"), \
        [e.type for e in events]


# -- the checking client ---------------------------------------------------------------------------------------

def _unary(method: str, path: str, status: int, body: bytes) -> None:
    if path.startswith("/v1/messages"):
        if status >= 400:
            conforms(A.ErrorResponse, body)
        else:
            conforms(A.MessageTokensCount if path.endswith("/count_tokens") else A.Message, body)
    elif method != "DELETE":  # (a deletion's answer is no Response)
        if status >= 400:
            conforms(OpenAIError, body)
        else:
            model = R.InputTokenCountResponse if path.endswith("/input_tokens") else R.Response
            conforms(model, body, extensions=RESPONSE_EXTENSIONS)


def checked_http_client(http: ModuleType = httpx, **options: Any) -> Any:
    """A client of `http` (httpx for `openai.OpenAI(http_client=...)`, httpx2 for `anthropic.Anthropic`) that
    checks every Responses and Messages answer against the SDKs' models: a body when it arrives, a streamed
    event as soon as it is complete (the stream is passed on unchanged), the whole stream when it ends."""

    class CheckedStream(http.SyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, inner: Any, event: Callable[[str | None, str], Any],
                     whole: Callable[[list[Any]], None]) -> None:  # fmt: skip
            self.inner, self.event, self.whole = inner, event, whole

        def __iter__(self) -> Iterator[bytes]:
            pending, events = b"", []
            for chunk in self.inner:
                pending += chunk
                complete, _, pending = pending.rpartition(b"\n\n")
                events += [self.event(name, data) for name, data in sse_events(complete.decode())]
                yield chunk
            assert not pending.strip(), pending
            self.whole(events)

        def close(self) -> None:
            self.inner.close()

    class Checking(http.HTTPTransport):  # type: ignore[name-defined,misc]
        def handle_request(self, request: Any) -> Any:
            response = super().handle_request(request)
            path = request.url.path
            if not path.startswith(("/v1/messages", "/v1/responses")):
                return response
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                messages = path.startswith("/v1/messages")
                response.stream = CheckedStream(response.stream, message_event if messages else response_event,
                                                message_stream if messages else response_stream)
            else:
                _unary(request.method, path, response.status_code, response.read())
            return response

    return http.Client(transport=Checking(), **options)
