"""`tandem.vllm.lifeline`: engine processes die with the worker that started them (no vLLM here: plain
Python processes stand in for the worker and its engine; tests/vllm/test_launch_vllm.py and
tests/vllm/test_vllm_migration.py do it with vLLM)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from tandem.vllm import lifeline
from tandem.vllm.checkpoint_restore import READY_FILE_ENV
from tandem.vllm.lifeline import OWNER_ENV, PLUGIN_NAME, mark_owner, register, watch_parent
from tests.support import REPO


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Owner:
    """tests/workers/lifeline_owner.py: an owner process and the engine it started (see there)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.workers.lifeline_owner", *args],
                                     env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, cwd=REPO,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)

    def read_report(self) -> None:
        report = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert report, "the owner ended before its engine reported (the engine died)"
        self.engine, self.sleeper, self.armed, self.pidfds, self.owner_env = json.loads(report)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def owners() -> Iterator:
    started: list[Owner] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Owner:
        started.append(Owner(*args, env=env))
        started[-1].read_report()
        return started[-1]

    yield start
    for owner in started:  # its session holds the engine and the engine's child
        with contextlib.suppress(ProcessLookupError):
            os.killpg(owner.proc.pid, signal.SIGKILL)
        owner.proc.wait()


@pytest.mark.parametrize("checkpoint", [False, True])
def test_the_engine_and_its_children_die_with_a_sigkilled_owner(owners, checkpoint: bool) -> None:  # type: ignore[no-untyped-def]
    # A worker that will be CRIU-checkpointed: its engine holds no pidfd (CRIU cannot dump one) and polls.
    owner = owners(env={READY_FILE_ENV: "/nonexistent/ready" if checkpoint else ""})
    # It outlived the thread that started it (it answered after that thread was gone from the kernel).
    assert owner.armed and owner.owner_env == str(owner.engine)  # the engine owns what it starts in turn
    assert owner.pidfds == (0 if checkpoint else 1)
    assert alive(owner.engine) and alive(owner.sleeper)
    owner.kill()
    deadline = time.monotonic() + 10
    while (alive(owner.engine) or alive(owner.sleeper)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(owner.engine) and not alive(owner.sleeper)


def test_only_a_direct_child_of_the_named_owner_is_tied(owners) -> None:  # type: ignore[no-untyped-def]
    # A stale variable naming another process (here the test itself, the engine's grandparent): nothing happens.
    owner = owners("--unmarked", env={OWNER_ENV: str(os.getpid())})
    assert not owner.armed and owner.owner_env == str(os.getpid())
    owner = owners("--unmarked", env={OWNER_ENV: ""})
    assert not owner.armed
    before = dict(os.environ)
    register()  # not started by multiprocessing at all (the worker itself loads vLLM's plugins too)
    assert dict(os.environ) == before
    assert not any(thread.name == "tandem-lifeline" for thread in threading.enumerate())


def test_an_owner_already_gone_is_acted_on_at_once() -> None:
    calls: list[str] = []
    watch_parent(os.getpid(), lambda: calls.append("gone"))  # not our parent: as if re-parented already
    assert calls == ["gone"]


def test_without_pidfds_the_parent_is_polled(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pidfd(pid: int) -> int:
        raise OSError(38, "Function not implemented")

    parents = iter([4242, 4242, 4242, 1])  # the parent exits after a few polls
    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    monkeypatch.setattr(os, "getppid", lambda: next(parents, 1))
    monkeypatch.setattr(lifeline, "POLL_INTERVAL", 0.001)
    gone = threading.Event()
    watch_parent(4242, gone.set)
    assert gone.wait(10)


@pytest.mark.parametrize(("plugins", "expected"), [
    (None, None),
    ("", PLUGIN_NAME),
    ("lora_filesystem_resolver", f"lora_filesystem_resolver,{PLUGIN_NAME}"),
    (f"a,{PLUGIN_NAME}", f"a,{PLUGIN_NAME}"),
])
def test_mark_owner(monkeypatch: pytest.MonkeyPatch, plugins: str | None, expected: str | None) -> None:
    monkeypatch.delenv(OWNER_ENV, raising=False)
    if plugins is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", plugins)
    mark_owner()
    assert os.environ[OWNER_ENV] == str(os.getpid())
    assert os.environ.get("VLLM_PLUGINS") == expected
