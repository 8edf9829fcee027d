"""Frontend benchmark: the OpenAI frontend's own cost in front of an engine that answers at once.
tandem's frontend + its test engine against Dynamo 1.6.1's frontend + its mocker, in the same run.

    python bench/frontend_bench.py                       # tandem, plus Dynamo if its venv has ai-dynamo
    python bench/frontend_bench.py --dynamo-python PATH  # Python with ai-dynamo + ai-dynamo-runtime 1.6.1
    python bench/frontend_bench.py --impl tandem --profile prof.out   # cProfile tandem's frontend
    python bench/frontend_bench.py --impl tandem --baseline-tree WORKTREE  # vs tandem at another commit
    python bench/frontend_bench.py --impl tandem --baseline-tree WORKTREE --paired 8  # CPU per request, paired

`bash bench/setup_baselines.sh` creates the Dynamo venv at .bench/dynamo-venv. Both deployments
use file discovery and the TCP request plane; the frontend is pinned to core 0, the engine and the
load generator (raw HTTP/1.1 keep-alive connections, one per concurrent stream) to core 1.
Per implementation and run:
  * streamed chat requests (max_tokens 32, or 1) at concurrency 1, 16 and 64 for --duration s each:
    requests/s, p50/p99 latency, p50 time to first token, and the frontend's (and the engine's)
    CPU time per request from /proc/<pid>/stat;
  * the engine called directly through the implementation's own runtime client, from core 0 (where
    the frontend would be), at concurrency 1 with max_tokens 32 and 1: what the frontend adds per
    request is p50(frontend) - p50(direct), per token the same on (p50@32 - p50@1) / 31;
  * RSS (the frontend's process tree) idle after warm-up, and its peak while --streams streams are
    open at once against a slow engine (tandem: --delay-ms 50 per token; Dynamo: the mocker at
    --speedup-ratio 0.4, ~43 ms per token at that batch), each streaming --stream-tokens tokens.
With --paired N, the frontends' CPU per request is compared in N rounds during which both deployments (tandem and
--baseline-tree, or tandem and Dynamo) serve the same load at the same time, both frontends on core 0: a change in
the host's speed (which moves single runs by a third here) hits both alike, so the rounds' ratios spread ~±2%
where sequential runs spread ±20%. An A/A run (the same tree on both sides) reads 1.00-1.03: the first-started
deployment (tandem's) pays up to 3% whichever load starts first, so the ratios err against this tree.
The load generator ACKs at once (TCP_QUICKACK): Dynamo's HTTP listener leaves Nagle on, so with
Linux's delayed ACKs every keep-alive request through it waits ~40 ms; one row shows that case.
The medians of --repeat runs (tandem and Dynamo interleaved) are reported; on a shared machine a
run during which other processes used > --max-others % of a core is discarded and repeated. This file runs under either interpreter: the roles
that talk HTTP run in tandem's venv, the `direct` role in the implementation's own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from _common import REPO, Proc, StreamConn, comparison_table, file_discovery_env, has_dynamo, wait_serving
from _common import cpu_seconds as _cpu_seconds
from _common import free_port as _free_port
from _common import machine_busy_seconds as _machine_busy_seconds
from _common import model_path as _model_path
from _common import pct as _pct
from _common import pinned as _pinned
from _common import rss_mb as _rss_mb
from _common import tree as _tree
from _common import wait_quiet as _wait_quiet

MODEL_NAME = "SmolLM2-135M-Instruct"
TANDEMS = ("tandem", "base")  # this checkout, and tandem from --baseline-tree
NAMESPACE = "bench"
ENDPOINT = f"{NAMESPACE}.backend.generate"
MESSAGES = [{"role": "user", "content": "Write one sentence about a quick brown fox."}]
FRONTEND_CORE, ENGINE_CORE = 0, 1
_CONTENT = re.compile(rb'"content":\s*"(?!")')  # a chunk carrying text (not the empty role chunk)


# -- the deployments ---------------------------------------------------------------------------
def start_deployment(impl: str, python: str, env: dict[str, str], logdir: str, slow: bool,
                     profile: str | None) -> tuple[Proc, Proc, str]:
    """(engine, frontend, base url); the engine answers at once unless `slow` (the RSS test)."""
    model = _model_path()
    if impl in TANDEMS:
        tree = env["PYTHONPATH"]  # this checkout or the baseline tree
        engine = Proc("engine", [python, "-m", "tandem.testing.engine", "--model", model, "--discovery-backend",
                                 "file", "--delay-ms", "50" if slow else "0"], env, logdir, ENGINE_CORE, cwd=tree)
        engine.wait_line("READY")
        frontend_cmd = [python, "-m", "tandem.frontend", "--http-host", "127.0.0.1", "--http-port", "0",
                        "--discovery-backend", "file"]
        if profile:
            frontend_cmd[1:3] = ["-m", "cProfile", "-o", profile, "-m", "tandem.frontend"]
        frontend = Proc("frontend", frontend_cmd, env, logdir, FRONTEND_CORE, cwd=tree)
        url = frontend.wait_line("READY").split()[1]
    else:
        # --speedup-ratio 0 is documented as "no simulation delays" but 1.6.1 still paces decode
        # (~6 ms/token here); a huge ratio makes its simulated steps take ~0.
        engine = Proc("engine", [python, "-m", "dynamo.mocker", "--model-path", model, "--model-name", MODEL_NAME,
                                 "--speedup-ratio", "0.4" if slow else "1000000", "--block-size", "32",
                                 "--max-num-seqs", "2048", "--discovery-backend", "file", "--request-plane", "tcp",
                                 "--event-plane", "zmq"], env, logdir, ENGINE_CORE)
        port = _free_port()
        frontend = Proc("frontend", [python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port",
                                     str(port), "--discovery-backend", "file", "--request-plane", "tcp",
                                     "--event-plane", "zmq", "--router-mode", "round-robin"], env, logdir, FRONTEND_CORE)
        url = f"http://127.0.0.1:{port}"
    _wait_serving(url, [engine, frontend])
    return engine, frontend, url


def _wait_serving(url: str, procs: list[Proc]) -> None:
    """Until a streamed chat request through the frontend succeeds (with its 2 tokens)."""
    wait_serving(url, procs, MODEL_NAME, min_chunks=2)


# -- load generator (raw HTTP/1.1, keep-alive, one connection per concurrent stream) --------------
class Conn(StreamConn):
    async def request(self, body: bytes, on_open: Any = None) -> tuple[float, float, int]:
        """(seconds to the first text chunk, seconds to the end, text chunks) of one streamed request."""
        start = time.perf_counter()
        status, events = await self.post("/v1/chat/completions", body)
        if not status.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"HTTP status {status!r}: {b''.join([e async for e in events])[:2000]!r}")
        if on_open is not None:
            on_open()
        first, tokens = 0.0, 0
        async for event in events:
            if _CONTENT.search(event):
                tokens += 1
                if not first:
                    first = time.perf_counter() - start
        return first, time.perf_counter() - start, tokens


def _body(max_tokens: int) -> bytes:
    return json.dumps({"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": max_tokens, "stream": True}).encode()


async def load(url: str, concurrency: int, duration: float, max_tokens: int, frontend: int,
               engine: int, quickack: bool = True) -> dict[str, float]:
    """Closed loop: `concurrency` connections each send the next request when the last one ended."""
    host, port = url.split("//")[1].rsplit(":", 1)
    body = _body(max_tokens)
    conns = [Conn(host, int(port), quickack) for _ in range(concurrency)]
    await asyncio.gather(*(c.request(body) for c in conns))  # connect + warm up
    results: list[tuple[float, float, int]] = []
    cpu0 = (_cpu_seconds(frontend), _cpu_seconds(engine), _cpu_seconds(os.getpid()), _machine_busy_seconds())
    start = time.perf_counter()
    deadline = start + duration

    async def worker(conn: Conn) -> None:
        while time.perf_counter() < deadline:
            results.append(await conn.request(body))

    await asyncio.wait_for(asyncio.gather(*(worker(c) for c in conns)), duration + 120)
    elapsed = time.perf_counter() - start
    cpu_frontend, cpu_engine = _cpu_seconds(frontend) - cpu0[0], _cpu_seconds(engine) - cpu0[1]
    # CPU used by other processes meanwhile (a shared machine): the figures are noisy if this is high
    cpu_others = _machine_busy_seconds() - cpu0[3] - cpu_frontend - cpu_engine - (_cpu_seconds(os.getpid()) - cpu0[2])
    for c in conns:
        if c.writer is not None:
            c.writer.close()
    latencies = sorted(r[1] for r in results)
    ttfts = sorted(r[0] for r in results)
    tokens = [r[2] for r in results]
    if min(tokens) < max_tokens:
        raise RuntimeError(f"a response had {min(tokens)} text chunks, wanted {max_tokens}")
    n = len(results)
    return {"rps": n / elapsed, "p50_ms": _pct(latencies, 0.5) * 1e3, "p99_ms": _pct(latencies, 0.99) * 1e3,
            "ttft_p50_ms": _pct(ttfts, 0.5) * 1e3, "tokens_per_s": sum(tokens) / elapsed,
            "frontend_cpu_us_per_req": cpu_frontend / n * 1e6, "frontend_core_busy_pct": cpu_frontend / elapsed * 100,
            "engine_cpu_us_per_req": cpu_engine / n * 1e6, "others_cpu_pct": max(cpu_others, 0) / elapsed * 100}


async def hold_streams(url: str, streams: int, max_tokens: int, frontend: int) -> dict[str, float]:
    """Open `streams` streaming requests at once; peak RSS of the frontend while they are open."""
    host, port = url.split("//")[1].rsplit(":", 1)
    body = _body(max_tokens)
    pids = _tree(frontend)
    state = {"open": 0, "max_open": 0, "peak": 0.0, "running": True}

    def opened() -> None:
        state["open"] += 1
        state["max_open"] = max(state["max_open"], state["open"])

    async def one() -> int:
        conn = Conn(host, int(port))
        try:
            _, _, tokens = await conn.request(body, on_open=opened)
        finally:
            state["open"] -= 1
            if conn.writer is not None:
                conn.writer.close()
        return tokens

    async def sample() -> None:
        while state["running"]:
            state["peak"] = max(state["peak"], _rss_mb(pids))
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample())
    start = time.perf_counter()
    counts = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(streams))), 300)
    elapsed = time.perf_counter() - start
    state["running"] = False
    await sampler
    if min(counts) < max_tokens:
        raise RuntimeError(f"a held stream had {min(counts)} text chunks, wanted {max_tokens}")
    return {"rss_streams_peak_mb": state["peak"], "streams_open_max": state["max_open"],
            "streams_seconds": elapsed, "rss_after_streams_mb": _rss_mb(pids)}


# -- direct role: the engine without the frontend, through the implementation's runtime client -----
async def direct(impl: str, token_ids: list[int], eos: list[int], duration: float) -> dict[str, float]:
    if impl in TANDEMS:
        from tandem.runtime import DistributedRuntime, RuntimeConfig

        runtime = await DistributedRuntime.create(RuntimeConfig.from_env())
        client = await runtime.endpoint(ENDPOINT).client()
        await client.wait_for_instances(1, timeout=30)
        options: dict[str, Any] = {}
    else:
        from dynamo.runtime import DistributedRuntime

        runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
        client = await runtime.endpoint(ENDPOINT).client()
        await client.wait_for_instances()
        options = {"annotated": False}

    async def one(max_tokens: int) -> int:
        request = {"model": MODEL_NAME, "token_ids": token_ids, "eos_token_ids": eos,
                   "stop_conditions": {"max_tokens": max_tokens, "stop_token_ids_hidden": eos},
                   "sampling_options": {}, "output_options": {}, "annotations": []}
        stream = await client.round_robin(request, **options)
        n = 0
        async for item in stream:
            n += len(item.get("token_ids") or [])
        return n

    result = {}
    for max_tokens in (32, 1):
        for _ in range(100):
            got = await one(max_tokens)
        if got != max_tokens:
            raise RuntimeError(f"direct call produced {got} tokens, wanted {max_tokens}")
        latencies = []
        deadline = time.perf_counter() + duration
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            await one(max_tokens)
            latencies.append(time.perf_counter() - start)
        latencies.sort()
        result[f"direct_{max_tokens}_p50_ms"] = _pct(latencies, 0.5) * 1e3
    if impl in TANDEMS:
        await runtime.shutdown()
    else:
        runtime.shutdown()
    return result


def _prompt_ids() -> tuple[list[int], list[int]]:
    """The prompt tokens the frontends send to the engine for MESSAGES, and the EOS ids."""
    from tandem.llm.chat_template import ChatTemplate
    from tandem.llm.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(_model_path())
    text = ChatTemplate.for_tokenizer(tokenizer).render(MESSAGES)
    return tokenizer.encode(text, add_special_tokens=False), list(tokenizer.eos_token_ids)


# -- client role: one implementation, one run ------------------------------------------------------
def run_client(args: argparse.Namespace) -> None:
    python = args.dynamo_python if args.impl == "dynamo" else sys.executable
    kv = tempfile.mkdtemp(prefix=f"fbench-{args.impl}-")  # removed unless the run fails
    logdir = os.path.join(kv, "logs")
    os.makedirs(logdir)
    # (each frontend at its default log level: both log each request at info)
    env = file_discovery_env(kv, NAMESPACE, args.baseline_tree if args.impl == "base" else REPO)
    import uvloop

    result: dict[str, float] = {}
    procs: list[Proc] = []
    try:
        engine, frontend, url = start_deployment(args.impl, python, env, logdir, False, args.profile)
        procs = [engine, frontend]
        os.sched_setaffinity(0, {ENGINE_CORE})  # the load generator shares the engine's core
        # warm up, then idle RSS
        uvloop.run(load(url, 16, 2.0, 32, frontend.pid, engine.pid))
        time.sleep(1.0)
        result["rss_idle_mb"] = _rss_mb(_tree(frontend.pid))
        for concurrency, max_tokens in ((1, 1), (1, 32), (16, 32), (64, 32)):
            stats = uvloop.run(load(url, concurrency, args.duration, max_tokens, frontend.pid, engine.pid))
            suffix = f"c{concurrency}" + ("_1tok" if max_tokens == 1 else "")
            result.update({f"{key}_{suffix}": value for key, value in stats.items()})
        # What a keep-alive client with Linux's default delayed ACKs (the OpenAI SDK, httpx) sees.
        stats = uvloop.run(load(url, 1, min(args.duration, 2.0), 32, frontend.pid, engine.pid, quickack=False))
        result["p50_ms_c1_plainack"] = stats["p50_ms"]
        token_ids, eos = _prompt_ids()
        out = subprocess.run([python, __file__, "--role", "direct", "--impl", args.impl, "--duration",
                              str(args.duration), "--token-ids", json.dumps(token_ids), "--eos", json.dumps(eos)],
                             env=env, capture_output=True, text=True, timeout=300,
                             preexec_fn=_pinned(FRONTEND_CORE))
        if out.returncode == 0 and out.stdout.strip():
            result.update(json.loads(out.stdout.strip().splitlines()[-1]))
        else:
            print(f"{args.impl}: direct calls failed:\n{out.stderr[-2000:]}", file=sys.stderr)
        for p in reversed(procs):
            p.stop()
        procs = []
        if args.streams:
            os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
            engine, frontend, url = start_deployment(args.impl, python, env, logdir, True, None)
            procs = [engine, frontend]
            os.sched_setaffinity(0, {ENGINE_CORE})
            result.update(uvloop.run(hold_streams(url, args.streams, args.stream_tokens, frontend.pid)))
    except BaseException:
        for p in procs:
            print(f"--- {p.name} log ---\n{p.tail()}", file=sys.stderr)
        print(f"(logs kept in {logdir})", file=sys.stderr)
        raise
    finally:
        for p in reversed(procs):
            p.stop()
    shutil.rmtree(kv, ignore_errors=True)
    print(json.dumps(result), flush=True)


# -- orchestrator ----------------------------------------------------------------------------------
def run_impl(impl: str, args: argparse.Namespace) -> dict[str, float]:
    """One run; on a shared machine, a run during which other processes used more than
    --max-others % of a core is discarded and repeated (up to --attempts runs; else the least
    disturbed one is kept, with a warning)."""
    cmd = [sys.executable, __file__, "--role", "client", "--impl", impl, "--duration", str(args.duration),
           "--streams", str(args.streams), "--stream-tokens", str(args.stream_tokens),
           "--dynamo-python", args.dynamo_python, "--baseline-tree", args.baseline_tree or ""]
    if args.profile:
        cmd += ["--profile", args.profile]
    failures, kept = 0, []
    while len(kept) + failures < args.attempts:
        _wait_quiet(args.max_others)
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, preexec_fn=_pinned(None))
        if out.returncode != 0 or not out.stdout.strip():
            failures += 1  # e.g. another process on the machine killed or starved a server
            print(f"{impl} run failed:\n{out.stderr[-1500:]}", file=sys.stderr)
            continue
        result = json.loads(out.stdout.strip().splitlines()[-1])
        others = max(v for k, v in result.items() if k.startswith("others_cpu_pct"))
        kept.append((others, result))
        if others <= args.max_others:
            break
        print(f"({impl} run discarded: other processes used {others:.0f}% of a core meanwhile)", file=sys.stderr)
    if not kept:
        raise SystemExit(f"{impl}: every run failed")
    others, result = min(kept, key=lambda k: k[0])
    if others > args.max_others:
        print(f"warning: kept a {impl} run during which other processes used {others:.0f}% of a core",
              file=sys.stderr)
    return result


def derive(impl: str, r: dict[str, float]) -> dict[str, float]:
    """Added latency per request and per token (when the direct figures exist)."""
    out = dict(r)
    out["per_token_frontend_us"] = (r["p50_ms_c1"] - r["p50_ms_c1_1tok"]) / 31 * 1e3
    if "direct_32_p50_ms" in r:
        out["added_per_request_1tok_us"] = (r["p50_ms_c1_1tok"] - r["direct_1_p50_ms"]) * 1e3
        out["per_token_direct_us"] = (r["direct_32_p50_ms"] - r["direct_1_p50_ms"]) / 31 * 1e3
        # Dynamo's direct path is its Python binding, which pays a Rust/Python crossing per item
        # (~26 us/token here) that its all-Rust frontend does not: the subtraction would be meaningless.
        if impl in TANDEMS:
            out["added_per_request_us"] = (r["p50_ms_c1"] - r["direct_32_p50_ms"]) * 1e3
            out["added_per_token_us"] = out["per_token_frontend_us"] - out["per_token_direct_us"]
    out["frontend_capacity_per_s_c64"] = 1e6 / r["frontend_cpu_us_per_req_c64"]
    out["others_cpu_pct_max"] = max(v for k, v in r.items() if k.startswith("others_cpu_pct"))
    return out


ROWS = [  # key, label, better: "low" / "high" / None
    ("rps_c1", "streamed requests/s, concurrency 1", "high"),
    ("rps_c16", "streamed requests/s, concurrency 16", "high"),
    ("rps_c64", "streamed requests/s, concurrency 64", "high"),
    ("tokens_per_s_c64", "streamed tokens/s, concurrency 64", "high"),
    ("p50_ms_c1", "latency p50, c=1 (ms)", "low"),
    ("p99_ms_c1", "latency p99, c=1 (ms)", "low"),
    ("ttft_p50_ms_c1", "time to first token p50, c=1 (ms)", "low"),
    ("p50_ms_c16", "latency p50, c=16 (ms)", "low"),
    ("p99_ms_c16", "latency p99, c=16 (ms)", "low"),
    ("ttft_p50_ms_c16", "time to first token p50, c=16 (ms)", "low"),
    ("p50_ms_c64", "latency p50, c=64 (ms)", "low"),
    ("p99_ms_c64", "latency p99, c=64 (ms)", "low"),
    ("ttft_p50_ms_c64", "time to first token p50, c=64 (ms)", "low"),
    ("p50_ms_c1_1tok", "latency p50, c=1, max_tokens 1 (ms)", "low"),
    ("p50_ms_c1_plainack", "latency p50, c=1, client with delayed ACKs (ms)", "low"),
    ("direct_32_p50_ms", "engine called directly, p50, 32 tokens (ms)", "low"),
    ("direct_1_p50_ms", "engine called directly, p50, 1 token (ms)", "low"),
    ("added_per_request_us", "added by the frontend per request, p50, 32 tokens (µs)", "low"),
    ("added_per_request_1tok_us", "added by the frontend per request, p50, 1 token (µs)", "low"),
    ("per_token_frontend_us", "per token through the frontend (µs)", "low"),
    ("per_token_direct_us", "per token direct (µs)", "low"),
    ("added_per_token_us", "added by the frontend per token (µs)", "low"),
    ("frontend_cpu_us_per_req_c1", "frontend CPU per request, c=1 (µs)", "low"),
    ("frontend_cpu_us_per_req_c64", "frontend CPU per request, c=64 (µs)", "low"),
    ("frontend_core_busy_pct_c64", "frontend core busy, c=64 (%)", None),
    ("frontend_capacity_per_s_c64", "frontend requests/s per core, from its CPU per request, c=64", "high"),
    ("engine_cpu_us_per_req_c64", "engine CPU per request, c=64 (µs)", None),
    ("others_cpu_pct_max", "other processes' CPU during the load levels, worst level (% of a core)", None),
    ("rss_idle_mb", "frontend RSS idle, after warm-up (MB)", "low"),
    ("rss_streams_peak_mb", "frontend RSS peak, {streams} open streams (MB)", "low"),
    ("streams_open_max", "streams open at once (of {streams})", None),
    ("streams_seconds", "time to serve the {streams} streams (s)", None),
]


PAIRED_LEVELS = ((64, 32), (1, 1))  # (concurrency, max_tokens)


def run_paired(args: argparse.Namespace, other: str) -> dict[str, float]:
    """Tandem and `other` ("base" or "dynamo") up at once, frontends on core 0; each round puts the same load
    on both at the same time. Per level: each side's median CPU per request and the rounds' ratios."""
    import uvloop

    deployments: list[tuple[Proc, Proc, str]] = []
    dirs = []
    try:
        for impl in ("tandem", other):
            kv = tempfile.mkdtemp(prefix=f"fbench-paired-{impl}-")
            dirs.append(kv)
            os.makedirs(os.path.join(kv, "logs"))
            python = args.dynamo_python if impl == "dynamo" else sys.executable
            env = file_discovery_env(kv, NAMESPACE, args.baseline_tree if impl == "base" else REPO)
            deployments.append(start_deployment(impl, python, env, os.path.join(kv, "logs"), False, None))
        os.sched_setaffinity(0, {ENGINE_CORE})

        async def together(concurrency: int, seconds: float, max_tokens: int, flip: bool = False) -> list[dict[str, float]]:
            """Both loads at once; `flip` starts the second deployment's first (rounds alternate, so that
            neither side always goes first)."""
            order = deployments[::-1] if flip else deployments
            results = list(await asyncio.gather(*(load(url, concurrency, seconds, max_tokens, frontend.pid, engine.pid)
                                                  for engine, frontend, url in order)))
            return results[::-1] if flip else results

        uvloop.run(together(16, 2.0, 32))  # warm up
        result: dict[str, float] = {}
        for concurrency, max_tokens in PAIRED_LEVELS:
            level = f"c{concurrency}" + ("_1tok" if max_tokens == 1 else "")
            ratios, ours, theirs, ttfts = [], [], [], ([], [])
            for round_ in range(args.paired):
                mine, base = uvloop.run(together(concurrency, args.duration, max_tokens, flip=bool(round_ % 2)))
                ours.append(mine["frontend_cpu_us_per_req"])
                theirs.append(base["frontend_cpu_us_per_req"])
                ratios.append(ours[-1] / theirs[-1])
                ttfts[0].append(mine["ttft_p50_ms"])
                ttfts[1].append(base["ttft_p50_ms"])
                print(f"  {level} round {round_ + 1}: tandem {ours[-1]:.0f} µs, {other} {theirs[-1]:.0f} µs per request, "
                      f"ratio {ratios[-1]:.3f}; TTFT p50 {ttfts[0][-1]:.1f} and {ttfts[1][-1]:.1f} ms",
                      file=sys.stderr, flush=True)
            result.update({f"cpu_us_{level}_tandem": statistics.median(ours), f"cpu_us_{level}_{other}":
                           statistics.median(theirs), f"ratio_{level}": statistics.median(ratios),
                           f"ratio_{level}_min": min(ratios), f"ratio_{level}_max": max(ratios),
                           f"ttft_ms_{level}_tandem": statistics.median(ttfts[0]),
                           f"ttft_ms_{level}_{other}": statistics.median(ttfts[1])})
        return result
    except BaseException:
        for _, frontend, _ in deployments:
            print(f"--- {frontend.name} log ---\n{frontend.tail()}", file=sys.stderr)
        raise
    finally:
        for engine, frontend, _ in deployments:
            frontend.stop()
            engine.stop()
        for kv in dirs:
            shutil.rmtree(kv, ignore_errors=True)


def paired_report(args: argparse.Namespace, impls: list[str]) -> None:
    for other in (impl for impl in impls if impl != "tandem"):
        _wait_quiet(args.max_others)
        r = run_paired(args, other)
        print(f"\nfrontend CPU per request, tandem and {other} serving the same load at the same time, {args.paired} "
              f"rounds of {args.duration:g} s per level (medians; the ratio is the median of the rounds' ratios):\n")
        print(f"| level | tandem (µs) | {other} (µs) | tandem / {other} | rounds' ratios | TTFT p50, tandem / {other} (ms) |")
        print("|---|---|---|---|---|---|")
        for concurrency, max_tokens in PAIRED_LEVELS:
            level = f"c{concurrency}" + ("_1tok" if max_tokens == 1 else "")
            print(f"| c={concurrency}, max_tokens {max_tokens} | {r[f'cpu_us_{level}_tandem']:,.0f} | "
                  f"{r[f'cpu_us_{level}_{other}']:,.0f} | {r[f'ratio_{level}']:.3f} | "
                  f"{r[f'ratio_{level}_min']:.3f}-{r[f'ratio_{level}_max']:.3f} | "
                  f"{r[f'ttft_ms_{level}_tandem']:.2f} / {r[f'ttft_ms_{level}_{other}']:.2f} |")
        print("\n" + json.dumps({other: r}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["orchestrate", "client", "direct"], default="orchestrate")
    parser.add_argument("--impl", choices=["tandem", "dynamo", "both", "base"], default="both")
    parser.add_argument("--baseline-tree", default=None,
                        help="also run tandem from this checkout (e.g. a git worktree of the previous commit), "
                        "interleaved; the ratio column then compares with it")
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per load level")
    parser.add_argument("--streams", type=int, default=1000, help="streams held open for the RSS test (0: skip)")
    parser.add_argument("--stream-tokens", type=int, default=100, help="tokens per held stream")
    parser.add_argument("--repeat", type=int, default=3, help="runs per implementation; the median is reported")
    parser.add_argument("--max-others", type=float, default=15.0,
                        help="discard a run if other processes used more than this %% of a core meanwhile")
    parser.add_argument("--attempts", type=int, default=4, help="runs tried per reported run")
    parser.add_argument("--paired", type=int, default=0, metavar="ROUNDS",
                        help="instead of the full benchmark: the frontends' CPU per request with both deployments "
                        "serving the same load at once, this many rounds per level")
    parser.add_argument("--profile", default=None, help="(tandem) write a cProfile of the frontend to this file")
    parser.add_argument("--dynamo-python", default=os.path.join(REPO, ".bench", "dynamo-venv", "bin", "python"))
    parser.add_argument("--token-ids", default="[]", help=argparse.SUPPRESS)
    parser.add_argument("--eos", default="[]", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "direct":
        import uvloop

        result = uvloop.run(direct(args.impl, json.loads(args.token_ids), json.loads(args.eos), args.duration))
        print(json.dumps(result), flush=True)
        os._exit(0)  # Dynamo's runtime threads may outlive the loop
    if args.role == "client":
        run_client(args)
        return

    impls = ["tandem"] if args.impl in ("tandem", "both") else []
    if args.baseline_tree:
        impls.append("base")
    if args.impl in ("dynamo", "both"):
        if has_dynamo(args.dynamo_python):
            impls.append("dynamo")
        else:
            print(f"(no Dynamo baseline: {args.dynamo_python} lacks ai-dynamo; run bash bench/setup_baselines.sh)")
    if args.paired:
        paired_report(args, impls)
        return
    all_runs: dict[str, list[dict[str, float]]] = {impl: [] for impl in impls}
    for _ in range(args.repeat):  # interleaved, so that a change in the machine's load hits both
        for impl in impls:
            all_runs[impl].append(derive(impl, run_impl(impl, args)))
    results: dict[str, dict[str, float]] = {}
    for impl, runs in all_runs.items():
        keys = [k for k in runs[0] if all(k in run for run in runs)]
        results[impl] = {key: statistics.median(run[key] for run in runs) for key in keys}
    print(f"\nfrontend_bench: streamed chat completions (max_tokens 32 unless noted), {args.duration:g} s per level, "
          f"{args.streams} held streams of {args.stream_tokens} tokens, median of {args.repeat} runs; frontend "
          f"on core {FRONTEND_CORE}, engine + load generator on core {ENGINE_CORE}\n")
    rows = [(key, label.format(streams=args.streams), better) for key, label, better in ROWS]
    print("\n".join(comparison_table(results, rows, "tandem advantage",
                                     lambda t, d, better: f"{d / t if better == 'low' else t / d:.3f}x")))
    print("\nThe frontend's CPU per request (its own CPU time from /proc, µs), each run:")
    for key in ("frontend_cpu_us_per_req_c1", "frontend_cpu_us_per_req_c64"):
        for impl, runs in all_runs.items():
            values = sorted(run[key] for run in runs)
            print(f"  {key:30s} {impl:7s} median {statistics.median(values):7.1f}  runs {', '.join(f'{v:.0f}' for v in values)}")
    if "tandem" in all_runs:
        for other in (impl for impl in all_runs if impl != "tandem"):
            print(f"  tandem / {other}, c=64, the ratio of each interleaved pair: " + ", ".join(
                f"{t['frontend_cpu_us_per_req_c64'] / o['frontend_cpu_us_per_req_c64']:.3f}"
                for t, o in zip(all_runs["tandem"], all_runs[other], strict=True)))
    print("\n" + json.dumps(results))


if __name__ == "__main__":
    main()
