"""Shared by the benchmarks that compare tandem with vLLM's own OpenAI server, one system at a time, same model
and engine flags (bench/embeddings_bench.py, bench/multimodal_bench.py; their docstrings give the method).

Here: the flags they share; starting either system with its engine on ENGINE_CORE and everything else on
FRONT_CORE; one closed-loop workload with the CPU time of each process and of everything else on the machine,
from /proc; measuring a workload again while other processes disturb it; the rounds that alternate the systems;
the medians and the tandem / vLLM ratios; the markdown tables and the ratio plots. Needs tandem's venv.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import _common
from _common import Proc, StreamConn, model_path
from serving_bench import engine_of, pin_threads

ENGINE_CORE, FRONT_CORE = 0, 1


class BadResponse(Exception):
    """An answer that is not a complete, successful response (each benchmark's check() says what that is)."""


# -- flags --------------------------------------------------------------------------------------------
def add_run_args(parser: argparse.ArgumentParser, plot_help: str, workloads_help: str) -> None:
    """--impl, --rounds, --duration, --min-requests, --warmup, --plot, --json and --workloads."""
    parser.add_argument("--impl", choices=["both", "tandem", "vllm"], default="both")
    parser.add_argument("--rounds", type=int, default=1,
                        help="1: vLLM then tandem; 2: vLLM, tandem, tandem, vLLM (and so on); medians reported")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds measured per workload, at least")
    parser.add_argument("--min-requests", type=int, default=8, help="answered requests per workload, at least")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of warm-up per workload")
    parser.add_argument("--plot", default=None, metavar="PNG", help=plot_help)
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="also write every run, the medians and the ratios as JSON (stdout without PATH)")
    parser.add_argument("--workloads", default=None, metavar="K,K", help=workloads_help)


def add_quiet_args(parser: argparse.ArgumentParser) -> None:
    """--max-others, --attempts and --quiet-timeout: how much other processes may disturb a measurement."""
    parser.add_argument("--max-others", type=float, default=15.0,
                        help="measure a workload again if other processes used more than this %% of a core meanwhile")
    parser.add_argument("--attempts", type=int, default=2, help="measurements tried per workload")
    parser.add_argument("--quiet-timeout", type=float, default=300.0,
                        help="seconds to wait for an idle machine before starting a system")


def select_workloads(parser: argparse.ArgumentParser, wanted: str, every: dict[str, Any]) -> list[Any]:
    """The workloads of `every` (key -> workload) that --workloads `wanted` names, in `every`'s order."""
    names = [w.strip() for w in wanted.split(",") if w.strip()]
    chosen = [w for k, w in every.items() if k in names]
    if len(chosen) != len(names):
        parser.error(f"--workloads takes {', '.join(every)}")
    return chosen


# -- texts --------------------------------------------------------------------------------------------
def make_texts(count: int, tokens: int, seed: int) -> list[str]:
    """`count` random texts of exactly `tokens` tokens each (single-token words, each with its leading
    space, so that no two words merge); a sample is checked with the model's tokenizer."""
    from tandem.llm.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(model_path())
    words = []
    for i in range(tok.hf.get_vocab_size()):
        piece = tok.token_text(i)
        if piece.startswith(" ") and piece[1:].isascii() and piece[1:].isalpha() and piece[1:].islower() \
                and len(piece) > 4:
            words.append(piece)
    rng = random.Random(seed)
    texts = ["".join(rng.choice(words) for _ in range(tokens)) for _ in range(count)]
    for text in texts[:20]:
        got = len(tok.encode(text, add_special_tokens=True))
        if got != tokens:
            raise RuntimeError(f"a generated text has {got} tokens, wanted {tokens}: {text[:80]!r}")
    return texts


# -- the two deployments ------------------------------------------------------------------------------
class System:
    """One system up and serving `model` as `served_name`: `url`, and its processes by role for CPU
    accounting (`front`: vLLM's API server, or tandem's frontend and worker main process; `engine`: EngineCore
    and its model worker, every thread of them on ENGINE_CORE); `start_s` once serving() started it.

    vLLM: `python -m vllm.entrypoints.openai.api_server --model M --served-model-name N <vllm_args>` with
    VLLM_CPU_OMP_THREADS_BIND=ENGINE_CORE; tandem: `python -m tandem.vllm --model M --served-model-name N
    --cpu-cores ENGINE_CORE --discovery-backend file <tandem_args>` (its environment: file discovery under
    `workdir` in `namespace`, plus `tandem_env`), then tandem's frontend. Every process is started under
    FRONT_CORE's affinity. The system serves once a POST of `ready_body` to `ready_path` answers 200 and
    `accept` (if given) takes its body without raising. With `second_worker` (a label and flags naming its role:
    an encoder, or a prefill worker), tandem also runs a second worker whose engine is on FRONT_CORE; its engine
    counts as engine, its main process as front."""

    def __init__(self, impl: str, workdir: str, model: str, served_name: str, *, namespace: str,
                 vllm_args: list[str], tandem_args: list[str], ready_path: str, ready_body: bytes,
                 ready_timeout: float, accept: Callable[[bytes], Any] | None = None,
                 tandem_env: dict[str, str] | None = None, timeout: float = 600,
                 second_worker: tuple[str, list[str]] | None = None) -> None:
        self.impl = impl
        self.start_s = 0.0
        logdir = os.path.join(workdir, "logs")
        os.makedirs(logdir, exist_ok=True)
        self.procs: list[Proc] = []
        second: Proc | None = None
        try:
            if impl == "vllm":
                port = _common.free_port()
                env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(ENGINE_CORE), "VLLM_USE_AOT_COMPILE": "0"}
                api = Proc("vllm-api-server", [
                    sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                    "--served-model-name", served_name, *vllm_args,
                    "--host", "127.0.0.1", "--port", str(port)], env, logdir, FRONT_CORE)
                self.procs = [api]
                self.url = f"http://127.0.0.1:{port}"
                self.front = {"api server": api.pid}
            else:
                env = {**_common.file_discovery_env(workdir, namespace, _common.REPO), **(tandem_env or {})}
                worker = Proc("tandem-worker", [
                    sys.executable, "-m", "tandem.vllm", "--model", model, "--served-model-name", served_name,
                    "--cpu-cores", str(ENGINE_CORE), "--discovery-backend", "file", *tandem_args], env, logdir,
                    FRONT_CORE)
                self.procs = [worker]
                worker.wait_line("READY", timeout)
                if second_worker is not None:
                    label, second_args = second_worker
                    second = Proc(f"tandem-{label}", [
                        sys.executable, "-m", "tandem.vllm", "--model", model, "--served-model-name", served_name,
                        "--cpu-cores", str(FRONT_CORE), "--discovery-backend", "file", *second_args], env, logdir,
                        FRONT_CORE)
                    self.procs.append(second)
                    second.wait_line("READY", timeout)
                frontend = Proc("frontend", [sys.executable, "-m", "tandem.frontend", "--http-host", "127.0.0.1",
                                             "--http-port", "0", "--discovery-backend", "file"], env, logdir, FRONT_CORE)
                self.procs.append(frontend)
                self.url = frontend.wait_line("READY").split()[1]
                self.front = {"frontend": frontend.pid, "worker main": worker.pid,
                              **({f"{second_worker[0]} main": second.pid} if second_worker and second else {})}
            self._wait_serving(ready_path, ready_body, ready_timeout, accept, timeout)
            self.engine = engine_of(self.procs[0].pid)  # {"engine core": pid, "model worker": pid}
            for pid in self.engine.values():  # every thread of the engine to core 0
                pin_threads(pid, ENGINE_CORE)
            if second_worker is not None and second is not None:
                second_engine = engine_of(second.pid)
                for pid in second_engine.values():
                    pin_threads(pid, FRONT_CORE)
                self.engine.update({f"{second_worker[0]}'s {name}": pid for name, pid in second_engine.items()})
        except BaseException:
            self.stop()
            raise

    def _wait_serving(self, path: str, body: bytes, request_timeout: float,
                      accept: Callable[[bytes], Any] | None, timeout: float) -> None:
        import httpx

        deadline, last = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.proc.poll() is not None:
                    raise RuntimeError(f"{p.name} exited ({p.proc.returncode}):\n{p.tail()}")
            try:
                r = httpx.post(f"{self.url}{path}", content=body, headers={"Content-Type": "application/json"},
                               timeout=request_timeout)
                if r.status_code == 200:
                    if accept is not None:
                        accept(r.content)
                    return
                last = f"{r.status_code} {r.text[:300]}"
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(1)
        raise RuntimeError(f"{self.impl} never answered {path} ({last}):\n{self.tails()}")

    def pids(self) -> list[int]:
        return [*self.front.values(), *self.engine.values()]

    def tails(self) -> str:
        return "\n".join(f"--- {p.name} log ({p.log_path}) ---\n{p.tail()}" for p in self.procs)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs = []


@contextmanager
def serving(impl: str, prefix: str, args: argparse.Namespace, start: Callable[[str], System]) -> Iterator[System]:
    """One system's run: `start(workdir)` in a new scratch folder once the machine is quiet (--max-others,
    --quiet-timeout; a warning if it never was), on every core; then this process, the load generator, goes to
    FRONT_CORE. Stops the system at the end; removes the folder after success, keeps it (and prints the logs'
    tails) after a failure."""
    workdir = tempfile.mkdtemp(prefix=f"{prefix}-{impl}-")
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    if not _common.wait_quiet(args.max_others, timeout=args.quiet_timeout):
        print(f"warning: the machine was not quiet before starting {impl}", file=sys.stderr)
    started = time.monotonic()
    system = start(workdir)
    system.start_s = time.monotonic() - started
    try:
        os.sched_setaffinity(0, {FRONT_CORE})  # the load generator shares the front processes' core
        yield system
    except BaseException as e:
        if not isinstance(e, KeyboardInterrupt):
            print(system.tails(), file=sys.stderr)
        print(f"(logs kept in {workdir})", file=sys.stderr)
        system.stop()
        raise
    system.stop()
    shutil.rmtree(workdir, ignore_errors=True)


# -- load generator -----------------------------------------------------------------------------------
async def send(conn: StreamConn, path: str, body: bytes) -> tuple[int, list[bytes], list[float]]:
    """POST one request; its status, its events and when each arrived."""
    status, stream = await conn.post(path, body)
    events, times = [], []
    async for event in stream:
        events.append(event)
        times.append(time.perf_counter())
    parts = status.split()
    return (int(parts[1]) if len(parts) > 1 else 0), events, times


class Answer(NamedTuple):
    """A request answered during the window."""
    start: float  # time.perf_counter() when it was sent
    end: float  # ... when its answer ended
    cycle: float  # from the previous answer on the same connection to this one
    got: Any  # what the benchmark's check made of the answer


class Loop(NamedTuple):
    """What one closed-loop workload measured."""
    concurrency: int
    answers: list[Answer]
    errors: list[str]
    window: float  # seconds (0: not measured, the probe failed)
    cpu: dict[int, float]  # CPU seconds of each process measured during the window
    others: float  # CPU seconds of everything else on the machine during the window
    probe: Any  # what the check made of the probe's answer (None: no probe, or it failed)

    @property
    def rps(self) -> float:
        # closed loop: each connection answers one request per cycle, so requests/s = connections / mean cycle
        # (Little's law) — unlike counting answers in a window, not rounded off by requests of seconds that a
        # batching engine answers in waves
        return self.concurrency / statistics.fmean(a.cycle for a in self.answers) if self.answers else 0.0

    def cpu_of(self, pids: Iterable[int]) -> float:
        """CPU seconds of `pids` during the window."""
        return sum(self.cpu.get(p, 0.0) for p in pids)

    def counts(self) -> dict[str, Any]:
        """The result's first fields: requests, errors (and a few of them), requests/s."""
        return {"requests": len(self.answers), "errors": len(self.errors),
                "error_samples": sorted(set(self.errors))[:3], "rps": self.rps}

    def disturbance(self) -> dict[str, float]:
        """The result's last fields: other processes' CPU (% of a core) and the window."""
        return {"others_cpu_pct": max(self.others, 0.0) / self.window * 100 if self.window else 0.0,
                "window_s": self.window}


async def closed_loop(system: System, path: str, concurrency: int, args: argparse.Namespace,
                      body: Callable[[], bytes], check: Callable[[int, list[bytes], list[float]], Any], *,
                      probe: bytes | None = None, extra_pids: Iterable[int] = (), drain: bool = True) -> Loop:
    """One closed-loop workload of POSTs to `path` (the benchmarks' docstrings): `concurrency` connections, each
    sending `body()` as soon as its previous answer is in; `check(status, events, times)` raises on a bad answer,
    else its value goes into the Answer. A warm-up of --warmup s and until every connection has had an answer
    (else BadResponse), then a window of at least --duration s and --min-requests answers, with the CPU time of
    the system's processes and of `extra_pids` (ours too), and of everything else. `probe`: a request sent and
    checked first (if it fails, nothing else is sent); `drain`: let the requests still in flight at the end of
    the window finish (else they are cut: the system is stopped next). Errors: every --timeout s, connection
    error or check that fails, counted and reported."""
    host, port = system.url.split("//")[1].rsplit(":", 1)
    conns = [StreamConn(host, int(port)) for _ in range(concurrency)]
    answers: list[Answer] = []
    errors: list[str] = []
    state: dict[str, Any] = {"measuring": False, "stop": False, "warm": 0}

    def failed(e: Exception) -> None:
        errors.append(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)

    probed = None
    if probe is not None:
        try:
            async with asyncio.timeout(args.timeout):
                probed = check(*await send(conns[0], path, probe))
        except Exception as e:  # noqa: BLE001 — every failure is counted and reported
            conns[0].close()
            failed(e)

    async def one(conn: StreamConn, last_end: float | None) -> float | None:
        """One request; the time it ended (None if it failed)."""
        request = body()
        start = time.perf_counter()
        try:
            async with asyncio.timeout(args.timeout):
                status, events, times = await send(conn, path, request)
            got = check(status, events, times)
        except Exception as e:  # noqa: BLE001 — every failure is counted and reported
            conn.close()
            failed(e)
            return None
        end = time.perf_counter()
        if last_end is None:
            state["warm"] += 1
        elif state["measuring"]:  # the cycle: from this connection's last answer to this one
            answers.append(Answer(start, end, end - last_end, got))
        return end

    async def loop(conn: StreamConn) -> None:
        last_end = None
        while not state["stop"]:
            last_end = await one(conn, last_end)

    tasks = [asyncio.create_task(loop(c)) for c in conns] if not errors else []
    window, cpu, others = 0.0, {}, 0.0
    try:
        if tasks:
            await asyncio.sleep(args.warmup)
            deadline = time.perf_counter() + args.timeout
            while state["warm"] < concurrency and not errors and time.perf_counter() < deadline:
                await asyncio.sleep(0.01)  # every connection answered once: the measured cycles are steady ones
            if errors or state["warm"] < concurrency:
                raise BadResponse(f"warm-up: {errors[:3] or 'no answer on every connection in time'}")
            pids = [*system.pids(), *extra_pids]
            cpu0 = {pid: _common.cpu_seconds(pid) for pid in pids}
            mine0, busy0 = _common.cpu_seconds(os.getpid()), _common.machine_busy_seconds()
            t0 = time.perf_counter()
            state["measuring"] = True
            while (time.perf_counter() - t0 < args.duration or len(answers) < args.min_requests) and not errors:
                if time.perf_counter() - t0 > args.duration + 10 * args.timeout:
                    break
                await asyncio.sleep(0.01)
            state["measuring"], state["stop"] = False, True
            cpu = {pid: _common.cpu_seconds(pid) - cpu0[pid] for pid in pids}
            others = (_common.machine_busy_seconds() - busy0 - sum(cpu.values())
                      - (_common.cpu_seconds(os.getpid()) - mine0))
            window = time.perf_counter() - t0
            if drain:  # the requests in flight end (checked, not counted) before the next workload starts
                await asyncio.wait_for(asyncio.gather(*tasks), args.timeout)
    finally:
        state["stop"] = True
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in conns:
            c.close()
    return Loop(concurrency, answers, errors, window, cpu, others, probed)


def measured(impl: str, k: str, system: System, args: argparse.Namespace,
             measure: Callable[..., Coroutine[Any, Any, dict[str, Any]]], *margs: Any, **kwargs: Any) -> dict[str, Any]:
    """Workload `k` measured by `measure(*margs, **kwargs)` (run with uvloop; a result with "errors" and
    "others_cpu_pct"), again (up to --attempts times, once the machine is quiet) while other processes used more
    than --max-others % of a core meanwhile; the least disturbed measurement without errors (with a warning if
    still disturbed)."""
    import uvloop

    kept: list[dict[str, Any]] = []
    for attempt in range(args.attempts):
        if attempt:
            _common.wait_quiet(args.max_others, timeout=60, exclude=system.pids)
        got = uvloop.run(measure(*margs, **kwargs))
        kept.append(got)
        if got["others_cpu_pct"] <= args.max_others or got["errors"]:
            break
        print(f"({impl} {k}: other processes used {got['others_cpu_pct']:.0f}% of a core; measured again)",
              file=sys.stderr)
    got = min(kept, key=lambda g: (g["errors"], g["others_cpu_pct"]))
    if got["others_cpu_pct"] > args.max_others:
        print(f"warning: {impl} {k} kept with other processes at {got['others_cpu_pct']:.0f}% of a core",
              file=sys.stderr)
    return got


def alternate(args: argparse.Namespace, run: Callable[[str], dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Each system's runs, `run(impl)` for --rounds rounds: vLLM then tandem in odd rounds, tandem then vLLM in
    even ones (--impl: the one system)."""
    order = ["vllm", "tandem"] if args.impl == "both" else [args.impl]
    runs: dict[str, list[dict[str, Any]]] = {impl: [] for impl in order}
    for r in range(args.rounds):
        for impl in (order if r % 2 == 0 else order[::-1]):
            print(f"round {r + 1}: {impl}", file=sys.stderr, flush=True)
            runs[impl].append(run(impl))
    return runs


# -- summary ------------------------------------------------------------------------------------------
def medians(runs: dict[str, list[dict[str, Any]]], keys: list[str], metrics: Iterable[str],
            more: Callable[[str, list[dict[str, Any]]], dict[str, Any]] | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """System -> workload key -> the median over the system's runs of each of `metrics` the runs have, what
    `more(key, runs)` adds, and the errors and requests of all the runs."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for impl, results in runs.items():
        out[impl] = {}
        for k in keys:
            m: dict[str, Any] = {x: statistics.median(r[k][x] for r in results) for x in metrics if x in results[0][k]}
            m.update(more(k, results) if more else {})
            m["errors"] = sum(r[k]["errors"] for r in results)
            m["requests"] = sum(r[k]["requests"] for r in results)
            out[impl][k] = m
    return out


def ratios(medians: dict[str, dict[str, dict[str, Any]]], keys: list[str],
           metrics: dict[str, str]) -> dict[str, dict[str, float]]:
    """Workload key -> name -> tandem / vLLM of the median `metrics[name]` (0 where vLLM's is 0); {} unless
    both systems ran."""
    if "tandem" not in medians or "vllm" not in medians:
        return {}
    out = {}
    for k in keys:
        t, v = medians["tandem"][k], medians["vllm"][k]
        out[k] = {name: t[m] / v[m] if v[m] else 0.0 for name, m in metrics.items()}
    return out


def error_count(summary: dict[str, Any]) -> int:
    """The errors of every system and workload (the exit status is 1 if there are any)."""
    return sum(int(m["errors"]) for per in summary["medians"].values() for m in per.values())


def table(head: str, rows: Iterable[tuple[str, str]], cells: Callable[[str], str]) -> list[str]:
    """A markdown table: `head`, then a row per (its first cells, workload key) of `rows`, `cells(key)` after."""
    out = [head, "|---" * head.count(" |") + "|"]
    for first, k in rows:
        out.append(first + cells(k))
    return out


def speed_table(summary: dict[str, Any], first: str, rows: Iterable[tuple[str, str]], columns: str,
                cells: Callable[[dict[str, Any]], str], ratio_columns: str,
                ratio_cells: Callable[[dict[str, float]], str]) -> list[str]:
    """The markdown table of the speeds: after the `first` cells of each of `rows`, per system `columns` ("{impl}"
    in them for its name) filled by `cells(its medians)`, then, with both systems, `ratio_columns` filled by
    `ratio_cells(the ratios)`, then the errors of all the systems' runs (bold when there are any)."""
    medians, ratios = summary["medians"], summary["ratios"]
    head = first + "".join(columns.format(impl=impl) for impl in medians) + (ratio_columns if ratios else "")

    def row(k: str) -> str:
        out = "".join(cells(per[k]) for per in medians.values()) + (ratio_cells(ratios[k]) if ratios else "")
        errors = sum(int(per[k]["errors"]) for per in medians.values())
        return out + (f" **{errors}** |" if errors else " 0 |")

    return table(head + " errors |", rows, row)


# -- plots ------------------------------------------------------------------------------------------
def plot(path: str, draw: Callable[[Any], Any]) -> None:
    """The figure `draw(matplotlib.pyplot)` returns (Agg backend), written to `path` (PNG, 80 dpi); nothing but
    a note on stderr without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("(no matplotlib: no plot)", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = draw(plt)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def ratio_bars(ax: Any, values: list[float], labels: list[str], colour: str, fontsize: float) -> None:
    """Bars of tandem / vLLM ratios, each with its value, and a line at 1."""
    bars = ax.bar(range(len(values)), values, color=colour)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(values)), labels, fontsize=fontsize)
    for bar, v in zip(bars, values, strict=True):
        ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.2f}", ha="center", va="bottom", fontsize=fontsize)
    ax.set_ylim(0, max(1.2, max(values, default=1.0) * 1.15))
