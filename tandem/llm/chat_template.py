"""Render a Hugging Face chat template (jinja2), the way transformers' `apply_chat_template` does.

Same sandboxed environment and helpers (`raise_exception`, `strftime_now`, a `tojson` that does not
escape HTML or non-ASCII), same template variables (`messages`, `tools`, `documents`,
`add_generation_prompt`, the special token strings, then any `chat_template_kwargs`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from tandem.llm.tokenizer import Tokenizer


class ChatTemplateError(ValueError):
    """The template does not compile, or rendering it failed (including `raise_exception`)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"invalid chat template: {e}") from e


def _flatten_content(content: Any) -> Any:
    """OpenAI content parts -> one string (the text parts, joined); other content is left as is."""
    if not isinstance(content, list):
        return content
    texts: list[str] = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif (
            isinstance(part, Mapping)
            and part.get("type", "text") == "text"
            and isinstance(part.get("text"), str)
        ):
            texts.append(part["text"])
    return "".join(texts)


def _prepare_message(message: Any) -> Any:
    """Copy-on-write normalisation: flattened content, no content as "" (an assistant turn of tool calls only:
    templates that concatenate `message['content']`, SmolLM2's among them, would fail on None), tool-call
    arguments as objects (templates apply `tojson` or iterate over `arguments`, while OpenAI sends a JSON
    string). All three as vLLM renders messages."""
    if not isinstance(message, Mapping):
        return message
    out: dict[str, Any] | None = None
    content = message.get("content")
    if content is None or isinstance(content, list):
        out = dict(message)
        out["content"] = "" if content is None else _flatten_content(content)
    tool_calls = message.get("tool_calls")
    if isinstance(tool_calls, list) and tool_calls:
        calls = []
        changed = False
        for call in tool_calls:
            function = call.get("function") if isinstance(call, Mapping) else None
            args = function.get("arguments") if isinstance(function, Mapping) else None
            if isinstance(args, str):
                try:
                    parsed = json.loads(args)
                except ValueError:
                    parsed = None
                if isinstance(parsed, dict):
                    call = {**call, "function": {**function, "arguments": parsed}}  # type: ignore[dict-item]
                    changed = True
            calls.append(call)
        if changed:
            out = dict(message) if out is None else out
            out["tool_calls"] = calls
    return message if out is None else out


class ChatTemplate:
    """A compiled chat template. `render` is safe to call concurrently."""

    def __init__(
        self,
        template: str,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        special_tokens: Mapping[str, Any] | None = None,
    ) -> None:
        self.template = template
        self._compiled = _compile(template)
        # Variables every render sees (HF passes the tokenizer's special_tokens_map); kwargs override.
        self._base: dict[str, Any] = dict(special_tokens or {})
        if bos_token is not None:
            self._base["bos_token"] = bos_token
        if eos_token is not None:
            self._base["eos_token"] = eos_token

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, name: str | None = None) -> ChatTemplate:
        """The tokenizer's template (or its named one), with its special tokens."""
        template = tokenizer.chat_templates.get(name) if name else tokenizer.chat_template
        if template is None:
            raise ChatTemplateError(f"the tokenizer has no chat template{f' named {name!r}' if name else ''}")
        return cls(template, special_tokens=tokenizer.special_tokens_map)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        context: dict[str, Any] = dict(self._base)
        context["tools"] = tools
        context["documents"] = None
        context["add_generation_prompt"] = add_generation_prompt
        if chat_template_kwargs:
            # Extra template variables (e.g. enable_thinking); like vLLM they may also override
            # add_generation_prompt / tools, but never the messages.
            context.update(chat_template_kwargs)
        context["messages"] = [_prepare_message(m) for m in messages]
        try:
            return self._compiled.render(context)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e
        except Exception as e:  # a template doing arithmetic/concatenation on unexpected message data
            raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from e
