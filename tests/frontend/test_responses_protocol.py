"""The Responses API's protocol layer without processes: /v1/responses bodies checked and mapped onto chat
requests (`parse_request`), input items as chat messages (`input_messages`), and the per-process
response store (`ResponseStore`: LRU order, ids naming their process, why an id is missing)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tandem.frontend.api.responses.protocol import input_messages, parse_request
from tandem.frontend.api.responses.store import ResponseStore, StoredResponse
from tandem.frontend.protocol.errors import RequestError

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMS}
SEARCH = {"type": "function", "name": "search"}
DEL = object()


def body(**fields: Any) -> bytes:
    raw: dict[str, Any] = {"model": "m", "input": "hi", **fields}
    return json.dumps({k: v for k, v in raw.items() if v is not DEL}).encode()


def refused(raw: bytes) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_request(raw)
    assert info.value.status == 400
    return info.value


# -- parse_request ---------------------------------------------------------------------------------


def test_defaults():
    req = parse_request(body())
    assert req.input == [{"role": "user", "content": "hi"}]
    assert (req.stream, req.store, req.parallel_tool_calls) == (False, True, True)
    assert req.tool_choice == "auto" and req.tool_fields == {"tool_choice": "none"} and req.tools == []
    assert req.guided is None and req.text_format == {"type": "text"} and req.effort is None
    chat = req.chat([])
    assert chat.messages == [{"role": "user", "content": "hi"}] and chat.tools is None
    assert chat.tool_choice == "none" and chat.max_tokens is None and chat.guided is None


def test_chat_request_puts_instructions_history_then_input():
    req = parse_request(body(instructions="Rules.", max_output_tokens=7, temperature=0.2, top_p=0.5, user="u",
                             stream=True, store=False, tools=[WEATHER]))
    history = [{"role": "user", "content": "before"}, {"role": "assistant", "content": "reply"}]
    chat = req.chat(history)
    assert chat.messages == [{"role": "system", "content": "Rules."}, *history, {"role": "user", "content": "hi"}]
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.user, chat.stream) == (7, 0.2, 0.5, "u", True)
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                            "parameters": WEATHER_PARAMS}}]
    assert chat.tool_choice == "auto" and req.store is False


def test_input_images_become_the_chat_requests_images_in_order():
    red, blue = "data:image/png;base64,AAAA", "http://127.0.0.1:9/blue.png"
    req = parse_request(body(input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Compare"},
                                     {"type": "input_image", "image_url": red, "detail": "low"}]},
        {"role": "assistant", "content": "Which?"},
        {"role": "user", "content": [{"type": "input_image", "image_url": blue}, {"type": "input_text", "text": "b"}]},
    ]))
    assert req.input[0]["content"] == [{"type": "text", "text": "Compare"}, {"type": "image"}]
    assert req.input[2]["content"] == [{"type": "image"}, {"type": "text", "text": "b"}]
    assert [(i.url, i.param) for i in req.images] == [(red, "input[0].content[1]"), (blue, "input[2].content[0]")]
    earlier = req.images[:1]
    chat = req.chat([{"role": "user", "content": [{"type": "image"}]}], earlier)
    assert [i.url for i in chat.images] == [red, red, blue]


@pytest.mark.parametrize("part, param", [
    ({"type": "input_image", "file_id": "file-1"}, "input[0].content[0].file_id"),
    ({"type": "input_image"}, "input[0].content[0].image_url"),
    ({"type": "input_image", "image_url": ""}, "input[0].content[0].image_url"),
    ({"type": "input_image", "image_url": "http://x", "detail": "max"}, "input[0].content[0].detail"),
    ({"type": "input_file", "file_id": "file-1"}, "input[0].content[0].type"),
])
def test_bad_input_images_name_the_field(part, param):
    assert refused(body(input=[{"role": "user", "content": [part]}])).param == param


def test_an_image_in_an_assistant_message_or_a_tool_output_is_refused():
    image = {"type": "input_image", "image_url": "http://x"}
    assert refused(body(input=[{"role": "assistant", "content": [image]}])).param == "input[0].content[0].type"
    assert refused(body(input=[{"type": "function_call_output", "call_id": "c", "output": [image]}])).param == \
        "input[0].output[0].type"


def test_integral_floats_are_integers():
    assert parse_request(body(max_output_tokens=8.0)).max_output_tokens == 8


def test_reasoning_effort():
    off = parse_request(body(reasoning={"effort": "none"})).chat([])
    assert off.chat_template_kwargs == {"enable_thinking": False} and off.thinking is False
    assert off.reasoning_effort is None
    low = parse_request(body(reasoning={"effort": "low", "summary": "auto"}))
    assert low.chat([]).reasoning_effort == "low" and low.summary == "auto"
    assert low.echo()["reasoning"] == {"effort": "low", "summary": "auto"}
    assert parse_request(body(reasoning={"effort": "xhigh"})).effort == "xhigh"


def test_tool_choices():
    none = parse_request(body(tools=[WEATHER], tool_choice="none"))
    assert none.tool_fields == {"tool_choice": "none"} and none.tool_choice == "none"
    named = parse_request(body(tools=[WEATHER, SEARCH], tool_choice={"type": "function", "name": "get_weather"}))
    assert named.tool_choice == {"type": "function", "name": "get_weather"}
    chat = named.chat([])
    assert chat.tool_choice == "required" and chat.forced_function == "get_weather"
    assert chat.guided is not None and chat.guided.json == WEATHER_PARAMS
    # a function without parameters: any object
    bare = parse_request(body(tools=[WEATHER, SEARCH], tool_choice={"type": "function", "name": "search"}))
    assert bare.chat([]).guided.json == {"type": "object"}
    required = parse_request(body(tools=[WEATHER, SEARCH], tool_choice="required", parallel_tool_calls=False))
    schema = required.chat([]).guided.json
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [i["properties"]["name"]["enum"] for i in schema["items"]["anyOf"]] == [["get_weather"], ["search"]]
    assert required.chat([]).parallel_tool_calls is False and required.echo()["parallel_tool_calls"] is False
    parallel = parse_request(body(tools=[WEATHER], tool_choice="required"))
    assert "maxItems" not in parallel.chat([]).guided.json


def test_text_formats():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    js = parse_request(body(text={"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}}))
    assert js.guided is not None and js.guided.json == schema and js.chat([]).guided.json == schema
    assert js.text_format == {"type": "json_schema", "name": "x", "schema": schema, "strict": True,
                              "description": None}
    obj = parse_request(body(text={"format": {"type": "json_object"}}))
    assert obj.guided.json == {"type": "object"} and obj.text_format == {"type": "json_object"}
    text = parse_request(body(text={"format": {"type": "text"}, "verbosity": "low"}))
    assert text.guided is None and text.text_format == {"type": "text"}


def test_accepted_and_ignored():
    """What tandem serves as asked, or has no effect to have: accepted."""
    req = parse_request(body(background=False, include=["reasoning.encrypted_content"], truncation="disabled",
                             service_tier="auto", safety_identifier="s", prompt_cache_key="k",
                             metadata={"a": "b"}))
    assert req.metadata == {"a": "b"} and req.echo()["metadata"] == {"a": "b"}


def test_echo():
    req = parse_request(body(instructions="I", tools=[WEATHER], tool_choice="auto", temperature=1.0,
                             previous_response_id="resp_x"))
    echo = req.echo()
    assert echo["tools"] == [{"type": "function", "name": "get_weather", "description": "Weather",
                              "parameters": WEATHER_PARAMS, "strict": None}]
    assert (echo["instructions"], echo["tool_choice"], echo["temperature"], echo["previous_response_id"]) == (
        "I", "auto", 1.0, "resp_x")
    assert echo["truncation"] == "disabled" and echo["store"] is True and echo["text"] == {"format": {"type": "text"}}


ERRORS: list[tuple[dict[str, Any], str | None, str]] = [
    # (fields, param, substring of the message)
    ({"model": DEL}, "model", "model"),
    ({"model": ""}, "model", "non-empty"),
    ({"input": DEL}, "input", "Missing required parameter"),
    ({"input": 5}, "input", "expected"),
    ({"input": ""}, "input", "must not be empty"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": ["hi"]}, "input[0]", "expected `object`"),
    ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"max_output_tokens": 1.5}, "max_output_tokens", "expected `int`"),
    ({"temperature": 3}, "temperature", "between 0 and 2"),
    ({"temperature": -0.1}, "temperature", "between 0 and 2"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"stream": "yes"}, "stream", "expected `bool`"),
    ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "function", "name": "web_search"}}, "tool_choice.name",
     "does not run"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "a b"}]}]},
     "tools[0].tools[0].name", "1 to 64"),
    ({"tools": [{"type": "namespace", "tools": []}]}, "tools[0].name", "Missing required"),
    ({"tools": [{"type": "function", "name": "ns__f"}, {"type": "namespace", "name": "ns", "description": "",
                                                       "tools": [{"type": "function", "name": "f"}]}]},
     "tools", "'ns__f' is given twice"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "tandem1:***"}]},
     "input[0].encrypted_content", "damaged"),
    ({"tools": [WEATHER, {"type": "function"}]}, "tools[1].name", "Missing required parameter"),
    ({"tools": [{"type": "function", "name": "a b"}]}, "tools[0].name", "1 to 64"),
    ({"tools": [{"type": "function", "name": "f", "parameters": []}]}, "tools[0].parameters", "expected `object`"),
    ({"tool_choice": "required"}, "tool_choice", "at least one tool"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "none, auto, required"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name", "'nope'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.name", "not in 'tools'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice.type", "only function"),
    ({"tools": [WEATHER], "tool_choice": {"name": "get_weather"}}, "tool_choice.type", "Missing required"),
    ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "tool_choice",
     "cannot be combined"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type", "text, json_object or json_schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "requires a 'schema'"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name", "requires a 'name'"),
    ({"text": {"format": {"name": "x"}}}, "text.format.type", "Missing required"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", "must be one of"),
    ({"background": True}, "background", "background responses are not supported"),
    ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt templates"),
    ({"max_tool_calls": 3}, "max_tool_calls", "not supported"),
    # 0 is a value too (0 == False in Python must not let it through as "not given")
    ({"max_tool_calls": 0}, "max_tool_calls", "not supported"),
    ({"top_logprobs": 2}, "top_logprobs", "/v1/chat/completions"),
    ({"truncation": "auto"}, "truncation", "only 'disabled'"),
    ({"include": ["reasoning.encrypted_content", "file_search_call.results"]}, "include[1]", "not supported"),
    ({"metadata": "a"}, "metadata", "expected `object`"),
]


@pytest.mark.parametrize(("fields", "param", "words"), ERRORS, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(ERRORS)])
def test_errors_name_the_field(fields, param, words):
    error = refused(body(**fields))
    assert error.param == param
    assert words in error.message
    assert error.body() == {"error": {"message": error.message, "type": "invalid_request_error", "param": param,
                                      "code": None}}


@pytest.mark.parametrize("raw", [b"{", b"[]", b'"hi"', b"\xff"])
def test_not_a_json_object(raw):
    error = refused(raw)
    assert error.param is None


# -- input_messages --------------------------------------------------------------------------------


def test_messages_as_they_are():
    assert input_messages([{"role": "user", "content": "hi"},
                           {"type": "message", "role": "developer", "content": "dev"},
                           {"role": "system", "content": [{"type": "input_text", "text": "a"},
                                                          {"type": "input_text", "text": "b"}]},
                           {"type": "message", "role": "assistant", "status": "completed", "id": "msg_1",
                            "content": [{"type": "output_text", "text": "x", "annotations": []},
                                        {"type": "refusal", "refusal": "no"}]}]) == [
        {"role": "user", "content": "hi"}, {"role": "developer", "content": "dev"},
        {"role": "system", "content": "a\nb"}, {"role": "assistant", "content": "x\nno"}]


def call(call_id: str, name: str = "f", arguments: str = "{}") -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments, "id": f"fc_{call_id}",
            "status": "completed"}


def chat_call(call_id: str, name: str = "f", arguments: str = "{}") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_calls_join_the_assistant_turn_before_them():
    assert input_messages([{"role": "user", "content": "q"}, {"role": "assistant", "content": "Checking."},
                           call("c1", "get_weather", '{"city": "Paris"}'), call("c2"),
                           {"type": "function_call_output", "call_id": "c1", "output": "21"},
                           {"type": "function_call_output", "call_id": "c2",
                            "output": [{"type": "input_text", "text": "ok"}]}]) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Checking.",
         "tool_calls": [chat_call("c1", "get_weather", '{"city": "Paris"}'), chat_call("c2")]},
        {"role": "tool", "tool_call_id": "c1", "content": "21"},
        {"role": "tool", "tool_call_id": "c2", "content": "ok"}]


def test_a_call_alone_is_an_assistant_turn():
    assert input_messages([{"role": "user", "content": "q"}, call("c1"),
                           {"type": "function_call_output", "call_id": "c1", "output": "r"}, call("c2")]) == [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [chat_call("c1")]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
        {"role": "assistant", "content": None, "tool_calls": [chat_call("c2")]}]


def test_reasoning_is_the_thinking_of_the_next_assistant_turn():
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "Plan."}]}
    assert input_messages([{"role": "user", "content": "q"}, reasoning,
                           {"role": "assistant", "content": "A."}, call("c1")]) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "A.", "reasoning_content": "Plan.", "tool_calls": [chat_call("c1")]}]
    # before a call: the call's turn carries it (not merged into the turn before)
    summary = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Short plan."}]}
    assert input_messages([{"role": "assistant", "content": "A."}, summary, call("c1")]) == [
        {"role": "assistant", "content": "A."},
        {"role": "assistant", "content": None, "tool_calls": [chat_call("c1")], "reasoning_content": "Short plan."}]


@pytest.mark.parametrize(("items", "param"), [
    ([{"role": "user", "content": "hi"}, {"type": "item_reference", "id": "x"}], "input[1].type"),
    ([{"type": 5, "role": "user", "content": "hi"}], "input[0].type"),
    ([{"role": "robot", "content": "hi"}], "input[0].role"),
    ([{"content": "hi"}], "input[0].role"),
    ([{"role": "user", "content": None}], "input[0].content"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}], "input[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_file", "file_id": "f"}]}],
     "input[0].content[1].type"),
    ([{"role": "user", "content": [{"type": "input_text"}]}], "input[0].content[0].text"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
    ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}], "input[0].arguments"),
    ([{"type": "function_call_output", "output": "21"}], "input[0].call_id"),
    ([{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_audio"}]}], "input[0].output[0].type"),
])
def test_bad_items_name_the_field(items, param):
    with pytest.raises(RequestError) as info:
        input_messages(items)
    assert info.value.param == param and info.value.status == 400


def test_the_param_prefix():
    with pytest.raises(RequestError) as info:
        input_messages([{"type": "nope"}], param="items")
    assert info.value.param == "items[0].type"


def test_parse_request_maps_input_items():
    req = parse_request(body(input=[{"role": "user", "content": "q"}, call("c1"),
                                    {"type": "function_call_output", "call_id": "c1", "output": "r"}]))
    assert [m["role"] for m in req.input] == ["user", "assistant", "tool"]


# -- ResponseStore ---------------------------------------------------------------------------------


def entry(n: int) -> StoredResponse:
    return StoredResponse({"id": n}, [{"role": "user", "content": str(n)}], [])


def test_ids_name_the_process():
    store = ResponseStore(4, 0x2A)
    rid = store.new_id("abc123")
    assert rid == "resp_000000000000002aabc123"
    assert ResponseStore(4, 2**63 - 1).new_id("x") == f"resp_{2**63 - 1:016x}x"


def test_lru_order():
    store = ResponseStore(2, 1)
    a, b, c, d = (store.new_id(x) for x in "abcd")
    store.put(a, entry(1))
    store.put(b, entry(2))
    assert store.get(a) == entry(1)  # a is now the most recently used
    store.put(c, entry(3))
    assert store.get(b) is None and store.get(a) == entry(1) and store.get(c) == entry(3)
    store.put(a, entry(11))  # put again: replaced, and the most recently used
    store.put(d, entry(4))
    assert store.get(c) is None and store.get(a) == entry(11) and store.get(d) == entry(4)


def test_delete():
    store = ResponseStore(2, 1)
    a = store.new_id("a")
    store.put(a, entry(1))
    assert store.delete(a) is True and store.get(a) is None and store.delete(a) is False


def test_capacity_zero_stores_nothing():
    store = ResponseStore(0, 1)
    a = store.new_id("a")
    store.put(a, entry(1))
    assert store.get(a) is None
    assert "--responses-store-size 0" in store.why_missing(a)


@pytest.mark.parametrize(("rid", "words"), [
    ("resp_nope", "not one this server made"),
    ("chatcmpl-000000000000000100", "not one this server made"),
    ("resp_0000000000000001", "not one this server made"),  # no request id after the process
    ("", "not one this server made"),
    ("resp_00000000000000ffabc", "another frontend process (instance ff)"),
    ("resp_0000000000000001abc", "store=false, deleted, or evicted"),
])
def test_why_missing(rid, words):
    store = ResponseStore(3, 1)
    assert words in store.why_missing(rid)


def test_why_missing_an_evicted_id_names_the_capacity():
    store = ResponseStore(1, 7)
    a, b = store.new_id("a"), store.new_id("b")
    store.put(a, entry(1))
    store.put(b, entry(2))
    assert store.get(a) is None
    why = store.why_missing(a)
    assert "evicted" in why and "last 1 responses" in why and "--responses-store-size" in why
    assert "another frontend" in ResponseStore(1, 8).why_missing(a)
