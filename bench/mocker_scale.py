"""The mocker's own cost at 16 and 32 workers, in this process: N simulated engines (tandem.mocker's
Scheduler + MockEngine, as `--num-workers N` builds them, without the request plane) driven by a closed
loop of --concurrency requests spread round-robin over the engines, in real time (--speedup-ratio).

    .venv/bin/python bench/mocker_scale.py                          # 16 and 32 workers, both workloads
    .venv/bin/python bench/mocker_scale.py --workers 32 --workloads decode --seconds 20
    .venv/bin/python bench/mocker_scale.py --profile out.prof --workers 32 --workloads decode

Reports per run: CPU seconds of this process per finished request and per simulated step (all engines'
steps), lag (wall time the engines were busy / the time the timing model gives their steps, minus 1: 0
when the mocker keeps pace), the worst step lateness (a step's tokens handed out later than its deadline),
TTFT and ITL p50/p99 as the engine hands tokens out. A run whose lag exceeds --max-lag is marked LAGGING
and left out of the summary. Workloads: prefill-heavy (ISL 3000, OSL 4) and decode-heavy (ISL 128, OSL 256).
The Dynamo comparison, through a frontend and the request plane: bench/mocker_compare.py --workers N.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

from _common import pct

from tandem.mocker.engine import MockEngine
from tandem.mocker.perf_model import PolynomialPerfModel
from tandem.mocker.scheduler import Scheduler, SchedulerConfig, SimRequest

WORKLOADS = {"prefill": (3000, 4), "decode": (128, 256)}
# Dynamo 1.6.1's mocker defaults, as bench/mocker_compare.py passes them.
CONFIG = {"block_size": 64, "num_blocks": 16384, "max_num_seqs": 256, "max_num_batched_tokens": 8192}


async def run(workers: int, workload: str, args: argparse.Namespace) -> dict[str, float]:
    isl, osl = WORKLOADS[workload]
    engines = [MockEngine(Scheduler(SchedulerConfig(**CONFIG), PolynomialPerfModel()), speedup_ratio=args.speedup_ratio)
               for _ in range(workers)]
    for e in engines:
        e.start()
    rng = random.Random(1)
    base = [rng.randrange(1, 30000) for _ in range(isl - 1)]
    ttft: list[float] = []
    itl: list[float] = []
    done = 0
    counter = 0
    stop_at = 0.0
    measuring = False

    async def client(slot: int) -> None:
        nonlocal done, counter
        while time.monotonic() < stop_at:
            counter += 1
            engine = engines[counter % workers]
            prompt = [counter, *base]  # a new first token: no prefix-cache hits across requests
            queue = engine.submit(SimRequest(f"r{counter}", prompt, osl, lambda i: 7 + i % 100))
            start = last = time.monotonic()
            first = True
            while (out := await queue.get()) is not None:
                now = time.monotonic()
                if measuring:
                    (ttft if first else itl).append((now - (start if first else last)) * 1000)
                first, last = False, now
                if out.finished:
                    break
            if measuring:
                done += 1

    loop_start = time.monotonic()
    stop_at = loop_start + args.warmup + args.seconds
    tasks = [asyncio.create_task(client(i)) for i in range(args.concurrency)]
    await asyncio.sleep(args.warmup)
    measuring = True
    cpu0, wall0 = time.process_time(), time.monotonic()
    steps0 = sum(e.steps for e in engines)
    sim0 = sum(e.simulated_seconds for e in engines)
    busy0 = sum(e.busy_seconds for e in engines)
    await asyncio.sleep(args.seconds)
    cpu1, wall1 = time.process_time(), time.monotonic()
    steps = sum(e.steps for e in engines) - steps0
    sim = sum(e.simulated_seconds for e in engines) - sim0
    busy = sum(e.busy_seconds for e in engines) - busy0
    measuring = False
    ttft.sort()
    itl.sort()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for e in engines:
        await e.stop()
    cpu = cpu1 - cpu0
    return {
        "workers": workers, "workload": workload, "requests": done, "steps": steps,
        "cpu_pct": cpu / (wall1 - wall0) * 100,
        "cpu_us_per_req": cpu / max(done, 1) * 1e6, "cpu_us_per_step": cpu / max(steps, 1) * 1e6,
        "lag_pct": (busy / sim - 1) * 100 if sim else 0.0,
        "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99),
        "itl_p50_ms": pct(itl, 0.5), "itl_p99_ms": pct(itl, 0.99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="16,32", help="comma-separated engine counts [16,32]")
    parser.add_argument("--workloads", default="prefill,decode", help="comma-separated: prefill, decode")
    parser.add_argument("--concurrency", type=int, default=None, help="requests in flight [4 per worker]")
    parser.add_argument("--speedup-ratio", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=15.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--max-lag", type=float, default=5.0, help="lag (%%) above which a run is discarded")
    parser.add_argument("--profile", default=None, help="write a cProfile of the runs here")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = []
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    for workers in (int(w) for w in args.workers.split(",")):
        for workload in args.workloads.split(","):
            conc = args.concurrency
            a = argparse.Namespace(**{**vars(args), "concurrency": conc or 4 * workers})
            r = asyncio.run(run(workers, workload, a))
            r["lagging"] = r["lag_pct"] > args.max_lag
            results.append(r)
            print(f"{workers:3} workers {workload:8} {r['requests']:6} req {r['steps']:7} steps  CPU {r['cpu_pct']:5.1f}%  "
                  f"{r['cpu_us_per_req']:8.0f} µs/req {r['cpu_us_per_step']:6.1f} µs/step  lag {r['lag_pct']:5.2f}%  "
                  f"TTFT p50/p99 {r['ttft_p50_ms']:.1f}/{r['ttft_p99_ms']:.1f} ms  ITL p50/p99 "
                  f"{r['itl_p50_ms']:.2f}/{r['itl_p99_ms']:.2f} ms{'  LAGGING (discarded)' if r['lagging'] else ''}",
                  flush=True)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    kept = [r for r in results if not r["lagging"]]
    if kept:
        print(f"median CPU per request {statistics.median(r['cpu_us_per_req'] for r in kept):.0f} µs over "
              f"{len(kept)} runs kept", file=sys.stderr)


if __name__ == "__main__":
    main()
