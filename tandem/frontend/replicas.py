"""`tandem frontend --num-processes N`: one port served by N frontend processes.

Each replica is a whole frontend (its own runtime, model discovery and KV router) that listens on the same
port with SO_REUSEPORT, so the kernel spreads new connections over them. Their KV routers see the same KV
events and share their load through replica sync (on by default here). This process only starts the
replicas, prints READY once they all are, starts a replica again when one dies (that replica's own streams
are lost; the others are untouched), and passes SIGTERM/SIGINT on for a graceful stop.

A scrape of the shared port reaches one replica, so each replica also serves its own /metrics on a system port
of its own (DYN_SYSTEM_PORT + its index, or any free port when none is set), which it registers in discovery
for the planner.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence

log = logging.getLogger("tandem.frontend")

REPLICA_ENV = "TANDEM_FRONTEND_REPLICA"  # set in a replica: "index/count"; it then listens with SO_REUSEPORT
RESTART_DELAY = (1.0, 30.0)  # seconds before starting a dead replica again: first, and at most (doubling)


def replica_argv(argv: Sequence[str], port: int, replica_sync: bool) -> list[str]:
    """A replica's command line: the frontend's own flags, minus --num-processes, on `port`."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in ("--num-processes", "--http-port"):
            skip = "=" not in arg
            continue
        out.append(arg)
    out += ["--http-port", str(port)]
    if replica_sync and "--router-replica-sync" not in out:
        out.append("--router-replica-sync")
    return out


def system_port(base: str | None, index: int) -> str:
    """Replica `index`'s own system port: the given one plus its index (one port each), or any free one."""
    try:
        port = int(base or 0)
    except ValueError:
        return base or ""  # the replica refuses it, naming DYN_SYSTEM_PORT
    return str(port + index) if port else "0"


def _reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound (not listening) to `port` (0: a free one) with SO_REUSEPORT, so the replicas can bind it
    too and no other program takes it meanwhile."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


class Replica:
    def __init__(self, index: int, count: int, argv: list[str], host: str) -> None:
        self.index = index
        self.count = count
        self.argv = argv
        self.host = host
        self.process: asyncio.subprocess.Process | None = None
        self.ready = asyncio.Event()
        self.url = ""

    async def start(self) -> None:
        self.ready.clear()
        env = {**os.environ, REPLICA_ENV: f"{self.index}/{self.count}", "DYN_FRONTEND_NUM_PROCESSES": "1",
               "DYN_SYSTEM_PORT": system_port(os.environ.get("DYN_SYSTEM_PORT"), self.index),
               "DYN_SYSTEM_HOST": os.environ.get("DYN_SYSTEM_HOST") or self.host}
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tandem.frontend", *self.argv, env=env, stdout=asyncio.subprocess.PIPE)
        asyncio.get_running_loop().create_task(self._read(self.process))

    async def _read(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        async for raw in process.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            if line.startswith("READY") and not self.ready.is_set():
                self.url = line.split()[1]
                self.ready.set()
            else:
                print(line, flush=True)


async def supervise(argv: Sequence[str], host: str, port: int, count: int, replica_sync: bool) -> int:
    reserved = _reserve_port(host, port)
    port = reserved.getsockname()[1]
    replicas = [Replica(i, count, replica_argv(argv, port, replica_sync), host) for i in range(count)]
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda sig=sig: _stop(replicas, sig, stopping))
    for replica in replicas:
        await replica.start()
    waits = [asyncio.ensure_future(replica.ready.wait()) for replica in replicas]
    exits = [asyncio.ensure_future(replica.process.wait()) for replica in replicas]  # type: ignore[union-attr]
    done, _ = await asyncio.wait({*exits, asyncio.ensure_future(asyncio.gather(*waits))},
                                 return_when=asyncio.FIRST_COMPLETED)
    reserved.close()  # the replicas hold the port now (or one failed to start)
    failed = [replica for replica, exit_ in zip(replicas, exits, strict=True) if exit_ in done]
    if failed:
        interrupted = stopping.is_set()  # a signal during start-up, already passed on to every replica
        if not interrupted:
            log.error("frontend replica %d exited before it was ready", failed[0].index)
            _stop(replicas, signal.SIGTERM, stopping)
        await asyncio.gather(*(replica.process.wait() for replica in replicas))  # type: ignore[union-attr]
        return 0 if interrupted else 1
    print(f"READY {replicas[0].url}", flush=True)
    log.info("serving %s from %d frontend processes", replicas[0].url, count)
    await asyncio.gather(*(_keep(replica, stopping) for replica in replicas))
    return 0


async def _keep(replica: Replica, stopping: asyncio.Event) -> None:
    """Start the replica again whenever it dies, until the stop."""
    delay = RESTART_DELAY[0]
    while True:
        assert replica.process is not None
        code = await replica.process.wait()
        if stopping.is_set():
            return
        log.warning("frontend replica %d (pid %d) exited with %d: starting it again in %g s (its streams were lost; "
                    "the other replicas serve on)", replica.index, replica.process.pid, code, delay)
        await asyncio.sleep(delay)
        if stopping.is_set():
            return
        await replica.start()
        delay = min(delay * 2, RESTART_DELAY[1])


def _stop(replicas: list[Replica], sig: signal.Signals, stopping: asyncio.Event) -> None:
    """First signal: each replica drains and stops. A second one: each exits at once."""
    if stopping.is_set():
        sig = signal.SIGKILL  # type: ignore[assignment]
    stopping.set()
    for replica in replicas:
        if replica.process is not None and replica.process.returncode is None:
            replica.process.send_signal(sig)
