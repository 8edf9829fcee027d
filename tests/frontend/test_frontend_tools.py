"""Tool calls and reasoning through the frontend, with the official `openai` client: test engines scripted
to write each parser family's output, served with that family's --dyn-tool-call-parser /
--dyn-reasoning-parser; streamed and unary answers must agree."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.support import TESTS
from tests.support.deployment import Deployment

TEMPLATES = TESTS / "templates"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}},
                                                "required": ["city"]}}}  # fmt: skip
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}}}}
TOOLS = [WEATHER, SEARCH]
PARIS = ("get_weather", {"city": "Paris", "days": 2})
CAFE = ("search", {"query": "café ☕ \"best\""})

# model -> (worker parser flags, what the model writes, content, reasoning, calls)
FAMILIES: dict[str, tuple[list[str], str, str | None, str | None, list[tuple[str, dict[str, Any]]]]] = {
    "hermes": (["--dyn-tool-call-parser", "hermes", "--dyn-reasoning-parser", "qwen3",
                "--custom-jinja-template", str(TEMPLATES / "hermes_tools.jinja")],
               '<think>The user wants weather.</think>\n\nChecking.\n<tool_call>\n'
               '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n<tool_call>\n'
               '{"name": "search", "arguments": {"query": "café ☕ \\"best\\""}}\n</tool_call>',
               "Checking.", "The user wants weather.", [PARIS, CAFE]),
    "llama": (["--dyn-tool-call-parser", "llama3_json"],
              '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
              None, None, [PARIS]),
    "mistral": (["--dyn-tool-call-parser", "mistral", "--dyn-reasoning-parser", "mistral"],
                '[THINK]Two lookups.[/THINK][TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}'
                '[TOOL_CALLS]search[ARGS]{"query": "café ☕ \\"best\\""}',
                None, "Two lookups.", [PARIS, CAFE]),
    "pythonic": (["--dyn-tool-call-parser", "pythonic"],
                 # (a space before the test engine's closing `]]`)
                 "[get_weather(city='Paris', days=2), search(query='café ☕ \"best\"')] ", None, None, [PARIS, CAFE]),
    "coder": (["--dyn-tool-call-parser", "qwen3_coder"],
              "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
              "</parameter>\n</function>\n</tool_call>",
              None, None, [PARIS]),
    "gptoss": (["--dyn-tool-call-parser", "harmony", "--dyn-reasoning-parser", "gpt_oss"],
               "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
               'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 2}',
               None, "Need weather.", [PARIS]),
    # -- part 2 families (each with one of the part 2 reasoning parsers)
    "nemotron-deci": (["--dyn-tool-call-parser", "nemotron_deci", "--dyn-reasoning-parser", "nemotron_deci"],
                      '<think>Plan.</think>Checking. <TOOLCALL>[{"name": "get_weather", "arguments": '
                      '{"city": "Paris", "days": 2}}]</TOOLCALL>', "Checking.", "Plan.", [PARIS]),
    "phi4": (["--dyn-tool-call-parser", "phi4"],
             'functools[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}] ', None, None, [PARIS]),
    "jamba": (["--dyn-tool-call-parser", "jamba"],
              '<tool_calls>[{"name": "search", "arguments": {"query": "café ☕ \\"best\\""}}]</tool_calls>',
              None, None, [CAFE]),
    "nemotron-nano": (["--dyn-tool-call-parser", "nemotron_nano", "--dyn-reasoning-parser", "nemotron_nano"],
                      "Plan.</think><tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                      "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>", None, "Plan.", [PARIS]),
    "minimax": (["--dyn-tool-call-parser", "minimax_m2", "--dyn-reasoning-parser", "minimax_append_think"],
                'Plan.</think><minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
                '</parameter>\n<parameter name="days">2</parameter>\n</invoke>\n</minimax:tool_call>',
                None, "Plan.", [PARIS]),
    "deepseek-v3": (["--dyn-tool-call-parser", "deepseek_v3", "--dyn-reasoning-parser", "step3"],
                    "Plan.</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None, "Plan.", [PARIS]),
    "deepseek-v31": (["--dyn-tool-call-parser", "deepseek_v3_1", "--dyn-reasoning-parser", "nemotron3"],
                     "Plan.</think>Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>"
                     '{"query": "café ☕ \\"best\\""}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Sure.", "Plan.", [CAFE]),
    "deepseek-v32": (["--dyn-tool-call-parser", "deepseek_v3_2"],
                     '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" '
                     'string="true">Paris</｜DSML｜parameter>\n<｜DSML｜parameter name="days" string="false">2'
                     "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>", None, None, [PARIS]),
    "deepseek-v4": (["--dyn-tool-call-parser", "deepseek-v4", "--dyn-reasoning-parser", "kimi_k25"],
                    'Plan.</think><｜DSML｜tool_calls>\n<｜DSML｜invoke name="search">\n<｜DSML｜parameter name="query" '
                    'string="true">café ☕ "best"</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>',
                    None, "Plan.", [CAFE]),
    "kimi": (["--dyn-tool-call-parser", "kimi_k2", "--dyn-reasoning-parser", "kimi"],
             "◁think▷Plan.◁/think▷<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
             '<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|><|tool_calls_section_end|>',
             None, "Plan.", [PARIS]),
    "glm45": (["--dyn-tool-call-parser", "glm45", "--dyn-reasoning-parser", "glm45"],
              "<think>Plan.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>", None, "Plan.", [PARIS]),
    "glm47": (["--dyn-tool-call-parser", "glm47", "--dyn-reasoning-parser", "granite"],
              "Here is my thought process: Plan. Here is my response: <tool_call>search<arg_key>query</arg_key>"
              '<arg_value>café ☕ "best"</arg_value></tool_call>', None, " Plan. ", [CAFE]),
    "gemma4": (["--dyn-tool-call-parser", "gemma4"],
               '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>', None, None, [PARIS]),
    "r1": (["--dyn-reasoning-parser", "deepseek_r1"],
           'Thinking hard.</think>Sure. <TOOLCALL>[{"name": "search", "arguments": {"query": "café ☕ \\"best\\""}}]'
           "</TOOLCALL>",
           "Sure.", "Thinking hard.", [CAFE]),
}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, smollm2):
    engines = [["--model-name", name, *flags] for name, (flags, *_) in FAMILIES.items()]
    engines.append(["--model-name", "plain"])
    deployment = Deployment(tmp_path_factory.mktemp("tools"), smollm2, engines=engines)
    yield deployment
    deployment.stop()


def ask(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"[[say:{text}]]"}]


def calls_of(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def accumulate(chunks: list[Any]) -> dict[str, Any]:
    """A streamed answer put together by hand, checking OpenAI's delta order on the way."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            if call.id is not None:
                assert call.index == len(calls) and call.type == "function" and call.function.name
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return {"content": content or None, "reasoning": reasoning or None, "finish": finish,
            "calls": [(c["name"], json.loads(c["arguments"])) for c in calls.values()],
            "ids": [c["id"] for c in calls.values()]}


@pytest.mark.parametrize("model", sorted(FAMILIES))
def test_family_streamed_and_unary_agree(deployment, model):
    _, text, content, reasoning, calls = FAMILIES[model]
    client = deployment.client()
    reply = client.chat.completions.create(model=model, messages=ask(text), tools=TOOLS)
    message = reply.choices[0].message
    assert calls_of(message) == calls
    assert message.content == content
    assert getattr(message, "reasoning_content", None) == reasoning
    assert reply.choices[0].finish_reason == "tool_calls"
    ids = [c.id for c in message.tool_calls or []]
    assert len(set(ids)) == len(ids)
    assert ids == ["functions.get_weather:0"] if model == "kimi" else all(i.startswith("call_") for i in ids)
    if reasoning is not None:
        details = reply.usage.completion_tokens_details
        assert details is not None and 0 < details.reasoning_tokens < reply.usage.completion_tokens
    streamed = accumulate(list(client.chat.completions.create(model=model, messages=ask(text), tools=TOOLS,
                                                              stream=True)))
    assert streamed["calls"] == calls and streamed["content"] == content and streamed["reasoning"] == reasoning
    assert streamed["finish"] == "tool_calls"


def test_sdk_stream_helper_accumulates_calls(deployment):
    """The SDK's own accumulation of a streamed answer (`client.chat.completions.stream`)."""
    _, text, _, _, calls = FAMILIES["mistral"]
    with deployment.client().chat.completions.stream(model="mistral", messages=ask(text), tools=TOOLS) as stream:
        final = stream.get_final_completion()
    assert calls_of(final.choices[0].message) == calls
    assert final.choices[0].finish_reason == "tool_calls"


def test_plain_text_and_tool_choice_none(deployment):
    client = deployment.client()
    text = '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
    plain = client.chat.completions.create(model="hermes", messages=ask("Just words, 2 < 3."), tools=TOOLS)
    assert plain.choices[0].message.content == "Just words, 2 < 3." and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop"
    none = client.chat.completions.create(model="hermes", messages=ask(text), tools=TOOLS, tool_choice="none")
    assert none.choices[0].message.content == text and none.choices[0].finish_reason == "stop"


def test_tools_in_template_and_two_turn_conversation(deployment):
    """call -> tool result -> answer, rendered by the Hermes-style template given with
    --custom-jinja-template (the engine echoes the prompt it got with [[prompt]])."""
    client = deployment.client()
    _, text, *_ = FAMILIES["hermes"]
    first = client.chat.completions.create(model="hermes", messages=ask(text), tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    messages = ask(text) + [first.choices[0].message.model_dump(exclude_none=True),
                            {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21} [[prompt]]'}]
    second = client.chat.completions.create(model="hermes", messages=messages, tools=TOOLS, tool_choice="none")
    prompt = second.choices[0].message.content
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"temp_c": 21} \n</tool_response>' in prompt
    assert "<tools>" not in prompt  # tool_choice none: tools left out of the template
    with_tools = client.chat.completions.create(model="hermes", messages=[
        {"role": "user", "content": "[[prompt]]"}], tools=TOOLS, tool_choice="auto")
    assert '"name": "get_weather"' in with_tools.choices[0].message.content


def test_thinking_switched_off_and_reasoning_effort(deployment):
    client = deployment.client()
    off = client.chat.completions.create(model="hermes", messages=[{"role": "user", "content": "[[prompt]]"}],
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    echo = client.chat.completions.create(model="hermes", messages=ask("x"), reasoning_effort="low")
    assert echo.choices[0].message.content == "x"


def test_parallel_tool_calls_false_keeps_the_first(deployment):
    _, text, _, _, calls = FAMILIES["mistral"]
    reply = deployment.client().chat.completions.create(model="mistral", messages=ask(text), tools=TOOLS,
                                                        parallel_tool_calls=False)
    assert calls_of(reply.choices[0].message) == calls[:1]


def test_forced_tool_choice_is_guided_decoding(deployment):
    """A named function and `required` reach the worker as a JSON schema built from the tools."""
    client = deployment.client()
    named = client.chat.completions.create(model="plain", messages=[{"role": "user", "content": "[[echo]]"}],
                                           tools=TOOLS, tool_choice={"type": "function",
                                                                     "function": {"name": "get_weather"}})
    # The test engine writes the options it got; as the forced function's arguments here.
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and named.choices[0].finish_reason == "stop"
    sent = json.loads(call.function.arguments)
    assert sent["sampling_options"]["guided_decoding"]["json"] == WEATHER["function"]["parameters"]
    required = client.chat.completions.create(model="plain", messages=[{"role": "user", "content": "[[echo]]"}],
                                              tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    # Not a list of calls (the engine ignores the schema): returned as text, not dropped.
    echoed = json.loads(required.choices[0].message.content)
    schema = echoed["sampling_options"]["guided_decoding"]["json"]
    assert schema["type"] == "array" and schema["maxItems"] == 1
    assert [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]] == [["get_weather"], ["search"]]


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "21"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                                          "function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"nvext": {"max_thinking_tokens": 5}}, "nvext.max_thinking_tokens"),  # `plain` has no reasoning parser
])
def test_bad_input_is_a_400_naming_the_field(deployment, body, param):
    payload = {"model": "plain", "messages": [{"role": "user", "content": "hi"}], **body}
    r = httpx.post(f"{deployment.url}/v1/chat/completions", json=payload)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unknown_parser_name_is_refused_by_the_worker(deployment, smollm2):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "tandem.testing.engine", "--model", smollm2,
                           "--dyn-tool-call-parser", "kimi_k3"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown tool-call parser 'kimi_k3'" in done.stderr and "hermes" in done.stderr
    with pytest.raises(openai.NotFoundError):
        deployment.client().chat.completions.create(model="kimi_k3", messages=ask("x"))


def test_reasoning_field_name(deployment):
    """--reasoning-field-name reasoning: vLLM's newer name for the thinking field."""
    from tests.support.processes import TandemProcess

    frontend = TandemProcess("tandem.frontend", "--http-host", "127.0.0.1", "--http-port", "0", "--discovery-backend",
                             "file", "--reasoning-field-name", "reasoning", env=deployment.env)
    try:
        url = frontend.ready[0]
        deployment.wait_for_instances(len(deployment.engines), url=url)
        _, text, _, reasoning, _ = FAMILIES["r1"]
        body = {"model": "r1", "messages": ask(text), "tools": TOOLS}
        message = httpx.post(f"{url}/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert message["reasoning"] == reasoning and "reasoning_content" not in message
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(e["choices"][0]["delta"].get("reasoning", "") for e in events if e["choices"]) == reasoning
    finally:
        frontend.stop()
