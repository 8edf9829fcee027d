"""Runtime configuration: Dynamo's flag and env names, CLI over env over defaults."""

from __future__ import annotations

import argparse
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

TRUE_VALUES = ("1", "true", "yes", "on")


def env_str(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def env_bool(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    return default if value in (None, "") else value.strip().lower() in TRUE_VALUES


def env_number(name: str, default: float, kind: type = float) -> float:
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a valid {kind.__name__}") from None


WILDCARDS = ("0.0.0.0", "::", "")


def _local_address_toward(host: str) -> str | None:
    """This machine's address on the route to `host`, unless it is loopback. Only connects a UDP socket:
    nothing is sent."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            address: str = s.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") or address in WILDCARDS else address


def detect_host(peers: Sequence[str] = ()) -> str:
    """An address of this machine that its peers can reach: the local end of the route to the first of
    `peers` (servers every process talks to) that is not on loopback; else of the default route; else
    this host's name resolved, if it can be bound; else loopback."""
    for peer in [*peers, "192.0.2.1"]:  # 192.0.2.1 (TEST-NET-1) stands for "the default route"
        address = _local_address_toward(peer)
        if address is not None:
            return address
    try:
        ip = socket.gethostbyname(socket.gethostname())
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
        return ip
    except OSError:
        return "127.0.0.1"


@dataclass
class RuntimeConfig:
    namespace: str = "dynamo"
    discovery_backend: str = "file"
    request_plane: str = "tcp"
    event_plane: str = "zmq"
    file_kv_root: str | None = None  # DYN_FILE_KV; None = $TMPDIR/dynamo_store_kv
    discovery_ttl: float = 10.0
    # Request plane (TCP)
    # The address peers use to reach this process's listeners (request plane, event plane, NIXL side channel);
    # None = DYN_TCP_RPC_HOST when it names one address, else detected (`detect_host`).
    advertise_host: str | None = None
    tcp_host: str | None = None  # where the request plane listens; None = the advertised address
    tcp_port: int = 0
    tcp_max_message_size: int = 32 * 1024 * 1024
    tcp_request_timeout: float = 10.0
    tcp_connect_timeout: float = 3.0
    tcp_peer_timeout: float = 10.0  # a peer silent this long (cut link, frozen host) closes the connection
    # NATS (request and event planes); auth options as Dynamo reads them
    nats_server: str = "nats://localhost:4222"
    nats_user: str | None = None
    nats_password: str | None = None
    nats_token: str | None = None
    nats_nkey: str | None = None  # an NKEY seed file
    nats_credentials_file: str | None = None
    nats_request_timeout: float = 10.0
    nats_connect_timeout: float = 3.0
    # Event plane
    event_host: str | None = None  # None = same as tcp_host
    # System status server
    system_host: str = "0.0.0.0"
    system_port: int | None = None
    # Key for the system server's routes other than health, liveness and metrics (required on a non-loopback bind).
    system_api_key: str | None = None
    system_allow_unauthenticated: bool = False  # the old behaviour: those routes open on any bind
    system_starting_health_status: str = "notready"
    system_health_path: str = "/health"
    system_live_path: str = "/live"
    system_use_endpoint_health_status: list[str] = field(default_factory=list)
    health_check_enabled: bool = False
    canary_wait_time: float = 10.0
    health_check_request_timeout: float = 3.0
    # Shutdown
    graceful_shutdown_grace_period: float = 5.0
    graceful_shutdown_timeout: float = 900.0

    @classmethod
    def from_env(cls) -> RuntimeConfig:
        """Defaults overridden by DYN_* environment variables."""
        import json

        from tandem.runtime.options import RUNTIME_OPTIONS, apply_options  # options.py builds on this module

        system_port = env_str("DYN_SYSTEM_PORT")
        endpoints_json = env_str("DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS")
        try:
            use_endpoints = json.loads(endpoints_json) if endpoints_json else []
        except json.JSONDecodeError:
            raise ValueError(
                f"DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS must be a JSON list of endpoint names, got {endpoints_json!r}"
            ) from None
        grace = env_number("DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS", 5.0)
        config = cls(
            file_kv_root=env_str("DYN_FILE_KV"),
            discovery_ttl=env_number("DYN_DISCOVERY_TTL_SECS", env_number("ETCD_LEASE_TTL", 10.0)),
            tcp_host=env_str("DYN_TCP_RPC_HOST"),
            tcp_port=int(env_number("DYN_TCP_RPC_PORT", 0, int)),
            tcp_max_message_size=int(env_number("DYN_TCP_MAX_MESSAGE_SIZE", 32 * 1024 * 1024, int)),
            tcp_request_timeout=env_number("DYN_TCP_REQUEST_TIMEOUT", 10.0),
            tcp_connect_timeout=env_number("DYN_TCP_CONNECT_TIMEOUT", 3.0),
            tcp_peer_timeout=env_number("DYN_TCP_PEER_TIMEOUT_SECS", 10.0),
            nats_server=env_str("NATS_SERVER", "nats://localhost:4222"),  # type: ignore[arg-type]
            nats_user=env_str("NATS_AUTH_USERNAME"),
            nats_password=env_str("NATS_AUTH_PASSWORD"),
            nats_token=env_str("NATS_AUTH_TOKEN"),
            nats_nkey=env_str("NATS_AUTH_NKEY"),
            nats_credentials_file=env_str("NATS_AUTH_CREDENTIALS_FILE"),
            nats_request_timeout=env_number("DYN_NATS_REQUEST_TIMEOUT_SECS", 10.0),
            nats_connect_timeout=env_number("DYN_NATS_CONNECT_TIMEOUT_SECS", 3.0),
            event_host=env_str("DYN_EVENT_PLANE_HOST"),
            system_host=env_str("DYN_SYSTEM_HOST", "0.0.0.0"),  # type: ignore[arg-type]
            system_port=_port("DYN_SYSTEM_PORT", system_port) if system_port else None,
            system_api_key=env_str("DYN_SYSTEM_API_KEY") or env_str("DYN_API_KEY"),
            system_allow_unauthenticated=env_bool("DYN_SYSTEM_ALLOW_UNAUTHENTICATED"),
            system_starting_health_status=(env_str("DYN_SYSTEM_STARTING_HEALTH_STATUS") or "notready").lower(),
            system_health_path=env_str("DYN_SYSTEM_HEALTH_PATH", "/health"),  # type: ignore[arg-type]
            system_live_path=env_str("DYN_SYSTEM_LIVE_PATH", "/live"),  # type: ignore[arg-type]
            system_use_endpoint_health_status=list(use_endpoints),
            health_check_enabled=env_bool("DYN_HEALTH_CHECK_ENABLED"),
            canary_wait_time=env_number("DYN_CANARY_WAIT_TIME", 10.0),
            health_check_request_timeout=env_number("DYN_HEALTH_CHECK_REQUEST_TIMEOUT", 3.0),
            graceful_shutdown_grace_period=max(grace, 0.0),
            graceful_shutdown_timeout=env_number("DYN_RUNTIME_GRACEFUL_SHUTDOWN_TIMEOUT_SECS", 900.0),
        )
        apply_options(config, RUNTIME_OPTIONS, None)
        return config

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RuntimeConfig:
        """Env-derived config with the runtime flags of `add_runtime_args` applied on top."""
        from tandem.runtime.options import RUNTIME_OPTIONS, apply_options

        config: RuntimeConfig = apply_options(cls.from_env(), RUNTIME_OPTIONS, args)
        config.validate()
        return config

    def peer_hosts(self) -> list[str]:
        """The servers every process of the deployment talks to (etcd, NATS): the way to them is the way
        peers come in."""
        urls: list[str] = []
        if self.discovery_backend == "etcd":
            urls += (env_str("ETCD_ENDPOINTS") or "").split(",")
        if "nats" in (self.request_plane, self.event_plane):
            urls += self.nats_server.split(",")
        hosts = [urlsplit(url.strip() if "://" in url else f"//{url.strip()}").hostname for url in urls]
        return [host for host in hosts if host]

    def advertised_host(self) -> str:
        """What this process tells its peers to connect to: never a wildcard."""
        if self.advertise_host:
            return self.advertise_host
        if self.tcp_host not in (None, *WILDCARDS):
            return self.tcp_host  # type: ignore[return-value]
        return detect_host(self.peer_hosts())

    def replace(self, **changes: object) -> RuntimeConfig:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return RuntimeConfig(**values)  # type: ignore[arg-type]

    def validate(self) -> None:
        from tandem.runtime.discovery import BACKENDS
        from tandem.runtime.options import RUNTIME_OPTIONS

        rows = {option.field: option for option in RUNTIME_OPTIONS}
        for name, built in (("discovery_backend", BACKENDS), ("request_plane", ("tcp", "nats")),
                            ("event_plane", ("zmq", "nats"))):
            value, row, setting = getattr(self, name), rows[name], name.replace("_", " ")
            flag, env = row.flags[0], row.envs[0]
            if value in (row.choices or ()) and value not in built:  # understood (kubernetes), not built
                raise ConfigError(f"{flag} {value} ({env}): the {value} {setting} is not built yet in tandem; "
                                  f"use {' or '.join(built)}")
            if value not in built:
                raise ConfigError(f"unknown {setting} {value!r} ({flag}, {env}); choose {' or '.join(built)}")
        if self.system_starting_health_status not in ("ready", "notready"):
            raise ValueError("DYN_SYSTEM_STARTING_HEALTH_STATUS must be 'ready' or 'notready'")
        if self.tcp_max_message_size < 1024:
            raise ValueError("DYN_TCP_MAX_MESSAGE_SIZE must be at least 1024 bytes")


class ConfigError(ValueError):
    """A setting the user gave (flag or environment variable) that cannot be used: the command prints the
    message and exits 2, with no traceback."""


def _port(name: str, value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{name}={port} is outside 0-65535")
    return port
