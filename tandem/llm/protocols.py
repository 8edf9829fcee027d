"""The contract between the frontend and the workers (Dynamo's wire format).

The frontend sends a `PreprocessedRequest` to a worker's `generate` endpoint (a text-input worker gets
a `TextRequest`, an embedding worker an `EmbeddingRequest`); the worker streams `LLMEngineOutput`s back
(a text-input worker `TextChunk`s; an embedding worker answers with one `EmbeddingOutput`): `OUTPUT_OF`.
All of them travel as msgpack maps whose absent optional fields are omitted; the endpoint decodes a request
into its Struct before the handler sees it, and the caller decodes each output into its Struct.
"""

from __future__ import annotations

import time
from enum import StrEnum
from typing import Any

import msgspec


class StopConditions(msgspec.Struct, omit_defaults=True):
    max_tokens: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_token_ids_hidden: list[int] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    max_thinking_tokens: int | None = None


class GuidedDecoding(msgspec.Struct, omit_defaults=True):
    """At most one of json / regex / choice / grammar / whitespace_pattern / structural_tag."""

    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace_pattern: str | None = None
    structural_tag: Any = None
    backend: str | None = None


class SamplingOptions(msgspec.Struct, omit_defaults=True):
    n: int | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    seed: int | None = None
    include_stop_str_in_output: bool | None = None
    guided_decoding: GuidedDecoding | None = None


class OutputOptions(msgspec.Struct, omit_defaults=True):
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool | None = None
    formatted_prompt: bool | None = None
    return_tokens_as_token_ids: bool | None = None


class RoutingHints(msgspec.Struct, omit_defaults=True):
    backend_instance_id: int | None = None
    prefill_worker_id: int | None = None
    decode_worker_id: int | None = None
    dp_rank: int | None = None
    prefill_dp_rank: int | None = None
    expected_output_tokens: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    priority: int | None = None
    session_id: str | None = None  # an agent's session: its turns go to one worker (see frontend.routing)


class PromptTokensDetails(msgspec.Struct, omit_defaults=True):
    cached_tokens: int | None = None


class DisaggregatedParams(msgspec.Struct, omit_defaults=True):
    """The prefill worker's hand-off to the decode worker; what is inside is the engine's own (vLLM's
    NIXL connector parameters, the mocker's simulated ones)."""

    kv_transfer_params: dict[str, Any] | None = None


class PrefillResult(msgspec.Struct, omit_defaults=True):
    """What the frontend tells a decode worker about the remote prefill of its request."""

    disaggregated_params: DisaggregatedParams
    prompt_tokens_details: PromptTokensDetails | None = None  # the prefill worker's cache hits


class MediaItem(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True, rename={"url": "Url"}):
    """One image or video of a request, as Dynamo's frontend sends it: `{"Url": "https://..." | "data:..."}`."""

    url: str


class MultiModalData(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """The media of a token-input request, in prompt order. A modality not named here fails the request's
    decoding (a 400) rather than being dropped."""

    image_url: list[MediaItem] = msgspec.field(default_factory=list)
    video_url: list[MediaItem] = msgspec.field(default_factory=list)


class PreprocessedRequest(msgspec.Struct, omit_defaults=True):
    model: str = ""  # a canary health request may name none
    token_ids: list[int] = msgspec.field(default_factory=list)
    stop_conditions: StopConditions = msgspec.field(default_factory=StopConditions)
    sampling_options: SamplingOptions = msgspec.field(default_factory=SamplingOptions)
    output_options: OutputOptions = msgspec.field(default_factory=OutputOptions)
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    mdc_sum: str | None = None
    annotations: list[str] = msgspec.field(default_factory=list)
    routing: RoutingHints | None = None
    router_config_override: dict[str, Any] | None = None
    prefill_result: PrefillResult | None = None
    extra_args: dict[str, Any] | None = None
    prompt_embeds: str | None = None  # base64 of a torch.save'd tensor, instead of token_ids
    multi_modal_data: MultiModalData | None = None  # the images; the prompt holds one placeholder token each

    @property
    def dp_rank(self) -> int | None:
        return self.routing.dp_rank if self.routing is not None else None

    @property
    def max_tokens(self) -> int | None:
        return self.stop_conditions.max_tokens

    @property
    def priority(self) -> int:
        """The engine's scheduling priority (`routing.priority`, vLLM's: lower first); 0 when none is given."""
        routing = self.routing
        return (routing.priority or 0) if routing is not None else 0


class EmbeddingRequest(msgspec.Struct, omit_defaults=True):
    """What an embedding worker's `generate` gets: the token ids of each input (the frontend tokenized
    them), and the vector size asked for (a matryoshka model's `dimensions`)."""

    token_ids: list[list[int]]
    model: str = ""
    dimensions: int | None = None
    mdc_sum: str | None = None
    annotations: list[str] = msgspec.field(default_factory=list)


class EmbeddingOutput(msgspec.Struct):
    """An embedding worker's answer: one vector per input, in the request's order."""

    embeddings: list[list[float]]
    prompt_tokens: int
    total_tokens: int


class TextRequest(msgspec.Struct, omit_defaults=True):
    """What a text-input worker (`--use-vllm-tokenizer`) gets: the client's OpenAI request, the fields
    the engine reads (the frontend neither templates nor tokenizes)."""

    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None

    def sampling_fields(self) -> dict[str, Any]:
        """The sampling settings the client gave, by vLLM's SamplingParams names."""
        return {name: value for name in _TEXT_SAMPLING_FIELDS if (value := getattr(self, name)) is not None}


_TEXT_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                         "repetition_penalty", "length_penalty", "seed", "max_tokens", "min_tokens", "stop",
                         "ignore_eos")


# -- engine output ---------------------------------------------------------------------------------

class FinishReason(StrEnum):
    """Why a stream ended, spelled on the wire as Dynamo spells it. `ERROR` comes with a message."""

    EOS = "eos"
    LENGTH = "length"
    STOP = "stop"
    CANCELLED = "cancelled"
    CONTENT_FILTER = "content_filter"
    ERROR = "error"

    @property
    def openai(self) -> str:
        """OpenAI's reason: `length` and `content_filter` as they are, every other end is `stop`."""
        return self.value if self in (FinishReason.LENGTH, FinishReason.CONTENT_FILTER) else "stop"


class CompletionUsage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int | None = None  # an engine may leave the sum to the reader
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
           details: PromptTokensDetails | None = None) -> CompletionUsage:
        """Usage with the total filled in; `details` (a prefill worker's) wins over `cached_tokens`."""
        if details is None and cached_tokens is not None:
            details = PromptTokensDetails(cached_tokens)
        return cls(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens, details)


class RankedLogprob(msgspec.Struct):
    """One alternative at a generated position, best first by `rank` (1 = the most likely)."""

    rank: int | None
    token_id: int
    token: str | None
    logprob: float


class LLMEngineOutput(msgspec.Struct, omit_defaults=True):
    """One chunk of a worker's answer: the new tokens since the last chunk; the last chunk has the
    finish reason and the usage."""

    token_ids: list[int]
    text: str | None = None  # engine-decoded text (text-input models); else the frontend detokenizes
    log_probs: list[float] | None = None  # of each new token
    top_logprobs: list[list[RankedLogprob]] | None = None
    # A worker of this contract sends a FinishReason; the reader also takes the forms other Dynamo-speaking
    # engines send ("error: <msg>", {"error": msg}, vLLM's "abort"): see `parse_finish_reason`.
    finish_reason: str | dict[str, Any] | None = None
    error: str | None = None  # why, when finish_reason is ERROR
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    completion_usage: CompletionUsage | None = None
    disaggregated_params: DisaggregatedParams | None = None  # a prefill worker's hand-off
    kv_transfer_ms: float | None = None  # a decode worker's wait for the prompt's KV (first chunk)

    @classmethod
    def failed(cls, error: str) -> LLMEngineOutput:
        return cls([], finish_reason=FinishReason.ERROR, error=error)

    @classmethod
    def cancelled(cls, usage: CompletionUsage | None = None) -> LLMEngineOutput:
        return cls([], finish_reason=FinishReason.CANCELLED, completion_usage=usage)


class TextDelta(msgspec.Struct):
    role: str = "assistant"
    content: str = ""


class TextChoice(msgspec.Struct):
    delta: TextDelta
    finish_reason: str | None = None  # OpenAI's spelling
    index: int = 0


class TextChunk(msgspec.Struct, omit_defaults=True):
    """What a text-input worker streams: an OpenAI `chat.completion.chunk` with one choice; the last one
    has the finish reason and the usage. The frontend relays it with its own id, time and model name."""

    id: str
    created: int
    model: str
    object: str
    choices: list[TextChoice]
    usage: CompletionUsage | None = None  # the only field left out when unset


def text_chunk(response_id: str, content: str, finish_reason: FinishReason | None,
               usage: CompletionUsage | None = None) -> TextChunk:
    choice = TextChoice(TextDelta(content=content), finish_reason.openai if finish_reason is not None else None)
    return TextChunk(response_id, int(time.time()), "unknown", "chat.completion.chunk", [choice], usage)


# What each kind of request to a worker's `generate` endpoint is answered with: the worker harness serves
# the request type, and the frontend's request-plane client decodes the stream into the output type.
OUTPUT_OF: dict[type, type] = {
    PreprocessedRequest: LLMEngineOutput,
    TextRequest: TextChunk,
    EmbeddingRequest: EmbeddingOutput,
}


class StatusReply(msgspec.Struct):
    """The answer of a worker's maintenance endpoints (`clear_kv_blocks`)."""

    status: str  # success | error
    message: str


def parse_finish_reason(value: Any, error: Any = None) -> tuple[str | None, str | None]:
    """A wire finish reason (and error message) -> (reason, error message); reason is one of eos, length,
    stop, cancelled, content_filter, error; None while the stream goes on. Besides this contract's
    `"error"` + message it reads the forms other Dynamo-speaking engines send: `"error: <msg>"`,
    `{"error": msg}` and vLLM's `"abort"`."""
    if value is None:
        return None, None
    if isinstance(value, dict):
        return "error", str(value.get("error", value))
    text = str(value)
    if text == "error":
        return "error", str(error) if error else "the engine failed"
    if text.startswith("error"):
        return "error", text.partition(":")[2].strip() or text
    if text.startswith("abort"):
        return "cancelled", None
    if text in FinishReason.__members__.values():
        return text, None
    return "error", f"unknown finish reason {text!r}"
