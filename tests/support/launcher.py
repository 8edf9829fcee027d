"""`tandem run` as a real process, for end-to-end tests: its output, its children, a clean kill."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import openai

from tests.support import REPO


def _sessions() -> dict[int, int]:
    """pid -> session id of every process (from /proc)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            found[int(entry)] = int(fields[3])  # after the name: state, ppid, pgrp, session
    return found


def _main_thread_children(pid: int) -> list[int]:
    """The children its main thread started (cheap: one file), which is where the launcher starts them."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def children(pid: int) -> list[int]:
    """The live child processes of `pid`, whichever of its threads started them."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            except OSError:
                continue
            if int(ppid) == pid and state != "Z":
                found.append(int(entry))
    return found


class Run:
    """A `tandem run` process driven with the test engine; `lines` collects its stdout."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        full_env = {**os.environ, "PYTHONPATH": str(REPO),
                    "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0", **(env or {})}
        full_env.pop("DYN_FILE_KV", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "tandem.launch", "--http-port", "0", *args],
                                     env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     cwd=REPO, start_new_session=True)
        self.lines: list[str] = []
        self.sessions: set[int] = set()  # the children's sessions (= their pids), seen while it runs
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.append(line.rstrip("\n"))

    def _watch(self) -> None:
        while self.proc.poll() is None:
            self.sessions = self.sessions | set(_main_thread_children(self.proc.pid))  # a new set: readers never see it change
            time.sleep(0.02)

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 30) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            ended = self.proc.poll() is not None
            if ended:
                self._reader.join(5)  # everything it printed is in `lines`
            matches = [m for line in list(self.lines) if (m := re.search(pattern, line))]
            if len(matches) >= count:
                return matches[count - 1]
            if ended or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} (x{count}) in the output:\n" + "\n".join(self.lines[-60:]))

    def serving(self) -> str:
        return self.wait_for(r"==> serving \S+ at (\S+)").group(1)

    def client(self, url: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    def stop(self, sig: int = signal.SIGINT, timeout: float = 20) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def children_running(self, text: str) -> list[int]:
        """The children (each leads its own session) whose command line contains `text`."""
        found = []
        for pid in sorted(self.sessions):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if text.encode() in f.read().replace(b"\0", b" "):
                        found.append(pid)
            except OSError:
                continue
        return found

    def leftovers(self) -> list[int]:
        return [pid for pid, sid in _sessions().items() if sid in self.sessions]

    def kill(self) -> None:
        for pid in [self.proc.pid, *self.sessions]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
