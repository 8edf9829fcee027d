"""Environment variables read by the vLLM worker itself, resolved lazily (each access reads os.environ).

    from tandem.vllm import envs
    envs.DYN_VLLM_KV_EVENT_PORT   # int, validated; ValueError when malformed
    envs.is_set("DYN_VLLM_KV_EVENT_PORT")
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

DEFAULT_KV_EVENT_PORT = 20080


def _resolve_port(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        port = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} must be an integer port number") from None
    if not 1024 <= port <= 49151:
        raise ValueError(f"{name}={port} is outside of the registered port range 1024-49151")
    return port


_VARIABLES: dict[str, Callable[[], Any]] = {
    # Base port of the ZMQ socket the engine publishes KV events on (the default kv_events_config).
    "DYN_VLLM_KV_EVENT_PORT": lambda: _resolve_port("DYN_VLLM_KV_EVENT_PORT", DEFAULT_KV_EVENT_PORT),
}


def __getattr__(name: str) -> Any:
    if name in _VARIABLES:
        return _VARIABLES[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_VARIABLES])


def is_set(name: str) -> bool:
    """Whether `name` (one of this module's variables) is explicitly set in the environment."""
    if name not in _VARIABLES:
        raise ValueError(f"unknown tandem vLLM environment variable {name!r}")
    return bool(os.environ.get(name, "").strip())
