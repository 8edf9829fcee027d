"""One way to declare a setting that has a flag and an environment variable: an `Option` row.

A row names the config field, its flags (the first canonical, the rest aliases), its env vars (the first
canonical), its kind (float, int, bool or str) and bounds. The flag wins over the env var, the env var
over the default; a value out of bounds is a ConfigError (a ValueError) that names where the value came from
(the flag or the env var). Flags are added with `default=None`, so "not given" and "given the default value"
differ. The default belongs to the use, not to the row: `add_options` shows, and the caller applies, the
defaults of the component adding the row (a worker kind with its own block size shares the row).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from tandem.runtime.config import ConfigError, RuntimeConfig, env_bool, env_str


@dataclass(frozen=True)
class Option:
    field: str
    flags: tuple[str, ...]
    envs: tuple[str, ...]
    help: str
    kind: type = float  # float, int, bool or str
    minimum: float | None = None  # inclusive lower bound
    maximum: float | None = None  # inclusive upper bound
    positive: bool = False  # strictly > 0
    choices: tuple[str, ...] | None = None
    casefold: bool = False  # choices in any case: the flag's or env var's value is lowercased
    metavar: str | None = None  # shown in --help; default: the flag's last word (str) or the kind

    @property
    def dest(self) -> str:
        return self.flags[0].lstrip("-").replace("-", "_") if self.flags else self.field

    def add_to(self, group: argparse._ActionsContainer, default: Any) -> None:
        """Add the flags to `group`; the help shows the env vars and `default`."""
        envs = " or ".join(self.envs)
        shown = "unset" if default is None else (str(default).lower() if self.kind is bool else default)
        where = f"env {envs}, default {shown}" if envs else f"default {shown}"
        if self.kind is bool:
            # BooleanOptionalAction also adds --no-<flag> for each alias, e.g. the legacy --no-kv-events.
            group.add_argument(*self.flags, dest=self.dest, action=argparse.BooleanOptionalAction, default=None,
                               help=f"{self.help} [{where}]")
        elif self.choices:
            group.add_argument(*self.flags, dest=self.dest, choices=self.choices, default=None,
                               type=str.lower if self.casefold else str,
                               help=f"{self.help}: {', '.join(self.choices)} [{where}]")
        else:
            metavar = self.metavar or (self.flags[0].rsplit("-", 1)[-1].upper() if self.kind is str
                                       else self.kind.__name__.upper())
            group.add_argument(*self.flags, dest=self.dest, type=self.kind, default=None, metavar=metavar,
                               help=f"{self.help} [{where}]")

    def value(self, args: argparse.Namespace | None, default: Any = None) -> Any:
        """The flag's value in `args`, else the first env var set, else `default`; validated."""
        value = getattr(args, self.dest, None) if args is not None and self.flags else None
        source = self.flags[0] if self.flags else ""
        if value is None:
            value, source = self._from_env()
        if value is None:
            return default
        self._validate(value, source)
        return self.kind(value) if self.choices else value  # one of the choices: as the kind (an enum)

    def _from_env(self) -> tuple[Any, str]:
        for name in self.envs:
            raw = env_str(name)
            if raw is None:
                continue
            if self.choices:
                return (raw.lower() if self.casefold else raw), name  # checked against the choices by _validate
            if self.kind is bool:
                return env_bool(name), name
            try:
                return self.kind(raw), name
            except ValueError:
                where = f" (for {self.flags[0]})" if self.flags else ""
                raise ConfigError(f"{name}={raw!r} is not a valid {self.kind.__name__}{where}") from None
        return None, ""

    def _validate(self, value: Any, source: str) -> None:
        if self.choices and value not in self.choices:
            raise ConfigError(f"{source} must be one of {', '.join(self.choices)}, got {value!r}")
        if self.kind not in (int, float):
            return
        if not math.isfinite(value):
            raise ConfigError(f"{source} must be a finite number, got {value}")
        if self.positive and value <= 0:
            raise ConfigError(f"{source} must be > 0, got {value}")
        if self.minimum is not None and value < self.minimum:
            raise ConfigError(f"{source} must be >= {self.minimum:g}, got {value}")
        if self.maximum is not None and value > self.maximum:
            raise ConfigError(f"{source} must be <= {self.maximum:g}, got {value}")


def add_options(group: argparse._ActionsContainer, options: Iterable[Option], defaults: Any) -> None:
    """Add each option's flags; `defaults` (an object with the fields) supplies the defaults shown."""
    for option in options:
        if option.flags:
            option.add_to(group, getattr(defaults, option.field))


def apply_options(target: Any, options: Iterable[Option], args: argparse.Namespace | None) -> Any:
    """Set each field of `target` given by a flag in `args` or an env var; returns `target`."""
    for option in options:
        value = option.value(args)
        if value is not None:
            setattr(target, option.field, value)
    return target


# The runtime's flags: every component takes them (`RuntimeConfig.from_env` reads their env vars).
RUNTIME_OPTIONS = (
    Option("namespace", ("--namespace",), ("DYN_NAMESPACE",), "namespace to serve in", kind=str),
    Option("discovery_backend", ("--discovery-backend", "--store-kv"), ("DYN_DISCOVERY_BACKEND", "DYN_STORE_KV"),
           "how processes find each other (file root: DYN_FILE_KV)", kind=str, casefold=True,
           choices=("file", "mem", "etcd", "kubernetes")),  # kubernetes: refused by RuntimeConfig.validate
    Option("request_plane", ("--request-plane",), ("DYN_REQUEST_PLANE",),
           "transport for requests to workers (nats: NATS_SERVER)", kind=str, casefold=True, choices=("tcp", "nats")),
    Option("event_plane", ("--event-plane",), ("DYN_EVENT_PLANE",),
           "transport for KV events and metrics (nats: NATS_SERVER)", kind=str, casefold=True,
           choices=("zmq", "nats")),
    Option("advertise_host", ("--advertise-host",), ("DYN_ADVERTISE_HOST",),
           "the address other hosts reach this process at (unset: DYN_TCP_RPC_HOST, else this host's address on "
           "the route to etcd or NATS)", kind=str, metavar="ADDRESS"),
)


def add_runtime_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The runtime flags every tandem component accepts, for `RuntimeConfig.from_args`."""
    group = parser.add_argument_group("Runtime options")
    add_options(group, RUNTIME_OPTIONS, RuntimeConfig)
    return group


# Settings more than one component reads (the frontend and the workers, or `tandem run` and the frontend).
class RouterMode(StrEnum):
    """How the frontend picks a worker (`--router-mode`)."""

    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    POWER_OF_TWO = "power-of-two"  # of two random workers, the one with fewer requests in flight
    LEAST_LOADED = "least-loaded"  # fewest requests in flight from this frontend
    DIRECT = "direct"  # the request names its worker
    KV = "kv"  # the KV-aware router (token requests)


ROUTER_MODES = tuple(mode.value for mode in RouterMode)
MIGRATION_LIMIT = Option(
    "migration_limit", ("--migration-limit",), ("DYN_MIGRATION_LIMIT",),
    "times a request may move to another worker when its worker fails mid-stream", kind=int, minimum=0)
ALLOW_PRIVATE_MEDIA_URLS = Option(
    "allow_private_media_urls", ("--allow-private-media-urls",), ("TANDEM_ALLOW_PRIVATE_MEDIA_URLS",),
    "fetch image URLs whose host is a private, loopback or link-local address (refused by default: a client "
    "could otherwise make the server reach internal services)", kind=bool)
