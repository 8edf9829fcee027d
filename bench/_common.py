"""Helpers shared by the benchmarks in bench/: server processes, CPU accounting, readiness.

Only the standard library is imported at module level, so any venv's Python (tandem's, Dynamo's) can
import this file; httpx is imported where it is used.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


# -- processes -------------------------------------------------------------------------------------
def pinned(core: int | None) -> Callable[[], None]:
    """preexec_fn: pin to `core` (None: no pinning) and die with the parent (no orphans if the bench
    is killed)."""
    def setup() -> None:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if core is not None and core < (os.cpu_count() or 1):
            os.sched_setaffinity(0, {core})
    return setup


def children_map() -> dict[int, list[int]]:
    """parent pid -> child pids, for every process on the machine (from /proc)."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def tree(pid: int, kids: dict[int, list[int]] | None = None) -> list[int]:
    """`pid` and all its descendants."""
    kids = children_map() if kids is None else kids
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A server process with its output in a log file, in its own session; stop() ends it, its process
    group and every descendant it had (also those that started sessions of their own)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], logdir: str, core: int | None = None) -> None:
        self.name = name
        self.log_path = os.path.join(logdir, f"{name}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
                                     preexec_fn=pinned(core), start_new_session=True)
        self.pid = self.proc.pid

    def wait_line(self, prefix: str, timeout: float = 120) -> str:
        """The first log line starting with `prefix` (after stripping blanks); raises if the process exits
        or `timeout` passes first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self.log_path, errors="replace") as f:
                for line in f:
                    if line.strip().startswith(prefix):
                        return line.strip()
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not print {prefix!r}:\n{self.tail()}")

    def tail(self, n: int = 3000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def stop(self, timeout: float = 10) -> None:
        family = tree(self.pid)[1:] if self.proc.poll() is None else []
        if self.proc.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        if self.proc.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        try:  # a process of the group that outlived its leader
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in family:  # descendants in sessions of their own (e.g. `tandem run`'s children)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()


# -- CPU accounting -------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process (all its threads) and its reaped children; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU time spent by everything on the machine (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, _irq, _softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + steal) / os.sysconf("SC_CLK_TCK")  # (interrupt time: loopback traffic)


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def wait_quiet(limit_pct: float, timeout: float = 120) -> None:
    """Until the machine has been (nearly) idle for 3 s — other processes below `limit_pct` % of a
    core — or `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = machine_busy_seconds()
        time.sleep(3)
        if (machine_busy_seconds() - busy) / 3 * 100 < limit_pct:
            return


def fmt(value: float) -> str:
    """A figure for a results table: thousands separators from 100, else 3 significant digits."""
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


IMPL_LABELS = {"tandem": "tandem", "dynamo": "Dynamo 1.6.1"}


def comparison_table(results: dict[str, dict[str, float]], rows: list[tuple[str, str, str | None]],
                     ratio_header: str, ratio: Callable[[float, float, str], str]) -> list[str]:
    """Markdown rows `| metric | tandem | Dynamo | ratio |` for the `rows` (key, label, "low"/"high"/None
    = which is better) present in `results` (implementation -> key -> value); `ratio(t, d, better)`
    fills the last column when both implementations ran and the metric has a direction."""
    names = list(results)
    both = "tandem" in results and "dynamo" in results
    lines = ["| metric | " + " | ".join(IMPL_LABELS[n] for n in names) + (f" | {ratio_header} |" if both else " |"),
             "|---" * (len(names) + 1 + both) + "|"]
    for key, label, better in rows:
        if not any(key in results[n] for n in names):
            continue
        row = [fmt(results[n][key]) if key in results[n] else "n/a" for n in names]
        extra = ""
        if both:
            t, d = results["tandem"].get(key), results["dynamo"].get(key)
            extra = " | —" if better is None or not t or not d or t <= 0 or d <= 0 else f" | {ratio(t, d, better)}"
        lines.append(f"| {label} | " + " | ".join(row) + extra + " |")
    return lines


def pct(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(int(len(sorted_values) * q), len(sorted_values) - 1)]


# -- deployments ----------------------------------------------------------------------------------
def model_path() -> str:
    """SmolLM2-135M-Instruct's folder (prepared from the PyPI wheel on first use; needs tandem's venv)."""
    from tandem.models import prepare_model

    return str(prepare_model())


def wait_serving(url: str, procs: list[Proc], model: str, timeout: float = 180, min_chunks: int = 0) -> None:
    """Until a streamed chat request through the frontend at `url` succeeds (with at least
    `min_chunks` chunks carrying text, if given); raises if one of `procs` exits first."""
    import re

    import httpx

    content = re.compile(rb'"content":\s*"(?!")')  # a chunk carrying text (not the empty role chunk)
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        for p in procs:
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.name} exited ({p.proc.returncode}):\n{p.tail()}")
        try:
            r = httpx.post(f"{url}/v1/chat/completions", timeout=10, json={
                "model": model, "messages": [{"role": "user", "content": "Write one sentence about a quick brown fox."}],
                "max_tokens": 2, "stream": True})
            if r.status_code == 200 and (len(content.findall(r.content)) == min_chunks if min_chunks
                                         else b"[DONE]" in r.content):
                return
            last = f"{r.status_code} {r.text[:300]}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(0.2)
    raise RuntimeError(f"the frontend at {url} never served a request ({last}):\n" +
                       "\n".join(p.tail(1500) for p in procs))
