"""The OpenAI routes' request bodies: `/v1/chat/completions` and `/v1/completions` decoded and checked into
the canonical `ChatRequest` and `CompletionRequest`, with the rule tables their bounds are written in once
(the range checks here and the OpenAPI description read them), and the response objects in exactly OpenAI's
shapes. Unknown top-level fields are ignored, as OpenAI clients send extras."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Iterable
from typing import Any

import msgspec

from tandem.frontend.protocol.errors import fail, from_validation
from tandem.frontend.protocol.sse import TextEvents
from tandem.frontend.protocol.validation import (
    I64_MAX,
    MAX_LOGPROBS,
    MAX_STOP,
    U32,
    Rule,
    check_rules,
    check_wire,
    decode_body,
)
from tandem.frontend.requests import (
    LOGPROBS_RULE,
    REASONING_EFFORTS,
    SAMPLING_RULES,
    ChatBody,
    ChatRequest,
    CompletionBody,
    CompletionRequest,
    GenerationBody,
    ImagePart,
    StructuredOutputs,
    check_messages,
    check_tools,
    nvext_of,
    tool_choice_fields,
)
from tandem.llm.postprocess import TokenLogprob
from tandem.llm.protocols import GuidedDecoding

CHAT_RULES = (
    SAMPLING_RULES[1],  # max_tokens, checked before max_completion_tokens replaces it
    Rule("max_completion_tokens", "integer", 1, I64_MAX),
    Rule("top_logprobs", "integer", 0, MAX_LOGPROBS),
)
COMPLETION_RULES = (LOGPROBS_RULE,)

_chat_decoder = msgspec.json.Decoder(ChatBody)


_completion_decoder = msgspec.json.Decoder(CompletionBody)


def _check_common(raw: GenerationBody) -> dict[str, Any]:
    """Validation shared by both endpoints; returns the normalized/derived fields to override."""
    if not raw.model:
        raise fail("model", "'model' must be a non-empty string.")
    if raw.stream_options is not None and not raw.stream:
        raise fail("stream_options", "stream_options is only allowed when stream is true.")
    check_rules(raw, SAMPLING_RULES)
    if raw.min_tokens is not None and raw.max_tokens is not None and raw.min_tokens > raw.max_tokens:
        raise fail("min_tokens", f"min_tokens ({raw.min_tokens}) must not exceed max_tokens ({raw.max_tokens}).")
    stop = [raw.stop] if isinstance(raw.stop, str) else raw.stop
    if stop is not None:
        if len(stop) > MAX_STOP:
            raise fail("stop", f"at most {MAX_STOP} stop sequences are allowed (got {len(stop)}).")
        stop = [s for s in stop if s] or None  # an empty stop string would match at once: drop it
    for i, tid in enumerate(raw.stop_token_ids or ()):
        if not 0 <= tid < U32:
            raise fail(f"stop_token_ids[{i}]", f"stop_token_ids must be token ids >= 0 (got {tid}).")
    return {"stream": bool(raw.stream), "stop": stop, "ext": nvext_of(raw.nvext, bool(raw.stream)), "guided": _guided(raw)}


def _json_schema(value: dict[str, Any] | str, param: str) -> Any:
    if isinstance(value, str):  # vLLM accepts the schema as a JSON string too
        try:
            value = msgspec.json.decode(value)
        except msgspec.DecodeError:
            raise fail(param, f"'{param}' is not valid JSON.") from None
        if not isinstance(value, dict):
            raise fail(param, f"'{param}' must be a JSON schema object.")
    return value


def _guided(raw: GenerationBody) -> GuidedDecoding | None:
    """The one guided-decoding mode the request asks for (several at once is an error)."""
    if (raw.response_format is None and raw.structured_outputs is None and raw.guided_json is None
            and raw.guided_regex is None and raw.guided_choice is None and raw.guided_grammar is None):
        return None  # the usual request: no mode asked for
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


def parse_chat_request(body: bytes) -> ChatRequest:
    """Decode and validate a /v1/chat/completions body; raises RequestError."""
    raw: ChatBody = decode_body(_chat_decoder, body)
    check_rules(raw, CHAT_RULES)
    if raw.max_completion_tokens is not None:  # the newer name wins
        raw.max_tokens = raw.max_completion_tokens
    derived = _check_common(raw)
    if raw.top_logprobs is not None and not raw.logprobs:
        raise fail("top_logprobs", "top_logprobs requires logprobs to be true.")
    if raw.reasoning_effort is not None and raw.reasoning_effort not in REASONING_EFFORTS:
        raise fail("reasoning_effort", f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)} "
                                        f"(got {raw.reasoning_effort!r}).")
    fields = msgspec.structs.asdict(raw) | derived | _tool_choice(raw, derived["guided"])
    images: list[ImagePart] = []
    fields["messages"] = check_messages(raw.messages, images)
    return ChatRequest(**fields, images=images)


class _NamedFunction(msgspec.Struct):
    name: str


class _NamedChoice(msgspec.Struct):
    type: str
    function: _NamedFunction


def _tool_choice(raw: ChatBody, guided: GuidedDecoding | None) -> dict[str, Any]:
    """tool_choice as none / auto / required (+ the forced function), checked against `tools`."""
    tools = check_tools(raw.tools) if raw.tools else []
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


def _token_ids(ids: list[Any], param: str) -> list[int]:
    if not ids:
        raise fail(param, f"'{param}' must not be empty.")
    for j, tid in enumerate(ids):
        if type(tid) is not int or not 0 <= tid < U32:
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
    raw: CompletionBody = decode_body(_completion_decoder, body)
    embeds: str | None = None
    if raw.prompt_embeds is None:
        prompt = _check_prompt(raw.prompt)
    elif raw.prompt is not None:  # vLLM serves both as a batch of two prompts
        raise fail("prompt_embeds", "send either 'prompt' or 'prompt_embeds', not both: one prompt per request "
                                    "is served.")
    else:
        prompt, embeds = "", _check_prompt_embeds(raw.prompt_embeds)
    check_rules(raw, COMPLETION_RULES)
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


# -- answers -----------------------------------------------------------------------------------------


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


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None, *,
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
        self.created = created if created is not None else int(time.time())
        self.model = model
        self.include_usage = include_usage
        self._usage: None | msgspec.UnsetType = None if include_usage else msgspec.UNSET

    def _plain(self, text: str) -> dict[str, Any]:
        """The chunk of a plain text delta (no logprobs, not finished)."""
        raise NotImplementedError

    @functools.cached_property
    def text_event(self) -> TextEvents:
        """The SSE event of `_plain(text)`, the envelope encoded once per stream."""
        return TextEvents(self._plain)


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

    _plain = content

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

    _plain = text

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
