"""OpenAI's Responses API (`/v1/responses`) end to end through the official `openai` client: unary and
streamed answers (event order, sequence numbers, the SDK's typed events and its stream helper), reasoning
and function tools on a Hermes-style engine, tool round trips with `previous_response_id` and without,
the response store (chaining, retrieval, deletion, eviction, ids of another process), structured output
as guided decoding, and OpenAI-shaped 400s naming the field. Every answer the client gets, every streamed event
and error body, is validated against the SDK's own models (tests/support/shapes.py).

The test engine writes what the prompt scripts: `[[say:TEXT]]`, `[[prompt]]` (its templated prompt),
`[[echo]]` (the request options it received), `[[fail]]` (an error mid-stream)."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pydantic
import pytest
from openai.types import responses as R

from tandem.testing.engine import DEFAULT_TEXT
from tests.support import TESTS
from tests.support.deployment import Deployment
from tests.support.processes import TandemProcess
from tests.support.shapes import RESPONSE_EVENTS, checked_http_client, conforms, sse_events

TEMPLATES = TESTS / "templates"
HERMES_FLAGS = ["--dyn-tool-call-parser", "hermes", "--dyn-reasoning-parser", "qwen3",
                "--custom-jinja-template", str(TEMPLATES / "hermes_tools.jinja")]
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                  "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_PARAMS}
SEARCH = {"type": "function", "name": "search",
          "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}
TOOLS = [WEATHER, SEARCH]
PARIS = ("get_weather", {"city": "Paris", "days": 2})
CAFE = ("search", {"query": "cafe"})
CALL_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
CALL_CAFE = '<tool_call>\n{"name": "search", "arguments": {"query": "cafe"}}\n</tool_call>'
# What the hermes engine writes: thinking, text, two calls.
HERMES = f"<think>The user wants weather.</think>\n\nChecking.\n{CALL_PARIS}\n{CALL_CAFE}"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, smollm2):
    deployment = Deployment(tmp_path_factory.mktemp("responses"), smollm2,
                            engines=[["--model-name", "plain"], ["--model-name", "hermes", *HERMES_FLAGS]])
    yield deployment
    deployment.stop()


@pytest.fixture(scope="module")
def small(deployment):
    """A second frontend on the same engines that keeps only 2 responses."""
    frontend = TandemProcess("tandem.frontend", "--http-host", "127.0.0.1", "--http-port", "0",
                             "--discovery-backend", "file", "--responses-store-size", "2", env=deployment.env)
    try:
        url = frontend.ready[0]
        deployment.wait_for_instances(len(deployment.engines), url=url)
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    finally:
        frontend.stop()


@pytest.fixture
def client(deployment) -> openai.OpenAI:
    """The official client; every answer it gets is checked against the SDK's models (tests/support/shapes.py)."""
    return deployment.client(timeout=60, http_client=checked_http_client())


def say(text: str) -> str:
    return f"[[say:{text}]]"


def items(response: Any) -> list[tuple[Any, ...]]:
    """A response's output items by what they say (not their ids)."""
    out: list[tuple[Any, ...]] = []
    for item in response.output:
        if item.type == "message":
            out.append(("message", item.role, [(c.type, c.text) for c in item.content]))
        elif item.type == "reasoning":
            out.append(("reasoning", [(c.type, c.text) for c in item.content or []]))
        else:
            assert item.type == "function_call"
            out.append(("function_call", item.name, json.loads(item.arguments)))
    return out


def compress(types: list[str]) -> list[str]:
    """Event types with each run of one delta type written once."""
    out: list[str] = []
    for t in types:
        if not (t.endswith(".delta") and out and out[-1] == t):
            out.append(t)
    return out


def check_typed(events: list[Any]) -> None:
    """Every event reached the test as the SDK's class for its type (the client's transport validated each
    event's wire form against that class, and the numbering 0, 1, 2, ...)."""
    for event in events:
        assert isinstance(event, RESPONSE_EVENTS[event.type]), (event.type, type(event))


def serves(client: openai.OpenAI) -> None:
    assert client.responses.create(model="plain", input=say("still here"), store=False).output_text == "still here"


# -- unary -----------------------------------------------------------------------------------------


def test_unary_string_input(client, tok):
    r = client.responses.create(model="plain", input=say("Hello there"), temperature=0.5, top_p=0.9,
                                metadata={"k": "v"})
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "plain"
    assert r.status == "completed" and r.incomplete_details is None and r.error is None
    assert r.output_text == "Hello there"
    assert items(r) == [("message", "assistant", [("output_text", "Hello there")])]
    assert r.output[0].status == "completed" and r.output[0].id.startswith("msg_")
    assert r.temperature == 0.5 and r.top_p == 0.9 and r.metadata == {"k": "v"} and r.store is True
    assert r.usage.input_tokens == client.responses.input_tokens.count(model="plain",
                                                                       input=say("Hello there")).input_tokens
    assert r.usage.output_tokens == len(tok.encode("Hello there")) + 1  # and EOS
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0


def test_usage_matches_the_sdk_schema(deployment):
    """The usage object as the SDK declares it (every required field, no other), unary and streamed."""
    body = {"model": "plain", "input": say("Hello there")}
    unary = httpx.post(f"{deployment.url}/v1/responses", json=body, timeout=60)
    conforms(R.ResponseUsage, json.dumps(unary.json()["usage"]))
    streamed = httpx.post(f"{deployment.url}/v1/responses", json=body | {"stream": True}, timeout=60)
    name, done = sse_events(streamed.text)[-1]
    assert name == "response.completed"
    conforms(R.ResponseUsage, json.dumps(json.loads(done)["response"]["usage"]))


def test_unary_message_list_with_instructions(client):
    conversation = [{"role": "user", "content": "My name is Ada."},
                    {"role": "assistant", "content": "Hello Ada."},
                    {"type": "message", "role": "user",
                     "content": [{"type": "input_text", "text": "Say it back."}, {"type": "input_text",
                                                                                  "text": "[[prompt]]"}]}]
    r = client.responses.create(model="plain", input=conversation, instructions="Be brief.")
    assert r.instructions == "Be brief."
    prompt = r.output_text
    assert prompt.startswith("<|im_start|>system\nBe brief.\n")
    turns = ["<|im_start|>user\nMy name is Ada.\n", "<|im_start|>assistant\nHello Ada.\n",
             "<|im_start|>user\nSay it back.\n\n<|im_start|>assistant\n"]
    assert all(t in prompt for t in turns) and [prompt.index(t) for t in turns] == sorted(prompt.index(t) for t in turns)
    counted = client.responses.input_tokens.count(model="plain", input=conversation, instructions="Be brief.")
    assert r.usage.input_tokens == counted.input_tokens
    without = client.responses.input_tokens.count(model="plain", input=conversation)
    assert without.input_tokens != counted.input_tokens


def test_max_output_tokens_is_incomplete(client, tok):
    r = client.responses.create(model="plain", input="tell me a story", max_output_tokens=4)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.max_output_tokens == 4 and r.usage.output_tokens == 4
    assert r.output_text == tok.decode(tok.encode(DEFAULT_TEXT)[:4])
    assert r.output[0].status == "incomplete"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="nope", input="hi")
    assert info.value.status_code == 404 and info.value.code == "model_not_found"
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.responses.input_tokens.count(model="nope", input="hi")
    serves(client)


def test_unary_failure_is_a_500(client):
    with pytest.raises(openai.InternalServerError) as info:
        client.responses.create(model="plain", input="[[fail]]")
    assert "failed as asked" in info.value.message
    serves(client)


# -- streaming -------------------------------------------------------------------------------------


def test_stream_event_order(client):
    events = list(client.responses.create(model="plain", input=say("Hello there, world"), stream=True))
    check_typed(events)
    assert compress([e.type for e in events]) == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert sum(e.type == "response.output_text.delta" for e in events) > 1
    created, done = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == done.id
    added = events[2].item
    assert added.type == "message" and added.status == "in_progress"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Hello there, world"
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {added.id}
    assert events[-4].text == text and events[-3].part.text == text
    assert events[-2].item.status == "completed" and events[-2].item.content[0].text == text
    assert done.status == "completed" and done.output_text == text and done.output[0].id == added.id
    unary = client.responses.create(model="plain", input=say("Hello there, world"))
    assert done.usage.input_tokens == unary.usage.input_tokens
    assert done.usage.output_tokens == unary.usage.output_tokens
    # the store keeps the streamed response as it ended
    assert client.responses.retrieve(done.id).model_dump() == done.model_dump()


def test_stream_helper_final_response_equals_unary(client):
    unary = client.responses.create(model="plain", input=say("Same either way."))
    with client.responses.stream(model="plain", input=say("Same either way.")) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == unary.output_text == "".join(deltas) == "Same either way."
    assert items(final) == items(unary)
    assert final.status == "completed"


def test_stream_cut_by_max_output_tokens_ends_incomplete(client):
    events = list(client.responses.create(model="plain", input="tell me a story", max_output_tokens=3,
                                          stream=True))
    check_typed(events)
    assert events[-1].type == "response.incomplete"
    assert "response.completed" not in [e.type for e in events]
    last = events[-1].response
    assert last.status == "incomplete" and last.incomplete_details.reason == "max_output_tokens"
    assert last.usage.output_tokens == 3 and last.output[0].status == "incomplete"
    assert events[-2].type == "response.output_item.done" and events[-2].item.status == "incomplete"


def test_stream_failure_ends_with_error_then_failed(client):
    events = list(client.responses.create(model="plain", input="[[fail]]", stream=True))
    check_typed(events)
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    error, failed = events[-2], events[-1].response
    assert "failed as asked" in error.message and error.code == "server_error"
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert failed.output[0].status == "incomplete" and failed.output_text == " partial"
    # the SDK's stream helper ends too, with no completed response to give
    with client.responses.stream(model="plain", input="[[fail]]") as stream:
        types = [e.type for e in stream]
        with pytest.raises(RuntimeError):
            stream.get_final_response()
    assert types[-2:] == ["error", "response.failed"]
    serves(client)


# -- reasoning and function tools (hermes) ---------------------------------------------------------


def test_reasoning_text_and_calls_unary(client):
    r = client.responses.create(model="hermes", input=say(HERMES), tools=TOOLS)
    assert items(r) == [("reasoning", [("reasoning_text", "The user wants weather.")]),
                        ("message", "assistant", [("output_text", "Checking.")]),
                        ("function_call", *PARIS), ("function_call", *CAFE)]
    calls = r.output[2:]
    assert all(c.call_id.startswith("call_") and c.id.startswith("fc_") for c in calls)
    assert len({c.call_id for c in calls}) == 2 and r.output[0].id.startswith("rs_")
    assert r.status == "completed" and r.tool_choice == "auto" and r.parallel_tool_calls is True
    assert [t.name for t in r.tools] == ["get_weather", "search"] and r.tools[0].parameters == WEATHER_PARAMS
    details = r.usage.output_tokens_details
    assert 0 < details.reasoning_tokens < r.usage.output_tokens
    counted = client.responses.input_tokens.count(model="hermes", input=say(HERMES), tools=TOOLS)
    assert counted.input_tokens == r.usage.input_tokens


def test_reasoning_text_and_calls_streamed(client):
    unary = client.responses.create(model="hermes", input=say(HERMES), tools=TOOLS)
    events = list(client.responses.create(model="hermes", input=say(HERMES), tools=TOOLS, stream=True))
    check_typed(events)
    item_events = ["response.output_item.added", "response.content_part.added"]
    assert compress([e.type for e in events]) == [
        "response.created", "response.in_progress",
        *item_events, "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        *item_events, "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.output_index for e in added] == [0, 1, 2, 3]
    assert [(e.item.name, e.item.arguments) for e in added[2:]] == [("get_weather", ""), ("search", "")]
    for call in added[2:]:
        arguments = "".join(e.delta for e in events
                            if e.type == "response.function_call_arguments.delta" and e.item_id == call.item.id)
        done = next(e for e in events if e.type == "response.function_call_arguments.done" and e.item_id == call.item.id)
        assert done.arguments == arguments and done.name == call.item.name
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == "The user wants weather."
    final = events[-1].response
    assert items(final) == items(unary)
    assert [o.type for o in final.output] == [o.type for o in unary.output]
    with client.responses.stream(model="hermes", input=say(HERMES), tools=TOOLS) as stream:
        helper = stream.get_final_response()
    assert items(helper) == items(unary)
    assert final.usage.output_tokens_details.reasoning_tokens == unary.usage.output_tokens_details.reasoning_tokens


@pytest.mark.parametrize("text", [
    HERMES,
    "Just words, 2 < 3.",
    f"<think>Plan.</think>\n\n{CALL_PARIS}",
    "<think>Only thinking.</think>",  # no answer after the thinking
    f"Checking.\n{CALL_PARIS}\nDone.",  # text after the call
    "",  # nothing at all
], ids=["all", "text", "thinking+call", "thinking-only", "text-after-call", "empty"])
def test_streamed_and_unary_agree(client, text):
    """The same output gives the same items in the same order, streamed or not."""
    unary = client.responses.create(model="hermes", input=say(text), tools=TOOLS)
    with client.responses.stream(model="hermes", input=say(text), tools=TOOLS) as stream:
        streamed = stream.get_final_response()
    assert items(streamed) == items(unary)
    assert streamed.output_text == unary.output_text


def test_tool_choice_none_keeps_the_text(client):
    text = f"Checking.\n{CALL_PARIS}"
    r = client.responses.create(model="hermes", input=say(text), tools=TOOLS, tool_choice="none")
    assert items(r) == [("message", "assistant", [("output_text", text)])]
    assert r.tool_choice == "none"
    with client.responses.stream(model="hermes", input=say(text), tools=TOOLS, tool_choice="none") as stream:
        assert items(stream.get_final_response()) == items(r)


def test_named_tool_choice(client):
    """A named function: guided decoding makes the whole answer its arguments (scripted here)."""
    choice = {"type": "function", "name": "get_weather"}
    r = client.responses.create(model="hermes", input=say('{"city": "Paris", "days": 2}'), tools=TOOLS,
                                tool_choice=choice)
    assert items(r) == [("function_call", *PARIS)] and r.status == "completed"
    assert r.tool_choice.type == "function" and r.tool_choice.name == "get_weather"
    with client.responses.stream(model="hermes", input=say('{"city": "Paris", "days": 2}'), tools=TOOLS,
                                 tool_choice=choice) as stream:
        assert items(stream.get_final_response()) == items(r)
    # what reached the engine: the function's parameters as the guided JSON schema
    echo = client.responses.create(model="plain", input="[[echo]]", tools=TOOLS, tool_choice=choice)
    [call] = echo.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["sampling_options"]["guided_decoding"]["json"] == WEATHER_PARAMS


def test_required_tool_choice_and_parallel_tool_calls(client):
    forced = say('[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}, '
                 '{"name": "search", "parameters": {"query": "cafe"}}] ')  # (a space before the closing `]]`)
    r = client.responses.create(model="hermes", input=forced, tools=TOOLS, tool_choice="required")
    assert items(r) == [("function_call", *PARIS), ("function_call", *CAFE)] and r.tool_choice == "required"
    one = client.responses.create(model="hermes", input=forced, tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False)
    assert items(one) == [("function_call", *PARIS)] and one.parallel_tool_calls is False
    with client.responses.stream(model="hermes", input=forced, tools=TOOLS, tool_choice="required",
                                 parallel_tool_calls=False) as stream:
        assert items(stream.get_final_response()) == items(one)
    # the schema the engine got: a list of {name, parameters}, at most one when parallel calls are off
    echo = client.responses.create(model="plain", input="[[echo]]", tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=False)
    schema = json.loads(echo.output_text)["sampling_options"]["guided_decoding"]["json"]
    assert schema["type"] == "array" and schema["maxItems"] == 1
    assert [i["properties"]["name"]["enum"] for i in schema["items"]["anyOf"]] == [["get_weather"], ["search"]]


def test_parallel_tool_calls_false_keeps_the_first_call(client):
    r = client.responses.create(model="hermes", input=say(HERMES), tools=TOOLS, parallel_tool_calls=False)
    assert [i[0] for i in items(r)] == ["reasoning", "message", "function_call"]
    assert items(r)[2] == ("function_call", *PARIS)
    events = list(client.responses.create(model="hermes", input=say(HERMES), tools=TOOLS,
                                          parallel_tool_calls=False, stream=True))
    assert items(events[-1].response) == items(r)


def test_reasoning_effort_none_switches_thinking_off(client):
    r = client.responses.create(model="hermes", input="[[prompt]]", reasoning={"effort": "none"})
    assert r.output_text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert [o.type for o in r.output] == ["message"] and r.reasoning.effort == "none"
    low = client.responses.create(model="hermes", input=say("x"), reasoning={"effort": "low", "summary": "auto"})
    assert low.output_text == "x" and low.reasoning.effort == "low"


# -- conversations ---------------------------------------------------------------------------------


def test_tool_round_trip_stateful_and_stateless(client):
    """call -> its output -> the next turn, once through previous_response_id and once with the whole
    conversation in the input (store=False): the engine gets the same prompt."""
    first_input = [{"role": "user", "content": say(f"Checking.\n{CALL_PARIS}")}]
    first = client.responses.create(model="hermes", input=first_input, tools=TOOLS)
    assert items(first) == [("message", "assistant", [("output_text", "Checking.")]), ("function_call", *PARIS)]
    call = first.output[1]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21} [[prompt]]'}
    stateful = client.responses.create(model="hermes", previous_response_id=first.id, input=[result],
                                       tools=TOOLS, tool_choice="none")
    assert stateful.previous_response_id == first.id
    prompt = stateful.output_text
    parts = ["<|im_start|>user\n[[say:Checking.",
             f"<|im_start|>assistantChecking.{CALL_PARIS}\n",  # (the template's whitespace control)
             '<|im_start|>user\n<tool_response>\n{"temp_c": 21} \n</tool_response>\n',
             "<|im_start|>assistant\n"]
    at = [prompt.find(p) for p in parts]
    assert -1 not in at and at == sorted(at), prompt
    assert prompt.endswith("<|im_start|>assistant\n") and "<tools>" not in prompt
    counted = client.responses.input_tokens.count(model="hermes", previous_response_id=first.id, input=[result],
                                                  tools=TOOLS, tool_choice="none")
    assert counted.input_tokens == stateful.usage.input_tokens
    earlier = [o.model_dump(mode="json", exclude_none=True) for o in first.output]
    stateless = client.responses.create(model="hermes", input=[*first_input, *earlier, result], tools=TOOLS,
                                        tool_choice="none", store=False)
    assert stateless.output_text == prompt
    assert stateless.usage.input_tokens == stateful.usage.input_tokens
    # only the call item, its output and the user turn: the call alone as the assistant's turn
    bare = client.responses.create(model="hermes", input=[*first_input, earlier[1], result], tools=TOOLS,
                                   tool_choice="none", store=False)
    assert f"<|im_start|>assistant{CALL_PARIS}\n<|im_start|>user\n<tool_response>" in bare.output_text


def test_reasoning_item_passed_back(client):
    """A reasoning item of the input becomes the thinking of the assistant turn after it: the same
    prompt as the stored conversation gives."""
    text = f"<think>Plan.</think>\n\n{CALL_PARIS}"
    first = client.responses.create(model="hermes", input=say(text), tools=TOOLS)
    assert [o.type for o in first.output] == ["reasoning", "function_call"]
    result = {"type": "function_call_output", "call_id": first.output[1].call_id, "output": "sunny [[prompt]]"}
    stateful = client.responses.create(model="hermes", previous_response_id=first.id, input=[result],
                                       tools=TOOLS, tool_choice="none", store=False)
    earlier = [o.model_dump(mode="json", exclude_none=True) for o in first.output]
    stateless = client.responses.create(model="hermes", input=[{"role": "user", "content": say(text)}, *earlier,
                                                               result], tools=TOOLS, tool_choice="none", store=False)
    assert stateless.output_text == stateful.output_text
    assert stateless.usage.input_tokens == stateful.usage.input_tokens


def test_three_turn_chain(client):
    # (the test engine follows the first [[say:...]] anywhere in its prompt: the turns say its fixed
    # sentence instead, cut at different lengths)
    one = client.responses.create(model="plain", input="first", instructions="First rules.", max_output_tokens=2)
    two = client.responses.create(model="plain", input="second", previous_response_id=one.id,
                                  max_output_tokens=4)
    assert (one.output_text, two.output_text) == (" The quick", " The quick brown fox")
    assert two.previous_response_id == one.id
    three = client.responses.create(model="plain", input="[[prompt]] three", previous_response_id=two.id,
                                    instructions="Be brief.")
    prompt = three.output_text
    parts = ["<|im_start|>system\nBe brief.\n", "<|im_start|>user\nfirst\n", "<|im_start|>assistant\n The quick\n",
             "<|im_start|>user\nsecond\n", "<|im_start|>assistant\n The quick brown fox\n",
             "<|im_start|>user\n three\n<|im_start|>assistant\n"]
    at = [prompt.find(p) for p in parts]
    assert -1 not in at and at == sorted(at), prompt
    assert "First rules." not in prompt  # instructions are not carried over
    counted = client.responses.input_tokens.count(model="plain", input="[[prompt]] three",
                                                  previous_response_id=two.id, instructions="Be brief.")
    assert counted.input_tokens == three.usage.input_tokens


def test_streamed_response_chains(client):
    with client.responses.stream(model="plain", input=say("four")) as stream:
        four = stream.get_final_response()
    five = client.responses.create(model="plain", input="[[prompt]]", previous_response_id=four.id)
    assert "<|im_start|>user\n[[say:four]]\n<|im_start|>assistant\nfour\n<|im_start|>user\n\n" in five.output_text


def _other_process_id(response_id: str) -> str:
    owner = response_id[5:21]
    return f"resp_{int(owner, 16) ^ 0x5A5A:016x}{response_id[21:]}"


def test_previous_response_id_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="plain", input="x", previous_response_id="resp_nope")
    assert info.value.body["param"] == "previous_response_id" and "not one this server made" in info.value.message
    made = client.responses.create(model="plain", input=say("mine"))
    foreign = _other_process_id(made.id)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="plain", input="x", previous_response_id=foreign)
    assert info.value.body["param"] == "previous_response_id"
    assert "another frontend process" in info.value.message
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(foreign)
    assert "another frontend process" in info.value.message and info.value.body["param"] == "response_id"
    with pytest.raises(openai.BadRequestError):
        client.responses.input_tokens.count(model="plain", input="x", previous_response_id=foreign)
    serves(client)


def test_store_false_is_neither_retrievable_nor_chainable(client):
    r = client.responses.create(model="plain", input=say("secret"), store=False)
    assert r.store is False and r.output_text == "secret"
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(r.id)
    assert "store=false" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="plain", input="x", previous_response_id=r.id)
    assert info.value.body["param"] == "previous_response_id"
    events = list(client.responses.create(model="plain", input=say("secret"), store=False, stream=True))
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(events[-1].response.id)


def test_retrieve_and_delete(client):
    r = client.responses.create(model="plain", input=say("keep me"), instructions="Rules.")
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    assert got.output_text == "keep me" and got.instructions == "Rules."
    raw = httpx.delete(f"{client.base_url}responses/{r.id}")
    assert raw.status_code == 200 and raw.json() == {"id": r.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="plain", input="x", previous_response_id=r.id)
    other = client.responses.create(model="plain", input=say("drop me"))
    assert client.responses.delete(other.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(other.id)


def test_eviction_and_another_frontend(client, small):
    """A frontend keeping 2 responses evicts the least recently used; an id of the other frontend is told
    apart from an evicted one."""
    a, b, c = (small.responses.create(model="plain", input=say(w)) for w in ("a", "b", "c"))
    with pytest.raises(openai.BadRequestError) as info:
        small.responses.create(model="plain", input="x", previous_response_id=a.id)
    assert info.value.body["param"] == "previous_response_id"
    assert "evicted" in info.value.message and "2" in info.value.message
    with pytest.raises(openai.NotFoundError):
        small.responses.retrieve(a.id)
    assert small.responses.retrieve(b.id).output_text == "b"  # b is now the most recently used
    small.responses.create(model="plain", input=say("d"))
    with pytest.raises(openai.NotFoundError):
        small.responses.retrieve(c.id)
    assert small.responses.retrieve(b.id).output_text == "b"
    chained = small.responses.create(model="plain", input="[[prompt]]", previous_response_id=b.id, store=False)
    assert "[[say:b]]" in chained.output_text
    # a response of the main frontend, on the small one
    main = client.responses.create(model="plain", input=say("main"))
    with pytest.raises(openai.BadRequestError) as info:
        small.responses.create(model="plain", input="x", previous_response_id=main.id)
    assert "another frontend process" in info.value.message
    with pytest.raises(openai.NotFoundError):
        small.responses.retrieve(main.id)
    assert client.responses.retrieve(main.id).output_text == "main"


# -- structured output -----------------------------------------------------------------------------


def test_text_format_is_guided_decoding(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
              "additionalProperties": False}
    r = client.responses.create(model="plain", input="[[echo]]",
                                text={"format": {"type": "json_schema", "name": "x", "schema": schema,
                                                 "strict": True}})
    sent = json.loads(r.output_text)
    assert sent["sampling_options"]["guided_decoding"]["json"] == schema
    assert r.text.format.type == "json_schema" and r.text.format.name == "x" and r.text.format.schema_ == schema
    obj = client.responses.create(model="plain", input="[[echo]]", text={"format": {"type": "json_object"}})
    assert json.loads(obj.output_text)["sampling_options"]["guided_decoding"]["json"] == {"type": "object"}
    assert obj.text.format.type == "json_object"
    plain = client.responses.create(model="plain", input="[[echo]]", text={"format": {"type": "text"}})
    assert (json.loads(plain.output_text)["sampling_options"] or {}).get("guided_decoding") is None
    counted = client.responses.input_tokens.count(model="plain", input="[[echo]]",
                                                  text={"format": {"type": "json_object"}})
    assert counted.input_tokens == obj.usage.input_tokens


def test_sdk_parse_with_a_pydantic_format(client):
    class Weather(pydantic.BaseModel):
        city: str
        days: int

    parsed = client.responses.parse(model="plain", input=say('{"city": "Paris", "days": 2}'), text_format=Weather)
    assert parsed.output_parsed == Weather(city="Paris", days=2)
    assert parsed.text.format.type == "json_schema" and parsed.text.format.name == "Weather"


# -- bad requests ----------------------------------------------------------------------------------

BAD: list[tuple[dict[str, Any], str]] = [
    ({"input": 5}, "input"),
    ({"input": None}, "input"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"model": ""}, "model"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "function", "name": "web_search"}}, "tool_choice.name"),
    ({"tools": [{"type": "function", "name": "has space"}]}, "tools[0].name"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "tool_choice"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "item_reference", "id": "x"}]}, "input[1].type"),
    # this test engine's model takes no images (no --enable-multimodal): the part is refused by name
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "21"}]}, "input[0].call_id"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include[0]"),
    ({"conversation": "conv_1"}, "conversation"),
]


@pytest.mark.parametrize(("fields", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_input_is_a_400_naming_the_field(deployment, client, fields, param):
    body = {"model": "plain", "input": "hi", **fields}
    body = {k: v for k, v in body.items() if not (k == "input" and v is None)}
    for route in ("/v1/responses", "/v1/responses/input_tokens"):
        r = httpx.post(f"{deployment.url}{route}", json=body)
        assert r.status_code == 400, (route, r.text)
        error = r.json()["error"]
        assert error.keys() == {"message", "type", "param", "code"}
        assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    serves(client)


def test_hosted_tools_are_left_out_with_a_warning(deployment, client):
    for stream in (False, True):
        r = httpx.post(f"{deployment.url}/v1/responses", timeout=60, json={
            "model": "plain", "input": "[[say:ok]]", "stream": stream, "tools": [{"type": "web_search"}, WEATHER]})
        assert r.status_code == 200, r.text
        assert r.headers["x-tandem-warning"] == "tools left out (tandem does not run them): web_search"
    plain = httpx.post(f"{deployment.url}/v1/responses", json={"model": "plain", "input": "[[say:ok]]"}, timeout=60)
    assert "x-tandem-warning" not in plain.headers
    # A tool whose type and name no header can hold (found by the contract test: the answer never came).
    odd = httpx.post(f"{deployment.url}/v1/responses", timeout=60, json={
        "model": "plain", "input": "[[say:ok]]", "tools": [{"type": "\u001f\r\nx: y", "name": "", "tools": []}]})
    assert odd.status_code == 200 and odd.headers["x-tandem-warning"].endswith(": ???x: y"), odd.headers


def test_prompt_longer_than_the_context_is_a_400(deployment, client):
    body = {"model": "plain", "input": "hello " * 9000}
    for route in ("/v1/responses", "/v1/responses/input_tokens"):
        r = httpx.post(f"{deployment.url}{route}", json=body)
        assert r.status_code == 400, r.text
        assert "maximum context length" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "input", r.text  # the Responses API has no `messages`
    serves(client)


def test_max_output_tokens_beyond_the_context_names_max_output_tokens(deployment, client):
    r = httpx.post(f"{deployment.url}/v1/responses", json={"model": "plain", "input": "hi",
                                                            "max_output_tokens": 9000})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "max_output_tokens", r.text  # the Responses API has no `max_tokens`
    assert "max_output_tokens" in error["message"]
    serves(client)


def test_wrong_types_through_the_sdk(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="plain", input="hi", extra_body={"temperature": "hot"})
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="plain", input="hi", max_output_tokens=0)
    assert info.value.body["param"] == "max_output_tokens"
    assert re.search("at least 1", info.value.message)
    serves(client)
