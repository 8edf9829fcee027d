"""Engine processes die with the worker that started them, whatever kills the worker.

vLLM's engine processes (`VLLM::EngineCore`, and `VLLM::Worker` under the `mp` executor) do not watch their
parent: when a tandem worker's main process is killed outright (SIGKILL, the OOM killer, a second SIGTERM
during its drain) they live on, re-parented to init, holding the model and the KV cache (device memory on a
GPU, where the next start then fails).

This module is a vLLM general plugin (entry point `tandem_lifeline` in `vllm.general_plugins`): vLLM calls
`register()` early in every process it starts, before any model is loaded (`EngineCore.__init__`,
`WorkerWrapperBase.init_worker`). It acts only in a process that the tandem worker started itself, which
`mark_owner()` names in `TANDEM_ENGINE_OWNER_PID`: there it exits at once if the worker is already gone,
else a thread waits on a pidfd of the worker (or polls it, in a worker that will be CRIU-checkpointed: CRIU
cannot dump a pidfd) and SIGKILLs this process and its children when the worker exits.
Each engine process then names itself as the owner of the processes it starts, so the chain holds
(worker -> EngineCore -> VLLM::Worker).

Why not `PR_SET_PDEATHSIG`: it fires when the *thread* that started the child exits, and the worker creates
its engine from a thread-pool thread. A pidfd becomes readable only when the whole process has exited.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import select
import signal
import threading
import time
from collections.abc import Callable

from tandem.vllm.checkpoint_restore import READY_FILE_ENV

OWNER_ENV = "TANDEM_ENGINE_OWNER_PID"
PLUGIN_NAME = "tandem_lifeline"
POLL_INTERVAL = 0.5  # seconds between checks of the parent when there is no pidfd to wait on


def mark_owner() -> None:
    """Called by the tandem worker before it creates its engine: the engine's processes will die with this
    process. A `VLLM_PLUGINS` allowlist gets the plugin added, or it would not load."""
    os.environ[OWNER_ENV] = str(os.getpid())
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in allowed.split(","):
        os.environ["VLLM_PLUGINS"] = f"{allowed},{PLUGIN_NAME}" if allowed else PLUGIN_NAME


def register() -> None:
    """The plugin's entry point; does nothing outside processes started by a marked owner."""
    owner = os.environ.get(OWNER_ENV, "")
    parent = multiprocessing.parent_process()  # the process that started this one, even if it is gone now
    # Only a direct child of the owner: the variable is inherited by everything below the worker, and a
    # stale value must not tie an unrelated process to some other one.
    if not owner.isdigit() or parent is None or parent.pid != int(owner):
        return
    os.environ[OWNER_ENV] = str(os.getpid())  # this process owns the engine processes it starts
    # CRIU cannot checkpoint a process holding a pidfd: a worker that will be checkpointed polls instead.
    watch_parent(int(owner), _die, pidfd=not os.environ.get(READY_FILE_ENV))


def watch_parent(pid: int, on_exit: Callable[[], None], *, pidfd: bool = True) -> None:
    """Call `on_exit()` when process `pid`, this process's parent, has exited: at once if it already has,
    else from a daemon thread, which waits on a pidfd (`pidfd`, where there are any) or polls."""
    fd = None
    if pidfd:
        with contextlib.suppress(OSError):  # gone already, or no pidfd here (kernel < 5.3, seccomp)
            fd = os.pidfd_open(pid)
    # Still our parent, so the pidfd (if any) is of the right process and not of a reused pid.
    if os.getppid() != pid:
        if fd is not None:
            os.close(fd)
        on_exit()
        return
    threading.Thread(target=_wait, args=(pid, fd, on_exit), name="tandem-lifeline", daemon=True).start()


def _wait(pid: int, pidfd: int | None, on_exit: Callable[[], None]) -> None:
    if pidfd is not None:
        select.select([pidfd], [], [])  # readable once the process has exited
    else:
        while os.getppid() == pid:
            time.sleep(POLL_INTERVAL)
    on_exit()


def _die() -> None:
    """SIGKILL this process's children, then itself (no clean shutdown: nobody is left to serve)."""
    with contextlib.suppress(OSError):
        os.write(2, f"tandem: the worker that owns engine process {os.getpid()} is gone: killing it\n".encode())
    for child in _children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _children() -> list[int]:
    """This process's children (not reaped yet, so their pids cannot have been reused)."""
    found: list[int] = []
    for task in os.listdir("/proc/self/task"):  # each thread lists the children it started
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/children") as f:
            found.extend(int(pid) for pid in f.read().split())
    return found
