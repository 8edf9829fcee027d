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
from tandem.llm.parsers.call_stream import ToolCallStream
from tandem.llm.parsers.chat import ChatParser, NamedCall, required_calls
from tandem.llm.parsers.harmony import HarmonyStream
from tandem.llm.parsers.markup import (
    DsmlCalls,
    DsmlV4Calls,
    Gemma4Calls,
    GlmCalls,
    MinimaxCalls,
    Qwen3CoderCalls,
)
from tandem.llm.parsers.reasoning import ThinkTags
from tandem.llm.parsers.tools import (
    CallSyntax,
    MistralCalls,
    PythonicCalls,
    SectionCalls,
    TaggedJson,
)

__all__ = ["CallPiece", "ChatParser", "ParsedDelta", "ToolCallDelta", "UnknownParserError", "chat_parser",
           "check_reasoning_parser", "check_tool_parser", "TOOL_PARSERS", "REASONING_PARSERS",
           "needs_special_tokens", "thinking_markers", "HARMONY"]  # fmt: skip

HARMONY = "harmony"
_Syntax = Callable[[Sequence[Mapping[str, Any]]], CallSyntax]


def _tagged(*tags: tuple[str, str | None], leading: tuple[str, ...] = ()) -> _Syntax:
    """JSON calls between tags (a close tag of None: to the end of the JSON)."""
    return lambda tools: TaggedJson(tools, tags=tags, leading=leading)


def _sections(section: tuple[str, str], call: tuple[str, str], args_start: str, name_of: Callable[[str], str | None],
              args_end: str = "", id_of: Callable[[str], str | None] | None = None) -> _Syntax:
    return lambda tools: SectionCalls(tools, section=section, call=call, args_start=args_start, name_of=name_of,
                                      args_end=args_end, id_of=id_of)


_DEEPSEEK_SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
_DEEPSEEK_CALL = ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>")


def _kimi_name(head: str) -> str | None:
    """Kimi K2 names a call `functions.NAME:INDEX`."""
    name = head.strip().removeprefix("functions.").rsplit(":", 1)[0]
    return name or None


_hermes = _tagged(("<tool_call>", "</tool_call>"))
# name -> the family's syntax (harmony is its own stream: it also carries the thinking).
TOOL_PARSERS: dict[str, _Syntax | None] = {
    "hermes": _hermes,
    "qwen25": _hermes,
    "llama3_json": _tagged(("<|python_tag|>", None), leading=("{",)),
    "mistral": MistralCalls,
    "pythonic": PythonicCalls,
    "qwen3_coder": Qwen3CoderCalls,
    "default": _tagged(("<TOOLCALL>", "</TOOLCALL>"), ("<|python_tag|>", None)),
    HARMONY: None,
    "nemotron_deci": _tagged(("<TOOLCALL>", "</TOOLCALL>")),
    "phi4": _tagged(("functools", None)),
    "jamba": _tagged(("<tool_calls>", "</tool_calls>")),
    "nemotron_nano": Qwen3CoderCalls,
    "minimax_m2": MinimaxCalls,
    "deepseek_v3": _sections(_DEEPSEEK_SECTION, _DEEPSEEK_CALL, "```json",
                             lambda head: head.split("<｜tool▁sep｜>")[-1].strip() or None, args_end="```"),
    "deepseek_v3_1": _sections(_DEEPSEEK_SECTION, _DEEPSEEK_CALL, "<｜tool▁sep｜>", lambda head: head.strip() or None),
    "deepseek_v3_2": DsmlCalls,
    "deepseek_v4": DsmlV4Calls,
    "deepseek-v4": DsmlV4Calls,
    # Kimi's templates give the call's own id (`functions.NAME:0`) back in the tool message: keep it.
    "kimi_k2": _sections(("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
                         ("<|tool_call_begin|>", "<|tool_call_end|>"), "<|tool_call_argument_begin|>", _kimi_name,
                         id_of=lambda head: head.strip() or None),
    "glm45": GlmCalls,
    "glm47": GlmCalls,
    "gemma4": Gemma4Calls,
    "gemma-4": Gemma4Calls,
}
_THINK, _END_THINK = ("<think>",), ("</think>",)
# name -> (start tags, end tags, thinking forced); gpt_oss is harmony's analysis channel.
REASONING_PARSERS: dict[str, tuple[tuple[str, ...], tuple[str, ...], bool] | None] = {
    "deepseek_r1": (_THINK, _END_THINK, True),
    "qwen3": (_THINK, _END_THINK, False),
    "basic": (_THINK, _END_THINK, False),
    "gpt_oss": None,
    "nemotron_deci": (_THINK, _END_THINK, False),
    "glm45": (_THINK, _END_THINK, False),
    "nemotron_nano": (_THINK, _END_THINK, True),  # its template opens the block
    "nemotron3": (_THINK, _END_THINK, True),
    "step3": (_THINK, _END_THINK, True),
    "kimi_k25": (_THINK, _END_THINK, True),
    # MiniMax-M2 thinks without writing the opening tag.
    "minimax_append_think": (_THINK, _END_THINK, True),
    "kimi": (("◁think▷",), ("◁/think▷",), False),
    "mistral": (("[THINK]",), ("[/THINK]",), True),
    "granite": (("Here's my thought process:", "Here is my thought process:"),
                ("Here's my response:", "Here is my response:"), False),
}
# Families whose markers are special tokens: the output must be detokenized with them kept.
_SPECIAL_MARKERS = frozenset(("llama3_json", "mistral", "pythonic", "default", HARMONY, "gpt_oss", "phi4", "jamba",
                              "minimax_m2", "deepseek_v3", "deepseek_v3_1", "deepseek_v3_2", "deepseek_v4",
                              "deepseek-v4", "kimi_k2", "glm45", "glm47", "gemma4", "gemma-4"))  # fmt: skip


def _check(kind: str, name: str, known: Mapping[str, Any]) -> str:
    if name in known:
        return name
    raise UnknownParserError(f"unknown {kind} parser {name!r}; known: {', '.join(known)}")


def check_tool_parser(name: str) -> str:
    return _check("tool-call", name, TOOL_PARSERS)


def check_reasoning_parser(name: str) -> str:
    return _check("reasoning", name, REASONING_PARSERS)


def thinking_markers(reasoning_parser: str) -> tuple[str, str]:
    """The text that opens a thinking block and the text that ends it and starts the answer (what an
    engine forces when the thinking budget runs out)."""
    tags = REASONING_PARSERS[check_reasoning_parser(reasoning_parser)]
    if tags is None:  # gpt_oss
        return "<|channel|>analysis<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>"
    return tags[0][0], tags[1][0]


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
        starts, ends, forced = REASONING_PARSERS[reasoning]  # type: ignore[misc]
        thinking_tags = ThinkTags(starts, ends, forced=forced, prompt=prompt)
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
