"""API-key checks shared by the frontend's API, the system status server and the planner's control API."""

from __future__ import annotations

import hmac
import ipaddress


def bearer_matches(authorization: str, key: str) -> bool:
    """`Authorization: Bearer KEY`, the scheme in any case, compared in constant time."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def key_matches(given: str | None, key: str) -> bool:
    """A key sent as it is (Anthropic's `x-api-key` header), compared in constant time."""
    return given is not None and hmac.compare_digest(given.strip().encode(), key.encode())


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name that may resolve anywhere


def refusal(authorization: str, key: str | None, host: str, allow_unauthenticated: bool) -> int | None:
    """The status a guarded route answers: 401 without the key when one is set; 403 when none is set and the
    server listens beyond loopback (unless opted out); None to serve it."""
    if key:
        return None if bearer_matches(authorization, key) else 401
    if not allow_unauthenticated and not is_loopback(host):
        return 403
    return None
