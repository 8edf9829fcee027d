"""Helpers shared by the benchmarks in bench/: server processes, CPU accounting, readiness.

Only the standard library is imported at module level, so any venv's Python (tandem's, Dynamo's) can
import this file; httpx is imported where it is used.
"""

from __future__ import annotations

import asyncio
import ctypes
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

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

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], logdir: str, core: int | None = None,
                 cwd: str = REPO) -> None:
        """`cwd`: where `python -m` finds its package first (a baseline tree runs from its own folder)."""
        self.name = name
        self.log_path = os.path.join(logdir, f"{name}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=cwd,
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


def wait_quiet(limit_pct: float, timeout: float = 120, exclude: Callable[[], list[int]] | None = None) -> bool:
    """Until the machine has been (nearly) idle for 3 s — other processes below `limit_pct` % of a
    core — or `timeout`; True if it was quiet. `exclude` (optional) names processes whose CPU time (with
    their descendants') does not count, e.g. a deployment that is up and idle between measurements."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        mine = tree_cpu_seconds(exclude()) if exclude else 0.0
        busy = machine_busy_seconds()
        time.sleep(3)
        others = machine_busy_seconds() - busy - ((tree_cpu_seconds(exclude()) - mine) if exclude else 0.0)
        if others / 3 * 100 < limit_pct:
            return True
    return False


def tree_cpu_seconds(pids: list[int]) -> float:
    """CPU time of `pids` and all their descendants (each process counted once)."""
    kids = children_map()
    seen: set[int] = set()
    for pid in pids:
        seen.update(tree(pid, kids))
    return sum(cpu_seconds(p) for p in seen)


def fmt(value: float) -> str:
    """A figure for a results table: thousands separators from 100, else 3 significant digits."""
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


IMPL_LABELS = {"tandem": "tandem", "dynamo": "Dynamo 1.6.1", "base": "tandem, baseline tree"}


def comparison_table(results: dict[str, dict[str, float]], rows: list[tuple[str, str, str | None]],
                     ratio_header: str, ratio: Callable[[float, float, str], str]) -> list[str]:
    """Markdown rows `| metric | tandem | Dynamo | ratio |` for the `rows` (key, label, "low"/"high"/None
    = which is better) present in `results` (implementation -> key -> value); `ratio(t, d, better)`
    fills the last column when tandem and a baseline (Dynamo, else tandem's baseline tree) ran and the
    metric has a direction."""
    names = list(results)
    baseline = "dynamo" if "dynamo" in results else "base"
    both = "tandem" in results and baseline in results
    lines = ["| metric | " + " | ".join(IMPL_LABELS[n] for n in names) + (f" | {ratio_header} |" if both else " |"),
             "|---" * (len(names) + 1 + both) + "|"]
    for key, label, better in rows:
        if not any(key in results[n] for n in names):
            continue
        row = [fmt(results[n][key]) if key in results[n] else "n/a" for n in names]
        extra = ""
        if both:
            t, d = results["tandem"].get(key), results[baseline].get(key)
            extra = " | —" if better is None or not t or not d or t <= 0 or d <= 0 else f" | {ratio(t, d, better)}"
        lines.append(f"| {label} | " + " | ".join(row) + extra + " |")
    return lines


def pct(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(int(len(sorted_values) * q), len(sorted_values) - 1)]


# -- deployments ----------------------------------------------------------------------------------
def file_discovery_env(workdir: str, namespace: str, pythonpath: str = REPO) -> dict[str, str]:
    """Environment for the processes of one deployment: file discovery under `workdir`, the TCP request
    plane, ZMQ events, no system server, the default log level; `pythonpath`: the tandem tree to run."""
    env = {**os.environ, "DYN_FILE_KV": os.path.join(workdir, "kv"), "DYN_NAMESPACE": namespace,
           "DYN_DISCOVERY_BACKEND": "file", "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq",
           "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_SYSTEM_ENABLED": "false", "PYTHONPATH": pythonpath}
    env.pop("DYN_LOG", None)
    return env


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


# -- mocker deployments (tandem / Dynamo 1.6.1) and aiperf ------------------------------------------
MODEL_NAME = "SmolLM2-135M-Instruct"


# -- the deployments ------------------------------------------------------------------------------
class Deployment:
    """One implementation's frontend + `workers` mocker workers, up and serving: `engine` are the mocker
    flags (the same on both sides), `frontend_args` extra frontend flags (tandem: via --frontend-args).

    Disaggregated: `prefill_workers` P and `decode_workers` D (both > 0) instead of `workers` — tandem
    `tandem run --prefill-workers P --decode-workers D`, Dynamo two `dynamo.mocker` processes with
    `--disaggregation-mode prefill|decode` (endpoints `NS.prefill.generate` / `NS.backend.generate`).
    tandem only: `engine_kind="vllm"` runs real vLLM workers (`engine` then goes to every worker),
    `run_args` are extra `tandem run` flags, `ready_timeout` bounds the start. `one_process`: tandem's
    `workers` mockers run in one process (`--num-workers`), as Dynamo's always do, rather than one
    process each."""

    def __init__(self, impl: str, engine: list[str], workdir: str, dynamo_python: str, *, workers: int = 4,
                 router_mode: str = "round-robin", model_name: str = MODEL_NAME,
                 frontend_args: list[str] | None = None, prefill_workers: int = 0, decode_workers: int = 0,
                 engine_kind: str = "mocker", run_args: list[str] | None = None,
                 ready_timeout: float = 180, tree: str | None = None, one_process: bool = False) -> None:
        self.impl = impl
        disagg = prefill_workers > 0 or decode_workers > 0
        if disagg and (prefill_workers < 1 or decode_workers < 1):
            raise ValueError("a disaggregated deployment needs at least one prefill and one decode worker")
        tandem_side = impl in ("tandem", "base")  # base: tandem from the source tree `tree`
        if engine_kind != "mocker" and not tandem_side:
            raise ValueError(f"engine {engine_kind!r}: only tandem deployments run real engines")
        if disagg:
            workers = prefill_workers + decode_workers
        self.prefill_workers, self.decode_workers = prefill_workers, decode_workers
        self.procs: list[Proc] = []
        self.logdir = os.path.join(workdir, "logs")
        os.makedirs(self.logdir, exist_ok=True)
        namespace = f"mcbench{os.getpid()}{impl}"
        env = {**os.environ, "DYN_FILE_KV": os.path.join(workdir, "kv"), "DYN_NAMESPACE": namespace,
               "DYN_DISCOVERY_BACKEND": "file", "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq",
               "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_SYSTEM_ENABLED": "false"}
        for name in ("DYN_LOG", "DYN_HTTP_PORT", "DYN_SYSTEM_PORT", "DYN_TCP_RPC_PORT", "DYN_ENDPOINT"):
            env.pop(name, None)  # each side at its default log level, no inherited ports
        model = model_path()
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.workers = workers
        frontend_args = list(frontend_args or [])
        WORKERS, MODEL_NAME = workers, model_name  # noqa: N806
        try:
            if tandem_side:
                env["PYTHONPATH"] = tree or REPO  # `tandem run` and the processes it starts run that code
                if one_process and (disagg or engine_kind != "mocker"):
                    raise ValueError("one_process is for an aggregated mocker deployment")
                shape = (["--prefill-workers", str(prefill_workers), "--decode-workers", str(decode_workers)]
                         if disagg else ["--workers", "1" if one_process else str(WORKERS)])
                if one_process:
                    engine = [*engine, "--num-workers", str(WORKERS)]
                launcher = Proc("tandem-run", [sys.executable, "-m", "tandem", "run", "--engine", engine_kind, "--model", model, "--model-name",
                                               MODEL_NAME, *shape, "--router-mode", router_mode,
                                               "--http-port", str(port), "--namespace", namespace,
                                               "--stop-timeout", "15", *(run_args or []),
                                               *([f"--frontend-args={shlex.join(frontend_args)}"] if frontend_args else []),
                                               "--", *engine], env, self.logdir)
                self.procs = [launcher]
                launcher.wait_line("==> serving", timeout=ready_timeout)
                kids = [(pid, cmdline(pid)) for pid in children_map().get(launcher.pid, [])]
                frontends = [pid for pid, cmd in kids if "tandem.frontend" in cmd]
                if len(frontends) != 1:
                    raise RuntimeError(f"cannot find tandem run's frontend among its children: {kids}")
                self.frontend_pid = frontends[0]
                self.engine_pids = [pid for pid, cmd in kids if f"tandem.{engine_kind}" in cmd]
                self.launcher_pid: int | None = launcher.pid
            else:
                groups = ([("mocker-prefill", prefill_workers, "prefill", "prefill"),
                           ("mocker-decode", decode_workers, "decode", "backend")] if disagg
                          else [("mocker", WORKERS, None, "backend")])
                for name, count, mode, component in groups:
                    self.procs.append(Proc(name, [
                        dynamo_python, "-m", "dynamo.mocker", "--model-path", model, "--model-name", MODEL_NAME,
                        "--num-workers", str(count), *engine, *(["--disaggregation-mode", mode] if mode else []),
                        "--endpoint", f"dyn://{namespace}.{component}.generate", "--discovery-backend", "file",
                        "--request-plane", "tcp", "--event-plane", "zmq"], env, self.logdir))
                mockers = list(self.procs)
                frontend = Proc("frontend", [dynamo_python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
                                             "--http-port", str(port), "--namespace", namespace,
                                             "--router-mode", router_mode, "--discovery-backend", "file",
                                             "--request-plane", "tcp", "--event-plane", "zmq", *frontend_args], env, self.logdir)
                self.procs.append(frontend)
                self.frontend_pid = frontend.pid
                self.engine_pids = [m.pid for m in mockers]
                self.launcher_pid = None
            processes = 1 if one_process else WORKERS if tandem_side else 2 if disagg else 1
            if len(self.engine_pids) != processes:
                raise RuntimeError(f"expected {processes} worker processes, found {self.engine_pids}")
            wait_serving(self.url, self.procs, MODEL_NAME)
            if not tandem_side or one_process:  # `tandem run` itself waits for the processes it starts
                self._wait_workers(WORKERS)
        except BaseException:
            self.stop()
            raise

    def _wait_workers(self, WORKERS: int) -> None:  # noqa: N803
        """Routing over fewer than all workers would skew the run: wait until the frontend's /health lists
        all `generate` instances."""
        import httpx

        deadline = time.monotonic() + 60
        seen = 0
        while time.monotonic() < deadline:
            try:
                instances = httpx.get(f"{self.url}/health", timeout=5).json().get("instances", [])
                # Dynamo lists {"endpoint": ...} objects, tandem the ids of the instances serving requests.
                seen = sum(1 for i in instances
                           if isinstance(i, int) or isinstance(i, dict) and i.get("endpoint") == "generate")
                if seen >= WORKERS:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the frontend sees {seen} of {WORKERS} workers after 60 s")

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs = []

    def tails(self) -> str:
        return "\n".join(f"--- {p.name} log ({p.log_path}) ---\n{p.tail()}" for p in self.procs)


def parse_aiperf(path: str) -> dict[str, float]:
    """The figures we report from aiperf's JSON export (profile_export_aiperf.json)."""
    with open(path) as f:
        d = json.load(f)

    def stat(key: str, which: str) -> float:
        return float(d[key][which])

    errors = sum(int(e.get("count", 1)) for e in d.get("error_summary") or [])
    out = {
        "rps": stat("request_throughput", "avg"),
        "output_tokens_per_s": stat("output_token_throughput", "avg"),
        "ttft_p50_ms": stat("time_to_first_token", "p50"), "ttft_p99_ms": stat("time_to_first_token", "p99"),
        "itl_p50_ms": stat("inter_token_latency", "p50"), "itl_p99_ms": stat("inter_token_latency", "p99"),
        "latency_p50_ms": stat("request_latency", "p50"), "latency_p99_ms": stat("request_latency", "p99"),
        "requests_ok": stat("request_count", "avg"), "errors": float(errors),
        "completion_tokens_min": stat("usage_completion_tokens", "min"),
        "duration_s": stat("benchmark_duration", "avg"),
    }
    out["_start"] = datetime.datetime.fromisoformat(d["start_time"]).timestamp()
    out["_end"] = datetime.datetime.fromisoformat(d["end_time"]).timestamp()
    return out


def run_aiperf(cmd: list[str], log_path: str, timeout: float, env_extra: dict[str, str] | None = None) -> None:
    env = dict(os.environ)  # (not HF_HUB_OFFLINE: aiperf 0.13 then refuses a local tokenizer folder)
    env.update(env_extra or {})
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True, preexec_fn=_die_with_parent)
        try:
            proc.wait(timeout)
        finally:
            family = tree(proc.pid)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            for pid in family[1:]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    if proc.returncode != 0:
        with open(log_path, errors="replace") as f:
            raise RuntimeError(f"aiperf exited {proc.returncode}:\n{f.read()[-3000:]}")


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def hub_cache_tokenizer(folder: str, cache_root: str, repo_id: str = "local/tokenizer") -> dict[str, str]:
    """Environment under which aiperf 0.13 loads the tokenizer in `folder` as hub repo `repo_id`: a
    Hugging Face cache layout (symlinks) under `cache_root`, offline. Needed where aiperf loads the
    tokenizer in its dataset worker processes (trace datasets), which run offline and accept only
    cached hub ids, not folders."""
    repo = os.path.join(cache_root, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", "0" * 40)
    os.makedirs(snapshot, exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write("0" * 40)
    for name in os.listdir(folder):
        link = os.path.join(snapshot, name)
        if not os.path.lexists(link):
            os.symlink(os.path.join(os.path.abspath(folder), name), link)
    return {"HF_HUB_CACHE": cache_root, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class BenchRun:
    """What a `bench_run` block sets: its deployment (stopped at the end; its log tails printed on failure)."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.deployment: Any = None


@contextmanager
def bench_run(label: str, keep_logs: bool, prefix: str) -> Iterator[BenchRun]:
    """A scratch directory for one measured run: removed after success unless `keep_logs`, kept (and
    the deployment's log tails printed) after a failure."""
    run = BenchRun(tempfile.mkdtemp(prefix=prefix))
    try:
        yield run
    except BaseException as e:
        if run.deployment is not None and not isinstance(e, KeyboardInterrupt):
            print(run.deployment.tails(), file=sys.stderr)
        print(f"(logs kept in {run.workdir})", file=sys.stderr)
        if run.deployment is not None:
            run.deployment.stop()
        raise
    if run.deployment is not None:
        run.deployment.stop()
    if keep_logs:
        print(f"({label}: logs in {run.workdir})", file=sys.stderr)
    else:
        shutil.rmtree(run.workdir, ignore_errors=True)


def add_output_args(parser: Any) -> None:
    """Flags every aiperf comparison shares: --json, --keep-logs and where the baselines live."""
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="also write the results as JSON (to stdout without PATH)")
    parser.add_argument("--keep-logs", action="store_true", help="keep each run's logs and aiperf artifacts")
    parser.add_argument("--dynamo-python", default=os.path.join(REPO, ".bench", "dynamo-venv", "bin", "python"))
    parser.add_argument("--aiperf", default=os.path.join(REPO, ".bench", "aiperf-venv", "bin", "aiperf"))


def write_json(where: str | None, obj: Any) -> None:
    """`--json` output: nothing for None, stdout for "-", else the file."""
    if where is None:
        return
    payload = json.dumps(obj, indent=1)
    if where == "-":
        print(payload)
    else:
        with open(where, "w") as f:
            f.write(payload)


# -- shared run-time plumbing -------------------------------------------------------------------------
def has_dynamo(dynamo_python: str) -> bool:
    """Whether `dynamo_python` imports Dynamo 1.6.1's frontend and mocker (the baseline venv)."""
    if not os.path.exists(dynamo_python):
        return False
    return subprocess.run([dynamo_python, "-c", "import dynamo.frontend, dynamo.mocker"],
                          capture_output=True).returncode == 0


def require_dynamo(dynamo_python: str) -> None:
    if not has_dynamo(dynamo_python):
        raise SystemExit(f"{dynamo_python} lacks ai-dynamo 1.6.1: run bash bench/setup_baselines.sh")


def interrupt_on_sigterm() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt (also when started in the background), which unwinds
    through every `finally`: deployments, load generators, cgroups are stopped."""
    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)


# -- HTTP load generation -----------------------------------------------------------------------------
class QuickAck(asyncio.StreamReaderProtocol):
    """ACK every segment at once (TCP_QUICKACK re-armed on each receive) instead of Linux's delayed
    ACK: a server that leaves Nagle on (Dynamo's HTTP listener does not set TCP_NODELAY) otherwise
    holds a stream's last small write until the client's delayed ACK, ~40 ms later."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._sock = transport.get_extra_info("socket")
        super().connection_made(transport)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        except OSError:
            pass
        super().data_received(data)


class StreamConn:
    """One keep-alive HTTP/1.1 connection that POSTs JSON and reads the response as server-sent events."""

    def __init__(self, host: str, port: int, quickack: bool = True) -> None:
        self.host, self.port, self.quickack = host, port, quickack
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        if not self.quickack:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 22)
            return
        loop = asyncio.get_running_loop()
        self.reader = asyncio.StreamReader(limit=1 << 22, loop=loop)
        protocol = QuickAck(self.reader, loop=loop)
        transport, _ = await loop.create_connection(lambda: protocol, self.host, self.port)
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.writer = asyncio.StreamWriter(transport, protocol, self.reader, loop)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def post(self, path: str, body: bytes, headers: bytes = b"") -> tuple[bytes, AsyncIterator[bytes]]:
        """Send the request (`headers`: extra header lines, each ending in CRLF); returns the status line
        and the response's events (`\n\n`-separated pieces of the body, without the separator), to be
        read to the end before the next request."""
        if self.writer is None:
            await self.connect()
        reader, writer = self.reader, self.writer
        assert reader is not None and writer is not None
        writer.write(b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                     b"Accept: text/event-stream\r\n%sContent-Length: %d\r\n\r\n%s"
                     % (path.encode(), self.host.encode(), self.port, headers, len(body), body))
        status = await reader.readline()
        chunked, length, close = False, None, False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "transfer-encoding" and "chunked" in value:
                chunked = True
            elif name == "content-length":
                length = int(value)
            elif name == "connection" and value == "close":
                close = True

        async def events() -> AsyncIterator[bytes]:
            pending = b""
            while True:
                if chunked:
                    size = int((await reader.readline()).split(b";")[0], 16)
                    if size == 0:
                        await reader.readline()
                        break
                    data = (await reader.readexactly(size + 2))[:-2]
                else:
                    data = await reader.readexactly(length) if length is not None else await reader.read()
                *complete, pending = (pending + data).split(b"\n\n")
                for event in complete:
                    yield event
                if not chunked:
                    break
            if pending:
                yield pending
            if close:
                self.close()

        return status, events()


# -- Prometheus ----------------------------------------------------------------------------------------
_SAMPLE = re.compile(r'^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    """All samples of `url`/metrics ({} when it cannot be read)."""
    import httpx

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out: Samples = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            try:
                out[(m.group(1), frozenset(_LABEL.findall(m.group(2) or "")))] = float(m.group(3))
            except ValueError:
                pass
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)
