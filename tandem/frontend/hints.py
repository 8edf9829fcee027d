"""The routing hints a request carries: Dynamo's `nvext` fields and the routing headers (which win), and the
agent session it belongs to; checked into `RoutingHints`, the routers' and the workers' view of them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy

from tandem.frontend.protocol.errors import fail
from tandem.frontend.requests import AnyRequest
from tandem.llm.protocols import RoutingHints

# Routing headers; the first name present wins, newer x-dynamo-* first.
WORKER_HEADERS = ("x-dynamo-worker-instance-id", "x-worker-instance-id")


PRIORITY_HEADER = "x-dynamo-request-priority"


_ROUTING_HEADERS: dict[str, tuple[str, ...]] = {
    "backend_instance_id": WORKER_HEADERS,
    "prefill_worker_id": ("x-dynamo-prefill-instance-id", "x-prefill-instance-id"),
    "dp_rank": ("x-dynamo-dp-rank", "x-dp-rank", "x-data-parallel-rank"),
    "prefill_dp_rank": ("x-dynamo-prefill-dp-rank", "x-prefill-dp-rank"),
    "priority": (PRIORITY_HEADER,),
}


_NVEXT_HINTS = ("backend_instance_id", "prefill_worker_id", "decode_worker_id", "cache_salt")


# An agent's session: Dynamo's header, then the ones Claude Code and Codex send with every turn.
SESSION_HEADERS = ("x-dynamo-session-id", "x-claude-code-session-id", "session-id")


MAX_SESSION_ID = 256


# vLLM's priority is any integer (lower first); Dynamo carries it as an i32. The rest are ids and ranks.
_HEADER_RANGES = {"priority": (-(2**31), 2**31)}


_ID_RANGE = (0, 2**64)


def _session_id(value: str | None, param: str) -> str | None:
    if value is not None and len(value) > MAX_SESSION_ID:  # a key, not a payload: the routers hash it
        raise fail(param, f"'{param}' must be at most {MAX_SESSION_ID} characters (got {len(value)}).")
    return value


def hint_param(name: str, headers: Mapping[str, str]) -> str:
    """What set routing hint `name`: the header the client sent, else its nvext field."""
    return next((key for key in _ROUTING_HEADERS.get(name, ()) if key in headers), f"nvext.{name}")


def routing_hints(req: AnyRequest | None, headers: Mapping[str, str] | None = None) -> RoutingHints | None:
    """Routing from nvext (a route without nvext gives no request), overridden by the routing headers;
    None when nothing was asked for. The whole request pinned to one worker (`backend_instance_id`) has no
    legs of its own to pin: given with `prefill_worker_id` or `decode_worker_id`, a 400 names the other."""
    hints: dict[str, Any] = {name: getattr(req.ext, name) for name in _NVEXT_HINTS} if req is not None else {}
    if req is not None and req.ext.agent_context is not None:
        hints["session_id"] = _session_id(req.ext.agent_context.session_id, "nvext.agent_context.session_id")
    # An HTTP request's headers match names in any case already; other mappings are lowered once.
    lower = headers if isinstance(headers, CIMultiDictProxy | CIMultiDict) else {
        k.lower(): v for k, v in (headers or {}).items()}
    if lower:
        key = next((k for k in SESSION_HEADERS if k in lower), None)
        if key is not None and lower[key]:
            hints["session_id"] = _session_id(lower[key], key)
        for name, keys in _ROUTING_HEADERS.items():
            for key in (k for k in keys if k in lower):
                try:
                    value = int(lower[key])
                except ValueError:
                    raise fail(key, f"header {key} must be an integer (got {lower[key]!r}).") from None
                low, high = _HEADER_RANGES.get(name, _ID_RANGE)
                if not low <= value < high:
                    raise fail(key, f"header {key} must be in [{low}, {high - 1}] (got {value}).")
                hints[name] = value
                break
    hints = {k: v for k, v in hints.items() if v is not None}
    if not hints:
        return None
    if "backend_instance_id" in hints:
        for leg in ("prefill_worker_id", "decode_worker_id"):
            if leg in hints:
                param = hint_param(leg, lower)
                raise fail(param, f"'{param}' names a worker for one leg of a request that "
                                  f"'{hint_param('backend_instance_id', lower)}' pins whole to one worker.")
    return RoutingHints(**hints)
