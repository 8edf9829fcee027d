"""The Responses API's requests: bodies checked in the Responses API's terms and mapped onto a chat request
(input items become chat messages, function tools chat tools, `text.format` guided decoding,
`reasoning.effort` the chat template's `reasoning_effort`)."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec

from tandem.frontend.protocol.errors import fail, from_validation
from tandem.frontend.protocol.validation import I64_MAX, Rule, check_rules, check_wire, decode_body
from tandem.frontend.requests import (
    FUNCTION_NAME,
    IMAGE_DETAILS,
    REASONING_EFFORTS,
    ChatRequest,
    FieldNames,
    ImagePart,
    chat_request,
    template_content,
    tool_choice_fields,
)
from tandem.frontend.tolerant import TolerantDecoder, notice
from tandem.llm.protocols import GuidedDecoding

# -- requests --------------------------------------------------------------------------------------

T = TypeVar("T", bound=msgspec.Struct)
EFFORTS = ("none", *REASONING_EFFORTS, "xhigh")
# `include` values served: reasoning items always carry their text in `content`, so a client asking for
# the encrypted form (to pass reasoning back without a stored response) needs nothing more.
_INCLUDES = frozenset(("reasoning.encrypted_content",))


class _Reasoning(msgspec.Struct):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class _TextFormat(msgspec.Struct):
    type: str
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class _Text(msgspec.Struct):
    format: _TextFormat | None = None
    verbosity: str | None = None


class _FunctionTool(msgspec.Struct):
    type: str
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    namespace: str | None = None  # the namespace tool it belongs to (set here, not read from the wire)


class _Namespace(msgspec.Struct):
    """A `namespace` tool: a group of function tools, called back as (namespace, name)."""

    name: str
    tools: list[dict[str, Any]]
    description: str | None = None


class _NamedFunction(msgspec.Struct):
    type: str
    name: str | None = None
    namespace: str | None = None


class _Body(msgspec.Struct, kw_only=True):
    """A /v1/responses body as it comes over the wire (unknown fields are ignored)."""

    model: str
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: _Reasoning | None = None
    text: _Text | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    # Accepted, not used: hints to OpenAI's own service. prompt_cache_key names the session (routing).
    prompt_cache_key: str | None = None
    client_metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_retention: str | None = None
    stream_options: dict[str, Any] | None = None


_reader = TolerantDecoder(_Body, "/v1/responses")
_UNUSED = ("client_metadata", "safety_identifier", "service_tier", "prompt_cache_retention", "stream_options")
_NAMES = FieldNames(prompt="input", max_tokens="max_output_tokens")
RULES = (
    Rule("max_output_tokens", "integer", 1, I64_MAX),
    Rule("temperature", "number", 0, 2),
    Rule("top_p", "number", 0, 1, exclusive_minimum=True),
)
# Fields of the API that tandem does not serve: refused by name rather than ignored.
_UNSERVED = (("background", "background responses are not supported: send the request and keep the connection"),
             ("conversation", "conversations objects are not supported: chain responses with previous_response_id"),
             ("prompt", "prompt templates are not supported: send the input itself"),
             ("max_tool_calls", "max_tool_calls is not supported (parallel_tool_calls false allows one call)"),
             ("top_logprobs", "logprobs are not served on /v1/responses (use /v1/chat/completions)"))  # fmt: skip


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """A checked /v1/responses request: its input as chat messages, and what the chat request and the
    Response object (which echoes the request's settings) are built from."""

    model: str
    stream: bool
    store: bool
    input: list[dict[str, Any]]  # the input items as chat messages
    instructions: str | None
    previous_response_id: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[_FunctionTool]
    tool_fields: dict[str, Any]  # the chat request's tool_choice / forced_function / guided
    tool_choice: str | dict[str, Any]  # as the client gave it, echoed
    parallel_tool_calls: bool
    effort: str | None
    summary: str | None
    text_format: dict[str, Any]
    guided: GuidedDecoding | None
    metadata: dict[str, str] | None
    user: str | None
    session_id: str | None = None  # prompt_cache_key: the session this turn belongs to
    encrypted_reasoning: bool = False  # include has reasoning.encrypted_content
    left_out_tools: list[str] = []  # tools of the request not offered to the model (see `_tools`)
    namespaces: list[_Namespace] = []  # as given, for the echo
    images: list[ImagePart] = []  # the input's images, in order (each an {"type": "image"} part of `input`)

    def chat(self, history: list[dict[str, Any]], history_images: Sequence[ImagePart] = ()) -> ChatRequest:
        """The chat request: instructions, the earlier conversation (`previous_response_id`) and its images,
        the input."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        tools = [{"type": "function", "function": _chat_function(t)} for t in self.tools]
        sampling: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p, "user": self.user}
        if self.effort == "none":
            sampling["chat_template_kwargs"] = {"enable_thinking": False}
        elif self.effort is not None:
            sampling["reasoning_effort"] = self.effort
        return chat_request(model=self.model, messages=[*system, *history, *self.input], stream=self.stream,
                                   max_tokens=self.max_output_tokens, tools=tools, tool_fields=self.tool_fields,
                                   parallel_tool_calls=self.parallel_tool_calls, guided=self.guided, names=_NAMES,
                                   session_id=self.session_id, images=[*history_images, *self.images],
                                   **sampling)

    def called(self, flat: str) -> tuple[str | None, str]:
        """(namespace, name) of the function the model called by its flat name."""
        for tool in self.tools:
            if tool.namespace is not None and flat_name(tool.namespace, tool.name) == flat:
                return tool.namespace, tool.name
        return None, flat

    def echo(self) -> dict[str, Any]:
        """The request's settings as a Response object repeats them."""
        tools: list[dict[str, Any]] = [
            {"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
             "strict": t.strict} for t in self.tools if t.namespace is None]  # fmt: skip
        tools += [{"type": "namespace", "name": n.name, "description": n.description, "tools": n.tools}
                  for n in self.namespaces]
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "parallel_tool_calls": self.parallel_tool_calls, "previous_response_id": self.previous_response_id,
                "reasoning": {"effort": self.effort, "summary": self.summary}, "store": self.store,
                "temperature": self.temperature, "text": {"format": self.text_format}, "tool_choice": self.tool_choice,
                "tools": tools, "top_p": self.top_p, "truncation": "disabled", "user": self.user,
                "metadata": self.metadata or {}}  # fmt: skip


def flat_name(namespace: str | None, name: str) -> str:
    """The one name the model sees for a function of a namespace: `namespace__name`, the name agent clients
    use for it where a namespace cannot be carried."""
    return name if namespace is None else f"{namespace.rstrip('_')}__{name.lstrip('_')}"


def _chat_function(tool: _FunctionTool) -> dict[str, Any]:
    """A function tool in chat's shape, as chat templates read it."""
    function: dict[str, Any] = {"name": flat_name(tool.namespace, tool.name)}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.parameters is not None:
        function["parameters"] = tool.parameters
    return function


def parse_request(body: bytes) -> ResponsesRequest:
    """Decode and check a /v1/responses (or /v1/responses/input_tokens) body; raises RequestError."""
    raw = _reader.decode(body) or decode_body(_reader.lenient, body)
    for name in _UNUSED:
        if getattr(raw, name) is not None:
            notice.once(f"/v1/responses field {name!r}", "accepted and not used (a hint to OpenAI's own service)")
    if not raw.model:
        raise fail("model", "'model' must be a non-empty string.")
    check_rules(raw, RULES)
    for name, why in _UNSERVED:
        value = getattr(raw, name)
        if value is not None and value is not False:  # (0 is not False here: max_tool_calls 0 is refused too)
            raise fail(name, why + ".")
    if raw.truncation not in (None, "disabled"):
        raise fail("truncation", f"truncation {raw.truncation!r} is not supported: only 'disabled' (an input "
                                        "longer than the context is refused)")
    for i, value in enumerate(raw.include or ()):
        if value not in _INCLUDES:
            raise fail(f"include[{i}]", f"include {value!r} is not supported (supported: {', '.join(_INCLUDES)}).")
    if raw.input is None:
        raise fail("input", "Missing required parameter: 'input'.")
    if raw.input == "" or raw.input == []:
        raise fail("input", "'input' must not be empty.")
    effort = raw.reasoning.effort if raw.reasoning else None
    if effort is not None and effort not in EFFORTS:
        raise fail("reasoning.effort", f"reasoning.effort must be one of {', '.join(EFFORTS)} (got {effort!r}).")
    text_format, guided = _text_format(raw.text.format if raw.text else None)
    tools, namespaces, left_out = _tools(raw.tools or [])
    choice, tool_fields = _tool_choice(raw.tool_choice, tools, left_out, raw.parallel_tool_calls is not False, guided)
    images: list[ImagePart] = []
    messages = ([{"role": "user", "content": raw.input}] if isinstance(raw.input, str)
                else input_messages(raw.input, images=images))
    return ResponsesRequest(model=raw.model, stream=bool(raw.stream), store=raw.store is not False, input=messages,
                            instructions=raw.instructions, previous_response_id=raw.previous_response_id,
                            max_output_tokens=raw.max_output_tokens, temperature=raw.temperature, top_p=raw.top_p,
                            tools=tools, tool_fields=tool_fields, tool_choice=choice,
                            parallel_tool_calls=raw.parallel_tool_calls is not False, effort=effort,
                            summary=raw.reasoning.summary if raw.reasoning else None, text_format=text_format,
                            guided=guided, metadata=raw.metadata, user=raw.user, session_id=raw.prompt_cache_key,
                            encrypted_reasoning="reasoning.encrypted_content" in (raw.include or ()),
                            left_out_tools=left_out, namespaces=namespaces, images=images)


def _text_format(fmt: _TextFormat | None) -> tuple[dict[str, Any], GuidedDecoding | None]:
    """`text.format` as the Response echoes it, and the guided decoding it asks for."""
    if fmt is None or fmt.type == "text":
        return {"type": "text"}, None
    if fmt.type == "json_object":
        return {"type": "json_object"}, GuidedDecoding(json={"type": "object"})
    if fmt.type != "json_schema":
        raise fail("text.format.type", f"text.format.type must be text, json_object or json_schema "
                                              f"(got {fmt.type!r}).")
    if fmt.schema is None:
        raise fail("text.format.schema", "text.format json_schema requires a 'schema'.")
    if not fmt.name:
        raise fail("text.format.name", "text.format json_schema requires a 'name'.")
    echo = {"type": "json_schema", "name": fmt.name, "schema": fmt.schema, "strict": fmt.strict,
            "description": fmt.description}  # fmt: skip
    return echo, GuidedDecoding(json=check_wire(fmt.schema, "text.format.schema"))


def _tools(raw: list[dict[str, Any]]) -> tuple[list[_FunctionTool], list[_Namespace], list[str]]:
    """The function tools (a namespace's functions among them, each with its namespace), the namespaces as
    given, and the names of the tools left out: OpenAI's hosted tools (`web_search`, `file_search`,
    `code_interpreter`, ...) run on OpenAI's servers, so the model here is not offered them."""
    tools: list[_FunctionTool] = []
    namespaces: list[_Namespace] = []
    left_out: list[str] = []
    for i, item in enumerate(raw):
        kind = item.get("type")
        if kind == "namespace":
            group = _convert(item, _Namespace, f"tools[{i}]")
            namespaces.append(group)
            for j, member in enumerate(group.tools):
                if member.get("type") == "function":
                    tools.append(_function(member, f"tools[{i}].tools[{j}]", group.name))
                else:
                    notice.once(f"namespace tool type {member.get('type')!r}", "left out of the model's tools")
                    left_out.append(flat_name(group.name, str(member.get("name"))))
        elif kind == "function":
            tools.append(_function(item, f"tools[{i}]", None))
        else:
            notice.once(f"tool type {kind!r}", "left out of the model's tools: tandem does not run it")
            left_out.append(str(item.get("name") or kind or "?"))
    names = [flat_name(t.namespace, t.name) for t in tools]
    if len(set(names)) < len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise fail("tools", f"tool names must be unique ({twice!r} is given twice).")
    return tools, namespaces, left_out


def _function(item: dict[str, Any], param: str, namespace: str | None) -> _FunctionTool:
    tool = _convert(item, _FunctionTool, param)
    if not FUNCTION_NAME.match(tool.name):
        raise fail(f"{param}.name", f"'{param}.name' must be 1 to 64 letters, digits, '_', '.' or "
                                           f"'-' (got {tool.name!r}).")
    tool.namespace = namespace
    return check_wire(tool, f"{param}.parameters")


def _convert(item: dict[str, Any], shape: type[T], param: str) -> T:
    try:
        return msgspec.convert(item, shape)
    except msgspec.ValidationError as e:
        raise from_validation(e, param) from None


def _tool_choice(raw: str | dict[str, Any] | None, tools: list[_FunctionTool], left_out: list[str], parallel: bool,
                 guided: GuidedDecoding | None) -> tuple[str | dict[str, Any], dict[str, Any]]:
    """The choice as echoed, and the chat request's tool fields."""
    forced = None
    if raw is None:
        choice: str = "auto" if tools else "none"
        echo: str | dict[str, Any] = "auto"
    elif isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise fail("tool_choice", f"tool_choice must be none, auto, required or a function (got {raw!r}).")
        choice = echo = raw
    else:
        try:
            named = msgspec.convert(raw, _NamedFunction)
        except msgspec.ValidationError as e:
            raise from_validation(e, "tool_choice") from None
        if named.type != "function":
            raise fail("tool_choice.type", f"only function tool choices are served (got {named.type!r}).")
        name = flat_name(named.namespace, named.name or "")
        if name in left_out:
            raise fail("tool_choice.name", f"tool_choice names tool {name!r}, which tandem does not run.")
        if name not in {flat_name(t.namespace, t.name) for t in tools}:
            raise fail("tool_choice.name", f"tool_choice names function {name!r}, which is not in 'tools'.")
        choice, forced = "required", name
        echo = {"type": "function", "name": named.name} | ({"namespace": named.namespace} if named.namespace else {})
    parameters = {flat_name(t.namespace, t.name): t.parameters for t in tools}
    return echo, tool_choice_fields(parameters, choice, forced, parallel, guided)


class _Part(msgspec.Struct):
    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: str | None = None  # input_image: an http(s) or data: URL
    file_id: str | None = None  # input_image: an uploaded file (there is no files API here)
    detail: str | None = None


class _Message(msgspec.Struct):
    role: str
    content: str | list[_Part]
    type: str = "message"


class _FunctionCall(msgspec.Struct):
    call_id: str
    name: str
    arguments: str
    type: str = "function_call"
    namespace: str | None = None


class _FunctionCallOutput(msgspec.Struct):
    call_id: str
    output: str | list[_Part]
    type: str = "function_call_output"


class _Reasoned(msgspec.Struct):
    type: str
    summary: list[_Part] = []
    content: list[_Part] | None = None
    encrypted_content: str | None = None


# `reasoning.encrypted_content` as tandem writes it: the thinking, base64 under a version prefix. OpenAI's
# is encrypted because its reasoning is hidden from clients; tandem's is not (the same text is in the item's
# `content`), so this only carries it back for clients that keep nothing else of a reasoning item.
_OPAQUE_PREFIX = "tandem1:"


def opaque_reasoning(thinking: str) -> str:
    return _OPAQUE_PREFIX + base64.b64encode(thinking.encode()).decode()


def _reasoning_text(item: _Reasoned, param: str) -> str | None:
    """The thinking a reasoning item carries: its text, else tandem's opaque form of it, else its summary.
    Another server's encrypted reasoning cannot be read here: that thinking is left out."""
    if item.content:
        return _text([*item.content, *item.summary], f"{param}.content")
    if item.encrypted_content is not None:
        if item.encrypted_content.startswith(_OPAQUE_PREFIX):
            try:
                return base64.b64decode(item.encrypted_content[len(_OPAQUE_PREFIX) :], validate=True).decode()
            except ValueError:
                raise fail(f"{param}.encrypted_content", "encrypted_content is damaged.") from None
        notice.once("encrypted reasoning of another server", "left out of the conversation: it cannot be read")
    return _text(item.summary, f"{param}.summary") if item.summary else None


_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")
_ITEMS: dict[str, type[msgspec.Struct]] = {"message": _Message, "function_call": _FunctionCall,
                                           "function_call_output": _FunctionCallOutput, "reasoning": _Reasoned}


def input_messages(items: list[dict[str, Any]], param: str = "input", *,
                   images: list[ImagePart] | None = None) -> list[dict[str, Any]]:
    """Input items as chat messages: messages as they are, function calls as the assistant's tool_calls,
    their outputs as tool messages, a reasoning item as the thinking of the assistant turn that follows.
    The messages' `input_image` parts are appended to `images`, in order (without a list they are refused)."""
    messages: list[dict[str, Any]] = []
    thinking: str | None = None
    for i, raw in enumerate(items):
        at = f"{param}[{i}]"
        kind = raw.get("type", "message")  # an "easy" input message has no type
        shape = _ITEMS.get(kind) if isinstance(kind, str) else None
        if shape is None:
            raise fail(f"{at}.type", f"input items of type {kind!r} are not supported (message, "
                                            "function_call, function_call_output and reasoning are).")
        try:
            item = msgspec.convert(raw, shape)
        except msgspec.ValidationError as e:
            raise from_validation(e, at) from None
        if isinstance(item, _Reasoned):
            thinking = _reasoning_text(item, at)
            continue
        message: dict[str, Any]
        if isinstance(item, _Message):
            if item.role not in _ROLES:
                raise fail(f"{at}.role", f"'{at}.role' must be one of {', '.join(_ROLES)} (got {item.role!r}).")
            content = _message_content(item.content, f"{at}.content", images) if item.role != "assistant" \
                else _text(item.content, f"{at}.content")
            message = {"role": item.role, "content": content}
        elif isinstance(item, _FunctionCallOutput):
            message = {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, f"{at}.output")}
        else:
            assert isinstance(item, _FunctionCall)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": flat_name(item.namespace, item.name), "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and thinking is None:
                last.setdefault("tool_calls", []).append(call)
                continue
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        if message["role"] == "assistant" and thinking is not None:
            message["reasoning_content"] = thinking
            thinking = None
        messages.append(message)
    return messages


def _message_content(content: str | list[_Part], param: str,
                     images: list[ImagePart] | None) -> str | list[dict[str, Any]]:
    """A user, system or developer message's content: its text, or with images its parts in order as the
    chat template takes them (`{"type": "text", "text": ...}` and `{"type": "image"}`)."""
    if isinstance(content, str) or images is None:
        return _text(content, param)
    return template_content([ImagePart(_image_url(part, f"{param}[{j}]"), f"{param}[{j}]")
                             if part.type == "input_image" else _part_text(part, f"{param}[{j}]")
                             for j, part in enumerate(content)], images)


def _image_url(part: _Part, param: str) -> str:
    if part.file_id is not None:
        raise fail(f"{param}.file_id", f"'{param}.file_id': images by file id are not supported (there is no "
                                       "files API here): send image_url, an http(s) or data: URL.")
    if not part.image_url:
        raise fail(f"{param}.image_url", f"'{param}.image_url' must be a non-empty string.")
    if part.detail is not None and part.detail not in IMAGE_DETAILS:
        raise fail(f"{param}.detail", f"'{param}.detail' must be one of {', '.join(IMAGE_DETAILS)} "
                                      f"(got {part.detail!r}).")
    return part.image_url


def _text(content: str | list[_Part], param: str) -> str:
    """A content's text parts joined (as the chat route joins text parts)."""
    if isinstance(content, str):
        return content
    return "\n".join(_part_text(part, f"{param}[{j}]") for j, part in enumerate(content))


def _part_text(part: _Part, param: str) -> str:
    if part.type == "refusal" and part.refusal is not None:
        return part.refusal
    if part.type in _TEXT_PARTS and part.text is not None:
        return part.text
    if part.type in _TEXT_PARTS:
        raise fail(f"{param}.text", f"'{param}.text' must be a string.")
    where = "only in user, system and developer messages" if part.type == "input_image" else "not yet"
    raise fail(f"{param}.type", f"content parts of type {part.type!r} are not supported here: text is served "
                                f"everywhere, input_image {where} (files and audio are not).")
