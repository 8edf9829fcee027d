"""vLLM's token-in/token-out route, `POST /inference/v1/generate` (vLLM 0.32's `GenerateRequest`; Dynamo
1.6+ serves the same shape): token ids and sampling params in, token ids (and their logprobs) out, with no
chat template on the way in. The body is checked here and becomes a completions request with a token
prompt, so the shared pipeline serves it (preprocess, KV routing, migration, metrics); `GenerateAnswer`
writes vLLM's response, stream chunks and error bodies.

What vLLM's request takes and tandem does not honour is refused with a 400 naming the field, never
ignored: multimodal inputs, client-driven KV or encoder-cache transfer, the engine-side reasoning
switches, a nonzero priority, and inside `sampling_params` every key `SamplingParams` does not list."""

from __future__ import annotations

import time
from http import HTTPStatus
from typing import Any, Literal

import msgspec
from aiohttp import web

from tandem.frontend.hints import PRIORITY_HEADER
from tandem.frontend.preprocess import Prepared
from tandem.frontend.protocol.answer import Answer, Ending, Outcome, Usage
from tandem.frontend.protocol.errors import RequestError, fail, refuse_given
from tandem.frontend.protocol.sse import SSE_DONE, sse
from tandem.frontend.protocol.validation import MAX_LOGPROBS, MAX_STOP, check_rules, check_wire, decode_body
from tandem.frontend.requests import (
    LOGPROBS_RULE,
    SAMPLING_RULES,
    CompletionRequest,
    FieldNames,
    Nvext,
    SamplingFields,
)
from tandem.frontend.serving import Mount, Serving
from tandem.llm.model_card import ModelType
from tandem.llm.parsers import ParsedDelta
from tandem.llm.postprocess import ProcessedDelta, TokenLogprob, TopLogprob
from tandem.llm.protocols import FinishReason, GuidedDecoding

ROUTE = "/inference/v1/generate"
OutputMode = Literal["tokens", "text"]

_U32 = 2**32
_SP = "sampling_params."
# vLLM's bounds on a cache salt (its cache backends key on it).
MAX_CACHE_SALT = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
# The names the shared pipeline's errors give the prompt and max_tokens on this route.
NAMES = FieldNames(prompt="token_ids", max_tokens="sampling_params.max_tokens")


# The completion's sampling bounds, named `sampling_params.<field>` here.
_SAMPLING_RULES = (*SAMPLING_RULES, LOGPROBS_RULE)


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # usage in every chunk too (with include_usage)


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's structured-output constraints that tandem serves: exactly one of them."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingParams(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    """The fields of vLLM's SamplingParams that tandem honours; any other key is a 400 naming it. vLLM's
    `top_k` 0 disables it, as -1 does; `max_tokens` None: what the context leaves (vLLM's server default)."""

    logprobs: int | None = None
    detokenize: bool = True
    structured_outputs: StructuredOutputs | None = None


class _Body(msgspec.Struct, kw_only=True):
    token_ids: list[int]
    sampling_params: SamplingParams
    request_id: str | None = None
    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = 0
    output_mode: OutputMode = "tokens"
    return_token_ids: bool | None = None
    # vLLM's fields that tandem does not honour, kept only to refuse them when given
    features: Any = None
    content_parts: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    reasoning_ended: Any = None
    reasoning_parser_kwargs: Any = None


_UNSERVED = (
    ("features", "multimodal inputs are not served"),
    ("content_parts", "multimodal inputs are not served"),
    ("kv_transfer_params", "the frontend runs disaggregated serving itself (prefill and decode workers); a "
                           "client's KV transfer parameters are not taken"),
    ("ec_transfer_params", "encoder-cache transfer is not served"),
    ("reasoning_ended", "structured outputs apply from the first generated token; the engine-side reasoning "
                        "switch is not served"),
    ("reasoning_parser_kwargs", "the engine-side reasoning parser is not served"),
)


class GenerateRequest(msgspec.Struct, kw_only=True, frozen=True):
    """A checked /inference/v1/generate request."""

    request_id: str | None  # echoed in the answer
    model: str | None  # None: the one model served
    token_ids: list[int]
    sampling: SamplingParams
    stop: list[str] | None  # the stop strings as a list, empty ones dropped
    guided: GuidedDecoding | None
    stream: bool
    include_usage: bool  # a usage chunk ends the stream
    continuous_usage: bool  # and every chunk carries the usage so far
    cache_salt: str | None
    output_mode: OutputMode
    return_token_ids: bool

    def completion_request(self, model: str) -> CompletionRequest:
        """The completions request with a token prompt that the shared pipeline serves."""
        sp = self.sampling
        return CompletionRequest(
            model=model, prompt=self.token_ids, stream=self.stream, n=sp.n, max_tokens=sp.max_tokens,
            temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
            presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty, seed=sp.seed, stop=self.stop, stop_token_ids=sp.stop_token_ids,
            ignore_eos=sp.ignore_eos, min_tokens=sp.min_tokens, include_stop_str_in_output=sp.include_stop_str_in_output,
            skip_special_tokens=sp.skip_special_tokens, logprobs=sp.logprobs, guided=self.guided,
            ext=Nvext(cache_salt=self.cache_salt), names=NAMES,
        )


_decoder = msgspec.json.Decoder(_Body)


def parse_request(body: bytes) -> GenerateRequest:
    """Decode and check a /inference/v1/generate body; raises RequestError naming the field."""
    raw: _Body = decode_body(_decoder, body)
    refuse_given(raw, _UNSERVED)
    if raw.model == "":
        raise fail("model", "'model' must be a non-empty string (or left out when one model is served).")
    _check_token_ids(raw.token_ids)
    if raw.priority != 0:
        raise fail("priority", f"priority {raw.priority} in the body is not supported (only 0): send it in "
                                      f"the {PRIORITY_HEADER} header.")
    _check_cache_salt(raw.cache_salt)
    sp = raw.sampling_params
    stop = _check_sampling(sp)
    if not sp.detokenize and raw.output_mode == "text":
        raise fail("output_mode", "output_mode 'text' requires sampling_params.detokenize to be true.")
    stream = bool(raw.stream)
    options = raw.stream_options or StreamOptions()
    # As vLLM's: stream_options only matter when streaming, and continuous usage only with include_usage.
    include_usage = stream and bool(options.include_usage)
    return GenerateRequest(request_id=raw.request_id, model=raw.model, token_ids=raw.token_ids, sampling=sp,
                           stop=stop, guided=_guided(sp.structured_outputs), stream=stream,
                           include_usage=include_usage,
                           continuous_usage=include_usage and bool(options.continuous_usage_stats),
                           cache_salt=raw.cache_salt, output_mode=raw.output_mode,
                           return_token_ids=bool(raw.return_token_ids))


def _check_token_ids(ids: list[int]) -> None:
    """Ids a worker can take; the preprocessor checks them against the vocabulary."""
    if not ids:
        raise fail("token_ids", "'token_ids' must not be empty.")
    for i, tid in enumerate(ids):
        if not 0 <= tid < _U32:
            raise fail(f"token_ids[{i}]", f"'token_ids[{i}]' must be a token id (an integer >= 0).")


def _check_cache_salt(salt: str | None) -> None:
    if salt is not None and (not salt or len(salt) > MAX_CACHE_SALT or _CACHE_SALT_FORBIDDEN.intersection(salt)):
        raise fail("cache_salt", f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT} "
                                        "characters without '@', '/', '\\' or NUL.")


def _check_sampling(sp: SamplingParams) -> list[str] | None:
    """Range and cross-field checks of sampling_params (named `sampling_params.<field>`); returns the stop
    strings as a list."""
    if sp.n is not None and sp.n != 1:
        raise fail(f"{_SP}n", f"{_SP}n must be 1: one sequence per request is supported (got {sp.n}).")
    if sp.logprobs == -1:
        raise fail(f"{_SP}logprobs", f"{_SP}logprobs -1 (the whole vocabulary) is not supported: ask for "
                                            f"at most {MAX_LOGPROBS}.")
    if sp.top_k == 0:
        sp.top_k = -1  # vLLM's 0 and -1 both disable top-k; tandem's pipeline spells it -1
    check_rules(sp, _SAMPLING_RULES, _SP)
    if sp.min_tokens is not None and sp.max_tokens is not None and sp.min_tokens > sp.max_tokens:
        raise fail(f"{_SP}min_tokens", f"{_SP}min_tokens ({sp.min_tokens}) must not exceed "
                                              f"{_SP}max_tokens ({sp.max_tokens}).")
    for i, tid in enumerate(sp.stop_token_ids or ()):
        if not 0 <= tid < _U32:
            raise fail(f"{_SP}stop_token_ids[{i}]", f"{_SP}stop_token_ids must be token ids >= 0 (got {tid}).")
    stop = [sp.stop] if isinstance(sp.stop, str) else sp.stop
    if stop is None:
        return None
    if len(stop) > MAX_STOP:
        raise fail(f"{_SP}stop", f"at most {MAX_STOP} stop sequences are allowed (got {len(stop)}).")
    if not sp.detokenize:  # as vLLM: stop strings are matched on the detokenized text
        raise fail(f"{_SP}stop", "stop strings require sampling_params.detokenize to be true.")
    return [s for s in stop if s] or None  # an empty stop string would match at once: dropped


def _guided(so: StructuredOutputs | None) -> GuidedDecoding | None:
    """The one structured-output constraint asked for (vLLM refuses none and several, and so does tandem)."""
    if so is None:
        return None
    param = f"{_SP}structured_outputs"
    given = [(mode, value) for mode in ("json", "regex", "choice", "grammar") if (value := getattr(so, mode)) is not None]
    if len(given) != 1:
        raise fail(param, f"'{param}' must give exactly one of json, regex, choice, grammar "
                                 f"(got {len(given)}).")
    mode, value = given[0]
    if mode == "json" and isinstance(value, str):  # the schema as a JSON string, as vLLM accepts it
        try:
            value = msgspec.json.decode(value)
        except msgspec.DecodeError:
            raise fail(f"{param}.json", f"'{param}.json' is not valid JSON.") from None
        if not isinstance(value, dict):
            raise fail(f"{param}.json", f"'{param}.json' must be a JSON schema object.")
    if mode == "choice" and not value:
        raise fail(f"{param}.choice", f"'{param}.choice' must list at least one choice.")
    return GuidedDecoding(**{mode: check_wire(value, f"{param}.{mode}")})


# -- the answer --------------------------------------------------------------------------------------

# vLLM's error `type`: the names it gives its own errors, else the status phrase (as its HTTP errors).
_ERROR_TYPES = {status.value: status.phrase for status in HTTPStatus} | {
    400: "BadRequestError", 404: "NotFoundError", 422: "UnprocessableEntityError", 500: "InternalServerError",
    501: "NotImplementedError", 503: "ServiceUnavailableError"}


def error_body(error: RequestError) -> dict[str, Any]:
    """vLLM's ErrorResponse: `code` is the HTTP status."""
    kind = _ERROR_TYPES.get(error.status, "Error")
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.status}}


def finish_reason(reason: str) -> str:
    """tandem's finish reason -> vLLM's: EOS and stops are `stop`, a cancelled request is `abort`."""
    if reason == FinishReason.CANCELLED:
        return "abort"
    return FinishReason(reason).openai


def usage(counts: Usage) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": counts.prompt_tokens, "completion_tokens": counts.completion_tokens,
                           "total_tokens": counts.prompt_tokens + counts.completion_tokens}
    if counts.cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": counts.cached_tokens}
    return out


def _clamp(logprob: float | None) -> float:
    # JSON has no -inf or NaN: vLLM sends -9999.0 for them (and for a missing value).
    return logprob if logprob is not None and logprob > -9999.0 else -9999.0


def _candidates(t: TokenLogprob, k: int) -> list[TopLogprob]:
    """vLLM's top_logprobs at one position: the sampled token first, then the other candidates best first,
    max(k, 1) of them."""
    sampled = [e for e in t.top if e.token_id == t.token_id]
    return (sampled + [e for e in t.top if e.token_id != t.token_id])[:max(k, 1)]


def _rank(t: TokenLogprob) -> int | None:
    # vLLM reports no rank (None) where the engine gave 0
    return next((e.rank for e in t.top if e.token_id == t.token_id), None) or None


def token_logprobs(tokens: list[TokenLogprob], k: int) -> dict[str, Any]:
    """Logprobs of `output_mode` tokens: integer token ids and ranks (vLLM's GenerateLogProbs)."""
    return {"content": [{"token_id": t.token_id, "logprob": _clamp(t.logprob), "rank": _rank(t),
                         "top_logprobs": [{"token_id": e.token_id, "logprob": _clamp(e.logprob), "rank": e.rank or None}
                                          for e in _candidates(t, k)]}
                        for t in tokens]}  # fmt: skip


def text_logprobs(tokens: list[TokenLogprob], k: int) -> dict[str, Any]:
    """Logprobs of `output_mode` text: decoded tokens and their bytes (OpenAI chat's shape, as vLLM's)."""
    return {"content": [{"token": t.token, "logprob": _clamp(t.logprob), "bytes": t.bytes,
                         "top_logprobs": [{"token": e.token, "logprob": _clamp(e.logprob), "bytes": e.bytes}
                                          for e in _candidates(t, k)]}
                        for t in tokens]}  # fmt: skip


class GenerateAnswer(Answer):
    """vLLM's generate answer. Streaming: one chunk per delta with tokens (or text held back for a stop
    string, in text mode), the last with the finish reason; a usage chunk with
    `stream_options.include_usage`; `[DONE]`, after an error event too. Unary: one choice with every
    token id."""

    def __init__(self, request: GenerateRequest, model: str, request_id: str, prepared: Prepared) -> None:
        self.request = request
        self.model = model
        # The client's id comes back as it was sent; without one, vLLM's spelling of a generated id.
        self.id = request.request_id if request.request_id is not None else f"generate-tokens-{request_id}"
        self.created = int(time.time())
        self.prompt_ids = prepared.prompt_ids
        self.text_mode = request.output_mode == "text"
        self.top = request.sampling.logprobs  # None: no logprobs asked for
        self.token_ids: list[int] = []  # the unary answer's
        self.prompt_pending = request.return_token_ids  # prompt_token_ids go in the first chunk
        self.finished = False
        prepared.processor.stop_token_logprobs = True  # every token id is paired with its logprob

    def _logprobs(self, tokens: list[TokenLogprob]) -> dict[str, Any] | None:
        if self.top is None:
            return None
        return text_logprobs(tokens, self.top) if self.text_mode else token_logprobs(tokens, self.top)

    def _choice(self, token_ids: list[int], reason: str | None, stop_reason: str | int | None, text: str,
                logprobs: dict[str, Any] | None) -> dict[str, Any]:  # fmt: skip
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "stop_reason": stop_reason,
                                  "token_ids": token_ids}
        if self.text_mode:
            choice["text"] = text
        choice["logprobs"] = logprobs
        return choice

    def _chunk(self, choices: list[dict[str, Any]], usage_so_far: dict[str, Any] | None) -> bytes:
        chunk: dict[str, Any] = {"request_id": self.id, "usage": usage_so_far}
        if self.prompt_pending:
            chunk["prompt_token_ids"] = self.prompt_ids
            self.prompt_pending = False
        chunk["output_mode"] = self.request.output_mode
        chunk["choices"] = choices
        return sse(chunk)

    def _running_usage(self, completion_tokens: int) -> dict[str, Any] | None:
        if not self.request.continuous_usage:
            return None
        return usage(Usage(len(self.prompt_ids), completion_tokens))

    def delta(self, delta: ProcessedDelta, parsed: ParsedDelta | None) -> list[bytes]:
        text = delta.text if self.text_mode else ""
        if not (delta.token_ids or delta.finish_reason or text):
            return []
        reason = None
        if delta.finish_reason:
            reason = finish_reason(delta.finish_reason)
            self.finished = True
        choice = self._choice(delta.token_ids, reason, delta.stop_reason if reason else None, text,
                              self._logprobs(delta.logprobs or []))
        return [self._chunk([choice], self._running_usage(delta.completion_tokens))]

    def closing(self, outcome: Outcome, ending: Ending) -> list[bytes]:
        events = []
        if not self.finished:  # the worker's stream ended without a reason: the last chunk still gives one
            choice = self._choice([], finish_reason(ending.reason), ending.stop_reason, "", self._logprobs([]))
            events.append(self._chunk([choice], self._running_usage(ending.usage.completion_tokens)))
        if self.request.include_usage:
            events.append(sse({"request_id": self.id, "usage": usage(ending.usage),
                                      "output_mode": self.request.output_mode, "choices": []}))
        events.append(SSE_DONE)
        return events

    def failure(self, error: RequestError) -> bytes:
        return sse(error_body(error)) + SSE_DONE

    def collect(self, delta: ProcessedDelta, parsed: ParsedDelta | None) -> None:
        self.token_ids.extend(delta.token_ids)

    def body(self, outcome: Outcome, ending: Ending) -> Any:
        choice = self._choice(self.token_ids, finish_reason(ending.reason), ending.stop_reason, "".join(outcome.text),
                              self._logprobs(outcome.logprobs))
        body: dict[str, Any] = {"request_id": self.id, "model": self.model, "created": self.created,
                                "output_mode": self.request.output_mode, "choices": [choice],
                                "usage": usage(ending.usage)}
        if self.request.return_token_ids:
            body["prompt_token_ids"] = self.prompt_ids
        return body

    @staticmethod
    def error_body(error: RequestError) -> dict[str, Any]:
        return error_body(error)


def routes(serving: Serving) -> Mount:
    async def generate_tokens(request: web.Request) -> web.StreamResponse:
        """The token ids go to the workers as they are (no template)."""
        body = await serving.body(request)
        parsed = parse_request(body)
        model = serving.model(serving.named_or_only(parsed.model), ModelType.Chat | ModelType.Completions, ROUTE)
        serving.token_input(model, ROUTE)

        def answer(request_id: str, prepared: Prepared) -> Answer:
            return GenerateAnswer(parsed, model.name, request_id, prepared)

        return await serving.serve(request, parsed.completion_request(model.name), len(body), model.pipeline,
                                   "generate", answer)

    # vLLM's error shape on its /inference routes: `code` is the HTTP status.
    return Mount([web.post(ROUTE, generate_tokens)], "/inference/", error_body)
