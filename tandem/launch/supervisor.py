"""Child processes of `tandem run`: start, relay their output with a label, restart, stop.

Each child runs in its own session, so a Ctrl-C at the terminal reaches only the launcher, and the child's
process group holds whatever it starts itself (vLLM's engine core), which is killed with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TextIO

from tandem.launch.cores import format_cores
from tandem.launch.plan import Plan, ProcessSpec, worker_label
from tandem.runtime import keys
from tandem.runtime.discovery import EtcdStore, FileStore, KeyValueStore
from tandem.runtime.discovery.etcd import EtcdConfig

RESTART_BACKOFF = (1.0, 30.0)  # first and longest wait before restarting a dead worker, seconds
RESTART_RESET_AFTER = 60.0  # a worker up this long counts as healthy: the next restart waits the shortest time
LOG_TAIL_LINES = 40
_READ_LIMIT = 1 << 20  # longest line kept whole
_PR_SET_PDEATHSIG = 1
_COLORS = (36, 33, 32, 35, 34, 31, 96, 93, 92, 95, 94)


class LogMux:
    """Writes lines from many processes to one stream, each prefixed with its label padded to a common width
    (coloured on a terminal)."""

    def __init__(self, out: TextIO | None = None, *, color: bool | None = None) -> None:
        self.out = out if out is not None else sys.stdout
        if color is None:
            color = self.out.isatty() and not os.environ.get("NO_COLOR")
        self.color = color
        self.width = 0
        self._colors: dict[str, int] = {}

    def add_label(self, label: str) -> None:
        self.width = max(self.width, len(label))
        self._colors.setdefault(label, _COLORS[len(self._colors) % len(_COLORS)])

    def format(self, label: str, text: str) -> str:
        self.add_label(label)
        prefix = f"{label:<{self.width}} |"
        if self.color:
            prefix = f"\x1b[{self._colors[label]}m{prefix}\x1b[0m"
        return f"{prefix} {text}" if text else prefix

    def line(self, label: str, text: str) -> None:
        self.out.write(self.format(label, text) + "\n")
        self.out.flush()

    def plain(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()


def _libc_prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


_prctl = _libc_prctl()  # looked up here: the forked child should not load libraries


def _child_setup(cores: tuple[int, ...] | None) -> Callable[[], None]:
    """Runs in the forked child before exec."""

    def setup() -> None:
        if _prctl is not None:
            # If the launcher is killed outright, the child goes too, at once: with SIGTERM a worker would drain
            # for its grace period with nobody left to stop it. Its engine processes follow it
            # (tandem.vllm.lifeline). The signal comes when the forking thread exits: here the event loop's,
            # which lives as long as the launcher.
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if cores:
            os.sched_setaffinity(0, cores)

    return setup


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


async def _lines(stream: asyncio.StreamReader) -> AsyncIterator[str]:
    while True:
        try:
            raw = await stream.readline()
        except ValueError:  # longer than _READ_LIMIT: asyncio dropped it
            yield "[a line too long to show]"
            continue
        if not raw:
            return
        yield raw.decode(errors="replace").rstrip("\r\n")


class Child:
    """One supervised process. `ready` holds the words after `READY` on its stdout once it printed that line,
    and is None again when it exits. With `restart`, it is started again after it dies, until `stop`."""

    def __init__(self, spec: ProcessSpec, mux: LogMux, *, restart: bool = False,
                 on_exit: Callable[[Child, list[str] | None], Awaitable[None]] | None = None) -> None:
        self.spec = spec
        self.mux = mux
        self.restart = restart
        self.on_exit = on_exit
        self.proc: asyncio.subprocess.Process | None = None
        self.ready: list[str] | None = None
        self.started_at: float | None = None  # time.monotonic() of its latest start
        self.ready_at: float | None = None  # ... and of the READY line that followed
        self.returncode: int | None = None
        self.tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self.done = asyncio.Event()  # set when it exited and will not be restarted
        self.stopping = False
        self._wake = asyncio.Event()  # cuts a restart backoff short when stopping
        self._task: asyncio.Task[None] | None = None
        mux.add_label(spec.label)

    @property
    def label(self) -> str:
        return self.spec.label

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"tandem-run-{self.label}")

    async def _supervise(self) -> None:
        backoff = RESTART_BACKOFF[0]
        try:
            while not self.stopping:
                started = time.monotonic()
                self.returncode = await self._run_once()
                if self.stopping or not self.restart:
                    break
                if time.monotonic() - started >= RESTART_RESET_AFTER:
                    backoff = RESTART_BACKOFF[0]
                self.mux.line(self.label, f"restarting in {backoff:g} s")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(backoff):
                        await self._wake.wait()
                backoff = min(backoff * 2, RESTART_BACKOFF[1])
        finally:
            self.done.set()

    async def _run_once(self) -> int:
        spec = self.spec
        where = f" on cores {format_cores(spec.cores)}" if spec.cores else ""
        self.mux.line(self.label, f"starting{where}: {shlex.join(['python', *spec.argv[1:]])}")
        try:
            proc = await asyncio.create_subprocess_exec(
                *spec.argv, env=dict(spec.env), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True, preexec_fn=_child_setup(spec.cores),
                limit=_READ_LIMIT,
            )
        except (OSError, subprocess.SubprocessError) as e:
            self.mux.line(self.label, f"cannot start: {e}")
            return 127
        self.proc = proc
        self.started_at, self.ready_at = time.monotonic(), None
        relay = asyncio.create_task(self._relay(proc))
        try:
            code = await proc.wait()
        finally:
            # Whatever it left in its group (an engine core) goes with it; that also closes the pipe.
            _killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await relay
            ready, self.ready, self.proc = self.ready, None, None
        self.mux.line(self.label, describe_exit(code))
        if self.on_exit is not None:
            await self.on_exit(self, ready)
        return code

    async def _relay(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        async for line in _lines(proc.stdout):
            if line.startswith("READY ") and self.ready is None:
                self.ready = line.split()[1:]
                self.ready_at = time.monotonic()
            self.tail.append(line)
            self.mux.line(self.label, line)

    def send(self, sig: int) -> None:
        """SIGTERM goes to the child alone (it stops its own children in order); SIGKILL to its whole group."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        if sig == signal.SIGKILL:
            _killpg(proc.pid, sig)
        else:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)

    async def stop(self, grace: float) -> None:
        """SIGTERM, then SIGKILL to the group if it is still running after `grace` seconds."""
        self.stopping = True
        self._wake.set()
        if self._task is None:  # never started
            self.done.set()
        self.send(signal.SIGTERM)
        try:
            async with asyncio.timeout(grace):
                await self.done.wait()
        except TimeoutError:
            self.mux.line(self.label, f"still running after {grace:g} s: killing it")
            self.send(signal.SIGKILL)
            await self.done.wait()

    def kill(self) -> None:
        """SIGKILL at once, without waiting (second Ctrl-C, or the launcher failing)."""
        self.stopping = True
        self._wake.set()
        self.send(signal.SIGKILL)


class Supervisor:
    """The frontend and the worker groups of one run. Worker groups can grow and shrink while it runs (`scale`),
    which is how a planner adds and removes workers."""

    def __init__(self, plan: Plan, mux: LogMux) -> None:
        self.plan = plan
        self.mux = mux
        self.frontend = None if plan.spec.no_frontend else Child(plan.frontend(), mux)
        self.groups = {group.role: group for group in plan.spec.workers}
        self.workers: dict[str, list[Child]] = {role: [] for role in self.groups}
        self._slots: dict[Child, int] = {}
        for group in self.groups.values():  # the padding fits every label from the first line on
            for index in range(group.count):
                mux.add_label(worker_label(group.role, index))

    @property
    def children(self) -> list[Child]:
        workers = [child for role in self.workers for child in self.workers[role]]
        return workers if self.frontend is None else [self.frontend, *workers]

    def start(self) -> None:
        if self.frontend is not None:
            self.frontend.start()
        for role, group in self.groups.items():
            self._grow(role, group.count)

    def _grow(self, role: str, count: int) -> None:
        group, children = self.groups[role], self.workers[role]
        while len(children) < count:
            taken = set(self._slots.values())
            slot = next(n for n in range(len(taken) + 1) if n not in taken)
            child = Child(self.plan.worker(group, len(children), slot), self.mux, restart=self.plan.spec.restart,
                          on_exit=self._forget_instance)
            self._slots[child] = slot
            children.append(child)
            child.start()

    async def scale(self, role: str, count: int) -> None:
        """Run `count` workers of `role`: start new ones, or stop the newest ones. The worker list changes at
        once, so a call made while another is still stopping workers starts from what that one left."""
        if role not in self.groups or count < 0:
            raise ValueError(f"cannot scale {role!r} workers to {count}: roles here are {', '.join(self.groups)}")
        self._grow(role, count)
        children = self.workers[role]
        surplus, self.workers[role] = children[count:], children[:count]
        await asyncio.gather(*(child.stop(self.plan.spec.stop_timeout) for child in surplus))
        for child in surplus:
            del self._slots[child]

    def startup_seconds(self) -> float | None:
        """The longest start-to-READY time of the workers running now (None before any is ready)."""
        times = [child.ready_at - child.started_at for children in self.workers.values() for child in children
                 if child.ready_at is not None and child.started_at is not None]
        return max(times) if times else None

    def expected_instances(self) -> set[int]:
        """Instance ids the frontend should know: every ready worker (prefill workers included, so that the
        first requests are already disaggregated) but the encoders, which serve the workers, not a model."""
        return {int(child.ready[0], 16) for role, children in self.workers.items() if role != "encode"
                for child in children if child.ready}

    async def _forget_instance(self, child: Child, ready: list[str] | None) -> None:
        """The process is gone, so its discovery entries are stale: remove them now rather than letting the
        frontend route to it until their lease runs out."""
        if ready:
            with contextlib.suppress(OSError):  # at worst the entries expire with their lease
                await forget_instance(self.plan.common_env, self.plan.spec.namespace, ready[0])

    async def stop(self, grace: float) -> None:
        """The frontend first: it stops taking requests and finishes its streams (within `grace`), and only
        then do the workers that serve those streams stop."""
        if self.frontend is not None:
            await self.frontend.stop(grace)
        await asyncio.gather(*(child.stop(grace) for child in self.children if child is not self.frontend))

    def kill(self) -> None:
        for child in self.children:
            child.kill()


async def forget_instance(env: dict[str, str], namespace: str, instance_hex: str) -> None:
    """Delete the instance and model-card keys of one instance (keys: `v1/<bucket>/ns/component/endpoint/<id>...`)
    from the deployment's discovery (`env`: its DYN_DISCOVERY_BACKEND, DYN_FILE_KV / ETCD_ENDPOINTS)."""
    if env.get("DYN_DISCOVERY_BACKEND") == "etcd":
        store: KeyValueStore = EtcdStore(EtcdConfig.from_env(env))
    else:
        store = FileStore(env["DYN_FILE_KV"])
    await store.start()
    try:
        for bucket in (keys.INSTANCES, keys.MODELS):
            for key in await store.get_prefix(f"{bucket}/{namespace}/"):
                parts = key.split("/")
                if len(parts) > 5 and parts[5] == instance_hex:
                    await store.delete(key)
    finally:
        await store.close()
