"""The frontend's OpenAPI description, served at /openapi.json.

It is the contract generated clients and fuzzers learn, so it states what the server checks: every
request a schema here calls invalid is refused with a 4xx, and every response matches its schema. Rules
that tie two fields together (stream_options needs stream, min_tokens <= max_tokens, the context length)
are the server's alone. The served model names are filled in per request.
"""

from __future__ import annotations

from typing import Any

_JSON = "application/json"
_U32_MAX = 2**32 - 1


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _int(minimum: int, maximum: int = _U32_MAX) -> dict[str, Any]:
    return _nullable({"type": "integer", "minimum": minimum, "maximum": maximum})


def _number(**bounds: float) -> dict[str, Any]:
    return _nullable({"type": "number", **bounds})


_BOOL = _nullable({"type": "boolean"})
_STRING = _nullable({"type": "string"})
_OBJECT = _nullable({"type": "object"})
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": _U32_MAX}}

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]}},
    }},
}
_ERRORS = {
    "400": "Invalid request; `param` names the field",
    "401": "Missing or wrong API key",
    "404": "Unknown model, or unknown worker instance named by the request",
    "405": "Method not allowed (the Allow header lists the allowed ones)",
    "408": "The request body did not arrive in time",
    "413": "Request body too large",
    "415": "The body is not JSON (Content-Type must be application/json)",
    "500": "Internal error",
    "503": "No worker available, or all workers busy",
}

_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {"prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
                   "total_tokens": {"type": "integer"}},
}


def _completion_object(obj: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {"id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
                       "model": {"type": "string"}, "choices": {"type": "array", "items": choice}, "usage": _USAGE},
    }


_FINISH = {"enum": ["stop", "length", "content_filter", "tool_calls", "cancelled", "error"]}
_CHAT_COMPLETION = _completion_object("chat.completion", {
    "type": "object",
    "required": ["index", "message", "finish_reason"],
    "properties": {"index": {"type": "integer"}, "finish_reason": _FINISH, "logprobs": _OBJECT,
                   "message": {"type": "object", "required": ["role", "content"],
                               "properties": {"role": {"const": "assistant"}, "content": _STRING}}},
})
_COMPLETION = _completion_object("text_completion", {
    "type": "object",
    "required": ["index", "text", "finish_reason"],
    "properties": {"index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": _FINISH,
                   "logprobs": _OBJECT},
})
_MODEL = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                   "owned_by": {"type": "string"}, "parent": {"type": "string"}},
}
_MODEL_LIST = {"type": "object", "required": ["object", "data"],
               "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _MODEL}}}
_HEALTH = {"type": "object", "required": ["status"],
           "properties": {"status": {"enum": ["healthy", "unhealthy"]}, "instances": {"type": "array"},
                          "endpoints": {"type": "array"}, "prefill_instances": {"type": "array"},
                          "frontend": {"type": "string", "description": "the instance id of the frontend process "
                                       "that answered (one of several with --num-processes)"}}}


_NULLABLE_FINISH = _nullable(_FINISH)


def _chunk(obj: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {"id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
                       "model": {"type": "string"}, "choices": {"type": "array", "items": choice},
                       "usage": _nullable(_USAGE)},
    }


_CHAT_CHUNK = _chunk("chat.completion.chunk", {
    "type": "object",
    "required": ["index", "delta", "finish_reason"],
    "properties": {"index": {"type": "integer"}, "finish_reason": _NULLABLE_FINISH, "logprobs": _OBJECT,
                   "delta": {"type": "object", "properties": {"role": {"const": "assistant"}, "content": _STRING}}},
})
_COMPLETION_CHUNK = _chunk("text_completion", {
    "type": "object",
    "required": ["index", "text", "finish_reason"],
    "properties": {"index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": _NULLABLE_FINISH,
                   "logprobs": _OBJECT},
})


def _sse(chunk: dict[str, Any]) -> dict[str, Any]:
    """One server-sent event: `data` is a JSON chunk, an error object, or the final `[DONE]`."""
    payload = {"anyOf": [chunk, {"$ref": "#/components/schemas/Error"}]}
    return {"type": "object", "required": ["data"], "properties": {"data": {
        "type": "string", "if": {"const": "[DONE]"},
        "else": {"contentMediaType": _JSON, "contentSchema": payload}}}}


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {_JSON: {"schema": schema}}}


def _op(summary: str, ok: dict[str, Any], errors: tuple[str, ...], *, request: str | None = None,
        stream: dict[str, Any] | None = None, parameters: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    """`stream`: the schema of one streamed chunk, when the operation can answer with server-sent events."""
    responses = {"200": ok} | {code: _json({"$ref": "#/components/schemas/Error"}, _ERRORS[code]) for code in errors}
    if stream is not None:
        ok["content"]["text/event-stream"] = {"schema": _sse(stream)}
    op: dict[str, Any] = {"summary": summary, "responses": responses}
    if request:
        op["requestBody"] = {"required": True, "content": {_JSON: {"schema": {"$ref": f"#/components/schemas/{request}"}}}}
    if parameters:
        op["parameters"] = parameters
    return op


_GENERATE_ERRORS = ("400", "401", "404", "408", "413", "415", "500", "503")


def _sampling(model: dict[str, Any]) -> dict[str, Any]:
    """Fields both generation routes take, with the bounds the server checks."""
    return {
        "model": model,
        "stream": _BOOL,
        "stream_options": _nullable({"type": "object", "properties": {"include_usage": _BOOL}}),
        "max_tokens": _int(1, 2**63 - 1),
        "temperature": _number(minimum=0, maximum=2),
        "top_p": _number(exclusiveMinimum=0, maximum=1),
        "top_k": _nullable({"anyOf": [{"const": -1}, {"type": "integer", "minimum": 1, "maximum": _U32_MAX}]}),
        "min_p": _number(minimum=0, maximum=1),
        "presence_penalty": _number(minimum=-2, maximum=2),
        "frequency_penalty": _number(minimum=-2, maximum=2),
        "repetition_penalty": _number(exclusiveMinimum=0),
        "seed": _int(-(2**63), 2**64 - 1),
        "stop": _nullable({"anyOf": [{"type": "string"},
                                     {"type": "array", "maxItems": 16, "items": {"type": "string"}}]}),
        "stop_token_ids": _nullable({"type": "array", "items": _TOKEN_IDS["items"]}),
        "ignore_eos": _BOOL,
        "min_tokens": _int(0),
        "include_stop_str_in_output": _BOOL,
        "skip_special_tokens": _BOOL,
        "n": _nullable({"const": 1}),
        "user": _STRING,
        "response_format": _nullable({
            "type": "object", "required": ["type"],
            "properties": {"type": {"enum": ["text", "json_object", "json_schema"]},
                           "json_schema": _nullable({"type": "object", "properties": {
                               "name": _STRING, "schema": _OBJECT, "strict": _BOOL}})},
        }),
        "guided_json": _nullable({"type": ["object", "string"]}),
        "guided_regex": _STRING,
        "guided_choice": _nullable({"type": "array", "minItems": 1, "items": {"type": "string"}}),
        "guided_grammar": _STRING,
        "structured_outputs": _nullable({"type": "object", "properties": {
            "json": _nullable({"type": ["object", "string"]}), "regex": _STRING,
            "choice": _nullable({"type": "array", "minItems": 1, "items": {"type": "string"}}),
            "grammar": _STRING}}),
        "nvext": _nullable({"type": "object", "properties": {
            "backend_instance_id": _int(0, 2**64 - 1), "prefill_worker_id": _int(0, 2**64 - 1),
            "decode_worker_id": _int(0, 2**64 - 1), "annotations": {"type": "array", "items": {"type": "string"}},
            "use_raw_prompt": _BOOL, "greed_sampling": _BOOL, "cache_salt": _STRING,
            "max_thinking_tokens": _int(0)}}),
    }


_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}
_FUNCTION_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_.\\-]{1,64}$"}
_TOOL = {"type": "object", "required": ["type", "function"],
         "properties": {"type": {"const": "function"},
                        "function": {"type": "object", "required": ["name"],
                                     "properties": {"name": _FUNCTION_NAME, "description": _STRING,
                                                    "parameters": _nullable({"type": "object"}),
                                                    "strict": _BOOL}}}}  # fmt: skip
_NAMED_CHOICE = {"type": "object", "required": ["type", "function"],
                 "properties": {"type": {"const": "function"},
                                "function": {"type": "object", "required": ["name"],
                                             "properties": {"name": {"type": "string"}}}}}  # fmt: skip
_MESSAGE_FIELDS = {"name": _STRING, "tool_call_id": _STRING,
                   "tool_calls": _nullable({"type": "array", "items": {"type": "object"}})}
# Every message has content, except an assistant message that carries tool calls instead.
_MESSAGE = {"anyOf": [
    {"type": "object", "required": ["role", "content"],
     "properties": {"role": {"enum": ["system", "developer", "user", "tool"]}, "content": _CONTENT,
                    **_MESSAGE_FIELDS}},
    {"type": "object", "required": ["role"],
     "properties": {"role": {"const": "assistant"}, "content": _nullable(_CONTENT), **_MESSAGE_FIELDS},
     "anyOf": [{"required": ["content"], "properties": {"content": _CONTENT}},
               {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}}]},
]}


def _requires(field: str, other: str, value: Any) -> dict[str, Any]:
    """`field`, when given (not null), needs `other` set to `value`."""
    return {"if": {"required": [field], "properties": {field: {"not": {"type": "null"}}}},
            "then": {"required": [other], "properties": {other: {"const": value}}}}


# stream_options only with stream; json_schema only with its schema.
_CROSS_FIELD = [_requires("stream_options", "stream", True),
                {"if": {"required": ["response_format"], "properties": {"response_format": {
                    "type": "object", "properties": {"type": {"const": "json_schema"}}}}},
                 "then": {"properties": {"response_format": {"required": ["json_schema"], "properties": {
                     "json_schema": {"type": "object", "required": ["schema"]}}}}}}]


def openapi_spec(models: list[str]) -> dict[str, Any]:
    """The OpenAPI document; `models` are the names served now (any name when there are none)."""
    model: dict[str, Any] = {"type": "string", "minLength": 1}
    if models:
        model["enum"] = sorted(models)
    model_param = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "tandem OpenAI-compatible API", "version": "1"},
        "paths": {
            "/v1/chat/completions": {"post": _op("Chat completion", _json(_CHAT_COMPLETION), _GENERATE_ERRORS,
                                                 request="ChatCompletionRequest", stream=_CHAT_CHUNK)},
            "/v1/completions": {"post": _op("Text completion", _json(_COMPLETION), _GENERATE_ERRORS,
                                            request="CompletionRequest", stream=_COMPLETION_CHUNK)},
            "/v1/models": {"get": _op("Models being served", _json(_MODEL_LIST), ("401",))},
            "/v1/models/{model}": {"get": _op("One model", _json(_MODEL), ("401", "404"), parameters=[model_param])},
            "/health": {"get": {"summary": "Health: 200 when at least one worker serves a model, else 503",
                                "responses": {"200": _json(_HEALTH), "503": _json(_HEALTH, "No worker")}}},
            "/live": {"get": {"summary": "Liveness", "responses": {"200": _json({"type": "object"})}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
                "200": {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        },
        "components": {
            "schemas": {
                "Error": _ERROR,
                "ChatCompletionRequest": {
                    "type": "object",
                    "required": ["model", "messages"],
                    "allOf": [*_CROSS_FIELD, _requires("top_logprobs", "logprobs", True)],
                    "properties": {
                        **_sampling(model),
                        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
                        "max_completion_tokens": _int(1, 2**63 - 1),
                        "logprobs": _BOOL,
                        "top_logprobs": _int(0, 20),
                        "tools": _nullable({"type": "array", "items": _TOOL}),
                        "tool_choice": _nullable({"anyOf": [{"enum": ["none", "auto", "required"]}, _NAMED_CHOICE]}),
                        "parallel_tool_calls": _BOOL,
                        "reasoning_effort": _nullable({"enum": ["minimal", "low", "medium", "high"]}),
                        "chat_template_kwargs": _OBJECT,
                    },
                },
                "CompletionRequest": {
                    "type": "object",
                    "required": ["model", "prompt"],
                    "allOf": _CROSS_FIELD,
                    "properties": {
                        **_sampling(model),
                        "prompt": {"anyOf": [
                            {"type": "string", "minLength": 1},
                            _TOKEN_IDS,
                            {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string", "minLength": 1}},
                            {"type": "array", "minItems": 1, "maxItems": 1, "items": _TOKEN_IDS},
                        ]},
                        "logprobs": _int(0, 20),
                        "echo": _nullable({"const": False}),
                        "suffix": _nullable({"type": "string", "maxLength": 0}),
                    },
                },
            }
        },
    }
