"""OpenAI protocol layer: request validation (status, param, message), mapping to tandem's options,
and response shapes checked against the official `openai` client's models and its SSE parser."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import msgspec
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tandem.frontend.api.anthropic.protocol import parse_messages_request
from tandem.frontend.api.openai.protocol import (
    ChatStream,
    CompletionStream,
    chat_chunk,
    chat_completion,
    chat_logprobs,
    completion,
    completion_chunk,
    completion_logprobs,
    models_list,
    parse_chat_request,
    parse_completion_request,
    usage_body,
)
from tandem.frontend.api.responses.protocol import parse_request
from tandem.frontend.hints import routing_hints
from tandem.frontend.openapi import openapi_spec
from tandem.frontend.preprocess import output_options, sampling_options, stop_conditions
from tandem.frontend.protocol.errors import RequestError
from tandem.frontend.protocol.sse import SSE_DONE, dumps, sse
from tandem.frontend.requests import AnyRequest, ChatRequest, ImagePart
from tandem.llm.postprocess import TokenLogprob, TopLogprob
from tandem.llm.protocols import (
    FinishReason,
    GuidedDecoding,
    OutputOptions,
    PreprocessedRequest,
    RoutingHints,
    StopConditions,
)

DEL = object()  # marks a key to remove from the base body
USER = [{"role": "user", "content": "hi"}]


def chat_body(**fields: Any) -> bytes:
    body: dict[str, Any] = {"model": "m", "messages": USER}
    body.update(fields)
    return json.dumps({k: v for k, v in body.items() if v is not DEL}).encode()


def cmpl_body(**fields: Any) -> bytes:
    body: dict[str, Any] = {"model": "m", "prompt": "hello"}
    body.update(fields)
    return json.dumps({k: v for k, v in body.items() if v is not DEL}).encode()


def error_of(parse, body: bytes) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse(body)
    return info.value


# -- errors ----------------------------------------------------------------------------------------

COMMON_ERRORS: list[tuple[dict[str, Any], str | None, str]] = [
    # (fields, param, substring of the message)
    ({"model": DEL}, "model", "model"),
    ({"model": 5}, "model", "expected `str`"),
    ({"model": ""}, "model", "non-empty"),
    ({"temperature": "hot"}, "temperature", "expected `float`, got `str`"),
    ({"temperature": 2.5}, "temperature", "between 0 and 2"),
    ({"temperature": -0.1}, "temperature", "between 0 and 2"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"top_p": 1.01}, "top_p", "(0, 1]"),
    ({"top_k": 0}, "top_k", "-1"),
    ({"top_k": -2}, "top_k", "-1"),
    ({"top_k": 1.5}, "top_k", "expected `int`"),
    ({"min_p": 1.5}, "min_p", "between 0 and 1"),
    ({"min_p": -0.5}, "min_p", "between 0 and 1"),
    ({"presence_penalty": 2.5}, "presence_penalty", "between -2 and 2"),
    ({"frequency_penalty": -3}, "frequency_penalty", "between -2 and 2"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"repetition_penalty": -1.0}, "repetition_penalty", "greater than 0"),
    ({"max_tokens": -1}, "max_tokens", "at least 1"),
    ({"max_tokens": 0}, "max_tokens", "at least 1"),
    ({"max_tokens": "10"}, "max_tokens", "expected `int`"),
    ({"n": 2}, "n", "only n=1 is supported"),
    ({"n": 0}, "n", "only n=1 is supported"),
    ({"min_tokens": -1}, "min_tokens", "between 0 and"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens", "must not exceed max_tokens"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop", "at most 16"),
    ({"stop": ["a", 1]}, "stop[1]", "expected `str`"),
    ({"stop": 5}, "stop", "expected `str | array`"),
    ({"stop_token_ids": [-1]}, "stop_token_ids[0]", "token ids"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids[0]", "expected `int`"),
    ({"seed": 2**70}, "seed", "64 bits"),
    ({"stream": "yes"}, "stream", "expected `bool`"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "expected `bool`"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "text, json_object, json_schema"),
    ({"response_format": {}}, "response_format.type", "Missing required parameter"),
    ({"response_format": "json"}, "response_format", "expected `object`"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     "schema"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex", "only one guided decoding mode"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice", "only one"),
    ({"guided_grammar": "root ::= 'a'", "structured_outputs": {"regex": "b"}}, "guided_grammar", "only one"),
    ({"guided_choice": []}, "guided_choice", "at least one choice"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": "[1]"}, "guided_json", "schema object"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice", "expected `array`"),
    ({"nvext": "x"}, "nvext", "expected `object`"),
    ({"nvext": {"annotations": [1]}}, "nvext.annotations[0]", "expected `str`"),
    ({"nvext": {"backend_instance_id": "w"}}, "nvext.backend_instance_id", "expected `int`"),
    ({"nvext": {"greed_sampling": "yes"}}, "nvext.greed_sampling", "expected `bool`"),
]

CHAT_ERRORS: list[tuple[dict[str, Any], str | None, str]] = [
    ({"messages": DEL}, "messages", "Missing required parameter"),
    ({"messages": None}, "messages", "Missing required parameter"),
    ({"messages": []}, "messages", "at least one message"),
    ({"messages": "hi"}, "messages", "expected `array`"),
    ({"messages": [1]}, "messages[0]", "expected `object`"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "must be one of"),
    ({"messages": [{"role": 1, "content": "x"}]}, "messages[0].role", "must be one of"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "is required"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string or a list"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "required"),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "u"}}]}]},
     "messages[0].content[0].type", "video_url content parts are not supported; only text and image_url"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}]},
     "messages[0].content[0].image_url.url", "non-empty string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u", "detail": "x"}}]}]},
     "messages[0].content[0].image_url.detail", "one of auto, low, high"),
    ({"messages": [{"role": "user", "content": ["x"]}]}, "messages[0].content[0].type", "only text"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages[0].content[0].text",
     "string"),
    ({"messages": [*USER, {"role": "assistant", "content": None}]}, "messages[1].content", "required"),
    ({"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": "x"}]}, "messages[1].tool_calls",
     "list of objects"),
    ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name", "string"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]}, "messages[0].tool_call_id", "string"),
    ({"max_completion_tokens": -5}, "max_completion_tokens", "at least 1"),
    ({"max_tokens": -1, "max_completion_tokens": 5}, "max_tokens", "at least 1"),
    ({"max_completion_tokens": 5, "min_tokens": 6}, "min_tokens", "must not exceed"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "between 0 and 20"),
    ({"top_logprobs": 2}, "top_logprobs", "requires logprobs"),
    ({"logprobs": False, "top_logprobs": 2}, "top_logprobs", "requires logprobs"),
    ({"logprobs": 3}, "logprobs", "expected `bool`"),
    ({"tool_choice": "sometimes"}, "tool_choice", "none, auto, required"),
    ({"tool_choice": 3}, "tool_choice", "expected"),
    ({"tools": "x"}, "tools", "expected `array`"),
    ({"nvext": {"max_thinking_tokens": -1}}, "nvext.max_thinking_tokens", ">= 0"),
    ({"chat_template_kwargs": []}, "chat_template_kwargs", "expected `object`"),
]

COMPLETION_ERRORS: list[tuple[dict[str, Any], str | None, str]] = [
    ({"prompt": DEL}, "prompt", "Missing required parameter"),
    ({"prompt": None}, "prompt", "Missing required parameter"),
    ({"prompt": 5}, "prompt", "string, a list of token ids"),
    ({"prompt": {"text": "x"}}, "prompt", "string, a list of token ids"),
    ({"prompt": []}, "prompt", "must not be empty"),
    ({"prompt": ""}, "prompt", "must not be empty"),
    ({"prompt": [""]}, "prompt[0]", "must not be empty"),
    ({"prompt": ["a", "b"]}, "prompt", "batch prompts are not supported"),
    ({"prompt": [[1], [2]]}, "prompt", "batch prompts are not supported"),
    ({"prompt": [[]]}, "prompt[0]", "must not be empty"),
    ({"prompt": [1, "a"]}, "prompt[1]", "token id"),
    ({"prompt": [1, -1]}, "prompt[1]", "token id"),
    ({"prompt": [True]}, "prompt[0]", "token id"),
    ({"prompt": [[1, 2.5]]}, "prompt[0][1]", "token id"),
    ({"logprobs": 21}, "logprobs", "between 0 and 20"),
    ({"logprobs": -1}, "logprobs", "between 0 and 20"),
    ({"logprobs": True}, "logprobs", "expected `int`"),
    ({"echo": True}, "echo", "not supported"),
    ({"suffix": "tail"}, "suffix", "not supported"),
]

ERROR_CASES = (
    [pytest.param(parse_chat_request, chat_body, *c, id=f"chat-{i}") for i, c in enumerate(COMMON_ERRORS)]
    + [pytest.param(parse_completion_request, cmpl_body, *c, id=f"cmpl-{i}") for i, c in enumerate(COMMON_ERRORS)]
    + [pytest.param(parse_chat_request, chat_body, *c, id=f"chat-only-{i}") for i, c in enumerate(CHAT_ERRORS)]
    + [pytest.param(parse_completion_request, cmpl_body, *c, id=f"cmpl-only-{i}")
       for i, c in enumerate(COMPLETION_ERRORS)]
)  # fmt: skip


@pytest.mark.parametrize("parse,make,fields,param,message", ERROR_CASES)
def test_invalid_field(parse, make, fields, param, message):
    err = error_of(parse, make(**fields))
    assert (err.status, err.param, err.type) == (400, param, "invalid_request_error"), err.message
    assert message.lower() in err.message.lower()
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error", "param": param,
                                    "code": None}}  # fmt: skip


@pytest.mark.parametrize("parse", [parse_chat_request, parse_completion_request])
@pytest.mark.parametrize("body,message", [
    (b"{not json", "not valid JSON"),
    (b"", "not valid JSON"),
    (b'{"model": "m",', "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[]", "must be a JSON object"),
    (b'"text"', "must be a JSON object"),
])  # fmt: skip
def test_malformed_body(parse, body, message):
    err = error_of(parse, body)
    assert (err.status, err.param) == (400, None)
    assert message in err.message


def test_number_out_of_range():
    err = error_of(parse_chat_request, b'{"model": "m", "messages": [], "temperature": 1e999}')
    assert (err.status, err.param) == (400, "temperature") and "out of range" in err.message


def test_error_statuses_and_types():
    assert RequestError("x").body()["error"]["type"] == "invalid_request_error"
    assert RequestError("x", status=404).type == "not_found_error"
    assert RequestError("too big", status=413).type == "invalid_request_error"
    assert RequestError("boom", status=500).type == "internal_server_error"
    assert RequestError("busy", status=503).type == "service_unavailable"
    err = RequestError.model_not_found("nope")
    assert err.status == 404
    assert err.body() == {"error": {"message": "The model `nope` does not exist.", "type": "invalid_request_error",
                                    "param": "model", "code": "model_not_found"}}  # fmt: skip
    assert err.sse().startswith(b"data: {") and err.sse().endswith(b"\n\n")


# -- good requests ---------------------------------------------------------------------------------


def test_chat_full_mapping():
    req = parse_chat_request(chat_body(
        temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5, frequency_penalty=-0.5,
        repetition_penalty=1.1, seed=7, stop=["END", "STOP"], stop_token_ids=[2, 3], ignore_eos=False,
        min_tokens=2, include_stop_str_in_output=True, skip_special_tokens=False, n=1, user="u",
        max_tokens=100, max_completion_tokens=50, logprobs=True, top_logprobs=3, stream=True,
        stream_options={"include_usage": True}, tools=[{"type": "function", "function": {"name": "f"}}],
        tool_choice="auto", chat_template_kwargs={"enable_thinking": False},
    ))  # fmt: skip
    assert req.stream is True and req.include_usage is True and req.is_guided is False
    assert req.max_tokens == 50  # max_completion_tokens wins
    assert req.tools == [{"type": "function", "function": {"name": "f"}}] and req.tool_choice == "auto"
    assert req.chat_template_kwargs == {"enable_thinking": False}
    s = sampling_options(req)
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.7, 0.9, 40, 0.05, 7)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.1)
    assert s.include_stop_str_in_output is True and s.guided_decoding is None and s.n is None
    assert stop_conditions(req) == StopConditions(
        max_tokens=50, stop=["END", "STOP"], stop_token_ids=[2, 3], min_tokens=2, ignore_eos=False
    )
    assert output_options(req) == OutputOptions(logprobs=3, skip_special_tokens=False)


def test_minimal_requests_leave_options_unset():
    for req in (parse_chat_request(chat_body()), parse_completion_request(cmpl_body())):
        assert req.stream is False and req.include_usage is False and req.stop is None
        # Unset means "engine default": nothing is sent on the wire.
        assert msgspec.json.encode(sampling_options(req)) == b"{}"
        assert msgspec.json.encode(stop_conditions(req)) == b"{}"
        assert msgspec.json.encode(output_options(req)) == b"{}"
        assert routing_hints(req) is None


def test_nulls_and_unknown_fields_are_accepted():
    nulls = {k: None for k in ("stream", "stream_options", "max_tokens", "temperature", "top_p", "stop", "n", "seed",
                               "logprobs", "response_format", "nvext", "tools", "tool_choice")}  # fmt: skip
    extras = {"metadata": {"a": "b"}, "parallel_tool_calls": False, "logit_bias": {"1": 2}, "store": False,
              "service_tier": "auto", "user": "me"}  # fmt: skip
    chat = parse_chat_request(chat_body(**nulls, **extras))
    assert chat.stream is False and chat.user == "me"
    assert parse_completion_request(cmpl_body(**(nulls | extras))).stream is False
    # as OpenAI and vLLM do: stream_options without stream is a mistake, not silently ignored
    err = error_of(parse_completion_request, cmpl_body(stream_options={"include_usage": True}))
    assert (err.status, err.param) == (400, "stream_options")
    cmpl = parse_completion_request(cmpl_body(stream=True, stream_options={"include_usage": True}))
    assert cmpl.include_usage is True and cmpl.stream is True


@pytest.mark.parametrize("fields,guided", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, GuidedDecoding(json={"type": "object"})),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": True,
                                                                 "schema": {"type": "integer"}}}},
     GuidedDecoding(json={"type": "integer"})),
    ({"guided_json": {"type": "string"}}, GuidedDecoding(json={"type": "string"})),
    ({"guided_json": '{"type": "string"}'}, GuidedDecoding(json={"type": "string"})),
    ({"guided_regex": "[a-z]+"}, GuidedDecoding(regex="[a-z]+")),
    ({"guided_choice": ["yes", "no"]}, GuidedDecoding(choice=["yes", "no"])),
    ({"guided_grammar": "root ::= 'a'"}, GuidedDecoding(grammar="root ::= 'a'")),
    ({"structured_outputs": {"json": {"type": "object"}}}, GuidedDecoding(json={"type": "object"})),
    ({"structured_outputs": {"regex": "x"}}, GuidedDecoding(regex="x")),
    ({"structured_outputs": {"choice": ["a"]}}, GuidedDecoding(choice=["a"])),
    ({"structured_outputs": {"grammar": "g"}}, GuidedDecoding(grammar="g")),
    ({"response_format": {"type": "text"}, "guided_regex": "x"}, GuidedDecoding(regex="x")),
])  # fmt: skip
@pytest.mark.parametrize("parse,make", [(parse_chat_request, chat_body),
                                        (parse_completion_request, cmpl_body)])  # fmt: skip
def test_guided_decoding(parse, make, fields, guided):
    req = parse(make(**fields))
    assert req.is_guided is (guided is not None)
    assert sampling_options(req).guided_decoding == guided


@pytest.mark.parametrize("fields,stop", [
    ({"stop": "END"}, ["END"]),
    ({"stop": ["a", "b"]}, ["a", "b"]),
    ({"stop": ["a", ""]}, ["a"]),
    ({"stop": ""}, None),
    ({"stop": []}, None),
    ({"stop": [f"s{i}" for i in range(16)]}, [f"s{i}" for i in range(16)]),
])  # fmt: skip
def test_stop_normalized(fields, stop):
    assert stop_conditions(parse_chat_request(chat_body(**fields))).stop == stop


@pytest.mark.parametrize("fields,logprobs", [
    ({}, None),
    ({"logprobs": False}, None),
    ({"logprobs": True}, 0),
    ({"logprobs": True, "top_logprobs": 0}, 0),
    ({"logprobs": True, "top_logprobs": 20}, 20),
])  # fmt: skip
def test_chat_logprobs_option(fields, logprobs):
    assert output_options(parse_chat_request(chat_body(**fields))).logprobs == logprobs


@pytest.mark.parametrize("prompt,expected", [
    ("hello", "hello"),
    ([1, 2, 3], [1, 2, 3]),
    (["hello"], "hello"),
    ([[4, 5]], [4, 5]),
])  # fmt: skip
def test_completion_prompt_forms(prompt, expected):
    req = parse_completion_request(cmpl_body(prompt=prompt, logprobs=2, echo=False, suffix=None, max_tokens=8))
    assert req.prompt == expected
    assert output_options(req).logprobs == 2 and stop_conditions(req).max_tokens == 8


def test_messages_kept_as_dicts():
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    messages = [
        {"role": "system", "content": "be nice"},
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "q", "name": "bob"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "assistant", "content": "", "reasoning_content": "hmm"},
    ]
    req = parse_chat_request(chat_body(messages=messages))
    assert req.messages[1] == {"role": "developer", "content": "a\nb"}  # text parts joined for the template
    assert req.messages[3] == {"role": "assistant", "content": None, "tool_calls": calls}
    assert [m for i, m in enumerate(req.messages) if i != 1] == [m for i, m in enumerate(messages) if i != 1]


def test_image_parts_are_taken_in_order_and_kept_as_parts_for_the_template():
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://a/1.png", "detail": "low"}},
                                             {"type": "text", "text": "and"}]},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"},
                                             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]
    req = parse_chat_request(chat_body(messages=messages))
    assert req.images == [ImagePart("http://a/1.png", "messages[0].content[0]"),
                          ImagePart("data:image/png;base64,AA", "messages[2].content[2]")]
    assert req.messages[0]["content"] == [{"type": "image"}, {"type": "text", "text": "and"}]
    assert req.messages[2]["content"] == [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}, {"type": "image"}]
    assert parse_chat_request(chat_body()).images == []


def test_nvext():
    req = parse_chat_request(chat_body(temperature=0.9, stream=True, nvext={
        "greed_sampling": True, "backend_instance_id": 17, "annotations": ["formatted_prompt", "token_ids"],
        "use_raw_prompt": True, "cache_salt": "s", "max_thinking_tokens": 64, "agent_hints": {"priority": 3},
        "extra_fields": ["worker_id"],
    }))  # fmt: skip
    assert req.ext.greed_sampling and req.ext.use_raw_prompt
    assert req.ext.annotations == ["formatted_prompt", "token_ids"]
    assert req.ext.extra == {"agent_hints": {"priority": 3}}
    assert req.ext.extra_fields == ["worker_id"]  # answered by the frontend, not passed on
    assert sampling_options(req).temperature == 0.0  # greedy overrides the request's temperature
    assert stop_conditions(req).max_thinking_tokens == 64
    assert routing_hints(req) == RoutingHints(backend_instance_id=17, cache_salt="s")


def test_routing_headers():
    req = parse_chat_request(chat_body(nvext={"prefill_worker_id": 1, "decode_worker_id": 5}))
    headers = {"x-prefill-instance-id": "3", "X-Data-Parallel-Rank": "1",
               "x-dynamo-prefill-dp-rank": "0", "X-Dynamo-Request-Priority": "9", "content-type": "x"}  # fmt: skip
    assert routing_hints(req, headers) == RoutingHints(
        prefill_worker_id=3, decode_worker_id=5, dp_rank=1, prefill_dp_rank=0, priority=9
    )
    # the newer x-dynamo-* name wins over the legacy one
    both = {"x-worker-instance-id": "2", "x-dynamo-worker-instance-id": "4"}
    assert routing_hints(None, both).backend_instance_id == 4  # type: ignore[union-attr]
    # a request pinned whole has no legs to pin
    err = error_of(lambda b: routing_hints(parse_chat_request(b), {"X-Worker-Instance-Id": "2"}),
                   chat_body(nvext={"decode_worker_id": 5}))
    assert err.status == 400 and err.param == "nvext.decode_worker_id"
    err = error_of(lambda b: routing_hints(parse_chat_request(b), {"x-dp-rank": "zero"}), chat_body())
    assert err.status == 400 and "x-dp-rank" in err.message


def test_options_fit_the_wire_request():
    req = parse_chat_request(chat_body(max_tokens=5, stop="x", logprobs=True, guided_regex="a",
                                           nvext={"backend_instance_id": 3}))  # fmt: skip
    wire = PreprocessedRequest(
        model=req.model, token_ids=[1, 2], stop_conditions=stop_conditions(req),
        sampling_options=sampling_options(req), output_options=output_options(req),
        annotations=req.ext.annotations, routing=routing_hints(req),
    )  # fmt: skip
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(wire), type=PreprocessedRequest) == wire


_FIELDS = ["model", "messages", "prompt", "stream", "stream_options", "max_tokens", "max_completion_tokens",
           "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "n", "seed", "logprobs",
           "top_logprobs", "response_format", "guided_json", "guided_choice", "structured_outputs", "nvext",
           "tools", "tool_choice", "min_tokens", "echo", "suffix"]  # fmt: skip
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["role", "content", "type", "text",
                                                                                   "json", "schema"]), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(_FIELDS), _json, max_size=6))
def test_fuzz_only_request_errors(body):
    """Whatever JSON arrives, parsing either succeeds or raises a 400 RequestError (never a 500)."""
    raw = json.dumps(body).encode()
    for parse in (parse_chat_request, parse_completion_request):
        try:
            req = parse(raw)
        except RequestError as e:
            assert e.status == 400 and e.message
            continue
        msgspec.json.encode([sampling_options(req), stop_conditions(req), output_options(req)])


# -- responses -------------------------------------------------------------------------------------

TOKENS = [
    TokenLogprob("Hel", 10, -0.1, list(b"Hel"),
                 [TopLogprob("Hel", 10, -0.1, list(b"Hel")), TopLogprob("Hi", 11, -2.5, list(b"Hi"))]),
    TokenLogprob("lo", 12, float("-inf"), list(b"lo"), [TopLogprob("lo", 12, float("-inf"), list(b"lo"))]),
]


def test_usage():
    assert usage_body(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert usage_body(3, 4, cached_tokens=2)["prompt_tokens_details"] == {"cached_tokens": 2}


def test_chat_stream_sequence_validates():
    stream = ChatStream("m", include_usage=True, created=123)
    assert stream.id.startswith("chatcmpl-") and len(stream.id) == len("chatcmpl-") + 32
    chunks = [stream.start(), stream.content("Hel", chat_logprobs(TOKENS[:1])),
              stream.content("lo", chat_logprobs(TOKENS[1:])), stream.finish("stop"),
              stream.usage(usage_body(5, 2, cached_tokens=4))]  # fmt: skip
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert all(c.id == stream.id and c.created == 123 and c.object == "chat.completion.chunk" for c in parsed)
    assert parsed[0].choices[0].delta.role == "assistant" and parsed[0].choices[0].delta.content == ""
    assert chunks[3]["choices"][0]["delta"] == {} and parsed[3].choices[0].finish_reason == "stop"
    top = parsed[1].choices[0].logprobs.content[0].top_logprobs  # type: ignore[index, union-attr]
    assert [(t.token, t.logprob, t.bytes) for t in top] == [("Hel", -0.1, list(b"Hel")), ("Hi", -2.5, list(b"Hi"))]
    assert parsed[2].choices[0].logprobs.content[0].logprob == -9999.0  # type: ignore[index, union-attr]
    assert all("usage" in c and c["usage"] is None for c in chunks[:4])  # OpenAI sends usage: null until the end
    assert parsed[4].choices == [] and parsed[4].usage is not None
    assert parsed[4].usage.total_tokens == 7 and parsed[4].usage.prompt_tokens_details.cached_tokens == 4  # type: ignore[union-attr]


def test_chat_stream_without_usage_has_no_usage_key():
    stream = ChatStream("m")
    for chunk in (stream.start(), stream.content("x"), stream.finish("length")):
        assert "usage" not in chunk
        ChatCompletionChunk.model_validate(chunk)
    assert set(stream.start()) == {"id", "object", "created", "model", "system_fingerprint", "choices"}
    assert set(stream.start()["choices"][0]) == {"index", "delta", "logprobs", "finish_reason"}


def test_chat_completion_validates():
    body = chat_completion("chatcmpl-test", 5, "m", content="Hello", finish_reason="stop", usage=usage_body(1, 2),
                               logprobs=chat_logprobs(TOKENS))  # fmt: skip
    parsed = ChatCompletion.model_validate(body)
    assert parsed.object == "chat.completion" and parsed.id.startswith("chatcmpl-")
    assert parsed.choices[0].message.content == "Hello" and parsed.choices[0].message.role == "assistant"
    assert [t.token for t in parsed.choices[0].logprobs.content] == ["Hel", "lo"]  # type: ignore[union-attr]
    assert parsed.usage is not None and parsed.usage.total_tokens == 3
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    body = chat_completion("chatcmpl-x", 5, "m", content=None, finish_reason="tool_calls", usage=usage_body(1, 2),
                               tool_calls=calls, reasoning="thinking")  # fmt: skip
    parsed = ChatCompletion.model_validate(body)
    assert parsed.choices[0].message.tool_calls[0].function.name == "f"  # type: ignore[index, union-attr]
    assert body["choices"][0]["message"]["reasoning_content"] == "thinking"


def test_completion_validates():
    lp = completion_logprobs(TOKENS, text_offset=0)
    assert lp == {"tokens": ["Hel", "lo"], "token_logprobs": [-0.1, -9999.0],
                  "top_logprobs": [{"Hel": -0.1, "Hi": -2.5}, {"lo": -9999.0}], "text_offset": [0, 3]}  # fmt: skip
    assert completion_logprobs(TOKENS[1:], text_offset=3)["text_offset"] == [3]  # continues across chunks
    body = completion("cmpl-test", 5, "m", text="Hello", finish_reason="length", usage=usage_body(1, 2),
                          logprobs=lp)  # fmt: skip
    parsed = Completion.model_validate(body)
    assert parsed.object == "text_completion" and parsed.id.startswith("cmpl-")
    assert parsed.choices[0].text == "Hello" and parsed.choices[0].logprobs.tokens == ["Hel", "lo"]  # type: ignore[union-attr]
    stream = CompletionStream("m", include_usage=True)
    last = Completion.model_validate(stream.finish("stop"))
    assert last.choices[0].text == "" and stream.text("x")["usage"] is None
    assert Completion.model_validate(stream.usage(usage_body(1, 1))).choices == []


def test_models_list():
    body = models_list([("m", 1, "tandem", None), ("m-lora", 2, "tandem", "m")])
    assert body["object"] == "list" and "parent" not in body["data"][0] and body["data"][1]["parent"] == "m"
    assert [Model.model_validate(d).id for d in body["data"]] == ["m", "m-lora"]


def test_sse_framing():
    assert sse({"a": [1, None], "b": "é"}) == b'data: {"a":[1,null],"b":"\xc3\xa9"}\n\n'
    assert SSE_DONE == b"data: [DONE]\n\n"
    assert dumps({"x": 1}) == b'{"x":1}'
    frame = RequestError("worker died", status=500).sse()
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert json.loads(frame[6:]) == {"error": {"message": "worker died", "type": "internal_server_error",
                                               "param": None, "code": None}}  # the unary error body's shape  # fmt: skip


# -- end to end with the official client (its request encoding, SSE parser and models) -------------


def _client(handler) -> openai.OpenAI:
    transport = httpx.MockTransport(handler)
    return openai.OpenAI(api_key="k", base_url="http://test/v1", max_retries=0,
                         http_client=httpx.Client(transport=transport))  # type: ignore[arg-type]  # fmt: skip


def _serve(request: httpx.Request) -> httpx.Response:
    """A toy HTTP layer: parse with this module, answer "Hello" in two pieces."""
    try:
        if request.url.path.endswith("/chat/completions"):
            req: AnyRequest = parse_chat_request(request.content)
        else:
            req = parse_completion_request(request.content)
    except RequestError as e:
        return httpx.Response(e.status, json=e.body())
    usage = usage_body(3, 2)
    if isinstance(req, ChatRequest):
        if not req.stream:
            return httpx.Response(200, content=dumps(chat_completion(
                "chatcmpl-test", 5, req.model, content="Hello", finish_reason="stop", usage=usage)))  # fmt: skip
        s = ChatStream(req.model, include_usage=req.include_usage)
        chunks = [s.start(), s.content("Hel"), s.content("lo"), s.finish("stop")]
        if req.messages[-1]["content"] == "fail":  # a worker dying mid-stream
            frames = [sse(chunks[0]), RequestError("worker died", status=500).sse()]
        else:
            frames = [sse(c) for c in chunks] + ([sse(s.usage(usage))] if req.include_usage else [])
    else:
        if not req.stream:
            return httpx.Response(200, content=dumps(completion(
                "cmpl-test", 5, req.model, text="Hello", finish_reason="stop", usage=usage)))  # fmt: skip
        c = CompletionStream(req.model, include_usage=req.include_usage)
        frames = [sse(c.text("Hel")), sse(c.text("lo")), sse(c.finish("length"))]
        frames += [sse(c.usage(usage))] if req.include_usage else []
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=b"".join(frames) + SSE_DONE)


def test_official_client_round_trip():
    client = _client(_serve)
    messages: Any = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    resp = client.chat.completions.create(model="m", messages=messages, temperature=0.5, max_completion_tokens=9,
                                          stop=["x"], seed=1, user="u", metadata={"k": "v"})  # fmt: skip
    assert resp.choices[0].message.content == "Hello" and resp.usage and resp.usage.total_tokens == 5

    chunks = list(client.chat.completions.create(model="m", messages=messages, stream=True,
                                                 stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
    assert chunks[-1].choices == [] and chunks[-1].usage and chunks[-1].usage.completion_tokens == 2
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"

    text = client.completions.create(model="m", prompt=[1, 2, 3], max_tokens=4, logprobs=2)
    assert text.choices[0].text == "Hello"
    pieces = list(client.completions.create(model="m", prompt="p", stream=True, stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == "Hello"
    assert pieces[-1].usage and pieces[-1].usage.total_tokens == 5

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=messages, temperature=3)
    assert info.value.status_code == 400 and info.value.param == "temperature"  # type: ignore[attr-defined]

    with pytest.raises(openai.APIError, match="worker died"):
        list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "fail"}], stream=True))


class _Top(msgspec.Struct):
    token: str
    token_id: int
    logprob: float | None
    bytes: list[int] | None = None


class _Tok(msgspec.Struct):
    token: str
    token_id: int
    logprob: float | None
    bytes: list[int] | None = None
    top: list[_Top] = msgspec.field(default_factory=list)


def test_logprobs_accept_duck_typed_records():
    """Records with object alternatives, missing logprobs and missing bytes (e.g. the postprocessor's)."""
    toks = [_Tok("a", 1, None, None, [_Top("a", 1, -0.5, [97]), _Top("b", 2, None)])]
    chat = chat_logprobs(toks)
    assert chat == {"content": [{"token": "a", "logprob": -9999.0, "bytes": None, "top_logprobs": [
        {"token": "a", "logprob": -0.5, "bytes": [97]}, {"token": "b", "logprob": -9999.0, "bytes": None}]}]}  # fmt: skip
    ChatCompletionChunk.model_validate(chat_chunk("c", 1, "m", delta={"content": "a"}, logprobs=chat))
    assert completion_logprobs(toks, 2)["top_logprobs"] == [{"a": -0.5, "b": -9999.0}]


def test_chunk_usage_key():
    assert "usage" not in chat_chunk("c", 1, "m", delta={})
    assert chat_chunk("c", 1, "m", delta={}, usage=None)["usage"] is None
    assert completion_chunk("c", 1, "m", text="", usage=None)["usage"] is None
    assert chat_chunk("c", 1, "m", delta={}, usage=usage_body(1, 1))["usage"]["total_tokens"] == 2


@pytest.mark.parametrize("reason,expected", [
    (None, None), ("eos", "stop"), ("stop", "stop"), ("length", "length"), ("cancelled", "stop"),
    ("content_filter", "content_filter"), ("error", "stop"),
])  # fmt: skip
def test_finish_reason(reason, expected):
    assert (FinishReason(reason).openai if reason else None) == expected


# -- the OpenAPI contract says what the parser refuses ----------------------------------------------
# Rules JSON Schema cannot state: between two fields' values, at most one of several fields, and what a
# string field must hold (a JSON schema given as a string).
_SERVER_ONLY = ("must not exceed", "only one", "not valid JSON", "schema object")


@pytest.mark.parametrize("parse,make,fields,param,message",
                         [case for case in ERROR_CASES if not any(rule in case.values[4] for rule in _SERVER_ONLY)])
def test_openapi_schema_rejects_what_the_parser_rejects(parse, make, fields, param, message):
    """Generated clients and fuzzers learn the contract from /openapi.json: a body the parser refuses for
    one field is invalid by the schema too (model "" and response_format {} used to pass it)."""
    schemas = openapi_spec(["m"])["components"]["schemas"]
    name = "ChatCompletionRequest" if parse is parse_chat_request else "CompletionRequest"
    validator = jsonschema.Draft202012Validator(schemas[name])
    assert not validator.is_valid(json.loads(make(**fields))), fields


@pytest.mark.parametrize("fields", [{"model": ""}, {"response_format": {}}, {"response_format": {"type": "xml"}},
                                    {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                                    {"stream_options": {"include_usage": True}}])
def test_openapi_schema_rejects_the_reported_cases(fields):
    schema = openapi_spec(["m"])["components"]["schemas"]["ChatCompletionRequest"]
    assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(chat_body(**fields)))
    with pytest.raises(RequestError):
        parse_chat_request(chat_body(**fields))


BEYOND_64_BITS = -(2**75)


@pytest.mark.parametrize(("parse", "body", "param"), [
    (parse_chat_request, {"messages": [{"role": "user", "content": "x"}], "guided_json": {"a": BEYOND_64_BITS}},
     "guided_json"),
    (parse_chat_request, {"messages": [{"role": "user", "content": "x"}], "nvext": {"x": [BEYOND_64_BITS]}},
     "nvext"),
    (parse_chat_request, {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"maximum": BEYOND_64_BITS}}}]},
     "tools[0].function.parameters"),
    (parse_request, {"input": "x", "text": {"format": {"type": "json_schema", "name": "n",
                                                                 "schema": {"a": BEYOND_64_BITS}}}}, "text.format.schema"),
    (parse_request, {"input": "x", "tools": [{"type": "function", "name": "f",
                                                        "parameters": {"a": BEYOND_64_BITS}}]}, "tools[0].parameters"),
    (parse_messages_request, {"max_tokens": 3, "messages": [{"role": "user", "content": "x"}],
                                        "output_config": {"format": {"type": "json_schema",
                                                                     "schema": {"a": BEYOND_64_BITS}}}},
     "output_config.format.schema"),
    (parse_messages_request, {"max_tokens": 3, "messages": [{"role": "user", "content": "x"}], "tools": [
        {"name": "f", "input_schema": {"type": "object", "maximum": BEYOND_64_BITS}}]}, "tools[0].input_schema"),
])
def test_integers_the_request_plane_cannot_carry_are_a_400(parse, body, param):
    """Free-form JSON that travels to the worker (schemas, nvext) is msgpack there: an integer beyond 64 bits
    is the client's mistake, named, not a failure to send."""
    with pytest.raises(RequestError) as e:
        parse(json.dumps({"model": "m", **body}).encode())
    assert (e.value.status, e.value.param) == (400, param)
