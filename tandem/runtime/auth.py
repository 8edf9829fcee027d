"""Bearer-key checks shared by the frontend's API and the system status server."""

from __future__ import annotations

import hmac
import ipaddress


def bearer_matches(authorization: str, key: str) -> bool:
    """`Authorization: Bearer KEY`, the scheme in any case, compared in constant time."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name that may resolve anywhere
