"""The Messages API's part of the OpenAPI description: /v1/messages and its count_tokens route, with
Anthropic's error body."""

from __future__ import annotations

from typing import Any

from tandem.frontend.api.anthropic.protocol import RULES
from tandem.frontend.protocol.schema import (
    GENERATE_ERRORS,
    STRING,
    U32_MAX,
    ApiSchema,
    json_body,
    named_sse,
    nullable,
    operation,
)
from tandem.frontend.protocol.validation import schemas

_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}},
}
_A_TEXT = {"type": "object", "required": ["type", "text"],
           "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
# Image blocks are served to models that take images (others refuse them, 400); documents are refused, so the
# schema leaves them out.
_A_IMAGE = {"type": "object", "required": ["type", "source"], "properties": {"type": {"const": "image"}, "source": {
    "anyOf": [{"type": "object", "required": ["type", "media_type", "data"],
               "properties": {"type": {"const": "base64"}, "media_type": {"type": "string"}, "data": {"type": "string"}}},
              {"type": "object", "required": ["type", "url"],
               "properties": {"type": {"const": "url"}, "url": {"type": "string"}}}]}}}
_A_BLOCK = {"anyOf": [
    _A_TEXT,
    _A_IMAGE,
    {"type": "object", "required": ["type", "id", "name", "input"],
     "properties": {"type": {"const": "tool_use"}, "id": {"type": "string"}, "name": {"type": "string"},
                    "input": {"type": "object"}}},
    {"type": "object", "required": ["type", "tool_use_id"],
     "properties": {"type": {"const": "tool_result"}, "tool_use_id": {"type": "string"}, "is_error": {"type": "boolean"},
                    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _A_TEXT}]}}},
    {"type": "object", "required": ["type", "thinking"],
     "properties": {"type": {"const": "thinking"}, "thinking": {"type": "string"}}},
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "redacted_thinking"}}},
]}
_A_TOOL_CHOICE = {"anyOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["auto", "any"]},
                                                            "disable_parallel_tool_use": {"type": "boolean"}}},
    {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"const": "tool"}, "name": {"type": "string"}, "disable_parallel_tool_use": {"type": "boolean"}}},
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "none"}}},
]}
_A_THINKING = {"anyOf": [
    {"type": "object", "required": ["type", "budget_tokens"], "properties": {
        "type": {"const": "enabled"}, "budget_tokens": {"type": "integer", "minimum": 1024, "maximum": U32_MAX}}},
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["disabled", "adaptive"]}}},
]}


def _prompt(model: dict[str, Any]) -> dict[str, Any]:
    """The fields of a Messages request that make its prompt (all count_tokens reads)."""
    return {
        "model": model,
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"enum": ["user", "assistant", "system"]},
                           "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _A_BLOCK}]}}}},
        # A list of blocks that can only be text: the type may be left out.
        "system": nullable({"anyOf": [{"type": "string"}, {"type": "array", "items": _A_TEXT | {"required": ["text"]}}]}),
        # Client tools; Anthropic's versioned tools (a `type` other than custom: left out, with a warning header).
        "tools": nullable({"type": "array", "items": {"anyOf": [
            {"type": "object", "required": ["name", "input_schema"],
             "properties": {"name": {"type": "string", "minLength": 1}, "description": STRING,
                            "type": nullable({"const": "custom"}),
                            "input_schema": {"type": "object", "required": ["type"],
                                             "properties": {"type": {"const": "object"}}}}},
            {"type": "object", "required": ["type", "name"],
             "properties": {"type": {"type": "string", "not": {"const": "custom"}}, "name": {"type": "string"}}}]}}),
        "tool_choice": nullable(_A_TOOL_CHOICE),
        "thinking": nullable(_A_THINKING),
    }


def _request(model: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["model", "messages", "max_tokens"],
        "properties": {
            **_prompt(model),
            **schemas(RULES),
            "max_tokens": RULES[0].schema(nullable=False),  # required
            "stream": {"type": "boolean"},
            "stop_sequences": nullable({"type": "array", "maxItems": 16, "items": {"type": "string"}}),
            "metadata": nullable({"type": "object", "properties": {"user_id": STRING}}),
            "output_config": nullable({"type": "object", "properties": {
                "effort": nullable({"enum": ["low", "medium", "high", "xhigh", "max"]}),
                "format": nullable({"type": "object", "required": ["schema"], "properties": {
                    "type": {"const": "json_schema"}, "schema": {"type": "object"}}})}}),
        },
    }


_MESSAGE_OBJECT = {
    "type": "object",
    "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"],
    "properties": {"id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"},
                   "model": {"type": "string"},
                   "content": {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {
                       "type": {"enum": ["text", "thinking", "tool_use"]}}}},
                   "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal"]},
                   "stop_sequence": STRING,
                   "usage": {"type": "object", "required": ["input_tokens", "output_tokens"],
                             "properties": {"input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"}}}},
}
_MESSAGE_EVENT = {"type": "object", "required": ["type"], "properties": {"type": {"type": "string"}}}
_TOKEN_COUNT = {"type": "object", "required": ["input_tokens"], "properties": {"input_tokens": {"type": "integer"}}}


def openapi(model: dict[str, Any]) -> ApiSchema:
    """The Messages routes; `model`: the schema of a served model's name."""
    return ApiSchema({
        "/v1/messages": {"post": operation("Create a message (Anthropic Messages API)", json_body(_MESSAGE_OBJECT),
                                           GENERATE_ERRORS, request="MessagesRequest",
                                           stream=named_sse(_MESSAGE_EVENT), error="AnthropicError")},
        "/v1/messages/count_tokens": {"post": operation("Count a message's input tokens", json_body(_TOKEN_COUNT),
                                                        GENERATE_ERRORS, request="MessagesCountRequest",
                                                        error="AnthropicError")},
    }, {"AnthropicError": _ANTHROPIC_ERROR, "MessagesRequest": _request(model),
        "MessagesCountRequest": {"type": "object", "required": ["model", "messages"], "properties": _prompt(model)}})
