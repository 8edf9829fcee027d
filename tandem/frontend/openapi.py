"""The frontend's OpenAPI description, served at /openapi.json.

It is the contract generated clients and fuzzers learn, so it states what the server checks (each API's
numeric bounds come from the rule tables its range checks read, `protocol.validation.Rule`): every
request a schema here calls invalid is refused with a 4xx, and every response matches its schema. Rules
that tie two fields together (stream_options needs stream, min_tokens <= max_tokens, the context length)
are the server's alone. The served model names are filled in per request.
"""

from __future__ import annotations

from typing import Any

from tandem.frontend.api.anthropic import protocol as anthropic
from tandem.frontend.api.openai.protocol import CHAT_RULES, COMPLETION_RULES
from tandem.frontend.api.responses import protocol as responses
from tandem.frontend.protocol.validation import schemas
from tandem.frontend.requests import LOGPROBS_RULE, SAMPLING_RULES

_JSON = "application/json"
_U32_MAX = 2**32 - 1


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _int(minimum: int, maximum: int = _U32_MAX) -> dict[str, Any]:
    return _nullable({"type": "integer", "minimum": minimum, "maximum": maximum})


_BOOL = _nullable({"type": "boolean"})
_STRING = _nullable({"type": "string"})
_OBJECT = _nullable({"type": "object"})
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": _U32_MAX}}

def _error(code: dict[str, Any]) -> dict[str, Any]:
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


_ERROR = _error({"type": ["string", "integer", "null"]})
_ERRORS = {
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


def _sse(chunk: dict[str, Any], error: str = "Error") -> dict[str, Any]:
    """One server-sent event: `data` is a JSON chunk, an error object (of the `error` schema), or the final
    `[DONE]`."""
    payload = {"anyOf": [chunk, {"$ref": f"#/components/schemas/{error}"}]}
    return {"type": "object", "required": ["data"], "properties": {"data": {
        "type": "string", "if": {"const": "[DONE]"},
        "else": {"contentMediaType": _JSON, "contentSchema": payload}}}}


def _named_sse(event: dict[str, Any]) -> dict[str, Any]:
    """One server-sent event with its type on the `event:` line and the same `type` in its JSON `data`."""
    return {"type": "object", "required": ["event", "data"], "properties": {
        "event": {"type": "string"}, "data": {"type": "string", "contentMediaType": _JSON, "contentSchema": event}}}


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {_JSON: {"schema": schema}}}


def _op(summary: str, ok: dict[str, Any], errors: tuple[str, ...], *, request: str | None = None,
        stream: dict[str, Any] | None = None, parameters: list[dict[str, Any]] | None = None,
        error: str = "Error") -> dict[str, Any]:  # fmt: skip
    """`stream`: the schema of one streamed event, when the operation can answer with server-sent events;
    `error`: the schema of the route's error bodies."""
    responses = {"200": ok} | {code: _json({"$ref": f"#/components/schemas/{error}"}, _ERRORS[code]) for code in errors}
    if stream is not None:
        ok["content"]["text/event-stream"] = {"schema": stream}
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
        **schemas(SAMPLING_RULES),
        "stop": _nullable({"anyOf": [{"type": "string"},
                                     {"type": "array", "maxItems": 16, "items": {"type": "string"}}]}),
        "stop_token_ids": _nullable({"type": "array", "items": _TOKEN_IDS["items"]}),
        "ignore_eos": _BOOL,
        "include_stop_str_in_output": _BOOL,
        "skip_special_tokens": _BOOL,
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
            "decode_worker_id": _int(0, 2**64 - 1), "annotations": {"type": "array", "items": {"enum": ["formatted_prompt", "token_ids"]}},
            "use_raw_prompt": _BOOL, "greed_sampling": _BOOL, "cache_salt": _STRING,
            "max_thinking_tokens": _int(0)}}),
    }


_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}
_FUNCTION_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_.\\-]{1,64}$"}
_RESPONSES_FUNCTION = {"type": "object", "required": ["type", "name"],
                       "properties": {"type": {"const": "function"}, "name": _FUNCTION_NAME, "description": _STRING,
                                      "parameters": _OBJECT, "strict": _BOOL}}  # fmt: skip
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
_IMAGE_PART = {"type": "object", "required": ["type", "image_url"],
               "properties": {"type": {"const": "image_url"},
                              "image_url": {"type": "object", "required": ["url"],
                                            "properties": {"url": {"type": "string", "minLength": 1},
                                                           "detail": {"enum": ["auto", "low", "high"]}}}}}
_CHAT_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": [_TEXT_PART, _IMAGE_PART]}}]}


def _message(content: dict[str, Any]) -> dict[str, Any]:
    """Every message has content, except an assistant message that carries tool calls instead."""
    return {"anyOf": [
        {"type": "object", "required": ["role", "content"],
         "properties": {"role": {"enum": ["system", "developer", "user", "tool"]}, "content": content,
                        **_MESSAGE_FIELDS}},
        {"type": "object", "required": ["role"],
         "properties": {"role": {"const": "assistant"}, "content": _nullable(content), **_MESSAGE_FIELDS},
         "anyOf": [{"required": ["content"], "properties": {"content": content}},
                   {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}}]},
    ]}


_MESSAGE = _message(_CONTENT)  # text only: the token-counting routes
_CHAT_MESSAGE = _message(_CHAT_CONTENT)  # chat takes images too (a model that does not refuses them, 400)


# -- the Responses API ------------------------------------------------------------------------------
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
                    "content": _nullable({"type": "array", "items": _PART})}},
]}
_TEXT_FORMAT = {"type": "object", "required": ["type"],
                "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}, "name": _STRING,
                               "schema": _OBJECT, "strict": _BOOL, "description": _STRING},
                "if": {"properties": {"type": {"const": "json_schema"}}},
                "then": {"required": ["name", "schema"],
                         "properties": {"name": {"type": "string", "minLength": 1}, "schema": {"type": "object"}}}}
_NULL = {"type": "null"}


def _responses_request(model: dict[str, Any]) -> dict[str, Any]:
    """What /v1/responses (and its input_tokens route) checks; the settings tandem does not serve
    (background, conversation, prompt, max_tool_calls, top_logprobs) may only be left out."""
    return {
        "type": "object",
        "required": ["model", "input"],
        "properties": {
            "model": model,
            "input": {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1,
                                                                      "items": _INPUT_ITEM}]},
            "instructions": _STRING,
            **schemas(responses.RULES),
            # Function tools; a namespace tool's functions; hosted tools (left out, with a warning header).
            "tools": _nullable({"type": "array", "items": {"anyOf": [
                _RESPONSES_FUNCTION,
                {"type": "object", "required": ["type", "name", "tools"],
                 "properties": {"type": {"const": "namespace"}, "name": {"type": "string"}, "description": _STRING,
                                "tools": {"type": "array", "items": {"type": "object", "required": ["type"]}}}},
                {"type": "object", "required": ["type"],
                 "properties": {"type": {"type": "string", "not": {"enum": ["function", "namespace"]}}}}]}}),
            "tool_choice": _nullable({"anyOf": [{"enum": ["none", "auto", "required"]}, {
                "type": "object", "required": ["type", "name"],
                "properties": {"type": {"const": "function"}, "name": {"type": "string"}}}]}),
            "parallel_tool_calls": _BOOL,
            "reasoning": _nullable({"type": "object", "properties": {
                "effort": _nullable({"enum": ["none", "minimal", "low", "medium", "high", "xhigh"]}),
                "summary": _STRING, "generate_summary": _STRING}}),
            "text": _nullable({"type": "object", "properties": {"format": _nullable(_TEXT_FORMAT),
                                                                "verbosity": _STRING}}),
            "stream": _BOOL,
            "store": _BOOL,
            "previous_response_id": _STRING,
            "metadata": _nullable({"type": "object", "additionalProperties": {"type": "string"}}),
            "user": _STRING,
            "truncation": _nullable({"const": "disabled"}),
            "include": _nullable({"type": "array", "items": {"const": "reasoning.encrypted_content"}}),
            "background": _nullable({"const": False}),
            "conversation": _NULL, "prompt": _NULL, "max_tool_calls": _NULL, "top_logprobs": _NULL,
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
                   "usage": _nullable({"type": "object", "required": ["input_tokens", "output_tokens", "total_tokens"],
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


# -- Anthropic's Messages API ------------------------------------------------------------------------
_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}},
}
_A_TEXT = {"type": "object", "required": ["type", "text"],
           "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
# Image and document blocks are refused (no multimodal serving yet), so the schema leaves them out.
_A_BLOCK = {"anyOf": [
    _A_TEXT,
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
        "type": {"const": "enabled"}, "budget_tokens": {"type": "integer", "minimum": 1024, "maximum": _U32_MAX}}},
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["disabled", "adaptive"]}}},
]}


def _messages_prompt(model: dict[str, Any]) -> dict[str, Any]:
    """The fields of a Messages request that make its prompt (all count_tokens reads)."""
    return {
        "model": model,
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"enum": ["user", "assistant", "system"]},
                           "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _A_BLOCK}]}}}},
        # A list of blocks that can only be text: the type may be left out.
        "system": _nullable({"anyOf": [{"type": "string"}, {"type": "array", "items": _A_TEXT | {"required": ["text"]}}]}),
        # Client tools; Anthropic's versioned tools (a `type` other than custom: left out, with a warning header).
        "tools": _nullable({"type": "array", "items": {"anyOf": [
            {"type": "object", "required": ["name", "input_schema"],
             "properties": {"name": {"type": "string", "minLength": 1}, "description": _STRING,
                            "type": _nullable({"const": "custom"}),
                            "input_schema": {"type": "object", "required": ["type"],
                                             "properties": {"type": {"const": "object"}}}}},
            {"type": "object", "required": ["type", "name"],
             "properties": {"type": {"type": "string", "not": {"const": "custom"}}, "name": {"type": "string"}}}]}}),
        "tool_choice": _nullable(_A_TOOL_CHOICE),
        "thinking": _nullable(_A_THINKING),
    }


def _messages_request(model: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["model", "messages", "max_tokens"],
        "properties": {
            **_messages_prompt(model),
            **schemas(anthropic.RULES),
            "max_tokens": anthropic.RULES[0].schema(nullable=False),  # required
            "stream": {"type": "boolean"},
            "stop_sequences": _nullable({"type": "array", "maxItems": 16, "items": {"type": "string"}}),
            "metadata": _nullable({"type": "object", "properties": {"user_id": _STRING}}),
            "output_config": _nullable({"type": "object", "properties": {
                "effort": _nullable({"enum": ["low", "medium", "high", "xhigh", "max"]}),
                "format": _nullable({"type": "object", "required": ["schema"], "properties": {
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
                   "stop_sequence": _STRING,
                   "usage": {"type": "object", "required": ["input_tokens", "output_tokens"],
                             "properties": {"input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"}}}},
}
_MESSAGE_EVENT = {"type": "object", "required": ["type"], "properties": {"type": {"type": "string"}}}
_TOKEN_COUNT = {"type": "object", "required": ["input_tokens"], "properties": {"input_tokens": {"type": "integer"}}}


# -- vLLM's tokenizer routes -------------------------------------------------------------------------
def _tokenize_request(model: dict[str, Any]) -> dict[str, Any]:
    """A prompt or chat messages (exactly one of them)."""
    return {
        "type": "object",
        "oneOf": [{"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                  {"required": ["messages"], "properties": {"messages": {"type": "array"}}}],
        "properties": {
            "model": _nullable(model),
            "prompt": _STRING,
            "messages": _nullable({"type": "array", "minItems": 1, "items": _MESSAGE}),
            "add_special_tokens": _BOOL,
            "add_generation_prompt": {"type": "boolean"},
            "continue_final_message": {"const": False},
            "return_token_strs": _BOOL,
            "chat_template": _NULL,
            "chat_template_kwargs": _OBJECT,
            "tools": _nullable({"type": "array", "items": _TOOL}),
        },
    }


def _detokenize_request(model: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["tokens"],
            "properties": {"model": _nullable(model), "tokens": {"type": "array", "items": {
                "type": "integer", "minimum": 0, "maximum": 2**64 - 1}}}}


_TOKENIZED = {"type": "object", "required": ["count", "max_model_len", "tokens", "token_strs"],
              "properties": {"count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                             "tokens": {"type": "array", "items": {"type": "integer"}},
                             "token_strs": _nullable({"type": "array", "items": {"type": "string"}})}}
_DETOKENIZED = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}


# -- embeddings ------------------------------------------------------------------------------------
def _embeddings_request(model: dict[str, Any]) -> dict[str, Any]:
    """A text, texts, token ids or lists of them; vectors as floats or base64 of float32."""
    text = {"type": "string", "minLength": 1}
    return {
        "type": "object",
        "required": ["model", "input"],
        "properties": {
            "model": model,
            "input": {"anyOf": [text, {"type": "array", "minItems": 1, "maxItems": 2048, "items": text}, _TOKEN_IDS,
                                {"type": "array", "minItems": 1, "maxItems": 2048, "items": _TOKEN_IDS}]},
            "encoding_format": {"enum": ["float", "base64"]},
            "dimensions": _nullable(_int(1)),
            "user": _nullable({"type": "string"}),
            "add_special_tokens": {"type": "boolean"},
            "embed_dtype": {"const": "float32"},
            "endianness": {"enum": ["native", "little", "big"]},
        },
    }


_EMBEDDINGS = {"type": "object", "required": ["object", "data", "model", "usage"], "properties": {
    "object": {"const": "list"}, "model": {"type": "string"},
    "data": {"type": "array", "items": {"type": "object", "required": ["index", "object", "embedding"], "properties": {
        "index": {"type": "integer"}, "object": {"const": "embedding"},
        "embedding": {"anyOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]}}}},
    "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"],
              "properties": {"prompt_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}}}}}


# -- vLLM's token-in/token-out route -----------------------------------------------------------------
_VLLM_ERROR = _error({"type": "integer"})
# Fields of vLLM's request that tandem does not honour: they may only be left out (or null).
_GENERATE_UNSERVED = ("features", "content_parts", "kv_transfer_params", "ec_transfer_params", "reasoning_ended",
                      "reasoning_parser_kwargs")
_SHARED_SAMPLING = ("n", "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                    "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens",
                    "include_stop_str_in_output", "skip_special_tokens")


def _generate_request(model: dict[str, Any]) -> dict[str, Any]:
    """vLLM's GenerateRequest as tandem serves it: `sampling_params` takes only the fields listed (any other
    key is refused); stop strings and `output_mode` text need `detokenize` (the server's rule)."""
    shared = _sampling(model)
    sampling = {name: shared[name] for name in _SHARED_SAMPLING} | {
        "top_k": _int(-1),  # vLLM's 0 disables it too
        **schemas((LOGPROBS_RULE,)),
        "detokenize": {"type": "boolean"},
        "structured_outputs": _nullable({"type": "object", "additionalProperties": False, "properties": {
            "json": _nullable({"type": ["object", "string"]}), "regex": _STRING,
            "choice": _nullable({"type": "array", "minItems": 1, "items": {"type": "string"}}),
            "grammar": _STRING}}),
    }
    return {
        "type": "object",
        "required": ["token_ids", "sampling_params"],
        "properties": {
            "request_id": _STRING,
            "model": _nullable(model),
            "token_ids": _TOKEN_IDS,
            "sampling_params": {"type": "object", "additionalProperties": False, "properties": sampling},
            "stream": _BOOL,
            "stream_options": _nullable({"type": "object", "properties": {"include_usage": _BOOL,
                                                                          "continuous_usage_stats": _BOOL}}),
            "cache_salt": _nullable({"type": "string", "minLength": 1, "maxLength": 128,
                                     "description": "without '@', '/', '\\' or NUL (vLLM's rule)"}),
            "priority": {"const": 0},
            "output_mode": {"enum": ["tokens", "text"]},
            "return_token_ids": _BOOL,
            **{name: _NULL for name in _GENERATE_UNSERVED},
        },
    }


_GENERATE_FINISH = {"enum": ["stop", "length", "abort", "content_filter"]}


def _generate_choice(finish: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["index", "finish_reason", "stop_reason", "token_ids", "logprobs"],
            "properties": {"index": {"type": "integer"}, "finish_reason": finish,
                           "stop_reason": {"type": ["string", "integer", "null"]},
                           "token_ids": {"type": "array", "items": {"type": "integer"}},
                           "text": {"type": "string"}, "logprobs": _OBJECT}}


_PROMPT_IDS = {"type": "array", "items": {"type": "integer"}}
_GENERATED = {
    "type": "object",
    "required": ["request_id", "model", "created", "output_mode", "choices", "usage"],
    "properties": {"request_id": {"type": "string"}, "model": {"type": "string"}, "created": {"type": "integer"},
                   "output_mode": {"enum": ["tokens", "text"]},
                   "choices": {"type": "array", "items": _generate_choice(_GENERATE_FINISH)}, "usage": _USAGE,
                   "prompt_token_ids": _PROMPT_IDS},
}
_GENERATE_CHUNK = {
    "type": "object",
    "required": ["request_id", "output_mode", "choices"],
    "properties": {"request_id": {"type": "string"}, "output_mode": {"enum": ["tokens", "text"]},
                   "choices": {"type": "array", "items": _generate_choice(_nullable(_GENERATE_FINISH))},
                   "usage": _nullable(_USAGE), "prompt_token_ids": _PROMPT_IDS},
}


def _requires(field: str, other: str, value: Any) -> dict[str, Any]:
    """`field`, when given (not null), needs `other` set to `value`."""
    return {"if": {"required": [field], "properties": {field: {"not": {"type": "null"}}}},
            "then": {"required": [other], "properties": {other: {"const": value}}}}


# stream_options and nvext.annotations (SSE events) only with stream; json_schema only with its schema.
_CROSS_FIELD = [_requires("stream_options", "stream", True),
                {"if": {"required": ["nvext"], "properties": {"nvext": {
                    "type": "object", "required": ["annotations"], "properties": {"annotations": {"minItems": 1}}}}},
                 "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}},
                {"if": {"required": ["response_format"], "properties": {"response_format": {
                    "type": "object", "properties": {"type": {"const": "json_schema"}}}}},
                 "then": {"properties": {"response_format": {"required": ["json_schema"], "properties": {
                     "json_schema": {"type": "object", "required": ["schema"]}}}}}}]


def openapi_spec(models: list[str], *, anthropic: bool = True) -> dict[str, Any]:
    """The OpenAPI document; `models` are the names served now (any name when there are none);
    `anthropic`: the Messages routes are served."""
    model: dict[str, Any] = {"type": "string", "minLength": 1}
    if models:
        model["enum"] = sorted(models)
    model_param = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    response_param = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    messages = {
        "/v1/messages": {"post": _op("Create a message (Anthropic Messages API)", _json(_MESSAGE_OBJECT),
                                     _GENERATE_ERRORS, request="MessagesRequest", stream=_named_sse(_MESSAGE_EVENT),
                                     error="AnthropicError")},
        "/v1/messages/count_tokens": {"post": _op("Count a message's input tokens", _json(_TOKEN_COUNT),
                                                  _GENERATE_ERRORS, request="MessagesCountRequest",
                                                  error="AnthropicError")},
    } if anthropic else {}
    return {
        "openapi": "3.1.0",
        "info": {"title": "tandem: OpenAI- and Anthropic-compatible API", "version": "1"},
        "paths": {
            "/v1/chat/completions": {"post": _op("Chat completion", _json(_CHAT_COMPLETION), _GENERATE_ERRORS,
                                                 request="ChatCompletionRequest", stream=_sse(_CHAT_CHUNK))},
            "/v1/completions": {"post": _op("Text completion", _json(_COMPLETION), _GENERATE_ERRORS,
                                            request="CompletionRequest", stream=_sse(_COMPLETION_CHUNK))},
            "/v1/responses": {"post": _op("Create a response (OpenAI Responses API)", _json(_RESPONSE),
                                          _GENERATE_ERRORS, request="ResponseRequest",
                                          stream=_named_sse(_RESPONSE_EVENT))},
            "/v1/responses/input_tokens": {"post": _op("Count a response's input tokens", _json(_INPUT_TOKENS),
                                                       _GENERATE_ERRORS, request="ResponseRequest")},
            "/v1/responses/{response_id}": {
                "get": _op("A stored response", _json(_RESPONSE), ("401", "404"), parameters=[response_param]),
                "delete": _op("Delete a stored response", _json(_DELETED), ("401", "404"),
                              parameters=[response_param]),
            },
            **messages,
            "/v1/embeddings": {"post": _op("Embeddings of texts or token ids (an embedding model)", _json(_EMBEDDINGS),
                                           _GENERATE_ERRORS, request="EmbeddingsRequest")},
            "/tokenize": {"post": _op("Token ids of a prompt, or of chat messages through the model's chat "
                                      "template (vLLM's route; not behind --api-key)", _json(_TOKENIZED),
                                      ("400", "404", "408", "413", "415"), request="TokenizeRequest")},
            "/detokenize": {"post": _op("The text of token ids (vLLM's route; not behind --api-key)",
                                        _json(_DETOKENIZED), ("400", "404", "408", "413", "415"),
                                        request="DetokenizeRequest")},
            "/inference/v1/generate": {"post": _op(
                "Token ids in, token ids (and logprobs) out: vLLM's token-in/token-out route, no chat template; "
                "behind --api-key", _json(_GENERATED), _GENERATE_ERRORS, request="GenerateRequest",
                stream=_sse(_GENERATE_CHUNK, "VllmError"), error="VllmError")},
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
                "ResponseRequest": _responses_request(model),
                "AnthropicError": _ANTHROPIC_ERROR,
                "TokenizeRequest": _tokenize_request(model),
                "EmbeddingsRequest": _embeddings_request(model),
                "DetokenizeRequest": _detokenize_request(model),
                "GenerateRequest": _generate_request(model),
                "VllmError": _VLLM_ERROR,
                "MessagesRequest": _messages_request(model),
                "MessagesCountRequest": {"type": "object", "required": ["model", "messages"],
                                         "properties": _messages_prompt(model)},
                "ChatCompletionRequest": {
                    "type": "object",
                    "required": ["model", "messages"],
                    "allOf": [*_CROSS_FIELD, _requires("top_logprobs", "logprobs", True)],
                    "properties": {
                        **_sampling(model),
                        "messages": {"type": "array", "minItems": 1, "items": _CHAT_MESSAGE},
                        **schemas(CHAT_RULES),
                        "logprobs": _BOOL,
                        "tools": _nullable({"type": "array", "items": _TOOL}),
                        "tool_choice": _nullable({"anyOf": [{"enum": ["none", "auto", "required"]}, _NAMED_CHOICE]}),
                        "parallel_tool_calls": _BOOL,
                        "reasoning_effort": _nullable({"enum": ["minimal", "low", "medium", "high"]}),
                        "chat_template_kwargs": _OBJECT,
                    },
                },
                "CompletionRequest": {
                    "type": "object",
                    "required": ["model"],
                    # A prompt, or its embeddings (base64 of a torch.save'd tensor), never both.
                    "oneOf": [{"required": ["prompt"]}, {"required": ["prompt_embeds"]}],
                    "allOf": _CROSS_FIELD,
                    "properties": {
                        **_sampling(model),
                        "prompt": {"anyOf": [
                            {"type": "string", "minLength": 1},
                            _TOKEN_IDS,
                            {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string", "minLength": 1}},
                            {"type": "array", "minItems": 1, "maxItems": 1, "items": _TOKEN_IDS},
                        ]},
                        "prompt_embeds": {"anyOf": [
                            {"type": "string", "minLength": 1},
                            {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string", "minLength": 1}},
                        ]},
                        **schemas(COMPLETION_RULES),
                        "echo": _nullable({"const": False}),
                        "suffix": _nullable({"type": "string", "maxLength": 0}),
                    },
                },
            }
        },
    }
