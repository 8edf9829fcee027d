"""The canonical requests every API maps onto: `ChatRequest` and `CompletionRequest`, in OpenAI's field
names (the shape the preprocessor, the routers and the workers' options are built from), Dynamo's request
extensions (`Nvext`), and the routing hints a request carries in its body or headers.

An API checks a body in its own terms (`frontend.api`), then builds one of these: the OpenAI routes decode
straight into them, the others through `chat_request`."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import msgspec

from tandem.frontend.protocol.errors import fail, from_validation
from tandem.frontend.protocol.validation import I64_MAX, MAX_LOGPROBS, U32, Rule, check_wire
from tandem.llm.protocols import GuidedDecoding


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class JsonSchemaFormat(msgspec.Struct):
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct):
    """vLLM's newer spelling of the guided_* fields."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


_InstanceId = Annotated[int, msgspec.Meta(ge=0)]


class AgentContext(msgspec.Struct, omit_defaults=True):
    """Dynamo's `nvext.agent_context`: the agent session a request belongs to (routing keeps a session on
    one worker, see `frontend.routing`)."""

    session_id: str | None = None
    session_type_id: str | None = None
    trajectory_id: str | None = None


class Nvext(msgspec.Struct, omit_defaults=True):
    """Dynamo's request extensions (`nvext`); fields not listed here are kept in `extra`."""

    backend_instance_id: _InstanceId | None = None
    prefill_worker_id: _InstanceId | None = None
    decode_worker_id: _InstanceId | None = None
    annotations: list[str] = []
    use_raw_prompt: bool | None = None
    greed_sampling: bool | None = None
    cache_salt: str | None = None
    max_thinking_tokens: Annotated[int, msgspec.Meta(ge=0, lt=U32)] | None = None
    agent_context: AgentContext | None = None
    extra_fields: list[str] = []
    extra: dict[str, Any] = {}


_NVEXT_KNOWN = frozenset(Nvext.__struct_fields__) - {"extra"}


# The annotations a streamed answer honours, as Dynamo's: each is one SSE event ahead of the first chunk.
ANNOTATIONS = ("formatted_prompt", "token_ids")
# The fields an answer's `nvext` may be asked for: Dynamo's worker ids, and the routing decision of each leg
# (the cached blocks per tier and their credit).
EXTRA_FIELDS = ("worker_id", "routing")


def nvext_of(raw: dict[str, Any] | None, stream: bool) -> Nvext:
    """A body's `nvext` map as `Nvext`: the fields tandem knows checked, the rest kept in `extra` for the
    workers; `stream`: annotations are answered in a stream only."""
    if not raw:
        return Nvext()
    known = {k: v for k, v in raw.items() if k in _NVEXT_KNOWN}
    try:
        ext = msgspec.convert(known, Nvext)
    except msgspec.ValidationError as e:
        raise from_validation(e, "nvext") from None
    if ext.annotations:
        _check_annotations(ext.annotations, stream)
    unknown = [name for name in ext.extra_fields if name not in EXTRA_FIELDS]
    if unknown:
        param = "nvext.extra_fields"
        raise fail(param, f"'{param}' may hold {' and '.join(EXTRA_FIELDS)} (got {unknown[0]!r}).")
    ext.extra = check_wire({k: v for k, v in raw.items() if k not in _NVEXT_KNOWN}, "nvext")
    return ext


def _check_annotations(annotations: list[str], stream: bool) -> None:
    param = "nvext.annotations"
    unknown = [a for a in annotations if a not in ANNOTATIONS]
    if unknown:
        raise fail(param, f"'{param}' may hold {' and '.join(ANNOTATIONS)} (got {unknown[0]!r}).")
    if not stream:
        raise fail(param, f"'{param}' are answered as events of a streamed answer: send 'stream': true.")


class SamplingFields(msgspec.Struct, kw_only=True):
    """The sampling and stop fields every generation route takes, as OpenAI's bodies and vLLM's
    SamplingParams both spell them."""

    n: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None


# The sampling bounds every generation route checks (vLLM's SamplingParams names).
SAMPLING_RULES = (
    Rule("n", "integer", 1, 1, message="only n=1 is supported"),
    # No tighter upper bound: the model's context length bounds it (`Preprocessor.worker_request`).
    Rule("max_tokens", "integer", 1, I64_MAX),
    Rule("temperature", "number", 0, 2),
    Rule("top_p", "number", 0, 1, exclusive_minimum=True),
    Rule("top_k", "integer", 1, U32 - 1, also=-1, message=f"must be -1 (disabled) or between 1 and {U32 - 1}"),
    Rule("min_p", "number", 0, 1),
    Rule("presence_penalty", "number", -2, 2),
    Rule("frequency_penalty", "number", -2, 2),
    Rule("repetition_penalty", "number", 0, exclusive_minimum=True),
    Rule("min_tokens", "integer", 0, U32 - 1),
    Rule("seed", "integer", -(2**63), 2**64 - 1, message="must fit in 64 bits"),
)
# A completion's `logprobs` (and vLLM's SamplingParams'): how many alternatives each token reports.
LOGPROBS_RULE = Rule("logprobs", "integer", 0, MAX_LOGPROBS)


class GenerationBody(SamplingFields, kw_only=True):
    """Fields common to /v1/chat/completions and /v1/completions, as they come over the wire."""

    model: str
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    nvext: dict[str, Any] | None = None


class ChatBody(GenerationBody, kw_only=True):
    messages: list[dict[str, Any]] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionBody(GenerationBody, kw_only=True):
    prompt: Any = None
    prompt_embeds: str | list[str] | None = None  # base64 of a torch.save'd tensor (vLLM's), instead of prompt
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None


class _Derived:
    """Convenience accessors shared by both request types (a slot-less mixin: msgspec allows it)."""

    __slots__ = ()
    stream: bool
    stream_options: StreamOptions | None
    guided: GuidedDecoding | None

    @property
    def is_guided(self) -> bool:
        return self.guided is not None

    @property
    def include_usage(self) -> bool:
        """Streaming with stream_options.include_usage: chunks carry usage: null, then a usage-only chunk ends it."""
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)


REASONING_EFFORTS = ("minimal", "low", "medium", "high")
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class FieldNames(msgspec.Struct, frozen=True):
    """What a route calls the fields its errors name when the chat pipeline checks them."""

    prompt: str = "messages"
    max_tokens: str = "max_tokens"


CHAT_NAMES = FieldNames()


COMPLETION_NAMES = FieldNames(prompt="prompt")


class ImagePart(msgspec.Struct, frozen=True):
    """An image of a chat request: its URL (http(s) or data:), and where it was, for the errors that name it."""

    url: str
    param: str


IMAGE_DETAILS = ("auto", "low", "high")


class ChatRequest(ChatBody, _Derived, kw_only=True):
    """A validated chat request. `messages` are plain dicts for the chat template, with text-part
    lists joined into one string; `max_tokens` already holds max_completion_tokens when given;
    `stop` is a list; `ext` is the parsed nvext; `guided` the single guided-decoding mode (a forced
    `tool_choice` is one); `tool_choice` is none, auto or required, and `forced_function` names the
    function a named choice forces."""

    stream: bool = False
    stop: list[str] | None = None
    messages: list[dict[str, Any]] = []
    images: list[ImagePart] = []  # in prompt order; each message part is {"type": "image"} for the template
    ext: Nvext = msgspec.field(default_factory=Nvext)
    guided: GuidedDecoding | None = None
    forced_function: str | None = None
    # max_tokens is a ceiling the client sends whatever the model (Anthropic's clients must send one): more
    # than the context leaves is lowered to fit instead of refused.
    fit_max_tokens: bool = False
    names: FieldNames = CHAT_NAMES

    @property
    def thinking(self) -> bool:
        """False when the client switched thinking off through the template's switch."""
        kwargs = self.chat_template_kwargs or {}
        return kwargs.get("enable_thinking", kwargs.get("thinking", True)) is not False

    def template_kwargs(self) -> dict[str, Any] | None:
        """Extra chat-template variables: chat_template_kwargs, and reasoning_effort when given."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}


class CompletionRequest(CompletionBody, _Derived, kw_only=True):
    """A validated completions request; `prompt` is a string or a list of token ids, or `prompt_embeds` is
    the one base64 tensor (its content is checked against the model by the preprocessor) and `prompt` empty."""

    stream: bool = False
    stop: list[str] | None = None
    prompt: str | list[int] = ""
    prompt_embeds: str | None = None
    ext: Nvext = msgspec.field(default_factory=Nvext)
    guided: GuidedDecoding | None = None
    names: FieldNames = COMPLETION_NAMES


AnyRequest = ChatRequest | CompletionRequest


ROLES = ("system", "developer", "user", "assistant", "tool")


def check_messages(messages: list[dict[str, Any]] | None,
                   images: list[ImagePart] | None = None) -> list[dict[str, Any]]:
    """Chat messages as the chat template takes them: roles checked, text-part lists joined into one string.
    With `images` (a list the images are appended to, in order), `image_url` parts are taken: a message
    with one keeps its parts, `{"type": "text", "text": ...}` and `{"type": "image"}`, for the template."""
    if messages is None:
        raise fail("messages", "Missing required parameter: 'messages'.")
    if not messages:
        raise fail("messages", "'messages' must contain at least one message.")
    out = []
    for i, msg in enumerate(messages):
        p = f"messages[{i}]"
        role = msg.get("role")
        if role not in ROLES:
            what = "is required" if role is None else f"must be one of {', '.join(ROLES)} (got {role!r})"
            raise fail(f"{p}.role", f"'{p}.role' {what}.")
        content = msg.get("content")
        if isinstance(content, list):
            msg = {**msg, "content": _content_parts(content, f"{p}.content", images)}
        elif content is None:
            if not (role == "assistant" and msg.get("tool_calls")):
                raise fail(f"{p}.content", f"'{p}.content' is required for a {role} message.")
        elif not isinstance(content, str):
            raise fail(f"{p}.content", f"'{p}.content' must be a string or a list of content parts.")
        for key in ("name", "tool_call_id"):
            if msg.get(key) is not None and not isinstance(msg[key], str):
                raise fail(f"{p}.{key}", f"'{p}.{key}' must be a string.")
        if role == "tool" and not msg.get("tool_call_id"):
            raise fail(f"{p}.tool_call_id", f"'{p}.tool_call_id' is required for a tool message.")
        calls = msg.get("tool_calls")
        if calls is not None:
            _check_tool_calls(calls, f"{p}.tool_calls")
        out.append(msg)
    return out


class _CalledFunction(msgspec.Struct):
    name: str
    arguments: str


class _AssistantCall(msgspec.Struct):
    function: _CalledFunction
    id: str | None = None
    type: str = "function"


def _check_tool_calls(calls: Any, param: str) -> None:
    """An assistant message's earlier calls, as the client echoes them back (OpenAI's shape)."""
    if not isinstance(calls, list):
        raise fail(param, f"'{param}' must be a list of objects.")
    for j, item in enumerate(calls):
        try:
            msgspec.convert(item, _AssistantCall)
        except msgspec.ValidationError as e:
            raise from_validation(e, f"{param}[{j}]") from None


def template_content(pieces: Sequence[str | ImagePart], images: list[ImagePart]) -> str | list[dict[str, Any]]:
    """A message's content for the chat template, from its text and image parts in order. Chat templates mostly
    expect string content: without an image the texts are joined with "\n" (what vLLM does); with one, the
    parts are kept in order, `{"type": "text", "text": ...}` and `{"type": "image"}`, as vision-language models'
    templates take them, and the images are appended to `images`."""
    texts = [piece for piece in pieces if isinstance(piece, str)]
    if len(texts) == len(pieces):
        return "\n".join(texts)
    parts: list[dict[str, Any]] = []
    for piece in pieces:
        if isinstance(piece, ImagePart):
            images.append(piece)
            parts.append({"type": "image"})
        else:
            parts.append({"type": "text", "text": piece})
    return parts


def _content_parts(parts: list[Any], param: str, images: list[ImagePart] | None) -> str | list[dict[str, Any]]:
    pieces: list[str | ImagePart] = []
    taken = "text and image_url" if images is not None else "text"
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image_url" and images is not None:
            pieces.append(ImagePart(_image_url(part, f"{param}[{j}]"), f"{param}[{j}]"))
            continue
        if kind != "text":
            what = f"{kind} content parts are not supported" if isinstance(kind, str) else "a content part needs a type"
            raise fail(f"{param}[{j}].type", f"'{param}[{j}]': {what}; only {taken} content parts are.")
        text = part.get("text")
        if not isinstance(text, str):
            raise fail(f"{param}[{j}].text", f"'{param}[{j}].text' must be a string.")
        pieces.append(text)
    return template_content(pieces, images if images is not None else [])


def _image_url(part: dict[str, Any], param: str) -> str:
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else image  # some clients send the URL itself
    if not isinstance(url, str) or not url:
        raise fail(f"{param}.image_url.url", f"'{param}.image_url.url' must be a non-empty string.")
    detail = image.get("detail") if isinstance(image, dict) else None
    if detail is not None and detail not in IMAGE_DETAILS:
        raise fail(f"{param}.image_url.detail", f"'{param}.image_url.detail' must be one of "
                                                f"{', '.join(IMAGE_DETAILS)} (got {detail!r}).")
    return url


class _Function(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _Tool(msgspec.Struct):
    type: str
    function: _Function


def check_tools(tools: list[dict[str, Any]]) -> list[_Tool]:
    """Function tools in chat's shape, their names and parameter schemas checked."""
    checked = []
    for i, tool in enumerate(tools):
        try:
            item = msgspec.convert(tool, _Tool)
        except msgspec.ValidationError as e:
            raise from_validation(e, f"tools[{i}]") from None
        if item.type != "function":
            raise fail(f"tools[{i}].type", f"'tools[{i}].type' must be 'function' (got {item.type!r}).")
        if not FUNCTION_NAME.match(item.function.name):
            raise fail(f"tools[{i}].function.name", f"'tools[{i}].function.name' must be 1 to 64 letters, "
                                                     f"digits, '_', '.' or '-' (got {item.function.name!r}).")
        check_wire(item.function.parameters, f"tools[{i}].function.parameters")
        checked.append(item)
    return checked


def tool_choice_fields(parameters: Mapping[str, dict[str, Any] | None], choice: str, forced: str | None,
                       parallel: bool, guided: GuidedDecoding | None, param: str = "tool_choice") -> dict[str, Any]:
    """A ChatRequest's tool fields from a checked choice (none, auto or required; `forced` names the function
    of a named choice) over the tools' parameter schemas by name: a forced choice becomes the request's
    guided decoding (a JSON schema built from the tools)."""
    if choice == "required" and not parameters:
        raise fail(param, f"{param} 'required' needs at least one tool in 'tools'.")
    if choice != "required":
        return {"tool_choice": choice}
    if guided is not None:
        raise fail(param, f"a forced {param} cannot be combined with a structured output format or guided "
                           "decoding (it is enforced through guided decoding itself).")
    if forced is not None:
        schema: dict[str, Any] = parameters[forced] or {"type": "object"}
    else:
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                   "parameters": schema or {"type": "object"}},
                  "required": ["name", "parameters"]} for name, schema in parameters.items()]  # fmt: skip
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not parallel:
            schema["maxItems"] = 1
    return {"tool_choice": "required", "forced_function": forced, "guided": GuidedDecoding(json=schema)}


def chat_request(*, model: str, messages: list[dict[str, Any]], stream: bool, max_tokens: int | None,
                 tools: list[dict[str, Any]] | None = None, tool_fields: dict[str, Any] | None = None,
                 parallel_tool_calls: bool | None = None, guided: GuidedDecoding | None = None,
                 max_thinking_tokens: int | None = None, fit_max_tokens: bool = False,
                 names: FieldNames = CHAT_NAMES, session_id: str | None = None,
                 images: list[ImagePart] | None = None, **sampling: Any) -> ChatRequest:
    """The ChatRequest another route's request means, its fields already checked in that route's terms:
    `messages` and `tools` in chat's shape, `tool_fields` from `tool_choice_fields`, `sampling` among
    temperature, top_p, top_k, stop, reasoning_effort, chat_template_kwargs and user; `fit_max_tokens`:
    a max_tokens beyond what the context leaves is lowered to fit; `names`: the route's names of the
    fields the pipeline's errors name; `session_id`: the agent session the request belongs to; `images`: the
    images of the messages' `{"type": "image"}` parts, in order."""
    fields = tool_fields or {"tool_choice": "auto" if tools else "none"}
    if guided is not None and "guided" not in fields:
        fields = {**fields, "guided": guided}
    agent = AgentContext(session_id=session_id) if session_id else None
    return ChatRequest(model=model, messages=messages, stream=stream, max_tokens=max_tokens, tools=tools or None,
                       parallel_tool_calls=parallel_tool_calls,
                       ext=Nvext(max_thinking_tokens=max_thinking_tokens, agent_context=agent),
                       fit_max_tokens=fit_max_tokens, names=names, images=images or [], **fields, **sampling)


EncodingFormat = Literal["float", "base64"]
Endianness = Literal["native", "little", "big"]


class EmbeddingsRequest(msgspec.Struct, kw_only=True):
    """A checked embeddings request: its inputs as texts or token-id lists, one kind per request."""

    model: str
    texts: list[str] | None
    token_ids: list[list[int]] | None
    encoding_format: EncodingFormat
    dimensions: int | None
    add_special_tokens: bool
    endianness: Endianness
    single: bool  # the body's input was one text or one token list, not a list of them

    def param(self, index: int) -> str:
        return input_param(self.single, index)


def input_param(single: bool, index: int) -> str:
    """How errors name an input: `input` for a single one, `input[i]` in a list."""
    return "input" if single else f"input[{index}]"


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """A checked /tokenize request: a prompt, or a chat request whose templated prompt is tokenized."""

    model: str | None
    prompt: str | None
    chat: ChatRequest | None
    add_special_tokens: bool
    return_token_strs: bool
