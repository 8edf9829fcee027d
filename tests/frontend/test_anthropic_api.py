"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) with the official `anthropic`
client against a real frontend and test engines: `plain` (no parsers) and `hermes` (Hermes tool calls and
Qwen3 thinking, the test template that renders tools and tool results). The frontend asks for an API key,
as Claude Code's deployments do, and takes bodies of at most 1 MB. Every answer the client gets (messages,
streamed events, token counts, errors) is validated against the SDK's own models (tests/support/shapes.py)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import httpx2
import pytest

from tests.frontend.test_frontend_tools import TEMPLATES
from tests.support.deployment import Deployment
from tests.support.shapes import checked_http_client

KEY = "sesame"
HERMES = ["--dyn-tool-call-parser", "hermes", "--dyn-reasoning-parser", "qwen3",
          "--custom-jinja-template", str(TEMPLATES / "hermes_tools.jinja")]
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                            "required": ["city"]}}  # fmt: skip
SEARCH = {"name": "search", "description": "Search the web",
          "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}
TOOLS = [WEATHER, SEARCH]
# What the hermes model writes to think and call a tool.
CALLING = ('<think>The user wants weather.</think>\n\nChecking.\n<tool_call>\n'
           '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>')


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, smollm2):
    deployment = Deployment(tmp_path_factory.mktemp("anthropic"), smollm2,
                            engines=[["--model-name", "plain"], ["--model-name", "hermes", *HERMES]],
                            frontend_args=["--api-key", KEY], env={"DYN_HTTP_BODY_LIMIT_MB": "1"})
    yield deployment
    deployment.stop()


@pytest.fixture(scope="module")
def client(deployment):
    """The official client; every answer it gets is checked against the SDK's models (tests/support/shapes.py)."""
    return anthropic.Anthropic(base_url=deployment.url, api_key=KEY, max_retries=0,
                               http_client=checked_http_client(httpx2))


def say(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"[[say:{text}]]"}]


def post(deployment: Deployment, path: str, body: object) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{deployment.url}{path}", content=data, timeout=60,
                      headers={"Content-Type": "application/json", "x-api-key": KEY, "anthropic-version": "2023-06-01"})


def blocks(message: Any) -> list[tuple[str, Any]]:
    """A message's content blocks as (type, what they hold)."""
    held = {"text": lambda b: b.text, "thinking": lambda b: b.thinking, "tool_use": lambda b: (b.name, b.input)}
    return [(b.type, held[b.type](b)) for b in message.content]


def still_serving(client: anthropic.Anthropic) -> None:
    reply = client.messages.create(model="plain", max_tokens=16, messages=say("still here"))
    assert blocks(reply) == [("text", "still here")]


# -- text ------------------------------------------------------------------------------------------
def test_text_unary_and_streamed(client):
    messages = say("Hello there, friend.")
    reply = client.messages.create(model="plain", max_tokens=64, messages=messages)
    assert reply.id.startswith("msg_") and (reply.type, reply.role, reply.model) == ("message", "assistant", "plain")
    assert blocks(reply) == [("text", "Hello there, friend.")]
    assert (reply.stop_reason, reply.stop_sequence) == ("end_turn", None)
    counted = client.messages.count_tokens(model="plain", messages=messages).input_tokens
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == counted
    assert reply.usage.output_tokens > 0

    with client.messages.stream(model="plain", max_tokens=64, messages=messages) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == "Hello there, friend." and len(pieces) > 1
    assert blocks(final) == blocks(reply) and final.id.startswith("msg_") and final.id != reply.id
    assert (final.stop_reason, final.stop_sequence) == ("end_turn", None)
    assert final.usage.output_tokens == reply.usage.output_tokens
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == counted


def test_raw_event_sequence(client):
    events = list(client.messages.create(model="plain", max_tokens=64, messages=say("one two"), stream=True))
    assert [e.type for e in events[:2]] == ["message_start", "content_block_start"]
    assert [e.type for e in events[-3:]] == ["content_block_stop", "message_delta", "message_stop"]
    assert {e.type for e in events[2:-3]} == {"content_block_delta"}
    start = events[0].message
    assert start.content == [] and start.stop_reason is None and start.usage.output_tokens == 0
    assert "".join(e.delta.text for e in events[2:-3]) == "one two"
    assert events[-2].delta.stop_reason == "end_turn" and events[-2].usage.output_tokens > 0


def test_stop_sequences_and_max_tokens(client):
    messages = say("alpha beta gamma delta")
    stopped = client.messages.create(model="plain", max_tokens=64, messages=messages, stop_sequences=["gamma"])
    assert blocks(stopped) == [("text", "alpha beta ")]
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "gamma")
    with client.messages.stream(model="plain", max_tokens=64, messages=messages, stop_sequences=["gamma"]) as stream:
        final = stream.get_final_message()
    assert blocks(final) == blocks(stopped) and (final.stop_reason, final.stop_sequence) == ("stop_sequence", "gamma")

    cut = client.messages.create(model="plain", max_tokens=5, messages=[{"role": "user", "content": "Go on."}])
    assert (cut.stop_reason, cut.usage.output_tokens) == ("max_tokens", 5)
    # Anthropic's clients send one max_tokens whatever the model: more than the context leaves is lowered.
    big = client.messages.create(model="plain", max_tokens=20000, messages=say("fits"),
                                 extra_body={"temperature": 0.2, "top_p": 0.9, "top_k": 20})
    assert blocks(big) == [("text", "fits")] and big.stop_reason == "end_turn"


# -- tools and thinking ----------------------------------------------------------------------------
def test_tool_use_round_trip(client):
    messages = say(CALLING)
    first = client.messages.create(model="hermes", max_tokens=256, tools=TOOLS, messages=messages)
    assert blocks(first) == [("thinking", "The user wants weather."), ("text", "Checking."),
                             ("tool_use", ("get_weather", {"city": "Paris", "days": 2}))]
    assert first.stop_reason == "tool_use"
    assert first.usage.output_tokens_details.thinking_tokens > 0
    call = first.content[2]

    # The answer goes back as the SDK gives it, with the tool's result (the engine echoes its prompt).
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                           "content": [{"type": "text", "text": '{"temp_c": 21} [[prompt]]'}]}]}
    # (tool_choice none: the echoed call is not parsed as a new one)
    second = client.messages.create(model="hermes", max_tokens=1024, tools=TOOLS, tool_choice={"type": "none"},
                                    messages=[*messages, first.to_param(), result])
    prompt = "".join(b.text if b.type == "text" else b.thinking for b in second.content)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"temp_c": 21} \n</tool_response>' in prompt

    with client.messages.stream(model="hermes", max_tokens=256, tools=TOOLS, messages=messages) as stream:
        final = stream.get_final_message()
    assert blocks(final) == blocks(first) and final.stop_reason == "tool_use"
    assert final.content[0].signature == "" and final.content[2].id.startswith("call_")
    assert final.usage.output_tokens == first.usage.output_tokens


def test_streamed_tool_events(client):
    events = list(client.messages.create(model="hermes", max_tokens=256, tools=TOOLS, messages=say(CALLING),
                                         stream=True))
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas.index("signature_delta") < deltas.index("text_delta") < deltas.index("input_json_delta")
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                      and e.delta.type == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris", "days": 2}


def test_tool_choice(client):
    forced = client.messages.create(model="hermes", max_tokens=256, tools=TOOLS,
                                    tool_choice={"type": "tool", "name": "search"}, messages=say('{"query": "x"}'))
    assert blocks(forced) == [("tool_use", ("search", {"query": "x"}))] and forced.stop_reason == "tool_use"
    # A forced tool reaches the engine as guided decoding by the tool's schema (the engine writes its options).
    echoed = client.messages.create(model="hermes", max_tokens=1024, tools=TOOLS,
                                    tool_choice={"type": "tool", "name": "get_weather"},
                                    messages=[{"role": "user", "content": "[[echo]]"}])
    options = echoed.content[0].input
    assert options["sampling_options"]["guided_decoding"]["json"] == WEATHER["input_schema"]

    any_ = client.messages.create(model="hermes", max_tokens=256, tools=TOOLS,
                                  tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                  messages=say('[{"name": "search", "parameters": {"query": "y"}}] '))  # (a space before `]]`)
    assert blocks(any_) == [("tool_use", ("search", {"query": "y"}))] and any_.stop_reason == "tool_use"

    auto = client.messages.create(model="hermes", max_tokens=1024, tools=TOOLS,
                                  messages=[{"role": "user", "content": "[[prompt]]"}])
    prompt = "".join(b.text for b in auto.content)
    assert "<tools>" in prompt and json.dumps(WEATHER["input_schema"]) in prompt  # input_schema as parameters
    none = client.messages.create(model="hermes", max_tokens=1024, tools=TOOLS, tool_choice={"type": "none"},
                                  messages=[{"role": "user", "content": "[[prompt]]"}],
                                  thinking={"type": "disabled"})
    prompt = "".join(b.text for b in none.content)
    assert "<tools>" not in prompt and "get_weather" not in prompt and none.stop_reason == "end_turn"
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking switched off
    text = '<tool_call>\n{"name": "search", "arguments": {"query": "z"}}\n</tool_call>'
    as_text = client.messages.create(model="hermes", max_tokens=256, tools=TOOLS, tool_choice={"type": "none"},
                                     messages=say(text))
    assert blocks(as_text) == [("text", text)] and as_text.stop_reason == "end_turn"


# -- a Claude-Code-shaped conversation ---------------------------------------------------------------
def _schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False,
            "$schema": "http://json-schema.org/draft-07/schema#"}


STR, INT, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
CODING_TOOLS = [
    ("Task", {"description": STR, "prompt": STR, "subagent_type": STR}, ["description", "prompt"]),
    ("Bash", {"command": STR, "timeout": {"type": "number", "maximum": 600000}, "description": STR,
              "run_in_background": BOOL}, ["command"]),
    ("Glob", {"pattern": STR, "path": STR}, ["pattern"]),
    ("Grep", {"pattern": STR, "path": STR, "glob": STR, "output_mode": {
        "type": "string", "enum": ["content", "files_with_matches", "count"]}, "-i": BOOL, "-n": BOOL,
        "head_limit": INT, "multiline": BOOL}, ["pattern"]),
    ("LS", {"path": STR, "ignore": {"type": "array", "items": STR}}, ["path"]),
    ("ExitPlanMode", {"plan": STR}, ["plan"]),
    ("Read", {"file_path": STR, "offset": INT, "limit": INT}, ["file_path"]),
    ("Edit", {"file_path": STR, "old_string": STR, "new_string": STR, "replace_all": BOOL},
     ["file_path", "old_string", "new_string"]),
    ("MultiEdit", {"file_path": STR, "edits": {"type": "array", "minItems": 1, "items": _schema(
        {"old_string": STR, "new_string": STR, "replace_all": BOOL}, ["old_string", "new_string"])}},
     ["file_path", "edits"]),
    ("Write", {"file_path": STR, "content": STR}, ["file_path", "content"]),
    ("NotebookEdit", {"notebook_path": STR, "cell_id": STR, "new_source": STR, "cell_type": {
        "type": "string", "enum": ["code", "markdown"]}, "edit_mode": {
        "type": "string", "enum": ["replace", "insert", "delete"]}}, ["notebook_path", "new_source"]),
    ("WebFetch", {"url": {"type": "string", "format": "uri"}, "prompt": STR}, ["url", "prompt"]),
    ("TodoWrite", {"todos": {"type": "array", "items": _schema(
        {"content": STR, "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
         "activeForm": STR}, ["content", "status", "activeForm"])}}, ["todos"]),
    ("BashOutput", {"bash_id": STR, "filter": STR}, ["bash_id"]),
    ("KillShell", {"shell_id": STR}, ["shell_id"]),
]
SYSTEM_PROMPT = "\n".join(
    f"- Rule {i}: when the user asks about code, read the files first, keep edits small, run the tests, "
    "and report what changed in a few sentences." for i in range(60))


def test_claude_code_shaped_request(client):
    tools = [{"name": name, "description": f"{name}: a tool of the coding agent. " * 3,
              "input_schema": _schema(properties, required)} for name, properties, required in CODING_TOOLS]
    tools[-1]["cache_control"] = {"type": "ephemeral"}
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.0.1; cc_entrypoint=cli; cch=1a2b;"},
              {"type": "text", "text": "You are Claude Code, a coding agent.", "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": SYSTEM_PROMPT, "cache_control": {"type": "ephemeral"}}]
    ls = {"type": "tool_use", "id": "toolu_01", "name": "LS", "input": {"path": "/repo"}}
    grep = {"type": "tool_use", "id": "toolu_02", "name": "Grep", "input": {"pattern": "def main", "-n": True}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>Context.</system-reminder>"},
                                     {"type": "text", "text": "What does this repo do?"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look around.", "signature": "EqQB"},
                                          {"type": "text", "text": "Let me look."}, ls, grep]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "README.md\nsrc/\ntests/"},
            {"type": "tool_result", "tool_use_id": "toolu_02", "content": [{"type": "text", "text": "src/app.py:3"}],
             "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "It is an app."}]},
        {"role": "user", "content": [{"type": "text", "text": "[[say:<think>Read the README.</think>\n<tool_call>\n"
                                                               '{"name": "Read", "arguments": {"file_path": '
                                                               '"/repo/README.md"}}\n</tool_call>]]',
                                      "cache_control": {"type": "ephemeral"}}]},
    ]
    common: dict[str, Any] = {"model": "hermes", "system": system, "tools": tools, "messages": messages,
                              "thinking": {"type": "enabled", "budget_tokens": 1024}}
    counted = client.messages.count_tokens(**common).input_tokens
    assert 3000 < counted < 8192  # a long prompt within the test model's context
    with client.messages.stream(**common, max_tokens=32000, metadata={"user_id": "user_0f1e_account_session_9"},
                                extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"},
                                extra_body={"temperature": 1, "context_management": {"edits": []}}) as stream:
        final = stream.get_final_message()
    assert blocks(final) == [("thinking", "Read the README."), ("tool_use", ("Read", {"file_path": "/repo/README.md"}))]
    assert final.stop_reason == "tool_use"
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == counted


# -- counting, auth, errors --------------------------------------------------------------------------
def test_count_tokens_matches_usage(client):
    common: dict[str, Any] = {"model": "hermes", "system": "Be brief.", "tools": TOOLS, "messages": say("ok")}
    counted = client.messages.count_tokens(**common).input_tokens
    reply = client.messages.create(**common, max_tokens=16)
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == counted
    without_tools = client.messages.count_tokens(model="hermes", system="Be brief.", messages=say("ok")).input_tokens
    assert without_tools < counted


def test_api_key(deployment, client):
    wrong = anthropic.Anthropic(base_url=deployment.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(model="plain", max_tokens=8, messages=say("x"))
    assert info.value.status_code == 401 and info.value.type == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.count_tokens(model="plain", messages=say("x"))
    bearer = anthropic.Anthropic(base_url=deployment.url, auth_token=KEY, max_retries=0)
    assert blocks(bearer.messages.create(model="plain", max_tokens=8, messages=say("ok"))) == [("text", "ok")]
    r = httpx.post(f"{deployment.url}/v1/messages", json={"model": "plain", "max_tokens": 8, "messages": say("x")})
    assert r.status_code == 401 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "authentication_error"
    still_serving(client)


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "search", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "content": "r"}]}]}, "messages[2].content[0].tool_use_id"),
    ({"temperature": 3}, "temperature"),
    ({"max_tokens": None}, "max_tokens"),
    ({"tools": [WEATHER, {"name": "f", "input_schema": "none"}]}, "tools[1].input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
      "tool_choice": {"type": "tool", "name": "web_search"}}, "tool_choice.name"),
])
def test_bad_input_is_a_400_naming_the_field(deployment, client, fields, param):
    body = {"model": "plain", "max_tokens": 16, "messages": say("x"), **fields}
    body = {k: v for k, v in body.items() if v is not None}
    r = post(deployment, "/v1/messages", body)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert param in error["error"]["message"]
    still_serving(client)


def test_server_tools_are_left_out_with_a_warning(deployment):
    for stream in (False, True):
        r = post(deployment, "/v1/messages", {"model": "plain", "max_tokens": 16, "messages": say("ok"), "stream": stream,
                                              "tools": [{"type": "web_search_20250305", "name": "web_search"}, WEATHER]})
        assert r.status_code == 200, r.text
        assert r.headers["x-tandem-warning"] == "tools left out (tandem does not run them): web_search"


def test_sdk_raises_on_bad_input(client):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="plain", max_tokens=16, messages=say("x"), extra_body={"temperature": 3})
    assert info.value.type == "invalid_request_error" and "temperature" in info.value.api_message
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.count_tokens(model="plain", messages=[])
    assert "messages" in info.value.api_message


def test_unknown_model_and_oversized_input(deployment, client):
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="nope", max_tokens=16, messages=say("x"))
    assert info.value.type == "not_found_error" and "nope" in info.value.api_message
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="nope", messages=say("x"))
    with pytest.raises(anthropic.BadRequestError) as info:  # more tokens than the model's context
        client.messages.create(model="plain", max_tokens=16, messages=[{"role": "user", "content": "x " * 9000}])
    assert "maximum context length" in info.value.api_message and "messages" in info.value.api_message
    r = post(deployment, "/v1/messages", {"model": "plain", "max_tokens": 16,  # over the 1 MB body limit
                                          "messages": [{"role": "user", "content": "x" * 2_000_000}]})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = post(deployment, "/v1/messages", b'{"model": "plain", "max_tokens": ')
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = post(deployment, "/v1/messages/count_tokens", {"model": "plain"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    still_serving(client)


def test_worker_failure(client):
    with pytest.raises(anthropic.InternalServerError) as info:
        client.messages.create(model="plain", max_tokens=16, messages=[{"role": "user", "content": "[[fail]]"}])
    assert info.value.type == "api_error"
    text = []
    with pytest.raises(anthropic.APIStatusError) as streamed:  # the `error` event, after some text
        with client.messages.stream(model="plain", max_tokens=16,
                                    messages=[{"role": "user", "content": "[[fail]]"}]) as stream:
            text.extend(stream.text_stream)
    assert streamed.value.type == "api_error" and streamed.value.api_message
    assert "".join(text) == " partial"
    still_serving(client)
