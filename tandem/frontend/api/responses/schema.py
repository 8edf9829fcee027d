"""The Responses API's part of the OpenAPI description: /v1/responses, its input_tokens route and the stored
responses."""

from __future__ import annotations

from typing import Any

from tandem.frontend.api.responses.protocol import RULES
from tandem.frontend.protocol.schema import (
    BOOL,
    FUNCTION_NAME,
    GENERATE_ERRORS,
    NULL,
    OBJECT,
    STRING,
    ApiSchema,
    json_body,
    named_sse,
    nullable,
    operation,
)
from tandem.frontend.protocol.validation import schemas

_RESPONSES_FUNCTION = {"type": "object", "required": ["type", "name"],
                       "properties": {"type": {"const": "function"}, "name": FUNCTION_NAME, "description": STRING,
                                      "parameters": OBJECT, "strict": BOOL}}  # fmt: skip

_PART = {"anyOf": [
    {"type": "object", "required": ["type", "text"],
     "properties": {"type": {"enum": ["input_text", "output_text", "text", "reasoning_text", "summary_text"]},
                    "text": {"type": "string"}}},
    {"type": "object", "required": ["type", "refusal"],
     "properties": {"type": {"const": "refusal"}, "refusal": {"type": "string"}}},
]}
_ITEM_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _PART}]}
_INPUT_IMAGE = {"type": "object", "required": ["type", "image_url"],
                "properties": {"type": {"const": "input_image"}, "image_url": {"type": "string", "minLength": 1},
                               "detail": {"enum": ["auto", "low", "high"]}}}
_INPUT_ITEM = {"anyOf": [
    {"type": "object", "required": ["role", "content"],  # a message; `type` may be left out
     "properties": {"type": {"const": "message"}, "role": {"enum": ["user", "system", "developer"]},
                    "content": {"anyOf": [{"type": "string"},
                                          {"type": "array", "items": {"anyOf": [_PART, _INPUT_IMAGE]}}]}}},
    {"type": "object", "required": ["role", "content"],
     "properties": {"type": {"const": "message"}, "role": {"const": "assistant"}, "content": _ITEM_CONTENT}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"],
     "properties": {"type": {"const": "function_call"}, "call_id": {"type": "string"}, "name": {"type": "string"},
                    "arguments": {"type": "string"}}},
    {"type": "object", "required": ["type", "call_id", "output"],
     "properties": {"type": {"const": "function_call_output"}, "call_id": {"type": "string"},
                    "output": _ITEM_CONTENT}},
    {"type": "object", "required": ["type"],
     "properties": {"type": {"const": "reasoning"}, "summary": {"type": "array", "items": _PART},
                    "content": nullable({"type": "array", "items": _PART})}},
]}
_TEXT_FORMAT = {"type": "object", "required": ["type"],
                "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}, "name": STRING,
                               "schema": OBJECT, "strict": BOOL, "description": STRING},
                "if": {"properties": {"type": {"const": "json_schema"}}},
                "then": {"required": ["name", "schema"],
                         "properties": {"name": {"type": "string", "minLength": 1}, "schema": {"type": "object"}}}}


def _request(model: dict[str, Any]) -> dict[str, Any]:
    """What /v1/responses (and its input_tokens route) checks; the settings tandem does not serve
    (background, conversation, prompt, max_tool_calls, top_logprobs) may only be left out."""
    return {
        "type": "object",
        "required": ["model", "input"],
        "properties": {
            "model": model,
            "input": {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1,
                                                                      "items": _INPUT_ITEM}]},
            "instructions": STRING,
            **schemas(RULES),
            # Function tools; a namespace tool's functions; hosted tools (left out, with a warning header).
            "tools": nullable({"type": "array", "items": {"anyOf": [
                _RESPONSES_FUNCTION,
                {"type": "object", "required": ["type", "name", "tools"],
                 "properties": {"type": {"const": "namespace"}, "name": {"type": "string"}, "description": STRING,
                                "tools": {"type": "array", "items": {"type": "object", "required": ["type"]}}}},
                {"type": "object", "required": ["type"],
                 "properties": {"type": {"type": "string", "not": {"enum": ["function", "namespace"]}}}}]}}),
            "tool_choice": nullable({"anyOf": [{"enum": ["none", "auto", "required"]}, {
                "type": "object", "required": ["type", "name"],
                "properties": {"type": {"const": "function"}, "name": {"type": "string"}}}]}),
            "parallel_tool_calls": BOOL,
            "reasoning": nullable({"type": "object", "properties": {
                "effort": nullable({"enum": ["none", "minimal", "low", "medium", "high", "xhigh"]}),
                "summary": STRING, "generate_summary": STRING}}),
            "text": nullable({"type": "object", "properties": {"format": nullable(_TEXT_FORMAT),
                                                                "verbosity": STRING}}),
            "stream": BOOL,
            "store": BOOL,
            "previous_response_id": STRING,
            "metadata": nullable({"type": "object", "additionalProperties": {"type": "string"}}),
            "user": STRING,
            "truncation": nullable({"const": "disabled"}),
            "include": nullable({"type": "array", "items": {"const": "reasoning.encrypted_content"}}),
            "background": nullable({"const": False}),
            "conversation": NULL, "prompt": NULL, "max_tool_calls": NULL, "top_logprobs": NULL,
        },
    }


_OUTPUT_ITEM = {"type": "object", "required": ["id", "type", "status"],
                "properties": {"id": {"type": "string"}, "status": {"enum": ["in_progress", "completed", "incomplete"]},
                               "type": {"enum": ["message", "reasoning", "function_call"]}}}
_RESPONSE = {
    "type": "object",
    "required": ["id", "object", "created_at", "status", "model", "output"],
    "properties": {"id": {"type": "string"}, "object": {"const": "response"}, "created_at": {"type": "integer"},
                   "status": {"enum": ["completed", "incomplete", "failed", "in_progress"]},
                   "model": {"type": "string"}, "output": {"type": "array", "items": _OUTPUT_ITEM},
                   "usage": nullable({"type": "object", "required": ["input_tokens", "output_tokens", "total_tokens"],
                                       "properties": {"input_tokens": {"type": "integer"},
                                                      "output_tokens": {"type": "integer"},
                                                      "total_tokens": {"type": "integer"}}})},
}
_RESPONSE_EVENT = {"type": "object", "required": ["type", "sequence_number"],
                   "properties": {"type": {"type": "string"}, "sequence_number": {"type": "integer"}}}
_INPUT_TOKENS = {"type": "object", "required": ["object", "input_tokens"],
                 "properties": {"object": {"const": "response.input_tokens"}, "input_tokens": {"type": "integer"}}}
_DELETED = {"type": "object", "required": ["id", "object", "deleted"],
            "properties": {"id": {"type": "string"}, "object": {"const": "response.deleted"}, "deleted": {"const": True}}}


def openapi(model: dict[str, Any]) -> ApiSchema:
    """The Responses routes; `model`: the schema of a served model's name."""
    response_id = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    return ApiSchema({
        "/v1/responses": {"post": operation("Create a response (OpenAI Responses API)", json_body(_RESPONSE),
                                            GENERATE_ERRORS, request="ResponseRequest",
                                            stream=named_sse(_RESPONSE_EVENT))},
        "/v1/responses/input_tokens": {"post": operation("Count a response's input tokens", json_body(_INPUT_TOKENS),
                                                         GENERATE_ERRORS, request="ResponseRequest")},
        "/v1/responses/{response_id}": {
            "get": operation("A stored response", json_body(_RESPONSE), ("401", "404"), parameters=[response_id]),
            "delete": operation("Delete a stored response", json_body(_DELETED), ("401", "404"),
                                parameters=[response_id]),
        },
    }, {"ResponseRequest": _request(model)})
