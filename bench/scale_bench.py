"""Scale-out on one machine, in one run: discovery (etcd against file) and frontend processes (1 against 2,
with Dynamo 1.6.1's frontend in the same run).

    .venv/bin/python bench/scale_bench.py                 # both parts
    .venv/bin/python bench/scale_bench.py --part discovery --instances 64 --events 200
    .venv/bin/python bench/scale_bench.py --part frontend --duration 10

Discovery part:
For each backend and population: `--instances` simulated instances register a key each under
`v1/instances/bench/...`, written by `--stores` stores (each its own lease, as a process has; more stores
in one process would measure this process's threads rather than the backend); a watcher follows the
prefix.
Measured:
- registration: from a new instance's `put` returning to its key reaching the watcher (what the
  frontend needs before it can route to a new worker), `--events` times, one at a time;
- watch event latency while `--rate` other updates per second are being written by the population
  (what a busy deployment adds);
- the cost of the population: start time of all the stores (lease grant and first put).
etcd runs from the venv's binary (scripts/install.sh) on loopback, with its data in a temp directory.

Frontend part: `tandem frontend` with 1 and with 2 processes (`--num-processes`), and Dynamo 1.6.1's frontend
(multi-threaded Rust), each in front of an engine that answers at once (tandem's test engine; Dynamo's
mocker at a huge speedup), on file discovery and TCP. The engine is pinned to core 1; the frontend processes
and the load generator are not pinned (this machine has 2 cores: a frontend cannot get two free ones while
the load generator and the engine run). A closed loop of `--concurrency` keep-alive connections streams
chat requests (`--max-tokens` tokens) for `--duration` s. Reported: requests/s, and the frontend's CPU
time per request summed over all its processes, so "requests/s per frontend CPU-second" says how well a
second process scales (1.0x = no overhead from splitting).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # frontend_bench's own imports

from bench._common import Proc, free_port, has_dynamo, pct, tree_cpu_seconds, wait_serving, write_json  # noqa: E402
from bench._common import model_path as bench_model_path  # noqa: E402
from tandem.runtime.discovery import EtcdStore, FileStore, KeyValueStore  # noqa: E402
from tandem.runtime.discovery.etcd import EtcdConfig  # noqa: E402


def start_etcd(workdir: str) -> tuple[subprocess.Popen[bytes], str]:
    import httpx

    binary = os.path.join(sys.prefix, "bin", "etcd")
    client, peer = free_port(), free_port()
    url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    proc = subprocess.Popen([binary, "--name", "bench", "--data-dir", os.path.join(workdir, "etcd"),
                             "--listen-client-urls", url, "--advertise-client-urls", url, "--listen-peer-urls",
                             peer_url, "--initial-advertise-peer-urls", peer_url, "--initial-cluster",
                             f"bench={peer_url}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).json().get("health") == "true":
                return proc, url
        except (httpx.HTTPError, ValueError):
            time.sleep(0.05)
    raise RuntimeError("etcd did not start")


async def measure(make: Any, instances: int, stores: int, events: int, rate: float) -> dict[str, float]:
    started = time.perf_counter()
    population: list[KeyValueStore] = [make() for _ in range(min(stores, instances))]
    await asyncio.gather(*(s.start() for s in population))
    await asyncio.gather(*(population[n % len(population)].put(f"v1/instances/bench/backend/generate/{n:x}", b"{}")
                           for n in range(instances)))
    startup = time.perf_counter() - started
    watcher = make()
    await watcher.start()
    watch = await watcher.watch_prefix("v1/instances/bench/")
    for _ in range(instances):  # the replay
        await anext(watch)

    async def latency(key: str, writer: KeyValueStore) -> float:
        t0 = time.perf_counter()
        await writer.put(key, b"new")
        while True:
            event = await anext(watch)
            if event.key == key:
                return (time.perf_counter() - t0) * 1000

    quiet = [await latency(f"v1/instances/bench/new/{n}", population[n % len(population)]) for n in range(events)]
    stop = asyncio.Event()

    async def churn() -> None:
        n = 0
        while not stop.is_set():
            await population[n % len(population)].put(f"v1/instances/bench/backend/generate/{n % instances:x}",
                                                      str(n).encode())
            n += 1
            await asyncio.sleep(1 / rate)

    churner = asyncio.create_task(churn())
    busy = [await latency(f"v1/instances/bench/busy/{n}", population[n % len(population)]) for n in range(events)]
    stop.set()
    await churner
    watch.close()
    await asyncio.gather(*(s.close() for s in [*population, watcher]))
    quiet.sort()
    busy.sort()
    return {"startup_s": startup, "quiet_p50_ms": statistics.median(quiet), "quiet_p99_ms": pct(quiet, 0.99),
            "busy_p50_ms": statistics.median(busy), "busy_p99_ms": pct(busy, 0.99)}


async def discovery_part(args: argparse.Namespace) -> dict[str, Any]:
    workdir = tempfile.mkdtemp(prefix="scale-bench-")
    etcd, url = start_etcd(workdir)
    results: dict[str, Any] = {}
    try:
        for instances in args.instances:
            root = os.path.join(workdir, f"kv-{instances}")
            for name, make in (("file", lambda root=root: FileStore(root)),
                               ("etcd", lambda: EtcdStore(EtcdConfig([url])))):
                r = await measure(make, instances, args.stores, args.events, args.rate)
                results[f"{name}-{instances}"] = r
                print(f"{name:<5} {instances:>4} instances ({min(args.stores, instances)} leases): start {r['startup_s']:6.2f} s | new key -> watcher "
                      f"p50 {r['quiet_p50_ms']:7.2f} ms p99 {r['quiet_p99_ms']:7.2f} ms | with {args.rate:g} "
                      f"updates/s: p50 {r['busy_p50_ms']:7.2f} ms p99 {r['busy_p99_ms']:7.2f} ms", flush=True)
    finally:
        etcd.terminate()
        etcd.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)
    return results


# -- frontend processes -----------------------------------------------------------------------------
ENGINE_CORE = 1
MODEL_NAME = "SmolLM2-135M-Instruct"


def start_frontend(impl: str, python: str, env: dict[str, str], logdir: str) -> tuple[Proc, Proc, str]:
    """(engine, frontend, url) for `impl`: tandem-1, tandem-2 (processes) or dynamo."""
    model = bench_model_path()
    if impl.startswith("tandem"):
        engine = Proc("engine", [python, "-m", "tandem.testing.engine", "--model", model, "--discovery-backend", "file",
                                 "--delay-ms", "0"], env, logdir, ENGINE_CORE)
        engine.wait_line("READY")
        frontend = Proc("frontend", [python, "-m", "tandem.frontend", "--http-host", "127.0.0.1", "--http-port", "0",
                                     "--discovery-backend", "file", "--num-processes", impl.split("-")[1]], env, logdir)
        url = frontend.wait_line("READY").split()[1].replace("0.0.0.0", "127.0.0.1")
    else:
        engine = Proc("engine", [python, "-m", "dynamo.mocker", "--model-path", model, "--model-name", MODEL_NAME,
                                 "--speedup-ratio", "1000000", "--block-size", "32", "--max-num-seqs", "2048",
                                 "--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"],
                      env, logdir, ENGINE_CORE)
        port = free_port()
        frontend = Proc("frontend", [python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port",
                                     str(port), "--discovery-backend", "file", "--request-plane", "tcp",
                                     "--event-plane", "zmq", "--router-mode", "round-robin"], env, logdir)
        url = f"http://127.0.0.1:{port}"
    wait_serving(url, [engine, frontend], MODEL_NAME, min_chunks=2)
    _wait_every_replica_lists_the_model(url)
    return engine, frontend, url


def _wait_every_replica_lists_the_model(url: str, timeout: float = 60) -> None:
    """Replicas discover the workers each on its own: until 20 fresh connections in a row (spread over the
    replicas by the kernel) all list the model."""
    import httpx

    deadline, in_a_row = time.monotonic() + timeout, 0
    while in_a_row < 20:
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every frontend process at {url} lists {MODEL_NAME}")
        listed = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=5).json().get("data", [])]
        in_a_row = in_a_row + 1 if MODEL_NAME in listed else 0
        time.sleep(0.01)


async def frontend_load(url: str, frontend_pid: int, concurrency: int, duration: float,
                        max_tokens: int) -> dict[str, float]:
    from frontend_bench import Conn, _body

    host, port = url.split("//")[1].rsplit(":", 1)
    body = _body(max_tokens)
    conns = [Conn(host, int(port)) for _ in range(concurrency)]
    await asyncio.gather(*(c.request(body) for c in conns))  # connect and warm up
    done = 0
    cpu0 = tree_cpu_seconds([frontend_pid])
    start = time.perf_counter()
    deadline = start + duration

    async def worker(conn: Any) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            _, _, tokens = await conn.request(body)
            if tokens < max_tokens:
                raise RuntimeError(f"a response had {tokens} text chunks, wanted {max_tokens}")
            done += 1

    await asyncio.wait_for(asyncio.gather(*(worker(c) for c in conns)), duration + 120)
    elapsed = time.perf_counter() - start
    cpu = tree_cpu_seconds([frontend_pid]) - cpu0
    for c in conns:
        if c.writer is not None:
            c.writer.close()
    return {"rps": done / elapsed, "frontend_cpu_s": cpu, "frontend_cpu_us_per_req": cpu / done * 1e6,
            "rps_per_frontend_cpu_s": done / cpu}


def frontend_part(args: argparse.Namespace) -> dict[str, Any]:
    impls = [("tandem-1", sys.executable), ("tandem-2", sys.executable)]
    if has_dynamo(args.dynamo_python):
        impls.append(("dynamo", args.dynamo_python))
    else:
        print(f"(no Dynamo baseline: {args.dynamo_python} lacks ai-dynamo; run bash bench/setup_baselines.sh)")
    runs: dict[str, list[dict[str, float]]] = {impl: [] for impl, _ in impls}
    for _ in range(args.repeat):
        for impl, python in impls:  # interleaved, so that drifts of the machine touch every one alike
            with tempfile.TemporaryDirectory(prefix=f"scale-{impl}-") as workdir:
                env = {**os.environ, "DYN_FILE_KV": os.path.join(workdir, "kv"), "DYN_NAMESPACE": "bench",
                       "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_LOG": "warn", "PYTHONPATH": os.path.dirname(
                           os.path.dirname(os.path.abspath(__file__)))}
                engine, frontend, url = start_frontend(impl, python, env, workdir)
                try:
                    r = asyncio.run(frontend_load(url, frontend.pid, args.concurrency, args.duration, args.max_tokens))
                finally:
                    frontend.stop()
                    engine.stop()
            runs[impl].append(r)
            print(f"{impl:<9} {r['rps']:8.0f} req/s | frontend CPU {r['frontend_cpu_us_per_req']:6.0f} us/req | "
                  f"{r['rps_per_frontend_cpu_s']:6.0f} req per frontend CPU-second", flush=True)
    results = {impl: {key: statistics.median(run[key] for run in rs) for key in rs[0]} for impl, rs in runs.items()}
    one, two = results["tandem-1"], results["tandem-2"]
    results["scaling_efficiency"] = two["rps_per_frontend_cpu_s"] / one["rps_per_frontend_cpu_s"]
    print(f"\nfrontend processes, concurrency {args.concurrency}, {args.max_tokens} tokens, median of {args.repeat}:")
    print("| frontend | requests/s | frontend CPU per request (us) | requests per frontend CPU-second |")
    print("|---|---|---|---|")
    for impl in runs:
        r = results[impl]
        print(f"| {impl} | {r['rps']:,.0f} | {r['frontend_cpu_us_per_req']:,.0f} | {r['rps_per_frontend_cpu_s']:,.0f} |")
    print(f"scaling efficiency (2 processes against 1, per frontend CPU-second): {results['scaling_efficiency']:.2f}x")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", nargs="+", choices=["discovery", "frontend"], default=["discovery", "frontend"])
    parser.add_argument("--instances", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--events", type=int, default=100)
    parser.add_argument("--stores", type=int, default=16, help="stores (leases) that write the instances' keys")
    parser.add_argument("--rate", type=float, default=50.0, help="background updates per second while measuring")
    parser.add_argument("--concurrency", type=int, default=64, help="frontend part: connections in the closed loop")
    parser.add_argument("--duration", type=float, default=8.0, help="frontend part: seconds of load per run")
    parser.add_argument("--max-tokens", type=int, default=8, help="frontend part: tokens per streamed request")
    parser.add_argument("--repeat", type=int, default=3, help="frontend part: runs per frontend (median reported)")
    parser.add_argument("--dynamo-python", default=os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), ".bench", "dynamo-venv", "bin", "python"))
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    if "discovery" in args.part:
        results["discovery"] = asyncio.run(discovery_part(args))
    if "frontend" in args.part:
        results["frontend"] = frontend_part(args)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
