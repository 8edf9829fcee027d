"""tandem.llm.chat_template: parity with transformers' apply_chat_template, helpers, errors."""

from __future__ import annotations

import datetime
import json
from typing import Any

import pytest

from tandem.llm.chat_template import ChatTemplate, ChatTemplateError
from tandem.llm.tokenizer import Tokenizer

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 🐍 and 世界."},
    ],
    [
        {"role": "system", "content": "Answer in French.\nAlways."},
        {"role": "user", "content": "Good morning"},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": "  spaces  and {{ braces }} and <|im_end|> inside  "},
    ],
]


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2: str) -> Any:
    import transformers
    return transformers.AutoTokenizer.from_pretrained(smollm2)


@pytest.fixture(scope="session")
def template(smollm2: str) -> ChatTemplate:
    return ChatTemplate.for_tokenizer(Tokenizer.from_folder(smollm2))


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_matches_transformers(
    template: ChatTemplate, hf_tokenizer: Any, index: int, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[index]
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert template.render(messages, add_generation_prompt=add_generation_prompt) == expected


def test_parts_with_an_image_are_left_to_the_template() -> None:
    from tests.support.vision_model import CHAT_TEMPLATE

    template = ChatTemplate(CHAT_TEMPLATE)
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}]
    assert template.render(parts, add_generation_prompt=False) == "<|im_start|>user\n<image>what?<|im_end|>\n"


def test_content_parts_are_flattened(template: ChatTemplate) -> None:
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Hello "},
                {"type": "image_url", "image_url": {}},
                {"type": "text", "text": "there"},
            ],
        }
    ]
    original = json.dumps(parts)
    assert template.render(parts) == template.render([{"role": "user", "content": "Hello there"}])
    assert json.dumps(parts) == original  # the caller's messages are not modified


def test_default_is_add_generation_prompt(template: ChatTemplate) -> None:
    assert template.render([{"role": "user", "content": "x"}]).endswith("<|im_start|>assistant\n")


def test_helpers_and_variables() -> None:
    t = ChatTemplate(
        "{{ bos_token }}{{ messages | tojson }}|{{ tools | tojson(indent=2) }}|{{ extra }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}|"
        "{{ {'b': 1, 'a': 'é<>'} | tojson(sort_keys=True) }}|{{ strftime_now('%Y') }}{{ eos_token }}",
        bos_token="<s>",
        eos_token="</s>",
    )
    messages = [{"role": "user", "content": "héllo <b>"}, {"role": "assistant", "content": "x"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    out = t.render(messages, tools=tools, chat_template_kwargs={"extra": 42})
    year = str(datetime.datetime.now().year)
    assert out == (
        "<s>"
        + json.dumps(messages, ensure_ascii=False)
        + "|"
        + json.dumps(tools, indent=2)
        + "|42|user|"
        + '{"a": "é<>", "b": 1}|'
        + year
        + "</s>"
    )


def test_kwargs_can_override_generation_prompt_but_not_messages() -> None:
    t = ChatTemplate("{{ messages[0].content }}{% if add_generation_prompt %}>>{% endif %}")
    msgs = [{"role": "user", "content": "a"}]
    assert t.render(msgs) == "a>>"
    assert t.render(msgs, chat_template_kwargs={"add_generation_prompt": False}) == "a"
    assert t.render(msgs, chat_template_kwargs={"messages": [{"content": "evil"}]}) == "a>>"


def test_tool_call_arguments_become_objects() -> None:
    t = ChatTemplate("{% for c in messages[0].tool_calls %}{{ c.function.arguments.city }}{% endfor %}")
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}}
        ],
    }
    assert t.render([msg]) == "Paris"
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'


def test_errors() -> None:
    with pytest.raises(ChatTemplateError, match="invalid chat template"):
        ChatTemplate("{% if %}")
    t = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}ok"
    )
    assert t.render([{"role": "user", "content": ""}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first message must be user"):
        t.render([{"role": "system", "content": ""}])
    # Arithmetic on message data of another type than the template expects.
    t = ChatTemplate("{{ 1 + messages[0]['content'] }}")
    with pytest.raises(ChatTemplateError):
        t.render([{"role": "assistant", "content": "x"}])
    # An assistant turn of tool calls only (no content) renders as empty content, as vLLM renders it, in a
    # template that concatenates the content (SmolLM2's does).
    t = ChatTemplate("{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] }}{% endfor %}")
    call = {"id": "1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
    assert t.render([{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": "21"}]) \
        == "<assistant><tool>21"
    # The sandbox refuses attribute access to internals.
    t = ChatTemplate("{{ messages.__class__.__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        t.render([])
    assert issubclass(ChatTemplateError, ValueError)


def test_compiled_once() -> None:
    a = ChatTemplate("{{ messages | length }}")
    b = ChatTemplate("{{ messages | length }}")
    assert a._compiled is b._compiled
