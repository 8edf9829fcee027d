"""Free TCP ports for a process to bind by number, never the same one twice in a test process."""

from __future__ import annotations

import contextlib
import random
import socket

# Ports a process is told to bind by number, later: below Linux's ephemeral range (32768 and up), so that
# no other process's bind to port 0 takes one in between.
NAMED_PORTS = (20000, 32000)


def free_port() -> int:
    """A free TCP port for a process to bind by number (also a registered port, as KV event ports must be)."""
    return free_port_range(1)


_handed_out: set[int] = set()  # ports given to a process of this session, which may not have bound them yet


def free_port_range(count: int, low: int = NAMED_PORTS[0], high: int = NAMED_PORTS[1]) -> int:
    """The first of `count` consecutive free TCP ports within [low, high), none handed out before."""
    for _ in range(100):
        base = random.randrange(low, high - count + 1)
        if _handed_out.intersection(range(base, base + count)):
            continue
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
            _handed_out.update(range(base, base + count))
            return base
    raise RuntimeError(f"no {count} free ports")
