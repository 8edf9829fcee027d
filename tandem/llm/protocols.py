"""Wire formats between the frontend and the workers (Dynamo's).

The frontend sends a `PreprocessedRequest` to a worker's `generate` endpoint; the worker streams
`LLMEngineOutput` maps back. Both travel as msgpack maps; absent optional fields are omitted.
"""

from __future__ import annotations

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


class PreprocessedRequest(msgspec.Struct, omit_defaults=True):
    model: str
    token_ids: list[int]
    stop_conditions: StopConditions = msgspec.field(default_factory=StopConditions)
    sampling_options: SamplingOptions = msgspec.field(default_factory=SamplingOptions)
    output_options: OutputOptions = msgspec.field(default_factory=OutputOptions)
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    mdc_sum: str | None = None
    annotations: list[str] = msgspec.field(default_factory=list)
    routing: RoutingHints | None = None
    router_config_override: dict[str, Any] | None = None
    prefill_result: dict[str, Any] | None = None
    extra_args: dict[str, Any] | None = None


# -- engine output ---------------------------------------------------------------------------------
# Workers yield plain maps with these keys (Dynamo's LLMEngineOutput); every key is optional:
#   token_ids: [int]            new tokens in this chunk (delta)
#   text: str                   engine-decoded text (text-input models); else the frontend detokenizes
#   log_probs: [float]          logprob of each new token
#   top_logprobs: [[{rank, token_id, token, logprob}]]
#   finish_reason: "eos" | "length" | "stop" | "cancelled" | "abort" | "content_filter" | "error: <msg>"
#                  | {"error": msg}
#   stop_reason: str | int
#   completion_usage: {prompt_tokens, completion_tokens, total_tokens, prompt_tokens_details: {cached_tokens}}
#   disaggregated_params: any   prefill -> decode hand-off (engine-owned)

FINISH_REASONS = ("eos", "length", "stop", "cancelled", "abort", "content_filter")


def parse_finish_reason(value: Any) -> tuple[str | None, str | None]:
    """An engine finish reason -> (normalized reason, error message). Normalized is one of
    eos, length, stop, cancelled, content_filter, error; None while the stream goes on."""
    if value is None:
        return None, None
    if isinstance(value, dict):
        return "error", str(value.get("error", value))
    text = str(value)
    if text.startswith("error"):
        return "error", text.partition(":")[2].strip() or text
    if text == "abort" or text.startswith("abort"):
        return "cancelled", None
    if text in FINISH_REASONS:
        return text, None
    return "error", f"unknown finish reason {text!r}"


def openai_finish_reason(reason: str | None) -> str | None:
    """Engine reason -> OpenAI's (`stop`, `length`, `content_filter`)."""
    if reason is None:
        return None
    if reason == "length":
        return "length"
    if reason == "content_filter":
        return "content_filter"
    return "stop"
