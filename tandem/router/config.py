"""KV router configuration: the flags we support, their env fallbacks, per-request overrides.

Each setting is an `Option` row (flag, aliases, env vars, bounds): CLI over env over default; an invalid
value raises ValueError naming the flag or env var it came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from tandem.runtime.config import RuntimeConfig
from tandem.runtime.options import Option, add_options, apply_options


@dataclass
class KvRouterConfig:
    overlap_score_credit: float = 1.0
    overlap_score_credit_decay: float = 0.0
    # Legacy (0.x) weight: when set, the legacy cost formula is used; 0 disables overlap.
    overlap_score_weight: float | None = None
    prefill_load_scale: float = 1.0
    # Prefill credit per prompt block a worker holds in host memory / on disk (continuing its device match)
    host_cache_hit_weight: float = 0.75
    disk_cache_hit_weight: float = 0.25
    decode_active_request_weight: float = 0.0
    temperature: float = 0.0
    use_kv_events: bool = True
    ttl_secs: float = 120.0  # approximate mode: lifetime of predicted blocks
    # With KV events: also predict blocks from routing decisions for this long (0 = off), covering the
    # time until the worker's events arrive. Dynamo leaves it unset; a follow-up turn sent as soon as
    # its answer ends would otherwise race the events.
    predicted_ttl_secs: float = 5.0
    max_tree_size: int = 2**20  # approximate mode: prune the index above this many nodes
    replica_sync: bool = False
    # Read the workers' KV events from their JetStream streams (workers run with --durable-kv-events):
    # a router that starts late or reconnects replays them instead of asking each worker for a dump.
    durable_kv_events: bool = False
    track_active_blocks: bool = True
    assume_kv_reuse: bool = True
    track_prefill_tokens: bool = True
    active_request_expiry_secs: float = 300.0
    # With KV events: ask each worker no event arrived from for this long whether it emitted more (0 = off).
    # An event lost on the way is otherwise found only at the worker's next event, which a quiet worker
    # may never send: the last events of a burst published while a subscription still connects, say.
    event_catch_up_secs: float = 2.0
    # Conditional disaggregation (policy isl_bounding): the frontend skips the remote prefill when
    # the decode worker it would pick already caches most of the prompt.
    conditional_disagg: bool = False
    conditional_disagg_eff_isl_threshold: int = 2048
    conditional_disagg_eff_isl_ratio_threshold: float = 0.7

    def with_overrides(self, override: dict[str, Any] | None) -> KvRouterConfig:
        """This config with a request's `router_config_override` applied. Unknown keys and null values
        are ignored; a value that is not a non-negative finite number (true or false for the switches)
        raises ValueError naming the key."""
        if not override:
            return self
        changes: dict[str, Any] = {}
        for key in _OVERRIDE_SWITCHES:
            value = override.get(key)
            if value is None:
                continue
            if not isinstance(value, bool):
                raise ValueError(f"router_config_override.{key} must be true or false, got {value!r}")
            changes[key] = value
        for key, field_name in _OVERRIDE_KEYS.items():
            value = override.get(key)
            if value is None:
                continue
            # bool is an int subclass, but `true` is never a meaningful weight
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"router_config_override.{key} must be a non-negative number, got {value!r}")
            changes[field_name] = float(value)
        return dataclasses.replace(self, **changes) if changes else self


# router_config_override key -> config field
_OVERRIDE_KEYS = {
    "overlap_score_weight": "overlap_score_weight",
    "overlap_score_credit": "overlap_score_credit",
    "router_temperature": "temperature",
    "temperature": "temperature",
    "prefill_load_scale": "prefill_load_scale",
    "host_cache_hit_weight": "host_cache_hit_weight",
    "disk_cache_hit_weight": "disk_cache_hit_weight",
}
# router_config_override switches (Dynamo's RouterConfigOverride has them too): the decode stage of a
# disaggregated request turns both off.
_OVERRIDE_SWITCHES = ("assume_kv_reuse", "track_prefill_tokens")


_OPTIONS: tuple[Option, ...] = (
    Option("overlap_score_credit", ("--router-kv-overlap-score-credit",), ("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT",),
            "blocks of prefill credit per cached prefix block", minimum=0.0),
    Option("overlap_score_credit_decay", ("--router-kv-overlap-score-credit-decay",),
            ("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY",),
            "shrink the overlap credit of workers with more queued prefill than the least loaded one "
            "(0 = never)", minimum=0.0),
    Option("overlap_score_weight", ("--router-kv-overlap-score-weight", "--kv-overlap-score-weight"),
            ("DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT", "DYN_OVERLAP_SCORE_WEIGHT", "DYN_KV_OVERLAP_SCORE_WEIGHT"),
            "deprecated: use the legacy cost weight * prefill_blocks + decode_blocks (0 ignores cache "
            "overlap)", minimum=0.0),
    Option("prefill_load_scale", ("--router-prefill-load-scale",), ("DYN_ROUTER_PREFILL_LOAD_SCALE",),
            "weight of a worker's prefill blocks against its decode blocks", minimum=0.0),
    Option("host_cache_hit_weight", ("--router-host-cache-hit-weight",), ("DYN_ROUTER_HOST_CACHE_HIT_WEIGHT",),
            "blocks of prefill credit per prompt block a worker holds in host memory after its device match",
            minimum=0.0),
    Option("disk_cache_hit_weight", ("--router-disk-cache-hit-weight",), ("DYN_ROUTER_DISK_CACHE_HIT_WEIGHT",),
            "blocks of prefill credit per prompt block a worker holds on disk (or external storage) after its "
            "device and host matches", minimum=0.0),
    Option("decode_active_request_weight", ("--router-decode-active-request-weight",),
            ("DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT",), "cost in blocks of each request active on a worker",
            minimum=0.0),
    Option("temperature", ("--router-temperature",), ("DYN_ROUTER_TEMPERATURE",),
            "0 picks the cheapest worker; higher values sample workers by softmax of their cost", minimum=0.0),
    Option("use_kv_events", ("--router-kv-events", "--kv-events"), ("DYN_ROUTER_USE_KV_EVENTS", "DYN_KV_EVENTS"),
            "follow the workers' KV cache events; --no-router-kv-events predicts the caches from routing "
            "decisions instead", kind=bool),
    Option("ttl_secs", ("--router-ttl-secs", "--router-ttl"), ("DYN_ROUTER_TTL_SECS",),
            "without KV events: how long a predicted cached block lives", positive=True),
    Option("predicted_ttl_secs", ("--router-predicted-ttl-secs",), ("DYN_ROUTER_PREDICTED_TTL_SECS",),
            "with KV events: also count the blocks of recent routing decisions as cached on their worker for "
            "this long, until its events arrive (0 = off)", minimum=0.0),
    Option("replica_sync", ("--router-replica-sync",), ("DYN_ROUTER_REPLICA_SYNC",),
            "share active-request load with other router replicas", kind=bool),
    Option("durable_kv_events", ("--router-durable-kv-events",), ("DYN_ROUTER_DURABLE_KV_EVENTS",),
            "replay the workers' KV events from NATS JetStream (workers run with --durable-kv-events) when this "
            "router starts or reconnects, instead of asking each worker for its recent events (needs "
            "--event-plane nats)", kind=bool),
    Option("track_active_blocks", ("--router-track-active-blocks", "--track-active-blocks"),
            ("DYN_ROUTER_TRACK_ACTIVE_BLOCKS",), "count the KV blocks of requests in flight as decode load",
            kind=bool),
    Option("assume_kv_reuse", ("--router-assume-kv-reuse", "--assume-kv-reuse"), ("DYN_ROUTER_ASSUME_KV_REUSE",),
            "assume requests in flight on a worker share their common prefix blocks", kind=bool),
    Option("track_prefill_tokens", ("--router-track-prefill-tokens",), ("DYN_ROUTER_TRACK_PREFILL_TOKENS",),
            "count prompt tokens waiting for prefill as load", kind=bool),
    Option("conditional_disagg", ("--router-conditional-disagg",), ("DYN_ROUTER_CONDITIONAL_DISAGG",),
            "disaggregated serving: skip the remote prefill of a request whose chosen decode worker already "
            "caches most of its prompt (needs decode workers that publish KV events)", kind=bool),
    Option("conditional_disagg_eff_isl_threshold", ("--router-conditional-disagg-eff-isl-threshold",),
            ("DYN_ROUTER_CONDITIONAL_DISAGG_EFF_ISL_THRESHOLD",),
            "conditional disaggregation: prefill locally only below this many uncached prompt tokens",
            kind=int, minimum=0),
    Option("conditional_disagg_eff_isl_ratio_threshold", ("--router-conditional-disagg-eff-isl-ratio-threshold",),
            ("DYN_ROUTER_CONDITIONAL_DISAGG_EFF_ISL_RATIO_THRESHOLD",),
            "conditional disaggregation: ... and below this fraction of uncached prompt tokens (0..1)",
            minimum=0.0, maximum=1.0),
)

# Env-only settings (no Dynamo flag).
_ENV_ONLY: tuple[Option, ...] = (
    Option("active_request_expiry_secs", (), ("DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS",),
            "forget requests in flight for longer than this", positive=True),
    Option("event_catch_up_secs", (), ("DYN_ROUTER_EVENT_CATCH_UP_SECS",),
            "with KV events: ask a worker no event arrived from for this long for any it emitted since (0 = off)",
            minimum=0.0),
)


def add_router_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The KV router flags with their legacy aliases; defaults are resolved by `config_from_args`."""
    group = parser.add_argument_group("KV router options (--router-mode kv)")
    add_options(group, _OPTIONS, KvRouterConfig())
    return group


def config_from_args(args: argparse.Namespace) -> KvRouterConfig:
    """The router config from parsed `add_router_args` flags, env fallbacks and defaults, validated."""
    return apply_options(KvRouterConfig(), _OPTIONS + _ENV_ONLY, args)


def parse_args_with_router_config(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse `argv` with a parser that has `add_router_args`, then set `args.router_config`; an
    invalid router setting exits 2 with a message naming its flag."""
    args = parser.parse_args(argv)
    try:
        args.router_config = config_from_args(args)
        if args.router_config.durable_kv_events:
            plane = RuntimeConfig.from_args(args).event_plane
            if plane != "nats":
                raise ValueError("--router-durable-kv-events (DYN_ROUTER_DURABLE_KV_EVENTS): durable KV events are "
                                 f"kept in NATS JetStream; they need --event-plane nats (DYN_EVENT_PLANE), not {plane}")
    except ValueError as e:
        parser.error(str(e))
    return args
