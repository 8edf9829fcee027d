"""Mocker deployment benchmark: tandem (frontend + its mocker, 4 workers) against Dynamo 1.6.1 (its
frontend + its mocker, 4 workers), same timing model, same aiperf workload, one after the other.

    .venv/bin/python bench/mocker_compare.py                     # both regimes, --repeat 2
    .venv/bin/python bench/mocker_compare.py --quick             # a short smoke run
    .venv/bin/python bench/mocker_compare.py --regimes frontend --requests 2000 --concurrency 64 --json out.json
    .venv/bin/python bench/mocker_compare.py --impl tandem,base --baseline-tree WORKTREE  # vs another commit

`bash bench/setup_baselines.sh` creates .bench/dynamo-venv (ai-dynamo 1.6.1) and .bench/aiperf-venv
(aiperf 0.13, the load generator). The deployments:
  tandem: tandem run --engine mocker --workers 4 --router-mode round-robin --http-port P
              -- --speedup-ratio S <engine flags>
  Dynamo: python -m dynamo.frontend --router-mode round-robin --discovery-backend file --request-plane tcp
              --event-plane zmq  +  python -m dynamo.mocker --num-workers 4 --speedup-ratio S <engine flags>
with the same engine flags (Dynamo's mocker defaults, given explicitly): block size 64, 16384 KV
blocks, max-num-seqs 256, max-num-batched-tokens 8192; each side in its own file-discovery directory
and namespace. The load: aiperf profile, OpenAI chat, streaming, synthetic prompts of --isl tokens
(stddev 0) asking for --osl tokens (ignore_eos), fixed --concurrency, --requests requests after
2 x concurrency warm-up requests, token counts from the server's usage (--use-server-token-count).

Regimes:
  engine    speedup ratio 1 (the polynomial timing model in real time): the simulated engine sets the
            pace; the frontend is nearly idle.
  frontend  speedup ratio 1e6 (engine time ~0) at high concurrency. On a 2-core machine aiperf itself
            costs several times more CPU per request than either frontend, so left alone it would be
            the bottleneck; the frontend process (tandem: `tandem run`'s frontend child) is therefore
            put in a cgroup with a CPU quota of --frontend-cpu cores (default 0.2), which makes the
            frontend the bottleneck for both stacks alike (this needs root: it writes /sys/fs/cgroup).
            --frontend-cpu 0 disables the quota.
Each run also records the CPU time of the frontend, the engine process(es), the launcher (tandem),
aiperf and everything else on the machine during aiperf's profiling phase (from /proc); a run during
which other processes used more than --max-others % of a core is discarded and repeated.
At 8-32 workers (--workers N --one-process) tandem's workers run in one mocker process as Dynamo's do,
and that process reports its lag (the wall time its engines were busy against the time their timing
model gives their steps) on its system port: a run whose mocker lagged by more than --max-lag % is
repeated like a disturbed one. Workloads: prefill-heavy --isl 3000 --osl 4, decode-heavy --isl 128
--osl 256 (bench/mocker_scale.py measures the mocker alone, without frontend or request plane).
Order: tandem then Dynamo in odd rounds, Dynamo then tandem in even ones; medians over --repeat rounds.
Ratios are tandem / Dynamo: for throughput > 1 means tandem is better, for latencies < 1 does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from _common import (
    IMPL_LABELS,
    MODEL_NAME,
    Deployment,
    add_output_args,
    bench_run,
    children_map,
    comparison_table,
    cpu_seconds,
    free_port,
    interrupt_on_sigterm,
    machine_busy_seconds,
    model_path,
    parse_aiperf,
    require_dynamo,
    run_aiperf,
    scrape,
    total,
    tree,
    wait_quiet,
    write_json,
)

WORKERS = 4
# Dynamo 1.6.1's mocker defaults (vLLM engine type), passed explicitly to both mockers.
ENGINE_FLAGS = ["--block-size", "64", "--num-gpu-blocks-override", "16384", "--max-num-seqs", "256",
                "--max-num-batched-tokens", "8192"]
REGIMES: dict[str, dict[str, Any]] = {
    "engine": {"speedup": 1.0, "concurrency": 32, "requests": 960, "quick_requests": 96},
    "frontend": {"speedup": 1e6, "concurrency": 64, "requests": 3000, "quick_requests": 400},
}


# -- frontend CPU quota (cgroup) ------------------------------------------------------------------
class CpuQuota:
    """A cgroup limiting its processes to `cores` cores of CPU time (cgroup v1 `cpu` or v2 `cpu.max`),
    with a short period (10 ms) so that the throttling stalls stay short."""

    PERIOD_US = 10_000

    def __init__(self, cores: float) -> None:
        name = f"mocker-compare-{os.getpid()}"
        quota = max(int(cores * self.PERIOD_US), 1000)
        v1 = "/sys/fs/cgroup/cpu"
        if os.path.exists(os.path.join(v1, "cpu.cfs_quota_us")):
            self.path = os.path.join(v1, name)
            self.root = v1
            os.makedirs(self.path, exist_ok=True)
            self._write("cpu.cfs_period_us", str(self.PERIOD_US))
            self._write("cpu.cfs_quota_us", str(quota))
        elif os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            self.root = "/sys/fs/cgroup"
            self.path = os.path.join(self.root, name)
            os.makedirs(self.path, exist_ok=True)
            self._write("cpu.max", f"{quota} {self.PERIOD_US}")
        else:
            raise RuntimeError("no cgroup cpu controller found")

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def add(self, pid: int) -> None:
        """Moves the process (all its threads) into the cgroup."""
        self._write("cgroup.procs", str(pid))

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        try:
            with open(os.path.join(self.path, "cpu.stat")) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    out[key] = float(value)
        except OSError:
            pass
        return out

    def remove(self) -> None:
        try:
            with open(os.path.join(self.path, "cgroup.procs")) as f:
                pids = [line.strip() for line in f if line.strip()]
            for pid in pids:  # still running (stop() failed?): back to the root group
                with open(os.path.join(self.root, "cgroup.procs"), "w") as g:
                    g.write(pid)
            os.rmdir(self.path)
        except OSError:
            pass


# -- CPU sampling -----------------------------------------------------------------------------------
class Sampler(threading.Thread):
    """Samples cumulative CPU seconds of each role every `interval` s, with wall-clock stamps, so that
    the CPU used during aiperf's profiling phase (known only afterwards) can be interpolated."""

    def __init__(self, roles: dict[str, Any], interval: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.roles = roles  # name -> list of pids, or a callable returning one (a changing tree)
        self.interval = interval
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop_event = threading.Event()

    def sample(self) -> None:
        kids = children_map()
        row: dict[str, float] = {}
        for name, pids in self.roles.items():
            pids = pids(kids) if callable(pids) else pids
            row[name] = sum(cpu_seconds(pid) for pid in pids)
        row["machine"] = machine_busy_seconds()
        self.samples.append((time.time(), row))

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        self.sample()

    def at(self, t: float) -> dict[str, float]:
        """Counters at wall time `t`, interpolated between the samples around it."""
        before = [s for s in self.samples if s[0] <= t]
        after = [s for s in self.samples if s[0] >= t]
        if not before:
            return after[0][1]
        if not after:
            return before[-1][1]
        (t0, a), (t1, b) = before[-1], after[0]
        w = 0.0 if t1 == t0 else (t - t0) / (t1 - t0)
        return {k: a[k] + (b[k] - a[k]) * w for k in a}


# -- aiperf -----------------------------------------------------------------------------------------
def aiperf_command(aiperf: str, url: str, tokenizer: str, args: argparse.Namespace, concurrency: int,
                   requests: int, artifacts: str) -> list[str]:
    return [aiperf, "profile", "--model", MODEL_NAME, "--url", url, "--endpoint-type", "chat", "--streaming",
            "--tokenizer", tokenizer, "--isl", str(args.isl), "--isl-stddev", "0", "--osl", str(args.osl),
            "--osl-stddev", "0", "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
            "--concurrency", str(concurrency), "--request-count", str(requests),
            "--warmup-request-count", str(2 * concurrency), "--random-seed", "1",
            "--request-timeout-seconds", "300", "--artifact-dir", artifacts, "--export-level", "summary",
            "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry"]


# -- one run ----------------------------------------------------------------------------------------
@contextmanager
def _quota(cores: float) -> Iterator[CpuQuota | None]:
    if cores <= 0:
        yield None
        return
    quota = CpuQuota(cores)
    try:
        yield quota
    finally:
        quota.remove()


def run_once(impl: str, regime: str, args: argparse.Namespace) -> dict[str, float]:
    spec = REGIMES[regime]
    concurrency = args.concurrency or spec["concurrency"]
    requests = args.requests or (spec["quick_requests"] if args.quick else spec["requests"])
    with bench_run(f"{impl}/{regime}", args.keep_logs, prefix=f"mocker-compare-{impl}-{regime}-") as run:
        workdir = run.workdir
        # tandem's mockers in one process report their lag on the first worker's system port (in real
        # time only: at a speedup of 1e6 every step is late by design).
        lag_port = free_port() if impl != "dynamo" and args.one_process and regime == "engine" else None
        lag_url = f"http://127.0.0.1:{lag_port}" if lag_port else None
        deployment = run.deployment = Deployment(impl, ["--speedup-ratio", f"{spec['speedup']:g}", *ENGINE_FLAGS], workdir,
                                args.dynamo_python, workers=args.workers, one_process=args.one_process,
                                run_args=["--system-port-base", str(lag_port)] if lag_port else None,
                                tree=args.baseline_tree if impl == "base" else None)
        with _quota(args.frontend_cpu if regime == "frontend" else 0) as quota:
            if quota is not None:
                quota.add(deployment.frontend_pid)
            stats0 = quota.stats() if quota else {}
            own = os.getpid()
            deployment_pids: set[int] = set()
            for p in deployment.procs:
                deployment_pids.update(tree(p.pid))
            roles: dict[str, Any] = {
                "frontend": [deployment.frontend_pid], "engine": deployment.engine_pids,
                "launcher": [deployment.launcher_pid] if deployment.launcher_pid else [],
                "bench": [own],  # this script (the CPU sampler)
                "aiperf": lambda kids: [p for p in tree(own, kids) if p != own and p not in deployment_pids],
            }
            sampler = Sampler(roles)
            sampler.start()
            artifacts = os.path.join(workdir, "aiperf")
            cmd = aiperf_command(args.aiperf, deployment.url, model_path(), args, concurrency, requests, artifacts)
            lag0 = scrape(lag_url) if lag_url else {}
            try:
                run_aiperf(cmd, os.path.join(deployment.logdir, "aiperf.log"), timeout=args.run_timeout)
            finally:
                sampler.stop()
            lag1 = scrape(lag_url) if lag_url else {}
            stats1 = quota.stats() if quota else {}
            for p in deployment.procs:
                if p.proc.poll() is not None:
                    raise RuntimeError(f"{p.name} exited ({p.proc.returncode}) during the run")
        result = parse_aiperf(os.path.join(artifacts, "profile_export_aiperf.json"))
        start, end = result.pop("_start"), result.pop("_end")
        a, b = sampler.at(start), sampler.at(end)
        wall = max(end - start, 1e-9)
        used = {k: b[k] - a[k] for k in a}
        n = max(result["requests_ok"], 1)
        ours = sum(v for k, v in used.items() if k != "machine")
        result.update({
            "frontend_cpu_us_per_req": used["frontend"] / n * 1e6,
            "frontend_cpu_pct": used["frontend"] / wall * 100,
            "engine_cpu_us_per_req": used["engine"] / n * 1e6,
            "launcher_cpu_us_per_req": used["launcher"] / n * 1e6,
            "aiperf_cpu_us_per_req": used["aiperf"] / n * 1e6,
            "machine_busy_pct": used["machine"] / wall * 100,
            "others_cpu_pct": max(used["machine"] - ours, 0) / wall * 100,
        })
        if lag0 and lag1:
            simulated = (total(lag1, "tandem_mocker_simulated_seconds_total")
                         - total(lag0, "tandem_mocker_simulated_seconds_total"))
            busy = total(lag1, "tandem_mocker_busy_seconds_total") - total(lag0, "tandem_mocker_busy_seconds_total")
            result["mocker_lag_pct"] = (busy / simulated - 1) * 100 if simulated else 0.0
        if stats0 and stats1:
            periods = stats1.get("nr_periods", 0) - stats0.get("nr_periods", 0)
            throttled = stats1.get("nr_throttled", 0) - stats0.get("nr_throttled", 0)
            result["throttled_pct"] = throttled / periods * 100 if periods else 0.0
            result["frontend_quota_used_pct"] = result["frontend_cpu_pct"] / args.frontend_cpu
        expected = requests
        if result["errors"] or result["requests_ok"] < expected or result["completion_tokens_min"] < args.osl:
            raise RuntimeError(f"{impl}/{regime}: {result['errors']:.0f} errors, {result['requests_ok']:.0f} of "
                               f"{expected} requests, shortest answer {result['completion_tokens_min']:.0f} tokens")
        return result


def run_checked(impl: str, regime: str, args: argparse.Namespace) -> dict[str, float]:
    """One reported run: repeated (up to --attempts) while other processes on the machine used more than
    --max-others % of a core during it, tandem's mocker lagged its timing model by more than --max-lag %,
    or it failed; else the least disturbed run is kept."""
    kept: list[dict[str, float]] = []
    failures = 0
    while len(kept) + failures < args.attempts:
        wait_quiet(args.max_others)
        try:
            result = run_once(impl, regime, args)
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 - reported, then retried
            failures += 1
            print(f"{impl}/{regime} run failed: {e}", file=sys.stderr)
            continue
        kept.append(result)
        lagging = result.get("mocker_lag_pct", 0.0) > args.max_lag
        print(f"  {regime:8} {IMPL_LABELS[impl]:13} {result['rps']:8.1f} req/s  TTFT p50 {result['ttft_p50_ms']:7.1f} ms"
              f"  ITL p50 {result['itl_p50_ms']:6.2f} ms  frontend {result['frontend_cpu_pct']:5.1f}% of a core"
              f"  others {result['others_cpu_pct']:4.1f}%", file=sys.stderr, flush=True)
        if result["others_cpu_pct"] <= args.max_others and not lagging:
            break
        reason = (f"the mocker lagged its timing model by {result['mocker_lag_pct']:.1f}%" if lagging
                  else f"other processes used {result['others_cpu_pct']:.0f}% of a core meanwhile")
        print(f"  (discarded: {reason})", file=sys.stderr)
    if not kept:
        raise SystemExit(f"{impl}/{regime}: every run failed")
    best = min(kept, key=lambda r: (r.get("mocker_lag_pct", 0.0) > args.max_lag, r["others_cpu_pct"]))
    if best["others_cpu_pct"] > args.max_others:
        print(f"warning: kept a {impl}/{regime} run during which other processes used "
              f"{best['others_cpu_pct']:.0f}% of a core", file=sys.stderr)
    if best.get("mocker_lag_pct", 0.0) > args.max_lag:
        print(f"warning: kept a {impl}/{regime} run whose mocker lagged by {best['mocker_lag_pct']:.1f}%", file=sys.stderr)
    return best


# -- report -------------------------------------------------------------------------------------------
ROWS = [  # key, label, better: "high" / "low" / None (no ratio)
    ("rps", "requests/s", "high"),
    ("output_tokens_per_s", "output tokens/s", "high"),
    ("ttft_p50_ms", "TTFT p50 (ms)", "low"),
    ("ttft_p99_ms", "TTFT p99 (ms)", "low"),
    ("itl_p50_ms", "ITL p50 (ms)", "low"),
    ("itl_p99_ms", "ITL p99 (ms)", "low"),
    ("latency_p50_ms", "request latency p50 (ms)", "low"),
    ("frontend_cpu_us_per_req", "frontend CPU per request (µs)", "low"),
    ("frontend_cpu_pct", "frontend CPU (% of a core)", None),
    ("frontend_quota_used_pct", "frontend CPU (% of its quota)", None),
    ("throttled_pct", "quota periods throttled (%)", None),
    ("engine_cpu_us_per_req", "engine process(es) CPU per request (µs)", "low"),
    ("mocker_lag_pct", "mocker lag: busy / simulated time - 1 (%)", None),
    ("launcher_cpu_us_per_req", "`tandem run` launcher CPU per request (µs)", None),
    ("aiperf_cpu_us_per_req", "aiperf CPU per request (µs)", None),
    ("machine_busy_pct", "machine busy (% of one core; 2 cores = 200)", None),
    ("others_cpu_pct", "other processes (% of a core)", None),
    ("errors", "errors", None),
]


def report(results: dict[str, dict[str, dict[str, float]]], args: argparse.Namespace) -> str:
    lines = []
    for regime, by_impl in results.items():
        spec = REGIMES[regime]
        concurrency = args.concurrency or spec["concurrency"]
        requests = args.requests or (spec["quick_requests"] if args.quick else spec["requests"])
        quota = f", frontend limited to {args.frontend_cpu:g} core" if regime == "frontend" and args.frontend_cpu else ""
        lines += [f"\n### {regime}-bound: speedup ratio {spec['speedup']:g}, concurrency {concurrency}, "
                  f"{requests} requests, ISL {args.isl} / OSL {args.osl}{quota} (median of {args.repeat})\n"]
        ordered = {i: by_impl[i] for i in ("tandem", "dynamo", "base") if i in by_impl}
        baseline = "tandem / Dynamo" if "dynamo" in ordered else "tandem / baseline tree"
        lines += comparison_table(ordered, ROWS, baseline, lambda t, d, better: f"{t / d:.3f}x")
        if "tandem" in by_impl and "dynamo" in by_impl:
            lines.append("\n" + targets(regime, by_impl["tandem"], by_impl["dynamo"]))
    against = "Dynamo" if any("dynamo" in by_impl for by_impl in results.values()) else "the baseline tree"
    lines.append(f"\nRatios are tandem / {against}: above 1 is better for throughput, below 1 is better for "
                 "latency and CPU.")
    return "\n".join(lines)


def targets(regime: str, t: dict[str, float], d: dict[str, float]) -> str:
    if regime == "engine":
        # The same timing model: inter-token latencies within 10% either way; first tokens, which also
        # carry the frontend's and the request plane's cost, no more than 10% later; the mocker process
        # at most 1.2x Dynamo's CPU per request.
        checks = [(key, t[key] / d[key], lo, hi) for key, lo, hi in (
            ("itl_p50_ms", 0.9, 1.1), ("itl_p99_ms", 0.9, 1.1), ("ttft_p50_ms", 0, 1.1), ("ttft_p99_ms", 0, 1.1),
            ("engine_cpu_us_per_req", 0, 1.2))]
        met = all(lo <= r <= hi for _, r, lo, hi in checks)
        detail = ", ".join(f"{key} {r:.3f}x" for key, r, _, _ in checks)
        return (f"Target (ITL p50/p99 within 10% of Dynamo's, TTFT p50/p99 <= 1.1x, mocker CPU per request <= 1.2x): "
                f"{'met' if met else 'NOT met'} ({detail})")
    r = t["rps"] / d["rps"]
    return f"Target (>= 0.8x Dynamo's requests/s): {'met' if r >= 0.8 else 'NOT met'} ({r:.2f}x)"


# -- main ---------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--regimes", default="engine,frontend", help="comma-separated: engine, frontend")
    parser.add_argument("--impl", default="tandem,dynamo", help="comma-separated: tandem, dynamo, base")
    parser.add_argument("--baseline-tree", default=None,
                        help="the `base` implementation: tandem from this source tree (a git worktree of an older "
                        "commit), e.g. --impl tandem,base --baseline-tree /tmp/base")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per run [engine 960, frontend 3000; --quick: 96, 400]")
    parser.add_argument("--concurrency", type=int, default=None, help="[engine 32, frontend 64]")
    parser.add_argument("--workers", type=int, default=WORKERS, help="mocker workers [4]")
    parser.add_argument("--one-process", action="store_true",
                        help="tandem's mocker workers in one process (--num-workers), as Dynamo's always are; "
                        "without it `tandem run` starts a process per worker")
    parser.add_argument("--isl", type=int, default=256, help="input tokens per request")
    parser.add_argument("--osl", type=int, default=64, help="output tokens per request")
    parser.add_argument("--repeat", type=int, default=None, help="rounds; medians are reported [2; --quick 1]")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--frontend-cpu", type=float, default=0.2,
                        help="CPU quota of the frontend process in the frontend regime, in cores (0: none)")
    parser.add_argument("--max-others", type=float, default=20.0,
                        help="repeat a run if other processes used more than this %% of a core meanwhile")
    parser.add_argument("--attempts", type=int, default=3, help="runs tried per reported run")
    parser.add_argument("--max-lag", type=float, default=5.0,
                        help="repeat a run if tandem's mocker fell behind its timing model by more than this %% "
                        "(measured with --one-process)")
    parser.add_argument("--run-timeout", type=float, default=600, help="seconds one aiperf run may take")
    add_output_args(parser)
    args = parser.parse_args()
    if args.repeat is None:
        args.repeat = 1 if args.quick else 2
    regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    impls = [i.strip() for i in args.impl.split(",") if i.strip()]
    for name in regimes:
        if name not in REGIMES:
            parser.error(f"unknown regime {name!r} (engine, frontend)")
    for name in impls:
        if name not in IMPL_LABELS:
            parser.error(f"unknown implementation {name!r} (tandem, dynamo, base)")
    if "base" in impls and not args.baseline_tree:
        parser.error("--impl base needs --baseline-tree")
    if not os.access(args.aiperf, os.X_OK):
        raise SystemExit(f"no aiperf at {args.aiperf}: run bash bench/setup_baselines.sh")
    if "dynamo" in impls:
        require_dynamo(args.dynamo_python)

    interrupt_on_sigterm()
    started = time.monotonic()
    runs: dict[str, dict[str, list[dict[str, float]]]] = {r: {i: [] for i in impls} for r in regimes}
    try:
        for regime in regimes:
            for round_ in range(args.repeat):
                order = impls if round_ % 2 == 0 else list(reversed(impls))
                for impl in order:
                    runs[regime][impl].append(run_checked(impl, regime, args))
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        sys.exit(130)
    results: dict[str, dict[str, dict[str, float]]] = {}
    for regime, by_impl in runs.items():
        results[regime] = {}
        for impl, rs in by_impl.items():
            keys = [k for k in rs[0] if all(k in r for r in rs)]
            results[regime][impl] = {k: statistics.median(r[k] for r in rs) for k in keys}
    print(f"\nmocker_compare: tandem vs Dynamo 1.6.1, frontend + mocker with {args.workers} workers, aiperf 0.13, "
          f"{os.cpu_count()} cores, {time.monotonic() - started:.0f} s")
    print(report(results, args))
    write_json(args.json, {"results": results, "runs": runs})


if __name__ == "__main__":
    main()
