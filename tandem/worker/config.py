"""Settings every worker kind shares."""

from __future__ import annotations

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
    """Dynamo's `--disaggregation-mode`: whole requests, or one side of disaggregated serving."""

    AGGREGATED = "agg"
    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def worker_type(self) -> WorkerType:
        return {DisaggregationMode.AGGREGATED: WorkerType.Aggregated, DisaggregationMode.PREFILL: WorkerType.Prefill,
                DisaggregationMode.DECODE: WorkerType.Decode}[self]

    @property
    def default_component(self) -> str:
        """Prefill workers are their own component, so the frontend finds them apart from the rest."""
        return "prefill" if self is DisaggregationMode.PREFILL else "backend"


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
