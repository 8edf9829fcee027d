"""KV router configuration: the flags we support, their env fallbacks, per-request overrides.

Precedence is CLI over env over default. Flags default to None so `config_from_args` can tell "not
given" (fall back to the env, then the default) from "given"; invalid values raise ValueError naming
the flag and its env var.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from tandem.runtime.config import env_bool, env_str


@dataclass
class KvRouterConfig:
    overlap_score_credit: float = 1.0
    overlap_score_credit_decay: float = 0.0
    # Legacy (0.x) weight: when set, the legacy cost formula is used; 0 disables overlap.
    overlap_score_weight: float | None = None
    prefill_load_scale: float = 1.0
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
    track_active_blocks: bool = True
    assume_kv_reuse: bool = True
    track_prefill_tokens: bool = True
    active_request_expiry_secs: float = 300.0
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
}
# router_config_override switches (Dynamo's RouterConfigOverride has them too): the decode stage of a
# disaggregated request turns both off.
_OVERRIDE_SWITCHES = ("assume_kv_reuse", "track_prefill_tokens")


@dataclass(frozen=True)
class _Option:
    """One config field: its flags (first is canonical, the rest legacy aliases) and env vars."""

    field: str
    flags: tuple[str, ...]
    envs: tuple[str, ...]
    help: str
    kind: type = float  # float, int or bool
    minimum: float | None = None  # inclusive lower bound
    maximum: float | None = None  # inclusive upper bound
    positive: bool = False  # strictly > 0

    @property
    def dest(self) -> str:
        return self.flags[0].lstrip("-").replace("-", "_")

    def describe(self) -> str:
        """How errors name this setting: the canonical flag and env var, whichever exist."""
        if not self.flags:
            return self.envs[0]
        return f"{self.flags[0]} ({self.envs[0]})" if self.envs else self.flags[0]


_OPTIONS: tuple[_Option, ...] = (
    _Option("overlap_score_credit", ("--router-kv-overlap-score-credit",), ("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT",),
            "blocks of prefill credit per cached prefix block", minimum=0.0),
    _Option("overlap_score_credit_decay", ("--router-kv-overlap-score-credit-decay",),
            ("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY",),
            "shrink the overlap credit of workers with more queued prefill than the least loaded one "
            "(0 = never)", minimum=0.0),
    _Option("overlap_score_weight", ("--router-kv-overlap-score-weight", "--kv-overlap-score-weight"),
            ("DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT", "DYN_OVERLAP_SCORE_WEIGHT", "DYN_KV_OVERLAP_SCORE_WEIGHT"),
            "deprecated: use the legacy cost weight * prefill_blocks + decode_blocks (0 ignores cache "
            "overlap)", minimum=0.0),
    _Option("prefill_load_scale", ("--router-prefill-load-scale",), ("DYN_ROUTER_PREFILL_LOAD_SCALE",),
            "weight of a worker's prefill blocks against its decode blocks", minimum=0.0),
    _Option("decode_active_request_weight", ("--router-decode-active-request-weight",),
            ("DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT",), "cost in blocks of each request active on a worker",
            minimum=0.0),
    _Option("temperature", ("--router-temperature",), ("DYN_ROUTER_TEMPERATURE",),
            "0 picks the cheapest worker; higher values sample workers by softmax of their cost", minimum=0.0),
    _Option("use_kv_events", ("--router-kv-events", "--kv-events"), ("DYN_ROUTER_USE_KV_EVENTS", "DYN_KV_EVENTS"),
            "follow the workers' KV cache events; --no-router-kv-events predicts the caches from routing "
            "decisions instead", kind=bool),
    _Option("ttl_secs", ("--router-ttl-secs", "--router-ttl"), ("DYN_ROUTER_TTL_SECS",),
            "without KV events: how long a predicted cached block lives", positive=True),
    _Option("predicted_ttl_secs", ("--router-predicted-ttl-secs",), ("DYN_ROUTER_PREDICTED_TTL_SECS",),
            "with KV events: also count the blocks of recent routing decisions as cached on their worker for "
            "this long, until its events arrive (0 = off)", minimum=0.0),
    _Option("replica_sync", ("--router-replica-sync",), ("DYN_ROUTER_REPLICA_SYNC",),
            "share active-request load with other router replicas", kind=bool),
    _Option("track_active_blocks", ("--router-track-active-blocks", "--track-active-blocks"),
            ("DYN_ROUTER_TRACK_ACTIVE_BLOCKS",), "count the KV blocks of requests in flight as decode load",
            kind=bool),
    _Option("assume_kv_reuse", ("--router-assume-kv-reuse", "--assume-kv-reuse"), ("DYN_ROUTER_ASSUME_KV_REUSE",),
            "assume requests in flight on a worker share their common prefix blocks", kind=bool),
    _Option("track_prefill_tokens", ("--router-track-prefill-tokens",), ("DYN_ROUTER_TRACK_PREFILL_TOKENS",),
            "count prompt tokens waiting for prefill as load", kind=bool),
    _Option("conditional_disagg", ("--router-conditional-disagg",), ("DYN_ROUTER_CONDITIONAL_DISAGG",),
            "disaggregated serving: skip the remote prefill of a request whose chosen decode worker already "
            "caches most of its prompt (needs decode workers that publish KV events)", kind=bool),
    _Option("conditional_disagg_eff_isl_threshold", ("--router-conditional-disagg-eff-isl-threshold",),
            ("DYN_ROUTER_CONDITIONAL_DISAGG_EFF_ISL_THRESHOLD",),
            "conditional disaggregation: prefill locally only below this many uncached prompt tokens",
            kind=int, minimum=0),
    _Option("conditional_disagg_eff_isl_ratio_threshold", ("--router-conditional-disagg-eff-isl-ratio-threshold",),
            ("DYN_ROUTER_CONDITIONAL_DISAGG_EFF_ISL_RATIO_THRESHOLD",),
            "conditional disaggregation: ... and below this fraction of uncached prompt tokens (0..1)",
            minimum=0.0, maximum=1.0),
)

# Env-only settings (no Dynamo flag).
_ENV_ONLY: tuple[_Option, ...] = (
    _Option("active_request_expiry_secs", (), ("DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS",),
            "forget requests in flight for longer than this", positive=True),
)


def add_router_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The KV router flags with their legacy aliases; defaults are resolved by `config_from_args`."""
    group = parser.add_argument_group("KV router options (--router-mode kv)")
    defaults = KvRouterConfig()
    for option in _OPTIONS:
        default = getattr(defaults, option.field)
        envs = " or ".join(option.envs)
        if option.kind is bool:
            # BooleanOptionalAction also adds --no-<flag> for each alias, e.g. the legacy --no-kv-events.
            group.add_argument(*option.flags, dest=option.dest, action=argparse.BooleanOptionalAction,
                               default=None, help=f"{option.help} [env {envs}, default {str(default).lower()}]")
        else:
            shown = "unset" if default is None else default
            group.add_argument(*option.flags, dest=option.dest, type=option.kind, default=None,
                               metavar=option.kind.__name__.upper(),
                               help=f"{option.help} [env {envs}, default {shown}]")
    return group


def config_from_args(args: argparse.Namespace) -> KvRouterConfig:
    """The router config from parsed `add_router_args` flags, env fallbacks and defaults, validated."""
    config = KvRouterConfig()
    for option in _OPTIONS + _ENV_ONLY:
        value = getattr(args, option.dest, None) if option.flags else None
        if value is None:
            value = _from_env(option)
        if value is None:
            continue
        _validate(option, value)
        setattr(config, option.field, value)
    return config


def _from_env(option: _Option) -> Any:
    for name in option.envs:
        raw = env_str(name)
        if raw is None:
            continue
        if option.kind is bool:
            return env_bool(name)
        try:
            return option.kind(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not a valid {option.kind.__name__} "
                             f"(for {option.describe()})") from None
    return None


def _validate(option: _Option, value: Any) -> None:
    if option.kind is bool:
        return
    if not math.isfinite(value):
        raise ValueError(f"{option.describe()} must be a finite number, got {value}")
    if option.positive and value <= 0:
        raise ValueError(f"{option.describe()} must be > 0, got {value}")
    if option.minimum is not None and value < option.minimum:
        raise ValueError(f"{option.describe()} must be >= {option.minimum:g}, got {value}")
    if option.maximum is not None and value > option.maximum:
        raise ValueError(f"{option.describe()} must be <= {option.maximum:g}, got {value}")


def parse_args_with_router_config(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse `argv` with a parser that has `add_router_args`, then set `args.router_config`; an
    invalid router setting exits 2 with a message naming its flag."""
    args = parser.parse_args(argv)
    try:
        args.router_config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    return args
