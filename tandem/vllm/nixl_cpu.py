"""NIXL on vLLM's CPU backend: keep the model on the engine's own cores, and stop NIXL's UCX progress
thread from busy-polling them.

vLLM's NIXL connector worker, on CPU, moves the thread that creates it to the last core of each NUMA
node (meant as a core reserved for KV transfers). That thread is the model process's main thread, which
is also OpenMP's master thread: with one core per engine (`--cpu-cores 0`), every engine's model then
ran on the machine's last core. Two engines of a 1P1D pair on a 2-core host shared core 1 and left
core 0 idle; prefill and decode each ran at half speed. `keep_thread_affinity` restores the thread's
cores once the connector worker exists.

nixl's Python agent always creates its UCX progress thread with `pthrDelay = 0`, so between events
the thread polls with a zero timeout and keeps a whole core busy. Next to a GPU that costs a spare
host core; on the CPU backend the thread inherits the engine's core binding (`--cpu-cores`) and
takes that core from the model: a ~1300-token prefill on one core then ran past vLLM's 300 s step
timeout and killed the engine.

`NixlOnCpu` is given to vLLM as `--worker-extension-cls` on CPU (see `args.py`): vLLM imports this
module in the process that runs the model before its KV connector exists, and the import applies both
fixes there; every NIXL agent created afterwards gets a poll timeout of `PROGRESS_DELAY_US`. The
thread still wakes at once on UCX events (it polls UCX's event fd); the timeout only bounds how
long it sleeps without one.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any

log = logging.getLogger(__name__)

# Poll timeout of the progress thread between UCX events. NIXL rounds it up to whole milliseconds.
PROGRESS_DELAY_US = 1000


def install_progress_delay(delay_us: int = PROGRESS_DELAY_US) -> bool:
    """Make NIXL agents created from now on in this process use a progress-thread poll timeout of
    `delay_us` instead of 0. Returns False when NIXL is not installed."""
    from vllm.distributed import nixl_utils

    # Loads nixl the way vLLM's connector does (vLLM sets UCX variables before the first import).
    if nixl_utils.NixlWrapper is None:
        return False
    bindings = sys.modules[nixl_utils.NixlWrapper.__module__].nixlBind
    create = bindings.nixlAgent
    if getattr(create, "tandem_progress_delay", None) is not None:
        return True

    def agent_with_delay(name: str, config: Any) -> Any:
        if config.useProgThread and not config.pthrDelay:
            config.pthrDelay = delay_us
        return create(name, config)

    agent_with_delay.tandem_progress_delay = delay_us  # type: ignore[attr-defined]
    bindings.nixlAgent = agent_with_delay
    log.debug("NIXL progress thread poll timeout set to %d us", delay_us)
    return True


def keep_thread_affinity() -> bool:
    """Make vLLM's NIXL connector worker leave the creating thread on the cores it had. Returns False
    when this vLLM has no such class."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker
    except ImportError:
        return False
    init = NixlBaseConnectorWorker.__init__
    if getattr(init, "tandem_keeps_affinity", False):
        return True

    @functools.wraps(init)
    def init_on_own_cores(self: Any, *args: Any, **kwargs: Any) -> None:
        cores = os.sched_getaffinity(0)
        try:
            init(self, *args, **kwargs)
        finally:
            moved = os.sched_getaffinity(0)
            if moved != cores:
                log.info("NIXL connector moved the model thread to cores %s; back to %s", sorted(moved), sorted(cores))
                os.sched_setaffinity(0, cores)

    init_on_own_cores.tandem_keeps_affinity = True  # type: ignore[attr-defined]
    NixlBaseConnectorWorker.__init__ = init_on_own_cores  # type: ignore[method-assign]
    return True


class NixlOnCpu:
    """vLLM worker extension whose only job is the import-time patches below (it adds no methods to
    the worker)."""


install_progress_delay()
keep_thread_affinity()
