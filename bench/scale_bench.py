"""Discovery at scale: etcd against file discovery, on one machine, in one run.

    .venv/bin/python bench/scale_bench.py                 # 64 and 512 simulated instances
    .venv/bin/python bench/scale_bench.py --instances 64 --events 200

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

from bench._common import free_port, pct, write_json  # noqa: E402
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


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--events", type=int, default=100)
    parser.add_argument("--stores", type=int, default=16, help="stores (leases) that write the instances' keys")
    parser.add_argument("--rate", type=float, default=50.0, help="background updates per second while measuring")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args()
    write_json(args.json, asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
