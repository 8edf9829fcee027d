"""Tool-call and reasoning parsers, by name (the names Dynamo's and vLLM's users pass as
`--dyn-tool-call-parser` / `--dyn-reasoning-parser`).

`chat_parser(...)` builds one request's parser from the model's configured names and the request's
`tools` / `tool_choice` / thinking switch; None when there is nothing to parse. A name that is not built
is refused (`check_tool_parser`, `check_reasoning_parser`), never replaced by another parser.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tandem.llm.parsers.base import CallPiece, ParsedDelta, ToolCallDelta, UnknownParserError
from tandem.llm.parsers.chat import ChatParser, NamedCall, required_calls
from tandem.llm.parsers.harmony import HarmonyStream
from tandem.llm.parsers.reasoning import ThinkTags
from tandem.llm.parsers.tools import (
    CallSyntax,
    MistralCalls,
    PythonicCalls,
    TaggedJson,
    ToolCallStream,
    XmlCalls,
)

__all__ = ["CallPiece", "ChatParser", "ParsedDelta", "ToolCallDelta", "UnknownParserError", "chat_parser",
           "check_reasoning_parser", "check_tool_parser", "TOOL_PARSERS", "REASONING_PARSERS",
           "needs_special_tokens", "thinking_markers", "HARMONY"]  # fmt: skip

HARMONY = "harmony"
_Syntax = Callable[[Sequence[Mapping[str, Any]]], CallSyntax]


def _hermes(tools: Sequence[Mapping[str, Any]]) -> CallSyntax:
    return TaggedJson(tools, tags=(("<tool_call>", "</tool_call>"),))


def _llama3_json(tools: Sequence[Mapping[str, Any]]) -> CallSyntax:
    return TaggedJson(tools, tags=(("<|python_tag|>", None),), leading=("{",))


def _default(tools: Sequence[Mapping[str, Any]]) -> CallSyntax:
    return TaggedJson(tools, tags=(("<TOOLCALL>", "</TOOLCALL>"), ("<|python_tag|>", None)))


# name -> the family's syntax (harmony is its own stream: it also carries the thinking).
TOOL_PARSERS: dict[str, _Syntax | None] = {
    "hermes": _hermes,
    "qwen25": _hermes,
    "llama3_json": _llama3_json,
    "mistral": MistralCalls,
    "pythonic": PythonicCalls,
    "qwen3_coder": XmlCalls,
    "default": _default,
    HARMONY: None,
}
# name -> (start tag, end tag, thinking forced); gpt_oss is harmony's analysis channel.
REASONING_PARSERS: dict[str, tuple[str, str, bool] | None] = {
    "deepseek_r1": ("<think>", "</think>", True),
    "qwen3": ("<think>", "</think>", False),
    "basic": ("<think>", "</think>", False),
    "gpt_oss": None,
}
# Names Dynamo knows that tandem does not build yet.
_TOOL_PARSERS_LATER = ("nemotron_deci", "phi4", "jamba", "nemotron_nano", "minimax_m2", "deepseek_v3",
                       "deepseek_v3_1", "deepseek_v3_2", "deepseek_v4", "deepseek-v4", "kimi_k2", "glm45",
                       "glm47", "gemma4", "gemma-4")  # fmt: skip
_REASONING_PARSERS_LATER = ("nemotron_deci", "kimi", "kimi_k25", "step3", "mistral", "granite", "nemotron_nano",
                            "nemotron3", "glm45", "minimax_append_think")  # fmt: skip
# Families whose markers are special tokens: the output must be detokenized with them kept.
_SPECIAL_MARKERS = frozenset(("llama3_json", "mistral", "pythonic", "default", HARMONY, "gpt_oss"))


def _check(kind: str, name: str, known: Mapping[str, Any], later: Sequence[str]) -> str:
    if name in known:
        return name
    built = ", ".join(known)
    if name in later:
        raise UnknownParserError(f"{kind} parser {name!r} is not built yet in tandem; built: {built}")
    raise UnknownParserError(f"unknown {kind} parser {name!r}; known: {built}")


def check_tool_parser(name: str) -> str:
    return _check("tool-call", name, TOOL_PARSERS, _TOOL_PARSERS_LATER)


def check_reasoning_parser(name: str) -> str:
    return _check("reasoning", name, REASONING_PARSERS, _REASONING_PARSERS_LATER)


def thinking_markers(reasoning_parser: str) -> tuple[str, str]:
    """The text that opens a thinking block and the text that ends it and starts the answer (what an
    engine forces when the thinking budget runs out)."""
    tags = REASONING_PARSERS[check_reasoning_parser(reasoning_parser)]
    if tags is None:  # gpt_oss
        return "<|channel|>analysis<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>"
    return tags[0], tags[1]


def needs_special_tokens(tool_parser: str | None, reasoning_parser: str | None) -> bool:
    return tool_parser in _SPECIAL_MARKERS or reasoning_parser in _SPECIAL_MARKERS


def chat_parser(*, tool_parser: str | None, reasoning_parser: str | None,
                tools: Sequence[Mapping[str, Any]] | None, tool_choice: str | None = "auto",
                forced_function: str | None = None, thinking: bool = True, prompt: str = "",
                parallel_tool_calls: bool = True) -> ChatParser | None:  # fmt: skip
    """The request's parser. `tool_choice` is auto, none or required (`forced_function` names the
    function of a named choice); `thinking` False (the client turned thinking off) disables the
    reasoning parser; `prompt` is the templated prompt (a template may open the thinking block);
    without `parallel_tool_calls` only the first call is returned."""
    max_calls = None if parallel_tool_calls else 1
    reasoning = reasoning_parser if thinking else None
    if forced_function is not None or tool_choice == "required":
        tool_mode = "forced"
    elif tools and tool_choice != "none":
        tool_mode = "auto"
        tool_parser = tool_parser or "default"
    else:
        tool_mode = None
    harmony_calls = tool_mode == "auto" and tool_parser == HARMONY
    if harmony_calls or reasoning == "gpt_oss":
        harmony = HarmonyStream(calls=harmony_calls, reasoning=reasoning == "gpt_oss")
        if tool_mode != "forced":
            return ChatParser(harmony=harmony, max_calls=max_calls)
        if forced_function is not None:
            return ChatParser(harmony=harmony, named=NamedCall(forced_function), max_calls=max_calls)
        return ChatParser(harmony=harmony, tools=required_calls(tools or ()), max_calls=max_calls)
    thinking_tags = None
    if reasoning is not None:
        start, end, forced = REASONING_PARSERS[reasoning]  # type: ignore[misc]
        thinking_tags = ThinkTags(start, end, forced=forced, prompt=prompt)
    if tool_mode == "forced":
        if forced_function is not None:
            return ChatParser(thinking=thinking_tags, named=NamedCall(forced_function), max_calls=max_calls)
        return ChatParser(thinking=thinking_tags, tools=required_calls(tools or ()), max_calls=max_calls)
    stream = None
    if tool_mode == "auto":
        syntax = TOOL_PARSERS[tool_parser]
        stream = ToolCallStream(syntax(tools or ()))  # type: ignore[misc]
    if thinking_tags is None and stream is None:
        return None
    return ChatParser(thinking=thinking_tags, tools=stream, max_calls=max_calls)
