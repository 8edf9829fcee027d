"""The pieces the OpenAPI description is built from, shared by every API's part of it: nullable fields, the
error bodies and their statuses, JSON and server-sent-event responses, and an operation with its errors."""

from __future__ import annotations

from typing import Any, NamedTuple

JSON = "application/json"
U32_MAX = 2**32 - 1


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def integer(minimum: int, maximum: int = U32_MAX) -> dict[str, Any]:
    return nullable({"type": "integer", "minimum": minimum, "maximum": maximum})


BOOL = nullable({"type": "boolean"})
STRING = nullable({"type": "string"})
OBJECT = nullable({"type": "object"})
NULL = {"type": "null"}
TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": U32_MAX}}
FUNCTION_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_.\\-]{1,64}$"}


def error_body(code: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's error body, whose `code` is a string or a number (vLLM's: the HTTP status)."""
    return {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": ["string", "null"]}, "code": code},
        }},
    }


ERRORS = {
    "400": "Invalid request; `param` names the field",
    "401": "Missing or wrong API key",
    "404": "Unknown model, unknown worker instance named by the request, or unknown stored response",
    "405": "Method not allowed (the Allow header lists the allowed ones)",
    "408": "The request body did not arrive in time",
    "413": "Request body too large",
    "415": "The body is not JSON (Content-Type must be application/json)",
    "500": "Internal error",
    "503": "No worker available, or all workers busy",
}
GENERATE_ERRORS = ("400", "401", "404", "408", "413", "415", "500", "503")


def json_body(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def sse(chunk: dict[str, Any], error: str = "Error") -> dict[str, Any]:
    """One server-sent event: `data` is a JSON chunk, an error object (of the `error` schema), or the final
    `[DONE]`."""
    payload = {"anyOf": [chunk, {"$ref": f"#/components/schemas/{error}"}]}
    return {"type": "object", "required": ["data"], "properties": {"data": {
        "type": "string", "if": {"const": "[DONE]"},
        "else": {"contentMediaType": JSON, "contentSchema": payload}}}}


def named_sse(event: dict[str, Any]) -> dict[str, Any]:
    """One server-sent event with its type on the `event:` line and the same `type` in its JSON `data`."""
    return {"type": "object", "required": ["event", "data"], "properties": {
        "event": {"type": "string"}, "data": {"type": "string", "contentMediaType": JSON, "contentSchema": event}}}


def operation(summary: str, ok: dict[str, Any], errors: tuple[str, ...], *, request: str | None = None,
              stream: dict[str, Any] | None = None, parameters: list[dict[str, Any]] | None = None,
              error: str = "Error") -> dict[str, Any]:  # fmt: skip
    """`stream`: the schema of one streamed event, when the operation can answer with server-sent events;
    `error`: the schema of the route's error bodies."""
    responses = {"200": ok} | {code: json_body({"$ref": f"#/components/schemas/{error}"}, ERRORS[code])
                               for code in errors}
    if stream is not None:
        ok["content"]["text/event-stream"] = {"schema": stream}
    op: dict[str, Any] = {"summary": summary, "responses": responses}
    if request:
        op["requestBody"] = {"required": True, "content": {JSON: {"schema": {"$ref": f"#/components/schemas/{request}"}}}}
    if parameters:
        op["parameters"] = parameters
    return op


class ApiSchema(NamedTuple):
    """One API's part of the description: its paths, and the component schemas they refer to."""

    paths: dict[str, Any]
    schemas: dict[str, Any]
