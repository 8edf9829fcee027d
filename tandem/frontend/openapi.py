"""The frontend's OpenAPI description, served at /openapi.json.

It is the contract generated clients and fuzzers learn, so it states what the server checks (each API's
numeric bounds come from the rule tables its range checks read, `protocol.validation.Rule`): every
request a schema here calls invalid is refused with a 4xx, and every response matches its schema. Rules
that tie two fields together (stream_options needs stream, min_tokens <= max_tokens, the context length)
are the server's alone. The served model names are filled in per request.
"""

from __future__ import annotations

from typing import Any

from tandem.frontend.api.anthropic.schema import openapi as messages_api
from tandem.frontend.api.openai.protocol import CHAT_RULES, COMPLETION_RULES
from tandem.frontend.api.responses.schema import openapi as responses_api
from tandem.frontend.protocol.schema import (
    BOOL,
    FUNCTION_NAME,
    GENERATE_ERRORS,
    NULL,
    OBJECT,
    STRING,
    TOKEN_IDS,
    ApiSchema,
    error_body,
    integer,
    json_body,
    nullable,
    operation,
    sse,
)
from tandem.frontend.protocol.validation import schemas
from tandem.frontend.requests import LOGPROBS_RULE, SAMPLING_RULES

_ERROR = error_body({"type": ["string", "integer", "null"]})
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
    "properties": {"index": {"type": "integer"}, "finish_reason": _FINISH, "logprobs": OBJECT,
                   "message": {"type": "object", "required": ["role", "content"],
                               "properties": {"role": {"const": "assistant"}, "content": STRING}}},
})
_COMPLETION = _completion_object("text_completion", {
    "type": "object",
    "required": ["index", "text", "finish_reason"],
    "properties": {"index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": _FINISH,
                   "logprobs": OBJECT},
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


_NULLABLE_FINISH = nullable(_FINISH)


def _chunk(obj: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {"id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
                       "model": {"type": "string"}, "choices": {"type": "array", "items": choice},
                       "usage": nullable(_USAGE)},
    }


_CHAT_CHUNK = _chunk("chat.completion.chunk", {
    "type": "object",
    "required": ["index", "delta", "finish_reason"],
    "properties": {"index": {"type": "integer"}, "finish_reason": _NULLABLE_FINISH, "logprobs": OBJECT,
                   "delta": {"type": "object", "properties": {"role": {"const": "assistant"}, "content": STRING}}},
})
_COMPLETION_CHUNK = _chunk("text_completion", {
    "type": "object",
    "required": ["index", "text", "finish_reason"],
    "properties": {"index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": _NULLABLE_FINISH,
                   "logprobs": OBJECT},
})



def _sampling(model: dict[str, Any]) -> dict[str, Any]:
    """Fields both generation routes take, with the bounds the server checks."""
    return {
        "model": model,
        "stream": BOOL,
        "stream_options": nullable({"type": "object", "properties": {"include_usage": BOOL}}),
        **schemas(SAMPLING_RULES),
        "stop": nullable({"anyOf": [{"type": "string"},
                                     {"type": "array", "maxItems": 16, "items": {"type": "string"}}]}),
        "stop_token_ids": nullable({"type": "array", "items": TOKEN_IDS["items"]}),
        "ignore_eos": BOOL,
        "include_stop_str_in_output": BOOL,
        "skip_special_tokens": BOOL,
        "user": STRING,
        "response_format": nullable({
            "type": "object", "required": ["type"],
            "properties": {"type": {"enum": ["text", "json_object", "json_schema"]},
                           "json_schema": nullable({"type": "object", "properties": {
                               "name": STRING, "schema": OBJECT, "strict": BOOL}})},
        }),
        "guided_json": nullable({"type": ["object", "string"]}),
        "guided_regex": STRING,
        "guided_choice": nullable({"type": "array", "minItems": 1, "items": {"type": "string"}}),
        "guided_grammar": STRING,
        "structured_outputs": nullable({"type": "object", "properties": {
            "json": nullable({"type": ["object", "string"]}), "regex": STRING,
            "choice": nullable({"type": "array", "minItems": 1, "items": {"type": "string"}}),
            "grammar": STRING}}),
        "nvext": nullable({"type": "object", "properties": {
            "backend_instance_id": integer(0, 2**64 - 1), "prefill_worker_id": integer(0, 2**64 - 1),
            "decode_worker_id": integer(0, 2**64 - 1), "annotations": {"type": "array", "items": {"enum": ["formatted_prompt", "token_ids"]}},
            "use_raw_prompt": BOOL, "greed_sampling": BOOL, "cache_salt": STRING,
            "max_thinking_tokens": integer(0)}}),
    }


_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}
_TOOL = {"type": "object", "required": ["type", "function"],
         "properties": {"type": {"const": "function"},
                        "function": {"type": "object", "required": ["name"],
                                     "properties": {"name": FUNCTION_NAME, "description": STRING,
                                                    "parameters": nullable({"type": "object"}),
                                                    "strict": BOOL}}}}  # fmt: skip
_NAMED_CHOICE = {"type": "object", "required": ["type", "function"],
                 "properties": {"type": {"const": "function"},
                                "function": {"type": "object", "required": ["name"],
                                             "properties": {"name": {"type": "string"}}}}}  # fmt: skip
_MESSAGE_FIELDS = {"name": STRING, "tool_call_id": STRING,
                   "tool_calls": nullable({"type": "array", "items": {"type": "object"}})}
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
         "properties": {"role": {"const": "assistant"}, "content": nullable(content), **_MESSAGE_FIELDS},
         "anyOf": [{"required": ["content"], "properties": {"content": content}},
                   {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}}]},
    ]}


_MESSAGE = _message(_CONTENT)  # text only: the token-counting routes
_CHAT_MESSAGE = _message(_CHAT_CONTENT)  # chat takes images too (a model that does not refuses them, 400)


# -- vLLM's tokenizer routes -------------------------------------------------------------------------
def _tokenize_request(model: dict[str, Any]) -> dict[str, Any]:
    """A prompt or chat messages (exactly one of them)."""
    return {
        "type": "object",
        "oneOf": [{"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                  {"required": ["messages"], "properties": {"messages": {"type": "array"}}}],
        "properties": {
            "model": nullable(model),
            "prompt": STRING,
            "messages": nullable({"type": "array", "minItems": 1, "items": _MESSAGE}),
            "add_special_tokens": BOOL,
            "add_generation_prompt": {"type": "boolean"},
            "continue_final_message": {"const": False},
            "return_token_strs": BOOL,
            "chat_template": NULL,
            "chat_template_kwargs": OBJECT,
            "tools": nullable({"type": "array", "items": _TOOL}),
        },
    }


def _detokenize_request(model: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["tokens"],
            "properties": {"model": nullable(model), "tokens": {"type": "array", "items": {
                "type": "integer", "minimum": 0, "maximum": 2**64 - 1}}}}


_TOKENIZED = {"type": "object", "required": ["count", "max_model_len", "tokens", "token_strs"],
              "properties": {"count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                             "tokens": {"type": "array", "items": {"type": "integer"}},
                             "token_strs": nullable({"type": "array", "items": {"type": "string"}})}}
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
            "input": {"anyOf": [text, {"type": "array", "minItems": 1, "maxItems": 2048, "items": text}, TOKEN_IDS,
                                {"type": "array", "minItems": 1, "maxItems": 2048, "items": TOKEN_IDS}]},
            "encoding_format": {"enum": ["float", "base64"]},
            "dimensions": nullable(integer(1)),
            "user": nullable({"type": "string"}),
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
_VLLM_ERROR = error_body({"type": "integer"})
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
        "top_k": integer(-1),  # vLLM's 0 disables it too
        **schemas((LOGPROBS_RULE,)),
        "detokenize": {"type": "boolean"},
        "structured_outputs": nullable({"type": "object", "additionalProperties": False, "properties": {
            "json": nullable({"type": ["object", "string"]}), "regex": STRING,
            "choice": nullable({"type": "array", "minItems": 1, "items": {"type": "string"}}),
            "grammar": STRING}}),
    }
    return {
        "type": "object",
        "required": ["token_ids", "sampling_params"],
        "properties": {
            "request_id": STRING,
            "model": nullable(model),
            "token_ids": TOKEN_IDS,
            "sampling_params": {"type": "object", "additionalProperties": False, "properties": sampling},
            "stream": BOOL,
            "stream_options": nullable({"type": "object", "properties": {"include_usage": BOOL,
                                                                          "continuous_usage_stats": BOOL}}),
            "cache_salt": nullable({"type": "string", "minLength": 1, "maxLength": 128,
                                     "description": "without '@', '/', '\\' or NUL (vLLM's rule)"}),
            "priority": {"const": 0},
            "output_mode": {"enum": ["tokens", "text"]},
            "return_token_ids": BOOL,
            **{name: NULL for name in _GENERATE_UNSERVED},
        },
    }


_GENERATE_FINISH = {"enum": ["stop", "length", "abort", "content_filter"]}


def _generate_choice(finish: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["index", "finish_reason", "stop_reason", "token_ids", "logprobs"],
            "properties": {"index": {"type": "integer"}, "finish_reason": finish,
                           "stop_reason": {"type": ["string", "integer", "null"]},
                           "token_ids": {"type": "array", "items": {"type": "integer"}},
                           "text": {"type": "string"}, "logprobs": OBJECT}}


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
                   "choices": {"type": "array", "items": _generate_choice(nullable(_GENERATE_FINISH))},
                   "usage": nullable(_USAGE), "prompt_token_ids": _PROMPT_IDS},
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
    responses = responses_api(model)
    messages = messages_api(model) if anthropic else ApiSchema({}, {})
    return {
        "openapi": "3.1.0",
        "info": {"title": "tandem: OpenAI- and Anthropic-compatible API", "version": "1"},
        "paths": {
            "/v1/chat/completions": {"post": operation("Chat completion", json_body(_CHAT_COMPLETION), GENERATE_ERRORS,
                                                 request="ChatCompletionRequest", stream=sse(_CHAT_CHUNK))},
            "/v1/completions": {"post": operation("Text completion", json_body(_COMPLETION), GENERATE_ERRORS,
                                            request="CompletionRequest", stream=sse(_COMPLETION_CHUNK))},
            **responses.paths,
            **messages.paths,
            "/v1/embeddings": {"post": operation("Embeddings of texts or token ids (an embedding model)", json_body(_EMBEDDINGS),
                                           GENERATE_ERRORS, request="EmbeddingsRequest")},
            "/tokenize": {"post": operation("Token ids of a prompt, or of chat messages through the model's chat "
                                      "template (vLLM's route; not behind --api-key)", json_body(_TOKENIZED),
                                      ("400", "404", "408", "413", "415"), request="TokenizeRequest")},
            "/detokenize": {"post": operation("The text of token ids (vLLM's route; not behind --api-key)",
                                        json_body(_DETOKENIZED), ("400", "404", "408", "413", "415"),
                                        request="DetokenizeRequest")},
            "/inference/v1/generate": {"post": operation(
                "Token ids in, token ids (and logprobs) out: vLLM's token-in/token-out route, no chat template; "
                "behind --api-key", json_body(_GENERATED), GENERATE_ERRORS, request="GenerateRequest",
                stream=sse(_GENERATE_CHUNK, "VllmError"), error="VllmError")},
            "/v1/models": {"get": operation("Models being served", json_body(_MODEL_LIST), ("401",))},
            "/v1/models/{model}": {"get": operation("One model", json_body(_MODEL), ("401", "404"), parameters=[model_param])},
            "/health": {"get": {"summary": "Health: 200 when at least one worker serves a model, else 503",
                                "responses": {"200": json_body(_HEALTH), "503": json_body(_HEALTH, "No worker")}}},
            "/live": {"get": {"summary": "Liveness", "responses": {"200": json_body({"type": "object"})}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
                "200": {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        },
        "components": {
            "schemas": {
                "Error": _ERROR,
                **responses.schemas,
                **messages.schemas,
                "TokenizeRequest": _tokenize_request(model),
                "EmbeddingsRequest": _embeddings_request(model),
                "DetokenizeRequest": _detokenize_request(model),
                "GenerateRequest": _generate_request(model),
                "VllmError": _VLLM_ERROR,
                "ChatCompletionRequest": {
                    "type": "object",
                    "required": ["model", "messages"],
                    "allOf": [*_CROSS_FIELD, _requires("top_logprobs", "logprobs", True)],
                    "properties": {
                        **_sampling(model),
                        "messages": {"type": "array", "minItems": 1, "items": _CHAT_MESSAGE},
                        **schemas(CHAT_RULES),
                        "logprobs": BOOL,
                        "tools": nullable({"type": "array", "items": _TOOL}),
                        "tool_choice": nullable({"anyOf": [{"enum": ["none", "auto", "required"]}, _NAMED_CHOICE]}),
                        "parallel_tool_calls": BOOL,
                        "reasoning_effort": nullable({"enum": ["minimal", "low", "medium", "high"]}),
                        "chat_template_kwargs": OBJECT,
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
                            TOKEN_IDS,
                            {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string", "minLength": 1}},
                            {"type": "array", "minItems": 1, "maxItems": 1, "items": TOKEN_IDS},
                        ]},
                        "prompt_embeds": {"anyOf": [
                            {"type": "string", "minLength": 1},
                            {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string", "minLength": 1}},
                        ]},
                        **schemas(COMPLETION_RULES),
                        "echo": nullable({"const": False}),
                        "suffix": nullable({"type": "string", "maxLength": 0}),
                    },
                },
            }
        },
    }
