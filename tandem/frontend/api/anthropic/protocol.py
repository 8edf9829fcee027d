"""Anthropic's Messages API's requests, checked in Anthropic's terms and mapped onto a chat request, and its
error shape.

`system` becomes a leading system message, and a system message among `messages` stays where it was given;
content blocks become chat messages (`tool_use` blocks the assistant's `tool_calls`, each `tool_result` a
`tool` message, `thinking` blocks the assistant's `reasoning_content`; `redacted_thinking` is dropped, its
text being opaque); client `tools` become function tools (Anthropic's versioned server tools are left out,
with a warning header) and `tool_choice` tandem's none / auto / required / forced function;
`context_management` clears old thinking as asked; `thinking` switches the chat template's `enable_thinking`
and, on a model served with a reasoning parser, bounds the thinking with its `budget_tokens`;
`output_config.format` is guided decoding. `cache_control` is accepted anywhere and ignored: tandem caches
prompt prefixes by itself (and its router sends a request to the worker that holds most of it), so there are
no cache breakpoints to set. Image blocks (base64 or URL sources) become the chat request's images; documents are refused by name.
Unknown top-level fields and beta names are accepted and logged once (`tolerant.py`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from tandem.frontend.protocol.errors import RequestError, fail
from tandem.frontend.protocol.validation import MAX_STOP, U32, Rule, check_rules, check_wire, decode_body
from tandem.frontend.requests import (
    ChatRequest,
    ImagePart,
    chat_request,
    template_content,
    tool_choice_fields,
)
from tandem.frontend.tolerant import TolerantDecoder, notice
from tandem.llm.protocols import GuidedDecoding

# Anthropic's error types by HTTP status (529 is its "overloaded"; tandem's busy answer is a 503).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}  # fmt: skip


def error_body(error: RequestError) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`; the message names the field at fault."""
    kind = _ERROR_TYPES.get(error.status) or ("invalid_request_error" if error.status < 500 else "api_error")
    message = error.message
    if error.param and error.param not in message:
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


# -- requests --------------------------------------------------------------------------------------


class _Text(msgspec.Struct, tag="text"):
    text: str


class _Base64Source(msgspec.Struct, tag="base64"):
    media_type: str
    data: str


class _UrlSource(msgspec.Struct, tag="url"):
    url: str


class _Image(msgspec.Struct, tag="image"):
    source: _Base64Source | _UrlSource

    @property
    def url(self) -> str:
        source = self.source
        if isinstance(source, _UrlSource):
            return source.url
        return f"data:{source.media_type};base64,{source.data}"


class _Document(msgspec.Struct, tag="document"):
    pass


class _ToolUse(msgspec.Struct, tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class _ToolResult(msgspec.Struct, tag="tool_result"):
    tool_use_id: str
    content: str | list[_Text | _Image | _Document] = ""
    is_error: bool = False


class _Thinking(msgspec.Struct, tag="thinking"):
    thinking: str


class _RedactedThinking(msgspec.Struct, tag="redacted_thinking"):
    pass


_Block = _Text | _Image | _Document | _ToolUse | _ToolResult | _Thinking | _RedactedThinking


class _Message(msgspec.Struct):
    role: Literal["user", "assistant", "system"]  # system: an instruction given mid-conversation
    content: str | list[_Block]


class _Tool(msgspec.Struct):
    name: str
    input_schema: dict[str, Any] | None = None  # server tools have none
    description: str | None = None
    type: str | None = None


class _Auto(msgspec.Struct, tag="auto"):
    disable_parallel_tool_use: bool = False


class _AnyTool(msgspec.Struct, tag="any"):
    disable_parallel_tool_use: bool = False


class _NamedTool(msgspec.Struct, tag="tool"):
    name: str
    disable_parallel_tool_use: bool = False


class _NoTool(msgspec.Struct, tag="none"):
    pass


class _Enabled(msgspec.Struct, tag="enabled"):
    budget_tokens: int


class _Disabled(msgspec.Struct, tag="disabled"):
    pass


class _Adaptive(msgspec.Struct, tag="adaptive"):
    pass


class _JsonFormat(msgspec.Struct, tag="json_schema"):
    schema: dict[str, Any]


class _OutputConfig(msgspec.Struct):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: _JsonFormat | None = None


class _Metadata(msgspec.Struct):
    user_id: str | None = None


class _Keep(msgspec.Struct):
    type: str
    value: int


class _ContextEdit(msgspec.Struct):
    """One of `context_management.edits`; only `clear_thinking_*` changes the prompt here (`_manage_context`)."""

    type: str
    keep: _Keep | Literal["all"] | None = None


class _ContextManagement(msgspec.Struct):
    edits: list[_ContextEdit] = []


class _CountBody(msgspec.Struct, kw_only=True):
    """A /v1/messages/count_tokens body as it comes over the wire: what makes the prompt."""

    model: str
    messages: list[_Message]
    system: str | list[_Text] | None = None
    tools: list[_Tool] | None = None
    tool_choice: _Auto | _AnyTool | _NamedTool | _NoTool | None = None
    thinking: _Enabled | _Disabled | _Adaptive | None = None
    context_management: _ContextManagement | None = None


class _MessagesBody(_CountBody, kw_only=True):
    """A /v1/messages body: the prompt's fields and the generation's."""

    max_tokens: int
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: _Metadata | None = None
    output_config: _OutputConfig | None = None


_messages_reader = TolerantDecoder(_MessagesBody, "/v1/messages")
_count_reader = TolerantDecoder(_CountBody, "/v1/messages/count_tokens")
RULES = (
    Rule("max_tokens", "integer", 1, U32 - 1),
    Rule("temperature", "number", 0, 1),
    Rule("top_p", "number", 0, 1, exclusive_minimum=True),
    Rule("top_k", "integer", 0, U32 - 1),
)
MIN_THINKING_BUDGET = 1024  # Anthropic's least budget_tokens
# Claude Code's first system block: its version and a hash that changes with every request, which would
# make every prompt differ from its first tokens on and defeat prefix caching and KV-aware routing.
_BILLING_HEADER = "x-anthropic-billing-header:"
# Anthropic's efforts above "high" have no counterpart in chat templates' reasoning_effort.
_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


# Beta features whose meaning tandem serves (what each does here is in docs/frontend.md); other names in
# `anthropic-beta` are logged once and the request is served as without them.
SERVED_BETAS = frozenset(("claude-code-20250219", "interleaved-thinking-2025-05-14", "effort-2025-11-24",
                          "mid-conversation-system-2026-04-07", "structured-outputs-2025-11-13",
                          "structured-outputs-2025-12-15", "context-management-2025-06-27",
                          "thinking-token-count-2026-05-13", "prompt-caching-scope-2026-01-05",
                          "token-counting-2024-11-01"))  # fmt: skip


def note_betas(header: str | None) -> None:
    """Log, once each, the beta features a request names that tandem does not serve."""
    for name in (header or "").split(","):
        name = name.strip()
        if name and name not in SERVED_BETAS:
            notice.once(f"anthropic-beta {name!r}", "not served: the request is answered as without it")


class MessagesRequest(msgspec.Struct, kw_only=True):
    """A checked Messages API request, already in chat's terms: what `chat` builds the chat request from.
    `max_tokens` is None for count_tokens; `thinking` None leaves the chat template's default."""

    model: str
    stream: bool
    max_tokens: int | None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    tool_fields: dict[str, Any]  # tool_choice / forced_function / guided, from tool_choice_fields
    parallel_tool_calls: bool | None
    thinking: bool | None
    thinking_budget: int | None
    guided: GuidedDecoding | None = None
    stop: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    reasoning_effort: str | None = None
    user: str | None = None
    left_out_tools: list[str] = []  # tools of the request not offered to the model (see `_tools`)
    images: list[ImagePart] = []  # the image blocks' images, in prompt order

    def chat(self, *, reasoning: bool) -> ChatRequest:
        """The chat request; `reasoning`: the model is served with a reasoning parser, which is what
        bounds the thinking to its budget (without one, thinking is not told apart from the answer)."""
        template = None if self.thinking is None else {"enable_thinking": self.thinking}
        return chat_request(model=self.model, messages=self.messages, stream=self.stream,
                                   max_tokens=self.max_tokens, tools=self.tools, tool_fields=self.tool_fields,
                                   parallel_tool_calls=self.parallel_tool_calls, guided=self.guided,
                                   max_thinking_tokens=self.thinking_budget if reasoning else None,
                                   fit_max_tokens=True, stop=self.stop, temperature=self.temperature,
                                   top_p=self.top_p, top_k=self.top_k, reasoning_effort=self.reasoning_effort,
                                   chat_template_kwargs=template, user=self.user, images=self.images)


def parse_messages_request(body: bytes) -> MessagesRequest:
    """Decode and check a /v1/messages body; raises RequestError naming the field at fault."""
    raw = _messages_reader.decode(body) or decode_body(_messages_reader.lenient, body)
    check_rules(raw, RULES)
    if raw.stop_sequences is not None and len(raw.stop_sequences) > MAX_STOP:
        raise fail("stop_sequences", f"at most {MAX_STOP} stop sequences are allowed "
                                            f"(got {len(raw.stop_sequences)}).")
    if isinstance(raw.thinking, _Enabled) and raw.thinking.budget_tokens >= raw.max_tokens:
        raise fail("thinking.budget_tokens", f"budget_tokens ({raw.thinking.budget_tokens}) must be less "
                                                    f"than max_tokens ({raw.max_tokens}).")
    config = raw.output_config or _OutputConfig()
    guided = None
    if config.format is not None:
        guided = GuidedDecoding(json=check_wire(config.format.schema, "output_config.format.schema"))
    return msgspec.structs.replace(
        _prompt(raw, guided), stream=raw.stream, max_tokens=raw.max_tokens, guided=guided,
        stop=[s for s in raw.stop_sequences or () if s] or None,  # an empty one would match at once
        temperature=raw.temperature, top_p=raw.top_p,
        top_k=raw.top_k or None,  # 0 (Anthropic's least) samples from every token
        reasoning_effort=_EFFORTS[config.effort] if config.effort is not None else None,
        user=raw.metadata.user_id if raw.metadata is not None else None)


def parse_count_tokens_request(body: bytes) -> MessagesRequest:
    """Decode and check a /v1/messages/count_tokens body (no max_tokens, no stream); raises RequestError."""
    return _prompt(_count_reader.decode(body) or decode_body(_count_reader.lenient, body), None)


def _prompt(raw: _CountBody, guided: GuidedDecoding | None) -> MessagesRequest:
    """What both routes check and map: the fields that make the prompt (the rest left unset)."""
    if not raw.model:
        raise fail("model", "'model' must be a non-empty string.")
    if not raw.messages:
        raise fail("messages", "at least one message is required.")
    budget = raw.thinking.budget_tokens if isinstance(raw.thinking, _Enabled) else None
    if budget is not None and not MIN_THINKING_BUDGET <= budget < 2**32:  # engines count tokens in 32 bits
        raise fail("thinking.budget_tokens", f"budget_tokens must be between {MIN_THINKING_BUDGET} and "
                                                    f"4294967295 (got {budget}).")
    tools, left_out = _tools(raw.tools or [])
    tool_fields, parallel = _tool_choice(raw.tool_choice, tools, left_out, guided)
    images: list[ImagePart] = []
    messages = _system(raw.system) + _messages(raw.messages, images)
    if raw.context_management is not None:
        messages = _manage_context(messages, raw.context_management)
    return MessagesRequest(model=raw.model, stream=False, max_tokens=None, messages=messages,
                           tools=[{"type": "function", "function": f} for f in tools.values()],
                           tool_fields=tool_fields, parallel_tool_calls=parallel,
                           thinking=None if raw.thinking is None else not isinstance(raw.thinking, _Disabled),
                           thinking_budget=budget, left_out_tools=left_out, images=images)


def _manage_context(messages: list[dict[str, Any]], config: _ContextManagement) -> list[dict[str, Any]]:
    """The context edits tandem applies: `clear_thinking_*` drops the thinking of all but the last `keep`
    assistant turns that have some (one by default, none dropped with "all"). Other edits (clearing old
    tool results past a token threshold) are left undone and logged: the prompt is then longer, never
    different in meaning, and a prompt that no longer fits is refused with the context length."""
    for i, edit in enumerate(config.edits):
        if not edit.type.startswith("clear_thinking_"):
            notice.once(f"context_management edit {edit.type!r}", "not applied: the conversation is sent whole")
            continue
        keep = edit.keep
        if isinstance(keep, str):  # "all"
            continue
        if keep is not None and (keep.type != "thinking_turns" or keep.value < 0):
            raise fail(f"context_management.edits[{i}].keep",
                              "keep must be 'all' or {'type': 'thinking_turns', 'value': N >= 0}.")
        turns = 1 if keep is None else keep.value
        thinking = [j for j, m in enumerate(messages) if "reasoning_content" in m]
        dropped = thinking[: max(len(thinking) - turns, 0)]
        if dropped:
            messages = list(messages)
            for j in dropped:
                messages[j] = {k: v for k, v in messages[j].items() if k != "reasoning_content"}
    return messages


def _system(system: str | list[_Text] | None) -> list[dict[str, Any]]:
    if isinstance(system, list):
        system = "\n".join(b.text for b in system if not b.text.startswith(_BILLING_HEADER))
    return [{"role": "system", "content": system}] if system else []


def _messages(messages: list[_Message], images: list[ImagePart]) -> list[dict[str, Any]]:
    """The conversation as chat messages; a system message in it stays where it was given (the chat
    template places it, see `ChatTemplate`). The user turns' images are appended to `images`."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        p = f"messages[{i}]"
        content = message.content
        if isinstance(content, str):
            out.append({"role": message.role, "content": content})
        elif message.role == "assistant":
            out.append(_assistant(content, p))
        elif message.role == "system":
            out.append({"role": "system", "content": _texts(content, p, "system messages")})
        else:
            out.extend(_user(content, p, images))
    return out


def _texts(blocks: Sequence[_Block], p: str, where: str) -> str:
    for j, block in enumerate(blocks):
        if not isinstance(block, _Text):
            raise _misplaced(block, f"{p}.content[{j}]", where)
    return "\n".join(b.text for b in blocks if isinstance(b, _Text))


def _assistant(blocks: list[_Block], p: str) -> dict[str, Any]:
    """An assistant turn: its text, its thinking as `reasoning_content`, its tool_use blocks as `tool_calls`
    (arguments as JSON text, OpenAI's shape)."""
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(blocks):
        if isinstance(block, _Text):
            texts.append(block.text)
        elif isinstance(block, _Thinking):
            thoughts.append(block.thinking)
        elif isinstance(block, _ToolUse):
            arguments = msgspec.json.encode(block.input).decode()
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif not isinstance(block, _RedactedThinking):
            raise _misplaced(block, f"{p}.content[{j}]", "assistant messages")
    # No text beside calls is null content, as OpenAI's clients send it (what chat templates expect).
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[_Block], p: str, images: list[ImagePart]) -> list[dict[str, Any]]:
    """A user turn: a `tool` message per tool_result, then its text (Anthropic has the results first); a turn
    with images keeps its text and image parts in order, for the model's chat template."""
    out: list[dict[str, Any]] = []
    pieces: list[str | ImagePart] = []
    for j, block in enumerate(blocks):
        if isinstance(block, _Text):
            pieces.append(block.text)
        elif isinstance(block, _Image):
            pieces.append(ImagePart(block.url, f"{p}.content[{j}]"))
        elif isinstance(block, _ToolResult):
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": _result_text(block, f"{p}.content[{j}]")})
        else:
            raise _misplaced(block, f"{p}.content[{j}]", "user messages")
    if pieces or not out:
        out.append({"role": "user", "content": template_content(pieces, images)})
    return out


def _result_text(result: _ToolResult, p: str) -> str:
    text = result.content if isinstance(result.content, str) else _texts(result.content, p, "a tool_result")
    # The chat message has no error flag: the text says it, or the model would read a failure as a result.
    return f"Error: {text}" if result.is_error else text


def _misplaced(block: _Block, param: str, where: str) -> RequestError:
    kind = type(block).__struct_config__.tag
    if isinstance(block, _Document):
        return fail(param, "document blocks are not supported (send text).")
    return fail(param, f"{kind} blocks are not allowed in {where}.")


def _tools(tools: list[_Tool]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The client tools as chat functions, by name, and the names of the tools left out: Anthropic's
    versioned tools (`web_search_20250305`, `bash_20250124`, ...) run on Anthropic's servers or follow a
    schema only Anthropic's models are trained on, so the model here is not offered them."""
    functions: dict[str, dict[str, Any]] = {}
    left_out: list[str] = []
    for i, tool in enumerate(tools):
        p = f"tools[{i}]"
        if tool.type not in (None, "custom"):
            notice.once(f"tool type {tool.type!r}", "left out of the model's tools: tandem does not run it")
            left_out.append(tool.name)
            continue
        if not tool.name:
            raise fail(f"{p}.name", "a tool name must be a non-empty string.")
        if tool.name in functions:
            raise fail(f"{p}.name", f"tool names must be unique ({tool.name!r} is given twice).")
        if tool.input_schema is None:
            raise fail(f"{p}.input_schema", "Missing required parameter: 'input_schema'.")
        if tool.input_schema.get("type") != "object":
            raise fail(f"{p}.input_schema.type", "input_schema must be a JSON schema of type 'object'.")
        function: dict[str, Any] = {"name": tool.name,
                                    "parameters": check_wire(tool.input_schema, f"{p}.input_schema")}
        if tool.description is not None:
            function["description"] = tool.description
        functions[tool.name] = function
    return functions, left_out


def _tool_choice(choice: _Auto | _AnyTool | _NamedTool | _NoTool | None, tools: dict[str, dict[str, Any]],
                 left_out: list[str], guided: GuidedDecoding | None) -> tuple[dict[str, Any], bool | None]:
    """The chat request's tool fields and parallel_tool_calls for Anthropic's tool_choice."""
    if isinstance(choice, _NamedTool) and choice.name in left_out:
        raise fail("tool_choice.name", f"tool_choice names tool {choice.name!r}, which tandem does not run.")
    if isinstance(choice, _NoTool) or not tools:
        if isinstance(choice, _AnyTool | _NamedTool):
            raise fail("tool_choice", f"tool_choice {type(choice).__struct_config__.tag!r} needs at least "
                                             "one tool in 'tools'.")
        return {"tool_choice": "none"}, None
    parallel = False if choice is not None and choice.disable_parallel_tool_use else None
    if isinstance(choice, _NamedTool) and choice.name not in tools:
        raise fail("tool_choice.name", f"tool_choice names tool {choice.name!r}, which is not in 'tools'.")
    mode = "required" if isinstance(choice, _AnyTool | _NamedTool) else "auto"
    forced = choice.name if isinstance(choice, _NamedTool) else None
    parameters = {name: f["parameters"] for name, f in tools.items()}
    return tool_choice_fields(parameters, mode, forced, parallel is not False, guided), parallel
