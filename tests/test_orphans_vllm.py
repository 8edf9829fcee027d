"""No vLLM engine process outlives its worker, nor a worker its launcher, whatever kills them (issue 12, item 8).

Real `tandem vllm` workers with the `mp` executor, so the whole chain is there: (launcher ->) worker ->
VLLM::EngineCore -> VLLM::Worker. Each test tags the processes it starts with a unique environment variable
and follows their sessions in /proc, so processes of other test runs on the machine are not counted.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import TandemProcess
from tests.deployment import VLLM_TEST_ARGS
from tests.launcher import Run

pytestmark = pytest.mark.slow

TAG = "TANDEM_ORPHAN_TEST"
ENGINE_NAMES = ("VLLM::EngineCore", "VLLM::Worker")
GONE_WITHIN = 10.0  # seconds: the bound
# Small engine, one core, few GB; `mp` starts a separate VLLM::Worker process even with one rank.
ENGINE_ARGS = (*VLLM_TEST_ARGS, "--distributed-executor-backend", "mp", "--gpu-memory-utilization", "0.2",
               "--max-model-len", "512", "--max-num-seqs", "4")
SLOW_DRAIN = {"DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "60"}  # a worker stays in its drain for a minute


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (session id, command line) of every live process (zombies are gone: they hold nothing)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, _, _, session = f.read().rsplit(")", 1)[1].split()[:4]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if state != "Z":
            found[int(entry)] = (int(session), cmdline)
    return found


class Tagged:
    """The processes of one test: started with `env` (a unique tag), remembered by session. Each process the
    launcher or the test starts leads its own session, and vLLM's engine processes stay in their worker's
    session; their own environment cannot be read (setproctitle reuses its memory for the process title)."""

    def __init__(self) -> None:
        self.env = {TAG: uuid.uuid4().hex}
        self.sessions: set[int] = set()

    def find_chain(self) -> None:
        """Remember the sessions of the tagged processes, and check that they run a whole engine (so that an
        empty scan later means something)."""
        marker = "=".join(*self.env.items()).encode()
        for pid, (session, _) in _processes().items():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        self.sessions.add(session)
            except OSError:
                continue
        names = {cmdline.split()[0] for cmdline in self.members().values() if cmdline.startswith(ENGINE_NAMES)}
        assert "VLLM::EngineCore" in names and any(name.startswith("VLLM::Worker") for name in names), names

    def members(self) -> dict[int, str]:
        """pid -> command line of the live processes in the sessions."""
        return {pid: cmdline for pid, (session, cmdline) in _processes().items() if session in self.sessions}

    def assert_all_gone(self) -> None:
        """Within GONE_WITHIN seconds, no process (launcher, frontend, worker or engine) is left."""
        deadline = time.monotonic() + GONE_WITHIN
        while (left := self.members()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"still running {GONE_WITHIN:g} s later: {left}"


@pytest.fixture
def tagged() -> Iterator[Tagged]:
    """Whatever is left in the test's sessions at the end is killed (the orphans of a failed run)."""
    processes = Tagged()
    yield processes
    for pid in processes.members():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.timeout(400)
def test_sigkill_of_a_worker_takes_its_engine(tagged: Tagged, smollm2: str, tmp_path: Path) -> None:
    worker = TandemProcess("tandem.vllm", "--model", smollm2, "--discovery-backend", "file", "--connector", "none",
                           "--cpu-cores", "1", *ENGINE_ARGS, timeout=300,
                           env={**tagged.env, "DYN_FILE_KV": str(tmp_path), "DYN_NAMESPACE": "orphans"})
    tagged.find_chain()
    os.kill(worker.proc.pid, signal.SIGKILL)  # the main process only, as the OOM killer would
    worker.proc.wait()
    tagged.assert_all_gone()


def launch(tagged: Tagged, smollm2: str) -> Run:
    run = Run("--model", smollm2, "--engine", "vllm", "--workers", "1", "--ready-timeout", "300", "--",
              *ENGINE_ARGS, env={**tagged.env, **SLOW_DRAIN})
    run.wait_for(r"==> serving", timeout=300)
    tagged.find_chain()
    return run


@pytest.mark.timeout(400)
def test_sigterm_then_sigkill_of_the_launcher_mid_drain(tagged: Tagged, smollm2: str) -> None:
    run = launch(tagged, smollm2)
    run.proc.send_signal(signal.SIGTERM)
    run.wait_for(r"worker-0 +\|.*SIGTERM received: shutting down gracefully")  # the worker is draining
    run.proc.kill()  # as a process supervisor does when its stop timeout runs out
    run.proc.wait()
    tagged.assert_all_gone()


@pytest.mark.timeout(400)
def test_sigkill_of_the_launcher(tagged: Tagged, smollm2: str) -> None:
    run = launch(tagged, smollm2)
    run.proc.kill()
    run.proc.wait()
    tagged.assert_all_gone()
