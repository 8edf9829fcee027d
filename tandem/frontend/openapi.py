"""The frontend's OpenAPI description, served at /openapi.json."""

from __future__ import annotations

from typing import Any

_JSON = "application/json"


def _op(summary: str, request: str | None = None, stream: bool = False) -> dict[str, Any]:
    responses: dict[str, Any] = {
        "200": {"description": "OK", "content": {_JSON: {"schema": {"type": "object"}}}},
        "400": {"description": "Invalid request (the error names the parameter)"},
        "401": {"description": "Missing or wrong API key"},
        "404": {"description": "Unknown model"},
        "413": {"description": "Request body too large"},
        "503": {"description": "No worker available, or all workers busy"},
    }
    if stream:
        responses["200"]["content"]["text/event-stream"] = {"schema": {"type": "string"}}
    op: dict[str, Any] = {"summary": summary, "responses": responses}
    if request:
        op["requestBody"] = {"required": True, "content": {_JSON: {"schema": {"$ref": f"#/components/schemas/{request}"}}}}
    return op


_SAMPLING = {
    "model": {"type": "string"},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer"},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0},
    "seed": {"type": "integer"},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "ignore_eos": {"type": "boolean"},
    "min_tokens": {"type": "integer", "minimum": 0},
    "n": {"type": "integer", "enum": [1]},
    "user": {"type": "string"},
    "response_format": {"type": "object"},
    "nvext": {"type": "object"},
}

OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "tandem OpenAI-compatible API", "version": "1"},
    "paths": {
        "/v1/chat/completions": {"post": _op("Chat completion", "ChatCompletionRequest", stream=True)},
        "/v1/completions": {"post": _op("Text completion", "CompletionRequest", stream=True)},
        "/v1/models": {"get": _op("Models being served")},
        "/health": {"get": _op("Health: 200 when at least one worker serves a model, else 503")},
        "/live": {"get": _op("Liveness")},
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "OK"}}}},
    },
    "components": {
        "schemas": {
            "ChatCompletionRequest": {
                "type": "object",
                "required": ["model", "messages"],
                "properties": {
                    **_SAMPLING,
                    "messages": {"type": "array", "minItems": 1, "items": {"type": "object"}},
                    "max_completion_tokens": {"type": "integer", "minimum": 1},
                    "logprobs": {"type": "boolean"},
                    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
                    "tools": {"type": "array", "items": {"type": "object"}},
                    "chat_template_kwargs": {"type": "object"},
                },
            },
            "CompletionRequest": {
                "type": "object",
                "required": ["model", "prompt"],
                "properties": {
                    **_SAMPLING,
                    "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]},
                    "logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
                },
            },
        }
    },
}
