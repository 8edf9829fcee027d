"""Processes of this repository that the tests start: any `python -m ...` that prints READY, echo workers."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading

from tests.support import REPO


class TandemProcess:
    """A `python -m <module>` process of this repo that prints `READY <info...>` once serving."""

    def __init__(self, module: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120,
                 netns: str | None = None) -> None:
        """`netns`: run in that network namespace (a "host" of `tests.support.hosts.Hosts`)."""
        full_env = {**os.environ, "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1",
                    "PYTHONPATH": str(REPO), **(env or {})}
        self.proc = subprocess.Popen(
            [*(["ip", "netns", "exec", netns] if netns else []), sys.executable, "-m", module, *args], env=full_env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, cwd=REPO, start_new_session=True,  # its own process group: stop() takes its children too
        )
        self.stderr_lines: list[str] = []
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        ready: queue.Queue[str] = queue.Queue()  # the READY line, or "" when stdout closed without one
        threading.Thread(target=self._find_ready, args=(ready,), daemon=True).start()
        try:
            line = ready.get(timeout=timeout)  # a process that hangs silently cannot outlast `timeout`
        except queue.Empty:
            line = f"(nothing within {timeout:g} s)"
        if not line.startswith("READY"):
            self.stop()  # its whole process group: a vLLM engine core it started too
            raise RuntimeError(f"{module} did not start: {line!r}\n{self.stderr()}")
        self.ready = line.split()[1:]

    def _find_ready(self, ready: queue.Queue[str]) -> None:
        found = False
        for line in self.proc.stdout:  # type: ignore[union-attr]  # read to the end: a full pipe blocks it
            if not found and line.startswith("READY"):
                found = True
                ready.put(line)
        if not found:
            ready.put("")

    def _drain_stderr(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.stderr_lines.append(line)

    def stderr(self) -> str:
        return "".join(self.stderr_lines[-200:])

    def stop(self) -> None:
        """Kill the process and everything it started (e.g. vLLM's engine core)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


class WorkerProcess(TandemProcess):
    """A tests/workers/echo_worker.py process on the file discovery backend."""

    def __init__(self, file_kv: str, namespace: str, *extra: str, env: dict[str, str] | None = None) -> None:
        super().__init__("tests.workers.echo_worker", "--discovery-backend", "file", *extra,
                         env={"DYN_FILE_KV": file_kv, "DYN_NAMESPACE": namespace, **(env or {})})
        self.instance_id = int(self.ready[0], 16)
