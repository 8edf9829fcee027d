"""Settings every worker kind shares."""

from __future__ import annotations

import os
from enum import StrEnum
from typing import Any

from tandem.llm.model_card import WorkerType
from tandem.llm.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    UnknownParserError,
    check_reasoning_parser,
    check_tool_parser,
)
from tandem.runtime.options import Option


class DisaggregationMode(StrEnum):
    """Dynamo's `--disaggregation-mode`: whole requests, one side of disaggregated serving, or the encoder of
    other workers' images (`encode`: the role of `--vllm-native-encoder-worker`, which registers no model)."""

    AGGREGATED = "agg"
    PREFILL = "prefill"
    DECODE = "decode"
    ENCODE = "encode"

    @property
    def worker_type(self) -> WorkerType:
        """The type of the model a worker in this role registers (an encoder registers none)."""
        if self is DisaggregationMode.ENCODE:
            raise ValueError("an encoder worker registers no model")
        return {DisaggregationMode.AGGREGATED: WorkerType.Aggregated, DisaggregationMode.PREFILL: WorkerType.Prefill,
                DisaggregationMode.DECODE: WorkerType.Decode}[self]

    @property
    def default_component(self) -> str:
        """Prefill workers are their own component, so the frontend finds them apart from the rest."""
        return "prefill" if self is DisaggregationMode.PREFILL else "backend"

    @classmethod
    def of(cls, mode: str | None, prefill: bool, decode: bool) -> DisaggregationMode:
        """The role --disaggregation-mode names, or its shorthand --is-prefill-worker or --is-decode-worker;
        raises ValueError when they disagree."""
        if prefill and decode:
            raise ValueError("Cannot set both --is-prefill-worker and --is-decode-worker")
        shorthand = cls.PREFILL if prefill else cls.DECODE if decode else None
        if mode is not None and shorthand is not None and mode != shorthand:
            raise ValueError(f"--disaggregation-mode {mode} contradicts --is-{shorthand}-worker")
        return shorthand or cls(mode or cls.AGGREGATED)


def consumer_role(mode: DisaggregationMode, route_to_encoder: bool, ec_consumer_mode: bool, multimodal: bool) -> bool:
    """Whether the worker has encoder workers encode its images: --ec-consumer-mode, or its newer name
    --route-to-encoder, which needs --enable-multimodal and a worker that takes the prompt (ValueError)."""
    if not route_to_encoder:
        return ec_consumer_mode
    if mode in (DisaggregationMode.DECODE, DisaggregationMode.ENCODE):
        raise ValueError(f"--route-to-encoder with --disaggregation-mode {mode}: only a worker that computes the "
                         "prompt (agg, prefill) has its images encoded by encoder workers")
    if not multimodal:
        raise ValueError("Use --enable-multimodal with --route-to-encoder")
    return True


def encoder_role(mode: DisaggregationMode, multimodal: bool) -> bool:
    """Whether `mode` is the encoder role (what --vllm-native-encoder-worker makes); ValueError without
    --enable-multimodal."""
    if mode is not DisaggregationMode.ENCODE:
        return False
    if not multimodal:
        raise ValueError("Use --enable-multimodal with --disaggregation-mode encode")
    return True


DEFAULT_ENDPOINT_TYPES = "chat,completions"

# The flags every worker kind takes, each declared once. A default belongs to the worker kind, not to the
# row: a kind passes its own to `add_options` (the --help) and to `Option.value` or `apply_options`.
MODEL_PATH = Option("model_path", ("--model-path", "--model"), ("DYN_MODEL_PATH",),
                    "model folder (tokenizer, config.json), hub id or `smollm2`", kind=str, metavar="PATH")
SERVED_MODEL_NAME = Option("served_model_name", ("--model-name", "--served-model-name"), (),
                           "the model's name in the API (unset: the folder's name)", kind=str, metavar="NAME")
ENDPOINT_TYPES = Option("endpoint_types", ("--endpoint-types", "--dyn-endpoint-types"), ("DYN_ENDPOINT_TYPES",),
                        "OpenAI surfaces to enable, comma separated: chat, completions (an embedding model: embedding)",
                        kind=str)
CONTEXT_LENGTH = Option("context_length", ("--context-length", "--max-model-len"), (),
                        "maximum sequence length (unset: the model's max_position_embeddings)", kind=int,
                        positive=True)
BLOCK_SIZE = Option("block_size", ("--block-size",), (), "tokens per KV block", kind=int, positive=True)
CUSTOM_JINJA_TEMPLATE = Option("custom_jinja_template", ("--custom-jinja-template",), ("DYN_CUSTOM_JINJA_TEMPLATE",),
                               "chat template file overriding the model's (~ and $VARS expanded)", kind=str,
                               metavar="FILE")
# The worker's role: --disaggregation-mode, or Dynamo's older shorthands (see `DisaggregationMode.of`).
DISAGGREGATION_MODE = Option("disaggregation_mode", ("--disaggregation-mode",), ("DYN_VLLM_DISAGGREGATION_MODE",),
                             "whole requests (agg), one side of disaggregated serving (as --is-prefill-worker, "
                             "--is-decode-worker), or the encoder of other workers' images (encode: as "
                             "--vllm-native-encoder-worker)", kind=DisaggregationMode,
                             choices=tuple(mode.value for mode in DisaggregationMode))
# The newer name of --ec-consumer-mode (see `consumer_role`).
ROUTE_TO_ENCODER = Option("route_to_encoder", ("--route-to-encoder",), ("DYN_VLLM_ROUTE_TO_ENCODER",),
                          "have encoder workers encode this worker's images (as --ec-consumer-mode; agg and "
                          "prefill workers)",
                          kind=bool)
IS_PREFILL_WORKER = Option("is_prefill_worker", ("--is-prefill-worker",), ("DYN_VLLM_IS_PREFILL_WORKER",),
                           "prefill-only worker (component prefill)", kind=bool)
IS_DECODE_WORKER = Option("is_decode_worker", ("--is-decode-worker",), ("DYN_VLLM_IS_DECODE_WORKER",),
                          "decode-only worker (publishes no KV events)", kind=bool)


def custom_template_path(path: str | None) -> str | None:
    """--custom-jinja-template as an absolute path, ~ and $VARS expanded; FileNotFoundError when no such file."""
    if path is None:
        return None
    full = os.path.abspath(os.path.expandvars(os.path.expanduser(path)))
    if not os.path.isfile(full):
        raise FileNotFoundError(f"Custom Jinja template file not found: {full} (--custom-jinja-template {path})")
    return full


# The parsers the frontend applies to the model's output; every worker kind takes them and puts them in
# the model's card.
PARSER_OPTIONS = (
    Option("dyn_tool_call_parser", ("--dyn-tool-call-parser",), ("DYN_TOOL_CALL_PARSER",),
           f"how the frontend finds tool calls in this model's output: {', '.join(TOOL_PARSERS)}", kind=str,
           metavar="NAME"),
    Option("dyn_reasoning_parser", ("--dyn-reasoning-parser",), ("DYN_REASONING_PARSER",),
           f"how the frontend finds this model's thinking: {', '.join(REASONING_PARSERS)}", kind=str,
           metavar="NAME"),
)


# Every worker kind that publishes KV events takes it.
DURABLE_KV_EVENTS = Option(
    "durable_kv_events", ("--durable-kv-events",), ("DYN_DURABLE_KV_EVENTS",),
    "also keep this worker's KV events in a NATS JetStream stream, so that a router started with "
    "--router-durable-kv-events replays them when it starts late or reconnects (needs --event-plane nats)",
    kind=bool)


def check_durable_kv_events(durable: bool, event_plane: str) -> None:
    """Raises ValueError when durable KV events are asked for without the NATS event plane."""
    if durable and event_plane != "nats":
        raise ValueError(f"--durable-kv-events (DYN_DURABLE_KV_EVENTS): durable KV events are kept in NATS "
                         f"JetStream; they need --event-plane nats (DYN_EVENT_PLANE), not {event_plane}")


def check_parser_options(tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """Raises ValueError naming the flag and the built parsers when a parser name is not built."""
    checks = (check_tool_parser, check_reasoning_parser)
    for option, check, name in zip(PARSER_OPTIONS, checks, (tool_call_parser, reasoning_parser), strict=True):
        if name is not None:
            try:
                check(name)
            except UnknownParserError as e:
                raise ValueError(f"{option.flags[0]} ({option.envs[0]}): {e}") from None


def parser_options(args: Any) -> tuple[str | None, str | None]:
    """The parser flags (or their env vars) of a worker's command line, checked."""
    tool_call_parser, reasoning_parser = (option.value(args) for option in PARSER_OPTIONS)
    check_parser_options(tool_call_parser, reasoning_parser)
    return tool_call_parser, reasoning_parser
