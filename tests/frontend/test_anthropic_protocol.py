"""The Messages API's mapping without processes: request bodies onto chat requests, outcomes onto
Message objects and Anthropic's event stream."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tandem.frontend.api.anthropic.protocol import (
    error_body,
    parse_count_tokens_request,
    parse_messages_request,
)
from tandem.frontend.api.anthropic.serving import MessagesAnswer, stop_reason
from tandem.frontend.protocol.answer import Ending, Outcome, Usage
from tandem.frontend.protocol.errors import RequestError
from tandem.frontend.requests import ChatRequest, ImagePart
from tandem.llm.parsers import ParsedDelta, ToolCallDelta
from tandem.llm.postprocess import ProcessedDelta

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
SEARCH = {"name": "search", "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}}}


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}],
                       **fields}).encode()


def chat(reasoning: bool = False, **fields: Any) -> ChatRequest:
    return parse_messages_request(body(**fields)).chat(reasoning=reasoning)


# -- requests --------------------------------------------------------------------------------------
def test_conversation_with_tools_becomes_chat_messages():
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?", "cache_control": {"type": "ephemeral"}},
                                     {"type": "text", "text": "In Paris."}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Need a lookup.", "signature": "sig"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "search", "input": {"query": "café"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C", "cache_control": {"type": "ephemeral"}},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "no"}, {"type": "text", "text": "network"}]},
            {"type": "text", "text": "Go on."}]},
    ]
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0; cch=abc;"},
              {"type": "text", "text": "You are a helper."}, {"type": "text", "text": "Be brief.",
                                                               "cache_control": {"type": "ephemeral"}}]
    request = chat(messages=history, system=system, tools=[WEATHER, SEARCH])
    assert request.messages == [
        {"role": "system", "content": "You are a helper.\nBe brief."},
        {"role": "user", "content": "Weather?\nIn Paris."},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Need a lookup.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "toolu_2", "type": "function", "function": {"name": "search", "arguments": '{"query":"café"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "21 C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no\nnetwork"},
        {"role": "user", "content": "Go on."},
    ]
    assert request.tools == [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                               "parameters": WEATHER["input_schema"]}},
                             {"type": "function", "function": {"name": "search", "parameters": SEARCH["input_schema"]}}]
    assert request.tool_choice == "auto" and request.parallel_tool_calls is None and request.fit_max_tokens


def test_string_system_and_content():
    request = chat(system="Be brief.", messages=[{"role": "user", "content": "a"},
                                                  {"role": "assistant", "content": "b"}])
    assert request.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"},
                                {"role": "assistant", "content": "b"}]


def test_calls_alone_have_null_content_and_empty_turns_stay():
    call = {"type": "tool_use", "id": "t1", "name": "search", "input": {}}
    request = chat(tools=[SEARCH], messages=[
        {"role": "user", "content": []},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hm."}]}])
    assert request.messages == [
        {"role": "user", "content": ""},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "search", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t1", "content": ""},
        {"role": "assistant", "content": "", "reasoning_content": "Hm."}]


def test_sampling_stop_and_metadata():
    request = chat(stop_sequences=["END", ""], temperature=0.5, top_p=0.9, top_k=0, metadata={"user_id": "u1"},
                   service_tier="auto", container=None, unknown_field={"x": 1})
    assert (request.stop, request.temperature, request.top_p, request.top_k, request.user) == (["END"], 0.5, 0.9,
                                                                                                None, "u1")
    assert chat(top_k=40).top_k == 40 and chat().stop is None
    assert (request.max_tokens, request.stream) == (100, False)
    assert parse_messages_request(body(stream=True)).stream


@pytest.mark.parametrize(("thinking", "reasoning", "kwargs", "budget"), [
    ({"type": "enabled", "budget_tokens": 2048}, True, {"enable_thinking": True}, 2048),
    ({"type": "enabled", "budget_tokens": 2048}, False, {"enable_thinking": True}, None),
    ({"type": "adaptive"}, True, {"enable_thinking": True}, None),
    ({"type": "disabled"}, True, {"enable_thinking": False}, None),
    (None, True, None, None),
])
def test_thinking(thinking, reasoning, kwargs, budget):
    request = chat(reasoning, max_tokens=4096, **({"thinking": thinking} if thinking else {}))
    assert request.chat_template_kwargs == kwargs
    assert request.ext.max_thinking_tokens == budget
    assert request.thinking is (thinking is None or thinking["type"] != "disabled")


def test_tool_choice():
    assert chat(tools=[WEATHER], tool_choice={"type": "auto"}).tool_choice == "auto"
    assert chat().tool_choice == "none"  # no tools
    none = chat(tools=[WEATHER], tool_choice={"type": "none"})
    assert none.tool_choice == "none" and none.guided is None
    forced = chat(tools=[WEATHER, SEARCH], tool_choice={"type": "tool", "name": "search"})
    assert (forced.tool_choice, forced.forced_function) == ("required", "search")
    assert forced.guided is not None and forced.guided.json == SEARCH["input_schema"]
    any_ = chat(tools=[WEATHER, SEARCH], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert (any_.tool_choice, any_.forced_function, any_.parallel_tool_calls) == ("required", None, False)
    assert any_.guided is not None and any_.guided.json["maxItems"] == 1
    assert chat(tools=[WEATHER], tool_choice={"type": "auto", "disable_parallel_tool_use": True}).parallel_tool_calls \
        is False


def test_output_config():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = chat(output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "max"})
    assert request.guided is not None and request.guided.json == schema
    assert request.reasoning_effort == "high"
    assert chat(output_config={"effort": "low"}).reasoning_effort == "low"


def test_count_tokens_body_needs_no_max_tokens():
    request = parse_count_tokens_request(json.dumps({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
        "thinking": {"type": "enabled", "budget_tokens": 1024}}).encode())
    chat_request = request.chat(reasoning=True)
    assert (chat_request.max_tokens, chat_request.stream, chat_request.tool_choice) == (None, False, "auto")


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"max_tokens": "ten"}, "max_tokens", "expected `int`"),
    ({"max_tokens": 0}, "max_tokens", "between 1 and 4294967295"),
    ({"messages": "hi"}, "messages", "expected `array`"),
    ({"messages": []}, "messages", "at least one message"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "'tool'"),
    ({"messages": [{"role": "system", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages[0].content[0]", "not allowed in system messages"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0].type", "'audio'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].source.type", "type"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
     "messages[0].content[0].source.type", "file"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url"}}]}]},
     "messages[0].content[0].source.url", "url"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "document", "source": {}}]}]}]}, "messages[0].content[0].content[0]", "document blocks are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://a/b.png"}}]}]}]},
     "messages[0].content[0].content[0]", "image blocks are not allowed in a tool_result"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id", "Missing"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages[0].content[0]", "not allowed in user messages"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages[0].content[0]", "not allowed in assistant messages"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}]}]},
     "messages[0].content[0].input", "expected `object`"),
    ({"temperature": 3}, "temperature", "between 0 and 1"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"top_k": -1}, "top_k", "between 0"),
    ({"stop_sequences": ["s"] * 17}, "stop_sequences", "at most 16"),
    ({"system": [{"type": "image"}]}, "system[0].type", "'image'"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}], "tool_choice": {"type": "tool", "name": "web_search"}},
     "tool_choice.name", "does not run"),
    ({"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "tool_uses", "value": 1}}]}},
     "context_management.edits[0].keep", "thinking_turns"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema", "Missing"),
    ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "tools[0].input_schema.type", "'object'"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].name", "unique"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name", "'nope'"),
    ({"tool_choice": {"type": "any"}}, "tool_choice", "at least one tool"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type", "'sometimes'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "any"},
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "tool_choice", "cannot"),
    ({"thinking": {"type": "enabled", "budget_tokens": 512}, "max_tokens": 4096}, "thinking.budget_tokens",
     "between 1024"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2**40}, "max_tokens": 2**32 - 1}, "thinking.budget_tokens",
     "4294967295"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}, "max_tokens": 2048}, "thinking.budget_tokens",
     "less than max_tokens"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens", "Missing"),
    ({"metadata": {"user_id": 7}}, "metadata.user_id", "expected `str`"),
    ({"model": ""}, "model", "non-empty"),
])
def test_bad_input_names_the_field(fields, param, words):
    with pytest.raises(RequestError) as info:
        parse_messages_request(body(**fields))
    error = info.value
    assert (error.status, error.param) == (400, param)
    rendered = error_body(error)
    assert rendered["type"] == "error" and rendered["error"]["type"] == "invalid_request_error"
    assert param in rendered["error"]["message"]
    assert words in rendered["error"]["message"]


def test_missing_max_tokens_and_bad_json():
    with pytest.raises(RequestError) as info:
        parse_messages_request(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}')
    assert info.value.param == "max_tokens"
    with pytest.raises(RequestError) as info:
        parse_count_tokens_request(b'{"model": "m", "messages": [')
    assert info.value.status == 400 and "not valid JSON" in info.value.message


def test_error_types_by_status():
    kinds = {status: error_body(RequestError("x", status=status))["error"]["type"]
             for status in (400, 401, 404, 413, 429, 500, 503)}
    assert kinds == {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                     413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


# -- answers ---------------------------------------------------------------------------------------
def ending(reason: str = "eos", stop: str | int | None = None, called: bool = False, cached: int | None = None,
           reasoning: int | None = None) -> Ending:
    return Ending(reason, stop, called, Usage(50, 7, cached, reasoning))


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.mark.parametrize(("end", "calls", "expected"), [
    (ending("eos"), [], ("end_turn", None)),
    (ending("stop", "END"), [], ("stop_sequence", "END")),
    (ending("stop", 13), [], ("end_turn", None)),
    (ending("length"), [], ("max_tokens", None)),
    (ending("length"), [CALL], ("max_tokens", None)),  # a call cut off
    (ending("eos", called=True), [CALL], ("tool_use", None)),
    (ending("eos"), [CALL], ("tool_use", None)),  # a forced tool (OpenAI says stop)
    (ending("content_filter"), [], ("refusal", None)),
    (ending("cancelled"), [], ("end_turn", None)),
])
def test_stop_reasons(end, calls, expected):
    assert stop_reason(Outcome(tool_calls=calls), end) == expected


def test_unary_message():
    answer = MessagesAnswer("m", "msg_1", 50)
    second = {"id": "call_2", "type": "function", "function": {"name": "search", "arguments": '{"query": "x"'}}
    outcome = Outcome(text=["Check", "ing."], reasoning=["Plan", "."], tool_calls=[CALL, second])
    for parsed in (ParsedDelta(reasoning="Plan"), ParsedDelta(content="Check", reasoning="."), ParsedDelta(content="ing."),
                   ParsedDelta(tool_calls=[ToolCallDelta(0, '{"city": ', "call_1", "get_weather"),
                                           ToolCallDelta(0, '"Paris"}'), ToolCallDelta(1, '{"query": "x"', "call_2", "search")])):
        answer.collect(ProcessedDelta(), parsed)
    message = answer.body(outcome, ending("eos", called=True, cached=32, reasoning=3))
    assert message == {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
        "content": [{"type": "thinking", "thinking": "Plan.", "signature": ""}, {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "call_2", "name": "search", "input": {}}],  # arguments cut off
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 18, "output_tokens": 7, "cache_read_input_tokens": 32,
                  "output_tokens_details": {"thinking_tokens": 3}},
    }
    plain_answer = MessagesAnswer("m", "msg_2", 50)
    plain_answer.collect(ProcessedDelta(text="hi"), None)
    plain = plain_answer.body(Outcome(text=["hi"]), ending("stop", "END"))
    assert plain["content"] == [{"type": "text", "text": "hi"}]
    assert (plain["stop_reason"], plain["stop_sequence"]) == ("stop_sequence", "END")
    assert plain["usage"] == {"input_tokens": 50, "output_tokens": 7}


def events(frames: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for frame in b"".join(frames).decode().split("\n\n")[:-1]:
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[6:])
        assert payload["type"] == name[7:]
        out.append((name[7:], payload))
    return out


def test_event_stream():
    answer = MessagesAnswer("m", "msg_1", 50)
    frames = answer.opening()
    frames += answer.delta(ProcessedDelta("x"), ParsedDelta(reasoning="Pl"))
    frames += answer.delta(ProcessedDelta("x"), ParsedDelta(reasoning="an.", content="Sure."))
    frames += answer.delta(ProcessedDelta("x"), ParsedDelta(tool_calls=[
        ToolCallDelta(0, '{"city": ', "call_1", "get_weather")]))
    frames += answer.delta(ProcessedDelta("x"), ParsedDelta(tool_calls=[
        ToolCallDelta(0, '"Paris"}'), ToolCallDelta(1, "", "call_2", "search"), ToolCallDelta(1, "{}")]))
    frames += answer.delta(ProcessedDelta(""), ParsedDelta())
    frames += answer.closing(Outcome(tool_calls=[CALL]), ending("eos", called=True, cached=16))
    got = events(frames)
    assert got[0] == ("message_start", {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": 50, "output_tokens": 0}}})
    assert got[1] == ("ping", {"type": "ping"})
    assert [(name, e.get("index"), (e.get("delta") or e.get("content_block") or {}).get("type"))
            for name, e in got[2:-2]] == [
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"), ("content_block_stop", 2, None),
        ("content_block_start", 3, "tool_use"), ("content_block_delta", 3, "input_json_delta"),
        ("content_block_stop", 3, None),
    ]
    assert got[2][1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert got[10][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}
    assert "".join(e["delta"]["partial_json"] for name, e in got
                   if name == "content_block_delta" and e["index"] == 2) == '{"city": "Paris"}'
    assert got[-2] == ("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                                         "usage": {"input_tokens": 34, "output_tokens": 7,
                                                   "cache_read_input_tokens": 16}})
    assert got[-1] == ("message_stop", {"type": "message_stop"})


def test_event_stream_without_parser_and_failure():
    answer = MessagesAnswer("m", "msg_1", 5)
    frames = answer.delta(ProcessedDelta("Hel"), None) + answer.delta(ProcessedDelta(""), None)
    frames += answer.delta(ProcessedDelta("lo"), None)
    got = events(frames)
    assert [name for name, _ in got] == ["content_block_start", "content_block_delta", "content_block_delta"]
    assert [e["delta"]["text"] for _, e in got[1:]] == ["Hel", "lo"]
    failed = events([answer.failure(RequestError("the worker failed", status=500))])
    assert failed == [("error", {"type": "error", "error": {"type": "api_error", "message": "the worker failed"}})]
    busy = events([answer.failure(RequestError("no worker", status=503))])
    assert busy[0][1]["error"]["type"] == "overloaded_error"
    closing = events(answer.closing(Outcome(text=["Hello"]), ending("length")))
    assert [name for name, _ in closing] == ["content_block_stop", "message_delta", "message_stop"]
    assert closing[1][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}


def test_error_body_is_the_answer_error_shape():
    error = RequestError.model_not_found("nope")
    assert MessagesAnswer.error_body(error) == {
        "type": "error", "error": {"type": "not_found_error", "message": "The model `nope` does not exist."}}


def test_unary_blocks_keep_the_order_they_were_written():
    """Text after a tool call is its own block after it, in the body as in the stream."""
    deltas = [ParsedDelta(content="Checking."), ParsedDelta(tool_calls=[ToolCallDelta(0, "{}", "call_1", "search")]),
              ParsedDelta(content="Done.")]
    unary, streamed = MessagesAnswer("m", "msg_1", 5), MessagesAnswer("m", "msg_1", 5)
    for parsed in deltas:
        unary.collect(ProcessedDelta(), parsed)
    events = [e for parsed in deltas for e in streamed.delta(ProcessedDelta(), parsed)]
    blocks = unary.body(Outcome(), ending("eos", called=True))["content"]
    assert [b["type"] for b in blocks] == ["text", "tool_use", "text"]
    assert [b.get("text") for b in blocks] == ["Checking.", None, "Done."]
    started = [json.loads(e.split(b"data: ")[1])["content_block"]["type"] for e in events if b"content_block_start" in e]
    assert started == ["text", "tool_use", "text"]


def test_image_blocks_become_the_chat_requests_images_in_order():
    content = [{"type": "text", "text": "compare"},
               {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
               {"type": "image", "source": {"type": "url", "url": "https://a/b.png"}, "cache_control": {"type": "ephemeral"}}]
    req = chat(messages=[{"role": "user", "content": content}])
    assert req.images == [ImagePart("data:image/png;base64,AAAA", "messages[0].content[1]"),
                          ImagePart("https://a/b.png", "messages[0].content[2]")]
    assert req.messages[-1] == {"role": "user", "content": [{"type": "text", "text": "compare"}, {"type": "image"},
                                                            {"type": "image"}]}
