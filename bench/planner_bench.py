"""The SLA planner (throughput-based, load-based, or both) against static deployments and a threshold autoscaler,
on mocker workers replaying traces.

    .venv/bin/python bench/planner_bench.py                    # about 40 minutes; --help for the knobs

1. **Profile.** `tandem profile --quick` measures one mocker worker with the flags every worker of the run
   uses (a sped-up timing model, a small KV cache, a simulated start-up). The SLA planner reads this profile,
   and it sets the capacity the traces are scaled to: the requests/s `--max-workers` workers serve at the
   TTFT and ITL targets, by the planner's own formulas (times `--headroom`).
2. **Traces.** Each is a request trace in the Mooncake format (JSONL: `timestamp` ms, `input_length`,
   `output_length`, `hash_ids`), with Poisson arrivals at a rate that moves every interval between 20% and
   100% of that capacity: a step, a ramp, a sinusoid, and a bursty trace made here in the Mooncake format
   (no package ships the public Mooncake trace, so it is generated: a random walk of the rate with bursts,
   log-normal lengths).
3. **Policies.** Per trace, one deployment per policy (`tandem run`'s own supervisor, mocker workers):
   - `static-min`: as many workers as the trace's lowest load needs, all the time;
   - `static-max`: `--max-workers` workers all the time;
   - `threshold`: an HPA/KEDA-style autoscaler: every interval `desired = ceil(workers * observed /
     target)` for the workers' mean KV-cache usage and the frontend's queue of requests waiting for their
     first token, the larger of the two, within 10% tolerance kept as is; a scale-down only to the largest
     recommendation of the last `--stabilization` intervals (HPA's scale-down stabilization window);
   - `sla`: the SLA planner (agg mode, `tandem run --planner sla`'s code: the local connector), throughput-based:
     every interval, from the profile and the predicted traffic;
   - `load`: the planner's load-based scaling alone (`enable_load_scaling`, no throughput scaling, no profile):
     every `--load-interval` s, one worker more or fewer from the engines' forward-pass metrics;
   - `sla+load`: both: the throughput decision is a floor, load-based scaling moves above it.
   The three planner policies get the same targets (times `--planner-margin`), budget (`--max-workers`) and
   floor (the static-min size). `--load-interval` defaults to 1 s, a quarter of the 4 s interval (the load
   mode must decide more often than the throughput mode): a busy engine reports every 0.5 s, so each decision
   still averages about two reports per engine, and 1 s is under a worker's start-up here (about 2 s), so
   growing is paced by the start-up (no step while a new worker has not reported yet) rather than by the
   cadence. Dynamo's defaults (5 s against 180 s) are likewise much shorter than the throughput interval and
   than a worker's start-up.
4. **Measures**, per policy: the fraction of intervals whose mean TTFT and mean ITL (the frontend's
   histograms over that interval, the planner's definition) meet the targets; worker-seconds (workers
   running or starting, integrated over the run); scaling actions; failed requests (those while a worker
   was being stopped listed apart; all must be 0); the mockers' lag (wall time busy over the time their
   timing model gave those steps, minus one). A run whose lag is over 5% measured the host, not the
   policy: it is marked discarded.
   The planner runs on this process's event loop, as in `tandem run`, and can hold it up (the ARIMA fit
   takes seconds on busy cores), so nothing measured depends on that loop being on time: the worker count
   is recorded as each change is made (`scale`) and integrated exactly, and the frontend is read at each
   interval's end from a thread with its own event loop. Each run's log has one `bench` line per interval
   (when it was read, and how long the deployment's loop was held up) and the planner's lines, timed.

Writes a table (markdown) to stdout and `--json`, and one plot per trace (load, workers, TTFT, ITL per policy)
to `--plots`. `--from-json` runs nothing: it redraws the table and plots from one or more `--json` files (a row
of a later file replaces the same trace and policy of an earlier one; each row's "vs static-max" is against the
static-max row of its own file).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from _common import model_path, scrape, total

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

POLICIES = ("static-min", "static-max", "threshold", "sla", "load", "sla+load")
PLANNED = ("sla", "load", "sla+load")  # the policies the planner runs
# One colour per policy in every plot (the first four as matplotlib's default cycle gave them before).
COLOURS = {"static-min": "C0", "static-max": "C1", "threshold": "C2", "sla": "C3", "load": "C4", "sla+load": "C5"}
TRACES = ("step", "ramp", "sinusoid", "mooncake")
CALIBRATION_STEPS = 12
TOKEN_IDS = (1000, 30000)  # prompt token ids drawn from ordinary vocabulary


# -- traces ----------------------------------------------------------------------------------------
def load_shape(name: str, intervals: int, seed: int) -> list[float]:
    """The load of each interval, as a fraction of the static-max capacity (0.2 .. 1.0, mean near 0.5)."""
    k = intervals
    if name == "step":  # 20%, 100%, 20%, 60%: a quarter each
        return [(0.2, 1.0, 0.2, 0.6)[min(4 * i // k, 3)] for i in range(k)]
    if name == "ramp":  # 20% for a sixth, up to 100% over a third, down over a third, 20% for a sixth
        out = []
        for i in range(k):
            x = i / k
            rise = min(max((x - 1 / 6) * 3, 0.0), 1.0) if x < 0.5 else min(max((5 / 6 - x) * 3, 0.0), 1.0)
            out.append(0.2 + 0.8 * rise)
        return out
    if name == "sinusoid":  # 20 + 80 * ((1 - cos) / 2)^2: mean 50%, one period
        return [0.2 + 0.8 * ((1 - math.cos(2 * math.pi * i / k)) / 2) ** 2 for i in range(k)]
    if name == "mooncake":  # a random walk with bursts, stretched onto [0.2, 1.0]
        rng = random.Random(seed)
        level, walk = 0.45, []
        for _ in range(k):
            level += rng.gauss(0, 0.08) + 0.1 * (0.45 - level)
            walk.append(level + (0.35 if rng.random() < 0.12 else 0.0))
        low, high = min(walk), max(walk)
        return [0.2 + 0.8 * (w - low) / (high - low) for w in walk]
    raise ValueError(f"unknown trace {name!r}")


@dataclass(frozen=True)
class Lengths:
    isl_low: int = 200
    isl_high: int = 600
    osl_low: int = 16
    osl_high: int = 48

    @property
    def isl(self) -> float:
        return (self.isl_low + self.isl_high) / 2

    @property
    def osl(self) -> float:
        return (self.osl_low + self.osl_high) / 2

    def draw(self, rng: random.Random, bursty: bool) -> tuple[int, int]:
        if not bursty:
            return rng.randint(self.isl_low, self.isl_high), rng.randint(self.osl_low, self.osl_high)
        # Log-normal around the same means, clipped to the same range: a few long prompts, many short.
        isl = rng.lognormvariate(math.log(self.isl) - 0.08, 0.4)
        osl = rng.lognormvariate(math.log(self.osl) - 0.08, 0.4)
        return (int(min(max(isl, self.isl_low / 2), self.isl_high * 1.5)),
                int(min(max(osl, self.osl_low / 2), self.osl_high * 1.5)))


def write_trace(path: Path, shape: list[float], interval: float, capacity_rps: float, lengths: Lengths,
                seed: int, bursty: bool) -> int:
    """Poisson arrivals at `shape[i] * capacity_rps` during interval i, as Mooncake JSONL. Returns the count."""
    rng = random.Random(seed)
    rows = []
    for index, fraction in enumerate(shape):
        t, end = index * interval, (index + 1) * interval
        rate = fraction * capacity_rps
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                break
            isl, osl = lengths.draw(rng, bursty)
            blocks = math.ceil(isl / 64)
            first = len(rows) * 1000
            rows.append({"timestamp": int(t * 1000), "input_length": isl, "output_length": osl,
                         "hash_ids": list(range(first, first + blocks))})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


# -- the load generator (its own process, so that the policy's work cannot delay a request) -----------
async def replay(trace: Path, url: str, model: str, out: Path) -> None:
    import aiohttp

    rows = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    rng = random.Random(0)
    records: list[dict[str, object]] = []
    start = time.monotonic()

    async def one(http: aiohttp.ClientSession, row: dict[str, int]) -> None:
        prompt = [rng.randrange(*TOKEN_IDS) for _ in range(row["input_length"])]
        body = {"model": model, "prompt": prompt, "max_tokens": row["output_length"], "ignore_eos": True}
        sent = time.monotonic() - start
        try:
            async with http.post(f"{url}/v1/completions", json=body) as response:
                text = await response.text()
                error = None if response.status == 200 else f"{response.status} {text[:200]}"
        except (aiohttp.ClientError, TimeoutError) as e:
            error = repr(e)
        records.append({"sent": sent, "done": time.monotonic() - start, "error": error})

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
        tasks = []
        for row in rows:
            delay = start + row["timestamp"] / 1000 - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(http, row)))
        await asyncio.gather(*tasks)
    out.write_text(json.dumps(records))


# -- one run -----------------------------------------------------------------------------------------
@dataclass
class Settings:
    max_workers: int
    interval: float
    intervals: int
    ttft_ms: float
    itl_ms: float
    mocker_args: list[str]
    profile: Path
    predictor: str
    stabilization: int
    kv_target: float
    queue_target: float
    drain: float
    margin: float
    load_interval: float = 1.0


@dataclass
class Timeline:
    """One row per measurement interval."""

    t: list[float] = field(default_factory=list)
    offered: list[float] = field(default_factory=list)  # requests sent in the interval / interval (req/s)
    workers: list[float] = field(default_factory=list)  # mean workers over the interval
    ttft_ms: list[float] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)


@dataclass
class RunResult:
    trace: str
    policy: str
    intervals: int
    within_sla: float  # fraction of intervals with traffic meeting both targets
    ttft_met: float
    itl_met: float
    worker_seconds: float
    scaling_actions: int
    requests: int
    failed: int
    failed_during_scale_down: int
    unfinished: int
    lag: float
    discarded: bool
    timeline: Timeline
    held_up: float | None = None  # the longest the deployment's event loop was held up, s (None: not measured)


class Threshold:
    """HPA-style: `ceil(workers * observed / target)` for KV usage and queue depth; scale-down stabilized."""

    def __init__(self, settings: Settings, floor: int) -> None:
        self.s = settings
        self.floor = floor
        self.history: list[int] = []
        self.kv: list[float] = []
        self.queue: list[float] = []

    def sample(self, kv_usage: float, queued: float) -> None:
        self.kv.append(kv_usage)
        self.queue.append(queued)

    @staticmethod
    def _recommend(current: int, ratio: float) -> int:
        return current if abs(ratio - 1) <= 0.1 else math.ceil(current * ratio)

    def decide(self, current: int) -> int:
        kv = sum(self.kv) / len(self.kv) if self.kv else 0.0
        queue = sum(self.queue) / len(self.queue) if self.queue else 0.0
        self.kv.clear()
        self.queue.clear()
        wanted = max(self._recommend(current, kv / self.s.kv_target),
                     self._recommend(current, queue / max(current, 1) / self.s.queue_target))
        wanted = min(max(wanted, self.floor), self.s.max_workers)
        self.history = (self.history + [wanted])[-self.s.stabilization:]
        return wanted if wanted >= current else min(current, max(self.history))


async def run_policy(policy: str, trace_name: str, trace: Path, shape: list[float], settings: Settings,
                     static_min: int, work: Path, model_dir: str) -> RunResult:
    from tandem.launch.local_planner import LocalConnector, run_planner
    from tandem.launch.main import wait_until_serving
    from tandem.launch.plan import Plan
    from tandem.launch.spec import build_spec
    from tandem.launch.supervisor import LogMux, Supervisor
    from tandem.planner.config import PlannerConfig, PlannerMode, PredictorKind
    from tandem.planner.observe import FrontendObserver
    from tandem.planner.sla import IntervalMetrics, Replicas, SlaPlanner

    class CountedSupervisor(Supervisor):
        """Records each change of the worker count as it is made: `scale` changes the list of workers before
        its first await, and nothing else changes it."""

        changes: list[tuple[float, int]]  # (time.monotonic(), workers from then on)

        async def scale(self, role: str, count: int) -> None:
            self.changes.append((time.monotonic(), count))
            await super().scale(role, count)

        def worker_seconds(self, start: float, end: float) -> float:
            total, (at, count) = 0.0, self.changes[0]
            for when, new in [*self.changes[1:], (end, 0)]:
                total += count * max(min(when, end) - max(at, start), 0.0)
                at, count = max(at, when), new
            return total

    s = settings
    start_workers = {"static-min": static_min, "static-max": s.max_workers}.get(policy, static_min)
    system_base = 20000 + random.randrange(0, 20000)
    spec = build_spec({"model": model_dir, "engine": "mocker", "workers": start_workers, "http_port": 0,
                       "system_port_base": system_base}, worker_args=s.mocker_args)
    discovery = tempfile.mkdtemp(prefix="planner-bench-")
    log_path = work / f"{trace_name}-{policy}.log"
    opened = time.monotonic()
    with open(log_path, "w") as log:
        mux = LogMux(log, color=False)

        def say(source: str, text: str) -> None:  # seconds since the deployment started, to line up with the bench's
            mux.line(source, f"[{time.monotonic() - opened:6.1f} s] {text}")

        supervisor = CountedSupervisor(Plan(spec, model_dir, discovery), mux)
        supervisor.changes = [(time.monotonic(), start_workers)]
        connector = LocalConnector(supervisor)
        supervisor.start()
        stop = asyncio.Event()
        tasks: list[asyncio.Task[object]] = []
        try:
            url = await wait_until_serving(supervisor, supervisor.plan.served_name, spec.ready_timeout)
            assert url is not None
            model = supervisor.plan.served_name
            if policy in PLANNED:
                throughput = policy in ("sla", "sla+load")
                config = PlannerConfig(mode=PlannerMode.AGG, ttft=s.ttft_ms * s.margin, itl=s.itl_ms * s.margin,
                                       adjustment_interval=s.interval, load_predictor=PredictorKind(s.predictor),
                                       profile_results_dir=s.profile if throughput else None,
                                       max_gpu_budget=s.max_workers, min_endpoint=static_min,
                                       enable_throughput_scaling=throughput,
                                       enable_load_scaling=policy in ("load", "sla+load"),
                                       load_adjustment_interval=s.load_interval).validate()
                sla = SlaPlanner.from_config(config) if throughput else None
                tasks.append(asyncio.create_task(run_planner(config, sla, supervisor, url, stop,
                                                             lambda text: say("planner", text))))
            observer = FrontendObserver([url], model)
            await observer.sample(0.0)
            results = work / f"{trace_name}-{policy}.json"
            load = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--replay", str(trace), "--url", url, "--model", model, "--out",
                str(results), stdout=log, stderr=log)
            began = time.monotonic()
            main = asyncio.get_running_loop()
            threshold = Threshold(s, static_min) if policy == "threshold" else None
            scaling: list[concurrent.futures.Future[None]] = []  # the threshold policy's changes, on this loop
            lag_seen: dict[int, tuple[float, float]] = {}  # port -> (simulated, busy), last read
            stall = [0.0, 0.0]  # the longest this event loop was held up since the last interval, and in all, s

            async def watch_loop() -> None:
                while True:
                    before = time.monotonic()
                    await asyncio.sleep(0.05)
                    held = time.monotonic() - before - 0.05
                    stall[0], stall[1] = max(stall[0], held), max(stall[1], held)

            watch = asyncio.create_task(watch_loop())

            def note(source: str, text: str) -> None:  # from the meter's thread
                stamped = f"[{time.monotonic() - opened:6.1f} s] {text}"
                main.call_soon_threadsafe(mux.line, source, stamped)

            async def worker_samples() -> float:
                """Mean KV usage of the workers; records each one's lag counters."""
                usages = []
                for slot in range(2 * s.max_workers):  # slots of workers being stopped are not reused
                    page = await asyncio.to_thread(scrape, f"http://127.0.0.1:{system_base + slot}")
                    if page:
                        usages.append(total(page, "dynamo_component_kvstats_gpu_cache_usage_percent"))
                        lag_seen[slot] = (total(page, "tandem_mocker_simulated_seconds_total"),
                                          total(page, "tandem_mocker_busy_seconds_total"))
                return sum(usages) / len(usages) if usages else 0.0

            async def queued() -> float:
                return total(await asyncio.to_thread(scrape, url), "dynamo_frontend_queued_requests")

            async def meter() -> tuple[list[IntervalMetrics], int]:
                """The frontend's latencies at the end of each interval (and the threshold policy's reads and
                decisions), on a thread with its own event loop: the planner's work on this process's loop (an
                ARIMA fit can take seconds on these busy cores) must not shift the intervals. Reads the lag
                counters after each interval; the threshold policy's metrics every second (few scrapes: this
                process shares the two cores with the deployment), its changes made on the deployment's loop."""
                measured: list[IntervalMetrics] = []
                actions, tick, next_read = 0, 0.25, 0.0
                for index in range(len(shape)):
                    interval_end = began + (index + 1) * s.interval
                    while (now := time.monotonic()) < interval_end:
                        if threshold is not None and now >= next_read:
                            next_read = now + 1.0
                            threshold.sample(await worker_samples(), await queued())
                        await asyncio.sleep(max(0.0, min(tick, interval_end - time.monotonic())))
                    measured.append(await observer.sample(s.interval))
                    late = time.monotonic() - interval_end
                    if threshold is None:
                        await worker_samples()  # the lag counters
                    held, stall[0] = stall[0], 0.0
                    note("bench", f"interval {index + 1} (load {shape[index]:.0%}): TTFT {measured[-1].ttft_ms:.1f} ms, "
                         f"ITL {measured[-1].itl_ms:.2f} ms (read {late:.2f} s after its end); the deployment's "
                         f"loop was held up for up to {held:.2f} s")
                    if threshold is not None:
                        current = (await connector.replicas()).decode
                        wanted = threshold.decide(current)
                        note("threshold", f"workers {current} -> {wanted}")
                        if wanted != current:  # as the SLA planner: without waiting for a change in progress
                            scaling.append(asyncio.run_coroutine_threadsafe(connector.scale(Replicas(0, wanted)),
                                                                            main))
                            actions += 1
                return measured, actions

            measured, actions = await asyncio.to_thread(asyncio.run, meter())
            # Workers running or starting, from the changes as they were made: exact however late anything read.
            timeline = Timeline()
            worker_seconds = 0.0
            for index, metrics in enumerate(measured):
                spent = supervisor.worker_seconds(began + index * s.interval, began + (index + 1) * s.interval)
                worker_seconds += spent
                timeline.t.append((index + 1) * s.interval)
                timeline.offered.append(shape[index])
                timeline.workers.append(spent / s.interval)
                timeline.ttft_ms.append(metrics.ttft_ms)
                timeline.itl_ms.append(metrics.itl_ms)
            scale_downs = [(when - began, when - began + spec.stop_timeout)
                           for (when, count), (_, before) in zip(supervisor.changes[1:], supervisor.changes, strict=False)
                           if count < before]
            # The trace is over: let what is in flight finish (or give up on it after --drain s).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(load.wait(), s.drain)
            if load.returncode is None:
                load.kill()
                await load.wait()
            await worker_samples()
            stop.set()
            watch.cancel()
            for task in tasks:
                await asyncio.gather(task, return_exceptions=True)
            await asyncio.gather(*(asyncio.wrap_future(f) for f in scaling), return_exceptions=True)
            if policy in PLANNED:  # one "(scaled)" line per decision that changed the workers, either mode's
                actions = log_path.read_text().count("(scaled)")
        finally:
            stop.set()
            await supervisor.stop(spec.stop_timeout)
            shutil.rmtree(discovery, ignore_errors=True)
    records = json.loads(results.read_text()) if results.exists() else []
    failed = [r for r in records if r["error"] is not None]
    during = [r for r in failed if any(a <= r["done"] <= b for a, b in scale_downs)]
    sent = sum(1 for line in trace.read_text().splitlines() if line.strip())
    simulated = sum(v[0] for v in lag_seen.values())
    busy = sum(v[1] for v in lag_seen.values())
    lag = busy / simulated - 1 if simulated > 0 else 0.0
    ttft_ok = [t <= s.ttft_ms for t in timeline.ttft_ms if math.isfinite(t)]
    itl_ok = [t <= s.itl_ms for t in timeline.itl_ms if math.isfinite(t)]
    both = [a and b for a, b in zip(
        (t <= s.ttft_ms for t in timeline.ttft_ms), (t <= s.itl_ms for t in timeline.itl_ms), strict=True)]
    return RunResult(trace_name, policy, len(both), sum(both) / max(len(both), 1), sum(ttft_ok) / max(len(ttft_ok), 1),
                     sum(itl_ok) / max(len(itl_ok), 1), worker_seconds, actions, sent, len(failed), len(during),
                     sent - len(records), lag, lag > 0.05, timeline, stall[1])


# -- capacity, report, plots -------------------------------------------------------------------------
def capacity_per_worker(profile: Path, lengths: Lengths, ttft_ms: float, itl_ms: float) -> float:
    """Requests/s one worker serves at the targets, by the SLA planner's own agg formula."""
    from tandem.planner.config import PlannerConfig, PlannerMode
    from tandem.planner.perf import DecodeProfile, PrefillProfile
    from tandem.planner.sla import Forecast, SlaPlanner

    config = PlannerConfig(mode=PlannerMode.AGG, ttft=ttft_ms, itl=itl_ms, profile_results_dir=profile)
    planner = SlaPlanner(config, PrefillProfile.load(profile), DecodeProfile.load(profile))
    forecast = Forecast(1.0, lengths.isl, lengths.osl)
    busy = planner.prefill_workers(forecast, 1.0) + planner.decode_workers(forecast, 1.0)
    return 1.0 / busy


async def calibrate(settings: Settings, lengths: Lengths, work: Path, model_dir: str, seed: int) -> float:
    """The highest rate one worker serves with every interval within both targets: a staircase of rates (up to
    twice what the planner's formulas say a worker can do), one interval each, on a static worker."""
    guess = capacity_per_worker(settings.profile, lengths, settings.ttft_ms, settings.itl_ms)
    steps = [guess * 2 * (i + 1) / CALIBRATION_STEPS for i in range(CALIBRATION_STEPS)]
    trace = work / "calibration.jsonl"
    write_trace(trace, [r / guess for r in steps], settings.interval, guess, lengths, seed, bursty=False)
    result = await run_policy("static-min", "calibration", trace, steps, settings, 1, work, model_dir)
    best = 0.0
    for rate, ttft, itl in zip(steps, result.timeline.ttft_ms, result.timeline.itl_ms, strict=True):
        print(f"  calibration: {rate:.2f} req/s on one worker: TTFT {ttft:.1f} ms, ITL {itl:.2f} ms", flush=True)
        if not (ttft <= settings.ttft_ms and itl <= settings.itl_ms):
            break
        best = rate
    if best == 0.0:
        raise RuntimeError("one worker meets the targets at no calibration rate: loosen --ttft/--itl")
    return best


def report(results: list[RunResult], settings: Settings,
           baselines: dict[tuple[str, str], float | None] | None = None) -> str:
    """The table; `baselines` gives a row's static-max worker-seconds (trace, policy -> s, None: none) when it is
    not the static-max row of `results` (rows merged from several runs)."""
    held = any(r.held_up is not None for r in results)  # a column only for runs that measured it
    lines = ["| trace | policy | intervals within SLA | TTFT met | ITL met | worker-s | vs static-max | "
             "scaling actions | requests | failed (in scale-down) | unfinished | mocker lag |"
             + (" loop held up |" if held else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if held else "")]
    for r in results:
        if baselines is not None and (r.trace, r.policy) in baselines:
            top = baselines[(r.trace, r.policy)]
        else:
            top = next((x.worker_seconds for x in results if x.trace == r.trace and x.policy == "static-max"), None)
        ratio = f"{r.worker_seconds / top:.2f}" if top else "-"
        lag = f"{r.lag * 100:.1f}%" + (" (discarded)" if r.discarded else "")
        lines.append(f"| {r.trace} | {r.policy} | {r.within_sla * 100:.0f}% | {r.ttft_met * 100:.0f}% | "
                     f"{r.itl_met * 100:.0f}% | {r.worker_seconds:.0f} | {ratio} | {r.scaling_actions} | "
                     f"{r.requests} | {r.failed} ({r.failed_during_scale_down}) | {r.unfinished} | {lag} |"
                     + ((f" {r.held_up:.1f} s |" if r.held_up is not None else " - |") if held else ""))
    return "\n".join(lines)


def plot(results: list[RunResult], settings: Settings, capacity: float, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for trace in dict.fromkeys(r.trace for r in results):
        runs = [r for r in results if r.trace == trace]
        fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
        t = runs[0].timeline.t
        # Each value holds for the interval that ends at its time.
        axes[0].step(t, [f * 100 for f in runs[0].timeline.offered], where="pre", color="black")
        axes[0].set(ylabel="load (% of static-max)", title=f"{trace} trace: {settings.max_workers} workers "
                    f"= {capacity:.1f} req/s at the targets")
        for r in runs:
            colour = COLOURS.get(r.policy)
            axes[1].step(r.timeline.t, r.timeline.workers, where="pre", label=r.policy, color=colour)
            axes[2].plot(r.timeline.t, r.timeline.ttft_ms, marker=".", label=r.policy, color=colour)
            axes[3].plot(r.timeline.t, r.timeline.itl_ms, marker=".", label=r.policy, color=colour)
        axes[1].set(ylabel="workers")
        axes[2].axhline(settings.ttft_ms, color="grey", linestyle="--")
        axes[2].set(ylabel="mean TTFT (ms)", yscale="log")
        axes[3].axhline(settings.itl_ms, color="grey", linestyle="--")
        axes[3].set(ylabel="mean ITL (ms)", xlabel="seconds", yscale="log")
        axes[1].legend(loc="upper left", fontsize="small", ncol=2)
        fig.tight_layout()
        path = folder / f"planner-{trace}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    return written


def merge(files: list[Path]) -> tuple[list[RunResult], dict[tuple[str, str], float | None]]:
    """The rows of several `--json` files, a later file's row replacing the same trace and policy of an earlier
    one, in trace order (as first seen), then policy order; with each row's static-max worker-seconds from its
    own file."""
    rows: dict[tuple[str, str], RunResult] = {}
    baselines: dict[tuple[str, str], float | None] = {}
    for path in files:
        results = [RunResult(**{**r, "timeline": Timeline(**r["timeline"])}) for r in json.loads(path.read_text())]
        tops = {r.trace: r.worker_seconds for r in results if r.policy == "static-max"}
        for r in results:
            rows[(r.trace, r.policy)] = r
            baselines[(r.trace, r.policy)] = tops.get(r.trace)
    traces = list(dict.fromkeys(trace for trace, _ in rows))
    order = {policy: i for i, policy in enumerate(POLICIES)}
    keys = sorted(rows, key=lambda k: (traces.index(k[0]), order.get(k[1], len(order))))
    return [rows[k] for k in keys], baselines


# -- main --------------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-workers", type=int, default=8, help="the static-max size and the planner's budget")
    parser.add_argument("--interval", type=float, default=4.0, help="adjustment and measurement interval, s")
    parser.add_argument("--intervals", type=int, default=30, help="intervals per trace")
    parser.add_argument("--speedup", type=float, default=2.0, help="the mockers' --speedup-ratio")
    parser.add_argument("--kv-blocks", type=int, default=64, help="each mocker's KV cache, 64-token blocks")
    parser.add_argument("--startup", type=float, default=1.5, help="each mocker's simulated start-up, s")
    parser.add_argument("--ttft", type=float, default=100.0, help="TTFT target, ms")
    parser.add_argument("--itl", type=float, default=12.0, help="ITL target, ms")
    parser.add_argument("--per-worker", type=float, default=None,
                        help="requests/s one worker serves within the targets (default: measured, a staircase)")
    parser.add_argument("--headroom", type=float, default=1.0,
                        help="the traces' 100%% = this times the measured capacity of --max-workers workers")
    parser.add_argument("--planner-margin", type=float, default=0.8,
                        help="the SLA planner is given the targets times this (it is judged on the targets)")
    parser.add_argument("--predictor", default="arima", help="the SLA planner's load predictor")
    parser.add_argument("--load-interval", type=float, default=1.0,
                        help="load and sla+load policies: the planner's load_adjustment_interval, s (under --interval)")
    parser.add_argument("--stabilization", type=int, default=3, help="threshold policy: scale-down window, intervals")
    parser.add_argument("--kv-target", type=float, default=0.7, help="threshold policy: KV usage target")
    parser.add_argument("--queue-target", type=float, default=1.0,
                        help="threshold policy: requests waiting for a first token, per worker")
    parser.add_argument("--grace", type=float, default=1.0,
                        help="DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS of the workers, s")
    parser.add_argument("--drain", type=float, default=30.0, help="seconds in-flight requests get after a trace")
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--plots", type=Path, default=None, help="write one PNG per trace into this folder")
    parser.add_argument("--keep", type=Path, default=None, help="keep the logs, traces and profile here")
    parser.add_argument("--from-json", type=Path, nargs="+", default=None,
                        help="run nothing: the table and plots of earlier runs' --json (with their --max-workers, "
                        "--ttft, --itl and the capacity they printed as --per-worker); with several files, a row of "
                        "a later one replaces the same trace and policy of an earlier one")
    parser.add_argument("--replay", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replay is not None:
        asyncio.run(replay(args.replay, args.url, args.model, args.out))
        return 0
    # Time runs faster here (intervals of seconds), so a stopped worker's grace before it stops taking requests
    # is shortened alike (the default 5 s would span more than an interval).
    os.environ["DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS"] = str(args.grace)
    if args.from_json is not None:
        results, baselines = merge(args.from_json)
        settings = Settings(args.max_workers, args.interval, args.intervals, args.ttft, args.itl, [], Path(),
                            args.predictor, args.stabilization, args.kv_target, args.queue_target, args.drain,
                            args.planner_margin, args.load_interval)
        print(report(results, settings, baselines))
        if args.plots is not None:
            for path in plot(results, settings, (args.per_worker or 0.0) * args.max_workers * args.headroom,
                             args.plots):
                print(path)
        return 0

    unknown = set(args.policies.split(",")) - set(POLICIES)
    if unknown:
        parser.error(f"unknown policies: {', '.join(sorted(unknown))} (known: {', '.join(POLICIES)})")
    if any(p in ("load", "sla+load") for p in args.policies.split(",")) and not args.load_interval < args.interval:
        parser.error("--load-interval must be under --interval")
    model = model_path()
    work = Path(tempfile.mkdtemp(prefix="planner-bench-")) if args.keep is None else args.keep
    work.mkdir(parents=True, exist_ok=True)
    mocker_args = ["--speedup-ratio", str(args.speedup), "--num-gpu-blocks-override", str(args.kv_blocks),
                   "--startup-time", str(args.startup)]
    profile = work / "profile"
    began = time.monotonic()
    subprocess.run([sys.executable, "-m", "tandem.launch.profile", "--engine", "mocker", "--model", model,
                    "--output", str(profile), "--", *mocker_args], check=True, stdout=subprocess.DEVNULL,
                   cwd=HERE.parent)
    print(f"profile: {time.monotonic() - began:.0f} s", flush=True)
    lengths = Lengths()
    settings = Settings(args.max_workers, args.interval, args.intervals, args.ttft, args.itl, mocker_args, profile,
                        args.predictor, args.stabilization, args.kv_target, args.queue_target, args.drain,
                        args.planner_margin, args.load_interval)
    per_worker = args.per_worker or asyncio.run(calibrate(settings, lengths, work, model, args.seed))
    capacity = per_worker * args.max_workers * args.headroom
    print(f"capacity: one worker meets TTFT {args.ttft:g} ms and ITL {args.itl:g} ms up to {per_worker:.2f} req/s "
          f"(the planner's formulas say {capacity_per_worker(profile, lengths, args.ttft, args.itl):.2f}); traces' "
          f"100% = {capacity:.1f} req/s ({args.max_workers} workers x {args.headroom:g})", flush=True)
    results: list[RunResult] = []
    for number, trace_name in enumerate(args.traces.split(",")):
        shape = load_shape(trace_name, args.intervals, args.seed + number)
        trace = work / f"{trace_name}.jsonl"
        count = write_trace(trace, shape, args.interval, capacity, lengths, args.seed + number,
                            bursty=trace_name == "mooncake")
        static_min = max(1, math.ceil(min(shape) * args.max_workers / args.headroom))
        print(f"\n{trace_name}: {count} requests over {args.intervals * args.interval:.0f} s, mean load "
              f"{sum(shape) / len(shape) * 100:.0f}%", flush=True)
        for policy in args.policies.split(","):
            began = time.monotonic()
            result = asyncio.run(run_policy(policy, trace_name, trace, shape, settings, static_min, work, model))
            results.append(result)
            print(f"  {policy}: {result.within_sla * 100:.0f}% of intervals within SLA, {result.worker_seconds:.0f} "
                  f"worker-s, {result.scaling_actions} actions, {result.failed} failed, lag {result.lag * 100:.1f}%, loop held "
                  f"up {result.held_up:.1f} s ({time.monotonic() - began:.0f} s)", flush=True)
    print()
    print(report(results, settings))
    for where in (args.json, work / "results.json" if args.keep is not None else None):
        if where is not None:
            where.write_text(json.dumps([asdict(r) for r in results], indent=1))
    if args.plots is not None:
        for path in plot(results, settings, capacity, args.plots):
            print(path)
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r.failed == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
