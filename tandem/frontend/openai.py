"""OpenAI protocol layer of the frontend: parse and validate request bodies, map them to tandem's
internal options (`tandem.llm.protocols`), and build response objects in exactly OpenAI's shapes.

No I/O here; the HTTP server calls these functions. Bodies are decoded by msgspec straight into typed
Structs (fast, and its errors carry the JSON path, which becomes the error's `param`); range and
cross-field checks follow by hand. Unknown top-level fields are ignored, as OpenAI clients send extras.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any

import msgspec

from tandem.llm.postprocess import TokenLogprob
from tandem.llm.protocols import (
    FinishReason,
    GuidedDecoding,
    OutputOptions,
    RoutingHints,
    SamplingOptions,
    StopConditions,
)

_U32 = 2**32
MAX_TOKENS_LIMIT = _U32  # engines count tokens in 32 bits
MAX_STOP = 16
MAX_LOGPROBS = 20

# -- errors ----------------------------------------------------------------------------------------

_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                429: "rate_limit_error", 501: "not_implemented_error", 503: "service_unavailable"}  # fmt: skip


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "internal_server_error")


class RequestError(Exception):
    """A request the frontend refuses; `body()` is OpenAI's error JSON."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, type: str | None = None,
                 code: str | int | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or error_type(status)
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def sse(self) -> bytes:
        return sse(self.body())

    @classmethod
    def model_not_found(cls, model: str) -> RequestError:
        # OpenAI's exact answer for an unknown model (404, but type invalid_request_error).
        return cls(f"The model `{model}` does not exist.", status=404, param="model",
                   type="invalid_request_error", code="model_not_found")  # fmt: skip


_AT = re.compile(r"^(.*?)(?: - at `\$(.*)`)?$", re.S)


def from_validation(err: msgspec.ValidationError, prefix: str = "") -> RequestError:
    """msgspec's "Expected `float | null`, got `str` - at `$.a[0].b`" -> param "a[0].b"."""
    m = _AT.match(str(err))
    reason, path = (m.group(1), m.group(2) or "") if m else (str(err), "")
    path = (prefix + path).lstrip(".")
    missing = re.match(r"Object missing required field `(.*)`$", reason)
    if missing:
        param = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return RequestError(f"Missing required parameter: '{param}'.", param=param)
    unknown = re.match(r"Object contains unknown field `(.*)`$", reason)  # a Struct that forbids unknown fields
    if unknown:
        param = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        return RequestError(f"'{param}' is not supported.", param=param)
    if not path:
        return RequestError(f"The request body must be a JSON object ({reason}).")
    reason = reason.replace(" | null`", "`")
    return RequestError(f"Invalid value for '{path}': {reason[:1].lower()}{reason[1:]}.", param=path)


def fail(param: str | None, message: str) -> RequestError:
    return RequestError(message, param=param)


def refuse_given(raw: Any, unserved: Iterable[tuple[str, str]]) -> None:
    """A 400 naming the first field of `unserved` (name, why it is not served) that the body `raw` gives: a
    field a route does not honour is refused, never ignored."""
    for name, why in unserved:
        if getattr(raw, name) is not None:
            raise fail(name, f"'{name}' is not supported: {why}.")


def check_wire(value: Any, param: str) -> Any:
    """`value` (free-form JSON the workers get: a schema, nvext's extras) as it is; a 400 naming `param`
    when it holds an integer the request plane cannot carry (msgpack's are at most 64 bits)."""
    try:
        msgspec.msgpack.encode(value)
    except OverflowError:
        raise fail(param, f"'{param}' holds an integer beyond 64 bits, which cannot be sent to a worker.") from None
    return value


def check_wire_fields(body: dict[str, Any]) -> dict[str, Any]:
    """A whole body the workers get as it is (a text-input model's request); a 400 naming its field that
    holds an integer beyond 64 bits."""
    try:
        msgspec.msgpack.encode(body)
    except OverflowError:
        for name, value in body.items():
            check_wire(value, name)
    return body


# -- requests --------------------------------------------------------------------------------------


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
    max_thinking_tokens: Annotated[int, msgspec.Meta(ge=0, lt=_U32)] | None = None
    agent_context: AgentContext | None = None
    extra: dict[str, Any] = {}


_NVEXT_KNOWN = frozenset(Nvext.__struct_fields__) - {"extra"}
# The annotations a streamed answer honours, as Dynamo's: each is one SSE event ahead of the first chunk.
ANNOTATIONS = ("formatted_prompt", "token_ids")


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


class _Body(SamplingFields, kw_only=True):
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


class _ChatBody(_Body, kw_only=True):
    messages: list[dict[str, Any]] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class _CompletionBody(_Body, kw_only=True):
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


class FieldNames(msgspec.Struct, frozen=True):
    """What a route calls the fields its errors name when the chat pipeline checks them."""

    prompt: str = "messages"
    max_tokens: str = "max_tokens"


CHAT_NAMES = FieldNames()
COMPLETION_NAMES = FieldNames(prompt="prompt")


class ChatRequest(_ChatBody, _Derived, kw_only=True):
    """A validated chat request. `messages` are plain dicts for the chat template, with text-part
    lists joined into one string; `max_tokens` already holds max_completion_tokens when given;
    `stop` is a list; `ext` is the parsed nvext; `guided` the single guided-decoding mode (a forced
    `tool_choice` is one); `tool_choice` is none, auto or required, and `forced_function` names the
    function a named choice forces."""

    stream: bool = False
    stop: list[str] | None = None
    messages: list[dict[str, Any]] = []
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


class CompletionRequest(_CompletionBody, _Derived, kw_only=True):
    """A validated completions request; `prompt` is a string or a list of token ids, or `prompt_embeds` is
    the one base64 tensor (its content is checked against the model by the preprocessor) and `prompt` empty."""

    stream: bool = False
    stop: list[str] | None = None
    prompt: str | list[int] = ""
    prompt_embeds: str | None = None
    ext: Nvext = msgspec.field(default_factory=Nvext)
    guided: GuidedDecoding | None = None
    names: FieldNames = COMPLETION_NAMES


_chat_decoder = msgspec.json.Decoder(_ChatBody)
_completion_decoder = msgspec.json.Decoder(_CompletionBody)
_any_decoder = msgspec.json.Decoder()

Range = tuple[str, Callable[[Any], bool], str]
# (field, valid?, message); each message is formatted with the offending value.
_COMMON_RANGES: list[Range] = [
    ("n", lambda v: v == 1, "only n=1 is supported (got {})"),
    # No upper bound here: the model's context length bounds it (`check_max_tokens`).
    ("max_tokens", lambda v: 1 <= v, "max_tokens must be at least 1 (got {})"),
    ("temperature", lambda v: 0.0 <= v <= 2.0, "temperature must be between 0 and 2 (got {})"),
    ("top_p", lambda v: 0.0 < v <= 1.0, "top_p must be in (0, 1] (got {})"),
    ("top_k", lambda v: v == -1 or 1 <= v < _U32, "top_k must be -1 (disabled) or between 1 and 4294967295 (got {})"),
    ("min_p", lambda v: 0.0 <= v <= 1.0, "min_p must be between 0 and 1 (got {})"),
    ("presence_penalty", lambda v: -2.0 <= v <= 2.0, "presence_penalty must be between -2 and 2 (got {})"),
    ("frequency_penalty", lambda v: -2.0 <= v <= 2.0, "frequency_penalty must be between -2 and 2 (got {})"),
    ("repetition_penalty", lambda v: v > 0.0, "repetition_penalty must be greater than 0 (got {})"),
    ("min_tokens", lambda v: 0 <= v < _U32, "min_tokens must be between 0 and 4294967295 (got {})"),
    ("seed", lambda v: -(2**63) <= v < 2**64, "seed must fit in 64 bits (got {})"),
]
_CHAT_RANGES: list[Range] = [
    _COMMON_RANGES[1],  # max_tokens, checked before max_completion_tokens replaces it
    ("max_completion_tokens", lambda v: 1 <= v, "max_completion_tokens must be at least 1 (got {})"),
    ("top_logprobs", lambda v: 0 <= v <= MAX_LOGPROBS, f"top_logprobs must be between 0 and {MAX_LOGPROBS} (got {{}})"),
]
_COMPLETION_RANGES: list[Range] = [
    ("logprobs", lambda v: 0 <= v <= MAX_LOGPROBS, f"logprobs must be between 0 and {MAX_LOGPROBS} (got {{}})"),
]
# Every sampling bound of a completions request, for routes that take the same fields in another place.
SAMPLING_RANGES: list[Range] = _COMMON_RANGES + _COMPLETION_RANGES


def decode_body(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as e:  # a subclass of DecodeError, so first
        if "got `float`" not in str(e):
            raise from_validation(e) from None
        first = e
    except msgspec.DecodeError as e:
        raise fail(None, f"The request body is not valid JSON: {e}.") from None
    except UnicodeDecodeError:  # raised by msgspec for invalid UTF-8 inside a JSON string
        raise fail(None, "The request body is not valid UTF-8.") from None
    except RecursionError:
        raise fail(None, "The request body is nested too deeply.") from None
    # 8.0 is an integer to JSON Schema (and to OpenAI and vLLM): read integral floats as ints and retry.
    plain = decode_body(_any_decoder, body)  # the same answers for invalid JSON, UTF-8 or nesting
    try:
        return msgspec.convert(_integral_floats_as_ints(plain), decoder.type)
    except msgspec.ValidationError as again:
        raise from_validation(again) from None
    except RecursionError:
        raise from_validation(first) from None


def _integral_floats_as_ints(value: Any) -> Any:
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, list):
        return [_integral_floats_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral_floats_as_ints(v) for k, v in value.items()}
    return value


def check_ranges(raw: Any, table: list[Range], prefix: str = "") -> None:
    """`prefix`: where `raw`'s fields sit in the body (`sampling_params.`), for the errors' names."""
    for name, ok, message in table:
        value = getattr(raw, name)
        if value is not None and not ok(value):
            raise fail(prefix + name, prefix + message.format(value))


def _check_common(raw: _Body) -> dict[str, Any]:
    """Validation shared by both endpoints; returns the normalized/derived fields to override."""
    if not raw.model:
        raise fail("model", "'model' must be a non-empty string.")
    if raw.stream_options is not None and not raw.stream:
        raise fail("stream_options", "stream_options is only allowed when stream is true.")
    check_ranges(raw, _COMMON_RANGES)
    if raw.min_tokens is not None and raw.max_tokens is not None and raw.min_tokens > raw.max_tokens:
        raise fail("min_tokens", f"min_tokens ({raw.min_tokens}) must not exceed max_tokens ({raw.max_tokens}).")
    stop = [raw.stop] if isinstance(raw.stop, str) else raw.stop
    if stop is not None:
        if len(stop) > MAX_STOP:
            raise fail("stop", f"at most {MAX_STOP} stop sequences are allowed (got {len(stop)}).")
        stop = [s for s in stop if s] or None  # an empty stop string would match at once: drop it
    for i, tid in enumerate(raw.stop_token_ids or ()):
        if not 0 <= tid < _U32:
            raise fail(f"stop_token_ids[{i}]", f"stop_token_ids must be token ids >= 0 (got {tid}).")
    return {"stream": bool(raw.stream), "stop": stop, "ext": _nvext(raw.nvext, bool(raw.stream)), "guided": _guided(raw)}


def _nvext(raw: dict[str, Any] | None, stream: bool) -> Nvext:
    if not raw:
        return Nvext()
    known = {k: v for k, v in raw.items() if k in _NVEXT_KNOWN}
    try:
        ext = msgspec.convert(known, Nvext)
    except msgspec.ValidationError as e:
        raise from_validation(e, "nvext") from None
    if ext.annotations:
        _check_annotations(ext.annotations, stream)
    ext.extra = check_wire({k: v for k, v in raw.items() if k not in _NVEXT_KNOWN}, "nvext")
    return ext


def _check_annotations(annotations: list[str], stream: bool) -> None:
    param = "nvext.annotations"
    unknown = [a for a in annotations if a not in ANNOTATIONS]
    if unknown:
        raise fail(param, f"'{param}' may hold {' and '.join(ANNOTATIONS)} (got {unknown[0]!r}).")
    if not stream:
        raise fail(param, f"'{param}' are answered as events of a streamed answer: send 'stream': true.")


def _json_schema(value: dict[str, Any] | str, param: str) -> Any:
    if isinstance(value, str):  # vLLM accepts the schema as a JSON string too
        try:
            value = msgspec.json.decode(value)
        except msgspec.DecodeError:
            raise fail(param, f"'{param}' is not valid JSON.") from None
        if not isinstance(value, dict):
            raise fail(param, f"'{param}' must be a JSON schema object.")
    return value


def _guided(raw: _Body) -> GuidedDecoding | None:
    """The one guided-decoding mode the request asks for (several at once is an error)."""
    modes: list[tuple[str, GuidedDecoding]] = []
    rf = raw.response_format
    if rf is not None:
        if rf.type == "json_object":
            modes.append(("response_format", GuidedDecoding(json={"type": "object"})))
        elif rf.type == "json_schema":
            if rf.json_schema is None:
                raise fail("response_format.json_schema", "response_format json_schema requires 'json_schema'.")
            if rf.json_schema.schema is None:
                raise fail("response_format.json_schema.schema", "response_format json_schema requires a 'schema'.")
            schema = check_wire(rf.json_schema.schema, "response_format.json_schema.schema")
            modes.append(("response_format", GuidedDecoding(json=schema)))
        elif rf.type != "text":
            message = f"response_format type must be one of text, json_object, json_schema (got {rf.type!r})."
            raise fail("response_format.type", message)
    so = raw.structured_outputs or StructuredOutputs()
    for mode in ("json", "regex", "choice", "grammar"):
        for param, value in ((f"guided_{mode}", getattr(raw, f"guided_{mode}")),
                             (f"structured_outputs.{mode}", getattr(so, mode))):  # fmt: skip
            if value is None:
                continue
            if mode == "json":
                value = _json_schema(value, param)
            elif mode == "choice" and not value:
                raise fail(param, f"'{param}' must list at least one choice.")
            modes.append((param, GuidedDecoding(**{mode: check_wire(value, param)})))
    if len(modes) > 1:
        names = ", ".join(p for p, _ in modes)
        raise fail(modes[1][0], f"only one guided decoding mode may be given at once (got {names}).")
    return modes[0][1] if modes else None


ROLES = ("system", "developer", "user", "assistant", "tool")


def _check_messages(messages: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
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
            msg = {**msg, "content": _join_parts(content, f"{p}.content")}
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


def _join_parts(parts: list[Any], param: str) -> str:
    # Chat templates mostly expect string content; joining text parts with "\n" is what vLLM does.
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise fail(f"{param}[{j}].type", f"'{param}[{j}]': only text content parts are supported.")
        text = part.get("text")
        if not isinstance(text, str):
            raise fail(f"{param}[{j}].text", f"'{param}[{j}].text' must be a string.")
        texts.append(text)
    return "\n".join(texts)


def parse_chat_request(body: bytes) -> ChatRequest:
    """Decode and validate a /v1/chat/completions body; raises RequestError."""
    raw: _ChatBody = decode_body(_chat_decoder, body)
    check_ranges(raw, _CHAT_RANGES)
    if raw.max_completion_tokens is not None:  # the newer name wins
        raw.max_tokens = raw.max_completion_tokens
    derived = _check_common(raw)
    if raw.top_logprobs is not None and not raw.logprobs:
        raise fail("top_logprobs", "top_logprobs requires logprobs to be true.")
    if raw.reasoning_effort is not None and raw.reasoning_effort not in REASONING_EFFORTS:
        raise fail("reasoning_effort", f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)} "
                                        f"(got {raw.reasoning_effort!r}).")
    fields = msgspec.structs.asdict(raw) | derived | _tool_choice(raw, derived["guided"])
    fields["messages"] = _check_messages(raw.messages)
    return ChatRequest(**fields)


REASONING_EFFORTS = ("minimal", "low", "medium", "high")
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class _Function(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _Tool(msgspec.Struct):
    type: str
    function: _Function


class _NamedFunction(msgspec.Struct):
    name: str


class _NamedChoice(msgspec.Struct):
    type: str
    function: _NamedFunction


def _tools(tools: list[dict[str, Any]]) -> list[_Tool]:
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


def _tool_choice(raw: _ChatBody, guided: GuidedDecoding | None) -> dict[str, Any]:
    """tool_choice as none / auto / required (+ the forced function), checked against `tools`."""
    tools = _tools(raw.tools) if raw.tools else []
    choice = raw.tool_choice
    forced: str | None = None
    if isinstance(choice, dict):
        try:
            named = msgspec.convert(choice, _NamedChoice)
        except msgspec.ValidationError as e:
            raise from_validation(e, "tool_choice") from None
        if named.type != "function":
            raise fail("tool_choice.type", f"'tool_choice.type' must be 'function' (got {named.type!r}).")
        forced = named.function.name
        if forced not in {t.function.name for t in tools}:
            raise fail("tool_choice.function.name",
                        f"tool_choice names function {forced!r}, which is not in 'tools'.")
        choice = "required"
    elif choice is None:
        choice = "auto" if tools else "none"
    elif choice not in ("none", "auto", "required"):
        raise fail("tool_choice", f"tool_choice must be none, auto, required or an object (got {choice!r}).")
    parameters = {t.function.name: t.function.parameters for t in tools}
    return tool_choice_fields(parameters, choice, forced, raw.parallel_tool_calls is not False, guided)


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
                 names: FieldNames = CHAT_NAMES, session_id: str | None = None, **sampling: Any) -> ChatRequest:
    """The ChatRequest another route's request means, its fields already checked in that route's terms:
    `messages` and `tools` in chat's shape, `tool_fields` from `tool_choice_fields`, `sampling` among
    temperature, top_p, top_k, stop, reasoning_effort, chat_template_kwargs and user; `fit_max_tokens`:
    a max_tokens beyond what the context leaves is lowered to fit; `names`: the route's names of the
    fields the pipeline's errors name; `session_id`: the agent session the request belongs to."""
    fields = tool_fields or {"tool_choice": "auto" if tools else "none"}
    if guided is not None and "guided" not in fields:
        fields = {**fields, "guided": guided}
    agent = AgentContext(session_id=session_id) if session_id else None
    return ChatRequest(model=model, messages=messages, stream=stream, max_tokens=max_tokens, tools=tools or None,
                       parallel_tool_calls=parallel_tool_calls,
                       ext=Nvext(max_thinking_tokens=max_thinking_tokens, agent_context=agent),
                       fit_max_tokens=fit_max_tokens, names=names, **fields, **sampling)


def _token_ids(ids: list[Any], param: str) -> list[int]:
    if not ids:
        raise fail(param, f"'{param}' must not be empty.")
    for j, tid in enumerate(ids):
        if type(tid) is not int or not 0 <= tid < _U32:
            raise fail(f"{param}[{j}]", f"'{param}[{j}]' must be a token id (an integer >= 0).")
    return ids


def _check_prompt(prompt: Any) -> str | list[int]:
    if prompt is None:
        raise fail("prompt", "Missing required parameter: 'prompt'.")
    if isinstance(prompt, str):
        if not prompt:
            raise fail("prompt", "'prompt' must not be empty.")
        return prompt
    if not isinstance(prompt, list):
        raise fail("prompt", "'prompt' must be a string, a list of token ids, or a one-item list of either.")
    if prompt and isinstance(prompt[0], str | list):  # the batch forms: [str, ...] or [[int], ...]
        if len(prompt) > 1:
            raise fail("prompt", "batch prompts are not supported (send one prompt per request).")
        if isinstance(prompt[0], str):
            if not prompt[0]:
                raise fail("prompt[0]", "'prompt[0]' must not be empty.")
            return prompt[0]
        return _token_ids(prompt[0], "prompt[0]")
    return _token_ids(prompt, "prompt")


def _check_prompt_embeds(embeds: str | list[str]) -> str:
    if isinstance(embeds, list):
        if len(embeds) > 1:
            raise fail("prompt_embeds", "batch prompt embeddings are not supported (send one prompt per request).")
        embeds = embeds[0] if embeds else ""
    if not embeds:
        raise fail("prompt_embeds", "'prompt_embeds' must not be empty.")
    return embeds


def parse_completion_request(body: bytes) -> CompletionRequest:
    """Decode and validate a /v1/completions body; raises RequestError."""
    raw: _CompletionBody = decode_body(_completion_decoder, body)
    embeds: str | None = None
    if raw.prompt_embeds is None:
        prompt = _check_prompt(raw.prompt)
    elif raw.prompt is not None:  # vLLM serves both as a batch of two prompts
        raise fail("prompt_embeds", "send either 'prompt' or 'prompt_embeds', not both: one prompt per request "
                                    "is served.")
    else:
        prompt, embeds = "", _check_prompt_embeds(raw.prompt_embeds)
    check_ranges(raw, _COMPLETION_RANGES)
    derived = _check_common(raw)
    if raw.echo:
        raise fail("echo", "echo is not supported.")
    if raw.suffix:
        raise fail("suffix", "suffix is not supported.")
    annotations = derived["ext"].annotations
    if annotations and (embeds is not None or ("formatted_prompt" in annotations and not isinstance(prompt, str))):
        raise fail("nvext.annotations", "'nvext.annotations': a prompt of token ids has no formatted prompt, and "
                                        "prompt embeddings have neither a formatted prompt nor token ids.")
    return CompletionRequest(**(msgspec.structs.asdict(raw) | derived | {"prompt": prompt, "prompt_embeds": embeds}))


AnyRequest = ChatRequest | CompletionRequest

# -- mapping to tandem's internal options ------------------------------------------------------------


_SAMPLING = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed",
             "include_stop_str_in_output")  # fmt: skip


def sampling_options(req: AnyRequest) -> SamplingOptions:
    """Unset fields stay None (engine defaults); nvext.greed_sampling forces temperature 0."""
    temperature = 0.0 if req.ext.greed_sampling else req.temperature
    return SamplingOptions(temperature=temperature, guided_decoding=req.guided, **{k: getattr(req, k) for k in _SAMPLING})


def stop_conditions(req: AnyRequest) -> StopConditions:
    """The user's stop conditions; the preprocessor adds the model's hidden EOS ids (and applies ignore_eos)."""
    return StopConditions(max_tokens=req.max_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids or None,
                          min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
                          max_thinking_tokens=req.ext.max_thinking_tokens)  # fmt: skip


def output_options(req: AnyRequest) -> OutputOptions:
    if isinstance(req, ChatRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    return OutputOptions(logprobs=logprobs, skip_special_tokens=req.skip_special_tokens)


# Routing headers; the first name present wins, newer x-dynamo-* first.
WORKER_HEADERS = ("x-dynamo-worker-instance-id", "x-worker-instance-id")
PRIORITY_HEADER = "x-dynamo-request-priority"
_ROUTING_HEADERS: dict[str, tuple[str, ...]] = {
    "backend_instance_id": WORKER_HEADERS,
    "prefill_worker_id": ("x-dynamo-prefill-instance-id", "x-prefill-instance-id"),
    "dp_rank": ("x-dynamo-dp-rank", "x-dp-rank", "x-data-parallel-rank"),
    "prefill_dp_rank": ("x-dynamo-prefill-dp-rank", "x-prefill-dp-rank"),
    "priority": (PRIORITY_HEADER,),
}
_NVEXT_HINTS = ("backend_instance_id", "prefill_worker_id", "decode_worker_id", "cache_salt")
# An agent's session: Dynamo's header, then the ones Claude Code and Codex send with every turn.
SESSION_HEADERS = ("x-dynamo-session-id", "x-claude-code-session-id", "session-id")
MAX_SESSION_ID = 256
# vLLM's priority is any integer (lower first); Dynamo carries it as an i32. The rest are ids and ranks.
_HEADER_RANGES = {"priority": (-(2**31), 2**31)}
_ID_RANGE = (0, 2**64)


def _session_id(value: str | None, param: str) -> str | None:
    if value is not None and len(value) > MAX_SESSION_ID:  # a key, not a payload: the routers hash it
        raise fail(param, f"'{param}' must be at most {MAX_SESSION_ID} characters (got {len(value)}).")
    return value


def hint_param(name: str, headers: Mapping[str, str]) -> str:
    """What set routing hint `name`: the header the client sent, else its nvext field."""
    return next((key for key in _ROUTING_HEADERS.get(name, ()) if key in headers), f"nvext.{name}")


def routing_hints(req: AnyRequest | None, headers: Mapping[str, str] | None = None) -> RoutingHints | None:
    """Routing from nvext (a route without nvext gives no request), overridden by the routing headers;
    None when nothing was asked for. The whole request pinned to one worker (`backend_instance_id`) has no
    legs of its own to pin: given with `prefill_worker_id` or `decode_worker_id`, a 400 names the other."""
    hints: dict[str, Any] = {name: getattr(req.ext, name) for name in _NVEXT_HINTS} if req is not None else {}
    if req is not None and req.ext.agent_context is not None:
        hints["session_id"] = _session_id(req.ext.agent_context.session_id, "nvext.agent_context.session_id")
    lower = {k.lower(): v for k, v in headers.items()} if headers else {}
    if lower:
        key = next((k for k in SESSION_HEADERS if k in lower), None)
        if key is not None and lower[key]:
            hints["session_id"] = _session_id(lower[key], key)
        for name, keys in _ROUTING_HEADERS.items():
            for key in (k for k in keys if k in lower):
                try:
                    value = int(lower[key])
                except ValueError:
                    raise fail(key, f"header {key} must be an integer (got {lower[key]!r}).") from None
                low, high = _HEADER_RANGES.get(name, _ID_RANGE)
                if not low <= value < high:
                    raise fail(key, f"header {key} must be in [{low}, {high - 1}] (got {value}).")
                hints[name] = value
                break
    hints = {k: v for k, v in hints.items() if v is not None}
    if not hints:
        return None
    if "backend_instance_id" in hints:
        for leg in ("prefill_worker_id", "decode_worker_id"):
            if leg in hints:
                param = hint_param(leg, lower)
                raise fail(param, f"'{param}' names a worker for one leg of a request that "
                                  f"'{hint_param('backend_instance_id', lower)}' pins whole to one worker.")
    return RoutingHints(**hints)


# -- responses -------------------------------------------------------------------------------------


def chat_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def finish_reason(reason: str | None) -> str | None:
    """tandem's normalized reason (eos, length, stop, cancelled, content_filter, error) -> OpenAI's."""
    return None if reason is None else FinishReason(reason).openai


def _lp(x: float | None) -> float:
    # JSON has no -inf/NaN (msgspec writes null, which OpenAI clients reject); vLLM clamps the same way.
    return x if x is not None and x > -9999.0 else -9999.0


def _alternatives(t: TokenLogprob) -> list[tuple[str, float, list[int] | None]]:
    return [(e.token, _lp(e.logprob), e.bytes) for e in t.top]


def chat_logprobs(tokens: Iterable[TokenLogprob]) -> dict[str, Any]:
    return {"content": [{"token": t.token, "logprob": _lp(t.logprob), "bytes": t.bytes,
                         "top_logprobs": [{"token": tok, "logprob": lp, "bytes": b} for tok, lp, b in _alternatives(t)]}
                        for t in tokens]}  # fmt: skip


def completion_logprobs(tokens: Iterable[TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
    """`text_offset` is the length of the text already sent (so offsets continue across chunks)."""
    toks, lps, tops, offsets = [], [], [], []
    for t in tokens:
        toks.append(t.token)
        lps.append(_lp(t.logprob))
        tops.append({tok: lp for tok, lp, _ in _alternatives(t)})
        offsets.append(text_offset)
        text_offset += len(t.token)
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None, *,
          reasoning_tokens: int | None = None) -> dict[str, Any]:  # fmt: skip
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def _envelope(id: str, created: int, model: str, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": id, "object": obj, "created": created, "model": model, "system_fingerprint": None, "choices": choices}


def chat_chunk(id: str, created: int, model: str, *, delta: dict[str, Any], finish_reason: str | None = None,
               logprobs: dict[str, Any] | None = None,
               usage: dict[str, Any] | None | msgspec.UnsetType = msgspec.UNSET) -> dict[str, Any]:  # fmt: skip
    """One chat.completion.chunk. Pass usage=None to write `"usage": null` (OpenAI does so in every chunk
    when stream_options.include_usage is set); leave it unset to omit the key."""
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    chunk = _envelope(id, created, model, "chat.completion.chunk", [choice])
    return chunk if usage is msgspec.UNSET else chunk | {"usage": usage}


def completion_chunk(id: str, created: int, model: str, *, text: str, finish_reason: str | None = None,
                     logprobs: dict[str, Any] | None = None,
                     usage: dict[str, Any] | None | msgspec.UnsetType = msgspec.UNSET) -> dict[str, Any]:  # fmt: skip
    """One streamed text_completion chunk (OpenAI streams completions as `text_completion` objects)."""
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    chunk = _envelope(id, created, model, "text_completion", [choice])
    return chunk if usage is msgspec.UNSET else chunk | {"usage": usage}


def chat_usage_chunk(id: str, created: int, model: str, usage: dict[str, Any]) -> dict[str, Any]:
    """The last chunk of a stream with include_usage: no choices, only usage."""
    return _envelope(id, created, model, "chat.completion.chunk", []) | {"usage": usage}


def completion_usage_chunk(id: str, created: int, model: str, usage: dict[str, Any]) -> dict[str, Any]:
    return _envelope(id, created, model, "text_completion", []) | {"usage": usage}


def chat_completion(id: str, created: int, model: str, *, content: str | None, finish_reason: str,
                    usage: dict[str, Any], logprobs: dict[str, Any] | None = None,
                    tool_calls: list[dict[str, Any]] | None = None, reasoning: str | None = None,
                    reasoning_field: str = "reasoning_content") -> dict[str, Any]:  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    if reasoning is not None:
        message[reasoning_field] = reasoning
    choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    return _envelope(id, created, model, "chat.completion", [choice]) | {"usage": usage}


def completion(id: str, created: int, model: str, *, text: str, finish_reason: str, usage: dict[str, Any],
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return _envelope(id, created, model, "text_completion", [choice]) | {"usage": usage}


class _Stream:
    _prefix = ""

    def __init__(self, model: str, *, include_usage: bool = False, id: str | None = None,
                 created: int | None = None) -> None:  # fmt: skip
        self.id = id or f"{self._prefix}{uuid.uuid4().hex}"
        self.created = created if created is not None else now()
        self.model = model
        self.include_usage = include_usage
        self._usage: None | msgspec.UnsetType = None if include_usage else msgspec.UNSET


class ChatStream(_Stream):
    """The chunks of one streamed chat completion in OpenAI's order: `start()` (role), `content()`
    per delta, `finish()` (empty delta + finish_reason), then `usage()` only if include_usage."""

    _prefix = "chatcmpl-"

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        return chat_chunk(self.id, self.created, self.model, delta=delta, finish_reason=finish_reason,
                          logprobs=logprobs, usage=self._usage)  # fmt: skip

    def start(self) -> dict[str, Any]:
        return self._chunk({"role": "assistant", "content": ""})

    def content(self, text: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._chunk({"content": text}, logprobs=logprobs)

    def reasoning(self, text: str, field: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._chunk({field: text}, logprobs=logprobs)

    def tool_calls(self, calls: list[dict[str, Any]]) -> dict[str, Any]:
        return self._chunk({"tool_calls": calls})

    def finish(self, finish_reason: str) -> dict[str, Any]:
        return self._chunk({}, finish_reason)

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        return chat_usage_chunk(self.id, self.created, self.model, usage)


class CompletionStream(_Stream):
    """The chunks of one streamed completion: `text()` per delta, `finish()`, then `usage()` if asked."""

    _prefix = "cmpl-"

    def text(self, text: str, logprobs: dict[str, Any] | None = None, finish_reason: str | None = None) -> dict[str, Any]:
        return completion_chunk(self.id, self.created, self.model, text=text, finish_reason=finish_reason,
                                logprobs=logprobs, usage=self._usage)  # fmt: skip

    def finish(self, finish_reason: str) -> dict[str, Any]:
        return self.text("", finish_reason=finish_reason)

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        return completion_usage_chunk(self.id, self.created, self.model, usage)


def models_list(entries: Iterable[tuple[str, int, str, str | None]]) -> dict[str, Any]:
    data = []
    for model_id, created, owned_by, parent in entries:
        item: dict[str, Any] = {"id": model_id, "object": "model", "created": created, "owned_by": owned_by}
        if parent is not None:
            item["parent"] = parent
        data.append(item)
    return {"object": "list", "data": data}


# -- JSON / SSE framing ----------------------------------------------------------------------------

_encoder = msgspec.json.Encoder()
SSE_DONE = b"data: [DONE]\n\n"


def dumps(obj: Any) -> bytes:
    """Compact JSON (for non-streaming bodies)."""
    return _encoder.encode(obj)


def sse(obj: Any) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


def named_sse(event: str, obj: Any) -> bytes:
    """An SSE event with its type on an `event:` line (the Responses and Anthropic streams)."""
    return b"event: " + event.encode() + b"\ndata: " + _encoder.encode(obj) + b"\n\n"


def sse_error(status: int, message: str, *, type: str | None = None) -> bytes:
    """An error in the middle of a stream (headers already sent), in the same shape as a unary error body.
    The openai client raises APIError on it."""
    return RequestError(message, status=status, type=type).sse()
