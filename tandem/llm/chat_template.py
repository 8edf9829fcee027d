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
        compiled = _environment().from_string(template)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"invalid chat template: {e}") from e
    # The globals as one plain dict rather than jinja2's ChainMap over the environment's: every render
    # copies them into its context, and a ChainMap is iterated in Python (~10 µs a render).
    compiled.globals = dict(compiled.globals)
    return compiled


def _flatten_content(content: Any) -> Any:
    """OpenAI content parts -> one string (the text parts, joined); other content, and parts with an image
    (`{"type": "image"}`: a vision-language model's template places each), are left as they are."""
    if not isinstance(content, list) or any(isinstance(p, Mapping) and p.get("type") == "image" for p in content):
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


# A conversation with an instruction after its first message: what `ChatTemplate` probes a template with.
_LATE_SYSTEM_PROBE = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"},
                      {"role": "assistant", "content": "c"}, {"role": "system", "content": "d"},
                      {"role": "user", "content": "e"}]  # fmt: skip


def _fold_late_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The leading system messages as one, each later one folded into a user message (see ChatTemplate)."""
    lead = 0
    while lead < len(messages) and messages[lead].get("role") == "system":
        lead += 1
    out: list[dict[str, Any]] = []
    if lead:
        out.append({"role": "system", "content": "\n\n".join(_text(m) for m in messages[:lead])})
    pending: list[str] = []
    for m in messages[lead:]:
        if m.get("role") == "system":
            pending.append(_text(m))
        elif m.get("role") == "user" and pending:
            out.append({**m, "content": "\n\n".join([*pending, _text(m)])})
            pending = []
        else:
            out.append(m)
    if pending:
        last = next((i for i in range(len(out) - 1, -1, -1) if out[i].get("role") == "user"), None)
        if last is None:
            out.append({"role": "user", "content": "\n\n".join(pending)})
        else:
            out[last] = {**out[last], "content": "\n\n".join([_text(out[last]), *pending])}
    return out


def _text(message: Mapping[str, Any]) -> str:
    content = _flatten_content(message.get("content"))
    return content if isinstance(content, str) else ""


class ChatTemplate:
    """A compiled chat template. `render` is safe to call concurrently.

    Instructions are placed where the template can take them. `developer` messages (OpenAI's name for
    instructions) are system messages to a template that never mentions the role. A system message after
    the first message (agents send them mid-conversation) stays in place when the template renders one
    after a turn; otherwise the leading system messages become one, and each later one is folded into the
    start of the next user message (the end of the last one when no user message follows), so the model
    still reads it at the point of the conversation where it was given."""

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
        self._knows_developer = "developer" in template
        self._late_system: bool | None = None  # renders a system message after a turn; probed once

    @property
    def takes_late_system(self) -> bool:
        """Whether a system message after the conversation's first turn renders in place."""
        if self._late_system is None:
            try:
                self._compiled.render({**self._base, "messages": _LATE_SYSTEM_PROBE, "tools": None,
                                       "documents": None, "add_generation_prompt": True})
                self._late_system = True
            except Exception:  # whatever the template raises (raise_exception, or arithmetic on roles)
                self._late_system = False
        return self._late_system

    def place_instructions(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`messages` with developer and later system messages placed as the class says (the same list when
        nothing moves)."""
        instruction = ("system", "developer") if not self._knows_developer else ("system",)
        late = developer = False
        for i, m in enumerate(messages):
            role = m.get("role")
            if role in instruction:
                late = late or i > 0
                developer = developer or role == "developer"
        if not developer and not late:
            return messages
        if developer:
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        if not late or self.takes_late_system:
            return messages
        return _fold_late_system(messages)

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
        context["messages"] = [_prepare_message(m) for m in self.place_instructions(messages)]
        try:
            return self._compiled.render(context)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e
        except Exception as e:  # a template doing arithmetic/concatenation on unexpected message data
            raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from e
