"""Tier-aware KV routing with simulated KV offload tiers: 8 mocker workers, each with a small device KV
pool, a host-memory tier (G2) and a disk tier (G3) below it, on a multi-turn workload whose working set
is several times the device pools; four router settings, same workload, one stack after the other.

    .venv/bin/python bench/kv_tiers_bench.py                       # the four stacks below, 1 round (~5 min)
    .venv/bin/python bench/kv_tiers_bench.py --quick               # a short smoke run (~2.5 min)
    .venv/bin/python bench/kv_tiers_bench.py --rounds 2 --json out.json --plot docs/images/kv-tiers-bench.png
    .venv/bin/python bench/kv_tiers_bench.py --turn-gap 0          # closed loop, as router_bench.py replays
    .venv/bin/python bench/kv_tiers_bench.py --workers 16 --conversations 242 --gpu-blocks 512  # same rate and ratio

Needs .bench/aiperf-venv (`bash bench/setup_baselines.sh`).

Stacks (`tandem run --engine mocker --workers 8 --system-port-base PORT --router-mode kv|round-robin
--frontend-args=... -- MOCKER FLAGS`, a fresh deployment each, one mocker process per worker):
  tier-aware   --router-mode kv, default tier weights: a block continuing a worker's device match in
               its host memory is credited 0.75 of a device block, on its disk 0.25
  tier-blind   --router-mode kv --router-host-cache-hit-weight 1 --router-disk-cache-hit-weight 1
               (lower tiers counted as if on the device)
  device-only  --router-mode kv --router-host-cache-hit-weight 0 --router-disk-cache-hit-weight 0
               (lower tiers ignored: the KV router before tier awareness)
  round-robin  --router-mode round-robin
--router-args adds flags to the three KV frontends (otherwise all router settings are the defaults).

Engine (the same mocker flags on every stack): --speedup-ratio 1 --decode-speedup-ratio 4 (prefill in
real time per Dynamo's polynomial, ~1-1.2 ms per 64-token block plus 16.5 ms a step; decode 4x faster:
prefill dominates), block size 64, max-num-seqs 256, max-num-batched-tokens 8192, prefix caching on,
and per worker --num-gpu-blocks-override P (default 1024), --num-g2-blocks 2P, --num-g3-blocks 4P, the
mocker's default onboarding bandwidths (host→device 14 GB/s, disk→device 2 GB/s). KV bytes per token come
from the model (SmolLM2-135M: 30 layers x 2 x 3 KV heads x 64 x 2 bytes = 23,040), so a 64-token block
(1.47 MB) loads from host in ~0.11 ms and from disk in ~0.74 ms, against ~1-1.2 ms to compute it: a host
hit is nearly free, a disk hit saves ~30-40%.

Workload: router_bench.py's Mooncake-format multi-turn trace (its `write_trace`), replayed by aiperf 0.13:
--conversations conversations of --turns turns; each prompt is one system prompt shared by all
(--system-blocks), the conversation's own context (--context-blocks), then --turn-blocks new blocks per
turn so far; rows go turn by turn (every conversation's turn k, then turn k+1, ...). Paced (the default):
aiperf's fixed schedule, the rows evenly spread so that each conversation's turns are --turn-gap seconds
apart (6 s: more than the router's --router-predicted-ttl-secs, 5 s; see below), i.e. conversations /
gap requests per second, open loop; requests/s is then the schedule's rate. --turn-gap 0: closed loop at
--concurrency, rows in order, as router_bench.py (a conversation comes back as soon as every other one's
turn is done). Defaults: 242 conversations (30 per worker + 2: not a multiple of the workers, so that
round-robin moves each conversation every turn) x 8 turns = 1,936 requests, 8 + 48 + 8 per turn blocks,
so prompts of 64-120 blocks (4,096-7,680 tokens, mean 5,888), output 16 tokens: 40.3 requests/s.
Arithmetic (defaults): the working set at the last turn is 8 + 242 x (48 + 8 x 8) = 27,112 blocks, 3.3x
the 8 x 1,024 = 8,192 device blocks. A router that keeps each conversation on one worker puts ~30
conversations on each, whose blocks grow from ~1,700 (turn 1) to ~3,390 (turn 8): well beyond its device
pool (1,024), so a returning conversation has left the device; up to turn 6 (~2,900) within device + host
(3P = 3,072), beyond that partly on disk; always within device + host + disk (7P = 7,168). Round-robin, or
a router blind to the lower tiers, mostly sends a conversation to a worker whose tiers do not hold it,
which computes all of the prompt but the shared system prompt. The rate is what spreads the work: at
~20 requests/s (P = 512, 122 conversations) the KV router used 5 of the 8 workers (an idle worker without
the system prompt cached costs more than a warm one), so that each worker's share of the working set
exceeded its tiers and the returning conversations came mostly from disk.
--quick: the same, 3 turns (726 requests): working set 8 + 242 x 72 = 17,432 blocks, 2.1x the device
pools (the returning turns come back mostly from host memory).

Why paced: in a closed loop at this concurrency a conversation comes back a second or two after its last
turn, while the router still counts that turn's blocks, for --router-predicted-ttl-secs (5 s), as held
in its worker's pool (the events may not have arrived). Once the worker's events place those blocks on a
lower tier, the events count instead; until then the prediction credits them as pool blocks on the right
worker anyway. With turns 6 s apart the events are in, and the comparison is of the tier weights alone.
--turn-gap 0 shows the closed loop.

Figures. TTFT p50/p90, requests/s from aiperf. Hit rate = sum of usage.prompt_tokens_details.cached_tokens
/ sum of prompt tokens (aiperf's usage_prompt_cache_read_tokens / usage_prompt_tokens); the mocker counts
as cached the tokens its device pool held and those it loaded from its tiers (as vLLM with KVBM does), so
the hit rate is split with the mockers' own counters, read from every worker's system port
(DYN_SYSTEM_PORT = --system-port-base + i) and summed over the workers: kvbm_onboard_blocks_h2d
(host→device) and kvbm_onboard_blocks_d2d (disk→device) x 64 tokens over the prompt tokens are the host
and disk shares; device hit rate = hit rate - host share - disk share. Also kvbm_offload_blocks_d2h / _h2d
(blocks offloaded device→host, host→disk) and the mean over the workers of the kvbm_host_cache_hit_rate /
kvbm_disk_cache_hit_rate gauges (blocks found in that tier / blocks looked up there). Router side
(frontend /metrics, KV stacks): its estimated device hit rate (estimated hit blocks / prompt blocks) and
dynamo_router_tier_hit_blocks_total{tier} / prompt blocks: the blocks the chosen worker held, right after
its device match, in host memory / on disk, as the router saw them (whatever the weights: non-zero once
tier events reach the router and a match continues below the device).
--rounds N runs the stacks N times, interleaved, and reports medians.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

from _common import (
    Deployment,
    add_output_args,
    bench_run,
    fmt,
    free_port,
    hub_cache_tokenizer,
    interrupt_on_sigterm,
    machine_busy_seconds,
    model_path,
    parse_aiperf,
    run_aiperf,
    scrape,
    total,
    wait_quiet,
    write_json,
)
from router_bench import (
    BLOCK,
    TOKENIZER_REPO,
    aiperf_command,
    cache_stats,
    engine_flags,
    medians,
    write_trace,
)

WEIGHTS = ("--router-host-cache-hit-weight", "--router-disk-cache-hit-weight")
STACKS: dict[str, tuple[str, list[str], str]] = {  # name -> (router mode, frontend flags, label)
    "tier-aware": ("kv", [], "tier-aware (0.75/0.25)"),
    "tier-blind": ("kv", [WEIGHTS[0], "1", WEIGHTS[1], "1"], "tier-blind (1/1)"),
    "device-only": ("kv", [WEIGHTS[0], "0", WEIGHTS[1], "0"], "device-only (0/0)"),
    "round-robin": ("round-robin", [], "round-robin"),
}
TIERS = ("host_pinned", "disk")


# -- measurements -------------------------------------------------------------------------------------
def port_base(count: int) -> int:
    """A port such that it and the `count - 1` after it are free (the workers' system ports)."""
    for _ in range(50):
        base = free_port()
        if base + count > 65535:
            continue
        try:
            socks = []
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports")


def worker_metrics(base: int, workers: int) -> dict[str, float]:
    """The mockers' offload counters summed over the workers (gauges: mean over them)."""
    out = dict.fromkeys(("onboard_host_blocks", "onboard_disk_blocks", "offload_d2h_blocks", "offload_h2d_blocks",
                         "tier_matched_tokens"), 0.0)
    host_rates, disk_rates = [], []
    for i in range(workers):
        samples = scrape(f"http://127.0.0.1:{base + i}")
        if not any(name.startswith("kvbm_") for name, _ in samples):
            raise RuntimeError(f"worker {i} (system port {base + i}) serves no kvbm_* metrics")
        out["onboard_host_blocks"] += total(samples, "kvbm_onboard_blocks_h2d_total")
        out["onboard_disk_blocks"] += total(samples, "kvbm_onboard_blocks_d2d_total")
        out["offload_d2h_blocks"] += total(samples, "kvbm_offload_blocks_d2h_total")
        out["offload_h2d_blocks"] += total(samples, "kvbm_offload_blocks_h2d_total")
        out["tier_matched_tokens"] += total(samples, "kvbm_matched_tokens_total")
        host_rates.append(total(samples, "kvbm_host_cache_hit_rate"))
        disk_rates.append(total(samples, "kvbm_disk_cache_hit_rate"))
    out["host_tier_hit_pct"] = statistics.mean(host_rates) * 100
    out["disk_tier_hit_pct"] = statistics.mean(disk_rates) * 100
    return out


def frontend_metrics(url: str) -> dict[str, float]:
    """The router's view (frontend /metrics): estimated device hit rate and lower-tier hits, % of prompt blocks."""
    samples = scrape(url)
    prompt = total(samples, "dynamo_component_router_prompt_blocks_total")
    if not prompt:
        return {}
    out = {"router_est_hit_pct": total(samples, "dynamo_component_router_estimated_hit_blocks_total") / prompt * 100}
    for tier in TIERS:
        out[f"router_{tier}_hit_pct"] = total(samples, "dynamo_router_tier_hit_blocks_total", tier=tier) / prompt * 100
        out[f"router_{tier}_hit_blocks"] = total(samples, "dynamo_router_tier_hit_blocks_total", tier=tier)
    return out


def hit_split(result: dict[str, float]) -> None:
    """Hit rate (from usage) split into device / host / disk shares of the prompt tokens."""
    prompt_tokens = result["prompt_tokens_mean"] * result["requests_ok"]
    result["host_hit_pct"] = result["onboard_host_blocks"] * BLOCK / prompt_tokens * 100
    result["disk_hit_pct"] = result["onboard_disk_blocks"] * BLOCK / prompt_tokens * 100
    result["device_hit_pct"] = result["hit_rate_pct"] - result["host_hit_pct"] - result["disk_hit_pct"]


# -- workload -------------------------------------------------------------------------------------
def pace(trace: str, args: argparse.Namespace) -> None:
    """Rewrite the trace's timestamps (ms): row i (turn i // conversations, conversation i % conversations)
    at (turn + conversation / conversations) x --turn-gap, so each conversation's turns are a gap apart."""
    with open(trace) as f:
        rows = [json.loads(line) for line in f]
    gap_ms = args.turn_gap * 1000
    for i, row in enumerate(rows):
        turn, conversation = divmod(i, args.conversations)
        row["timestamp"] = round((turn + conversation / args.conversations) * gap_ms)
    with open(trace, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def load_command(args: argparse.Namespace, url: str, trace: str, requests: int, artifacts: str) -> list[str]:
    """router_bench's aiperf command; paced (--turn-gap > 0): the trace's fixed schedule instead of a
    closed loop at --concurrency."""
    cmd = aiperf_command(args, url, trace, requests, artifacts)
    if args.turn_gap > 0:
        at = cmd.index("--concurrency")
        del cmd[at:at + 2]
        cmd[cmd.index("--no-fixed-schedule")] = "--fixed-schedule"
    return cmd


# -- one run ----------------------------------------------------------------------------------------
def tier_flags(args: argparse.Namespace) -> list[str]:
    return [*engine_flags(args), "--num-g2-blocks", str(args.host_blocks), "--num-g3-blocks", str(args.disk_blocks)]


def run_stack(stack: str, args: argparse.Namespace, trace: str, requests: int,
              aiperf_env: dict[str, str]) -> dict[str, float]:
    mode, flags, _ = STACKS[stack]
    frontend_args = [*flags, *shlex.split(args.router_args)] if mode == "kv" else []
    base = port_base(args.workers)
    with bench_run(stack, args.keep_logs, prefix=f"kv-tiers-bench-{stack}-") as run:
        deployment = run.deployment = Deployment(
            "tandem", tier_flags(args), run.workdir, "", workers=args.workers, router_mode=mode,
            frontend_args=frontend_args, run_args=["--system-port-base", str(base)])
        artifacts = os.path.join(run.workdir, "aiperf")
        busy0, t0 = machine_busy_seconds(), time.monotonic()
        run_aiperf(load_command(args, deployment.url, trace, requests, artifacts),
                   os.path.join(deployment.logdir, "aiperf.log"), timeout=args.run_timeout, env_extra=aiperf_env)
        busy = (machine_busy_seconds() - busy0) / (time.monotonic() - t0) * 100
        export = os.path.join(artifacts, "profile_export_aiperf.json")
        result = parse_aiperf(export)
        result.pop("_start"), result.pop("_end")
        with open(export) as f:
            result["ttft_p90_ms"] = float(json.load(f)["time_to_first_token"]["p90"])
        result.update(cache_stats(export))
        result["machine_busy_pct"] = busy
        result.update(worker_metrics(base, args.workers))
        result.update(frontend_metrics(deployment.url))
        hit_split(result)
        if result["errors"] or result["requests_ok"] < requests or result["completion_tokens_min"] < args.osl:
            raise RuntimeError(f"{stack}: {result['errors']:.0f} errors, {result['requests_ok']:.0f} of {requests} "
                               f"requests, shortest answer {result['completion_tokens_min']:.0f} tokens")
        return result


# -- report -------------------------------------------------------------------------------------------
ROWS = [("ttft_p50_ms", "TTFT p50 (ms)"), ("ttft_p50_min_ms", "TTFT p50, lowest round (ms)"),
        ("ttft_p50_max_ms", "TTFT p50, highest round (ms)"), ("ttft_p90_ms", "TTFT p90 (ms)"),
        ("ttft_p99_ms", "TTFT p99 (ms)"), ("rps", "requests/s"), ("latency_p50_ms", "request latency p50 (ms)"),
        ("hit_rate_pct", "hit rate, all tiers (%, usage cached / prompt tokens)"),
        ("device_hit_pct", "  device hit rate (%)"), ("host_hit_pct", "  loaded from host (% of prompt tokens)"),
        ("disk_hit_pct", "  loaded from disk (% of prompt tokens)"),
        ("onboard_host_blocks", "blocks onboarded host→device (mockers, sum)"),
        ("onboard_disk_blocks", "blocks onboarded disk→device (mockers, sum)"),
        ("offload_d2h_blocks", "blocks offloaded device→host (mockers, sum)"),
        ("offload_h2d_blocks", "blocks offloaded host→disk (mockers, sum)"),
        ("host_tier_hit_pct", "host tier hit rate (%, found / looked up, mean of workers)"),
        ("disk_tier_hit_pct", "disk tier hit rate (%, found / looked up, mean of workers)"),
        ("router_est_hit_pct", "router: estimated device hit (% of prompt blocks)"),
        ("router_host_pinned_hit_pct", "router: chosen worker's host blocks (% of prompt blocks)"),
        ("router_disk_hit_pct", "router: chosen worker's disk blocks (% of prompt blocks)"),
        ("prompt_tokens_mean", "prompt tokens (mean)"), ("duration_s", "duration (s)"),
        ("machine_busy_pct", "machine busy during aiperf (% of a core)"), ("errors", "errors")]


def report(results: dict[str, dict[str, float]]) -> str:
    """The markdown table: a column a stack, then each stack's ratios to round-robin and to device-only."""
    names = list(results)

    def row(label: str, cells: list[str]) -> str:
        return "| " + " | ".join([label, *cells]) + " |"

    table = [row("metric", [STACKS[n][2] for n in names]), row("---", ["---"] * len(names))]
    table += [row(label, [fmt(results[n][key]) if key in results[n] else "n/a" for n in names])
              for key, label in ROWS if any(key in results[n] for n in names)]
    ratios = (("ttft_p50_ms", "TTFT p50"), ("ttft_p90_ms", "TTFT p90"), ("rps", "requests/s"))
    for ref, (key, label) in itertools.product(("round-robin", "device-only"), ratios):
        if ref in results:
            table.append(row(f"{label} / {ref}", [f"{results[n][key] / results[ref][key]:.2f}x" for n in names]))
    return "\n".join(table)


def plot(results: dict[str, dict[str, float]], args: argparse.Namespace, path: str) -> None:
    import _serve_compare

    names = list(results)
    labels = [STACKS[n][2].replace(" (", "\n(") for n in names]
    x = range(len(names))

    def draw(plt: Any) -> Any:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
        width = 0.38
        for offset, key, label in ((-width / 2, "ttft_p50_ms", "TTFT p50"), (width / 2, "ttft_p90_ms", "TTFT p90")):
            bars = left.bar([i + offset for i in x], [results[n][key] for n in names], width, label=label)
            for bar in bars:
                left.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{bar.get_height():.0f}",
                          ha="center", va="bottom", fontsize=8)
        left.set_xticks(list(x), labels, fontsize=8)
        left.set_ylabel("ms")
        left.set_title("time to first token", fontsize=10)
        left.legend(fontsize=8)
        bottom = [0.0] * len(names)
        for key, label, colour in (("device_hit_pct", "device", "tab:green"), ("host_hit_pct", "host → device", "tab:blue"),
                                   ("disk_hit_pct", "disk → device", "tab:orange")):
            values = [results[n][key] for n in names]
            right.bar(list(x), values, 0.6, bottom=bottom, label=label, color=colour)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        for i, b in enumerate(bottom):
            right.text(i, b, f"{b:.0f}%", ha="center", va="bottom", fontsize=8)
        right.set_xticks(list(x), labels, fontsize=8)
        right.set_ylabel("% of prompt tokens not computed")
        right.set_ylim(0, 100)
        right.set_title("where the cached prompt tokens came from", fontsize=10)
        right.legend(fontsize=8, loc="upper right")
        fig.suptitle(f"{args.workers} mocker workers, KV blocks per worker: device {args.gpu_blocks}, host "
                     f"{args.host_blocks}, disk {args.disk_blocks}; {args.conversations} conversations x "
                     f"{args.turns} turns, {load_label(args)}", fontsize=10)
        return fig

    _serve_compare.plot(path, draw)


# -- main ---------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stacks", default=",".join(STACKS), help=f"comma-separated, run in this order: {', '.join(STACKS)}")
    workload = parser.add_argument_group("workload and engine (whole numbers; blocks of 64 tokens)")
    for flag, default, text in (
            ("--workers", 8, "mocker workers (one process each), e.g. 16"),
            ("--conversations", None, "[30 per worker + 2: 242 for 8 workers]: not a multiple of the workers"),
            ("--turns", None, "[8; --quick 3]"),
            ("--system-blocks", 8, "blocks shared by every prompt"),
            ("--context-blocks", 48, "blocks of each conversation's own context"),
            ("--turn-blocks", 8, "new blocks of user text per turn"),
            ("--osl", 16, "output tokens per request"),
            ("--concurrency", 16, "closed loop (--turn-gap 0) only"),
            ("--gpu-blocks", 1024, "P: mocker --num-gpu-blocks-override per worker"),
            ("--host-blocks", None, "mocker --num-g2-blocks per worker [2P]"),
            ("--disk-blocks", None, "mocker --num-g3-blocks per worker [4P]")):
        workload.add_argument(flag, type=int, default=default, help=text)
    workload.add_argument("--turn-gap", type=float, default=6.0,
                          help="seconds between a conversation's turns (aiperf fixed schedule); 0: closed loop at "
                          "--concurrency, as router_bench.py")
    workload.add_argument("--speedup", type=float, default=1.0, help="mocker --speedup-ratio")
    workload.add_argument("--decode-speedup", type=float, default=4.0, help="mocker --decode-speedup-ratio")
    parser.add_argument("--router-args", default="", help="extra router flags for the KV frontends")
    parser.add_argument("--rounds", type=int, default=1, help="run every stack this many times, interleaved (medians)")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--plot", default=None, metavar="PNG", help="also draw TTFT and the hit split per stack")
    parser.add_argument("--from-json", default=None, metavar="PATH",
                        help="print the table (and --plot) of a run --json wrote, without running")
    parser.add_argument("--max-others", type=float, default=30.0, help="wait until the machine is this quiet first")
    parser.add_argument("--quiet-timeout", type=float, default=300, help="... for at most this many seconds")
    parser.add_argument("--run-timeout", type=float, default=900, help="seconds one aiperf run may take")
    add_output_args(parser)
    args = parser.parse_args()
    if args.conversations is None:
        args.conversations = 30 * args.workers + 2
    if args.turns is None:
        args.turns = 3 if args.quick else 8
    args.host_blocks = 2 * args.gpu_blocks if args.host_blocks is None else args.host_blocks
    args.disk_blocks = 4 * args.gpu_blocks if args.disk_blocks is None else args.disk_blocks
    stacks = [s.strip() for s in args.stacks.split(",") if s.strip()]
    for s in stacks:
        if s not in STACKS:
            parser.error(f"unknown stack {s!r} ({', '.join(STACKS)})")
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        vars(args).update({k: v for k, v in saved["args"].items() if k not in ("plot", "json", "from_json")})
        results, rounds, seconds = saved["results"], saved["rounds"], saved.get("seconds", 0.0)
    else:
        started = time.monotonic()
        interrupt_on_sigterm()
        try:
            rounds = measure(args, stacks)
        except KeyboardInterrupt:
            sys.exit("interrupted; everything started was stopped")
        results = {stack: medians(runs) for stack, runs in rounds.items()}
        seconds = time.monotonic() - started
    print(f"\nkv_tiers_bench: {args.workers} mocker workers per stack, aiperf 0.13, {os.cpu_count()} cores, "
          f"{f'{seconds:.0f} s, ' if seconds else ''}{args.rounds} round(s) (figures: medians)\n{describe(args)}\n")
    print(report(results))
    aware = results.get("tier-aware", {})
    if aware and not aware.get("router_host_pinned_hit_blocks") and not aware.get("router_disk_hit_blocks"):
        print("\nWARNING: tier-aware: the router counted no lower-tier blocks: no tier events reached it")
    if args.plot:
        plot(results, args, args.plot)
    if not args.from_json:
        write_json(args.json, {"args": vars(args), "results": results, "rounds": rounds, "seconds": seconds})


def measure(args: argparse.Namespace, stacks: list[str]) -> dict[str, list[dict[str, float]]]:
    """Every stack's figures, one list per stack (a result a round; the rounds interleave the stacks)."""
    if not os.access(args.aiperf, os.X_OK):
        raise SystemExit(f"no aiperf at {args.aiperf}: run bash bench/setup_baselines.sh")
    os.environ.setdefault("DYN_SYSTEM_HOST", "127.0.0.1")  # the workers' system ports, on loopback
    rounds: dict[str, list[dict[str, float]]] = {stack: [] for stack in stacks}
    with tempfile.TemporaryDirectory(prefix="kv-tiers-bench-trace-") as tmp:
        trace = os.path.join(tmp, "trace.jsonl")
        requests, _ = write_trace(trace, args)
        if args.turn_gap > 0:
            pace(trace, args)
        aiperf_env = hub_cache_tokenizer(model_path(), os.path.join(tmp, "hub"), TOKENIZER_REPO)
        for n, stack in itertools.product(range(args.rounds), stacks):
            wait_quiet(args.max_others, timeout=args.quiet_timeout)
            got = run_stack(stack, args, trace, requests, aiperf_env)
            rounds[stack].append(got)
            print(f"  round {n + 1} {STACKS[stack][2]:24} {got['rps']:6.2f} req/s  TTFT p50 "
                  f"{got['ttft_p50_ms']:7.1f} p90 {got['ttft_p90_ms']:7.1f} ms  hit {got['hit_rate_pct']:5.1f}% "
                  f"(device {got['device_hit_pct']:.1f}, host {got['host_hit_pct']:.1f}, disk {got['disk_hit_pct']:.1f})",
                  file=sys.stderr, flush=True)
    return rounds


def load_label(args: argparse.Namespace) -> str:
    return (f"paced: turns {args.turn_gap:g} s apart, {args.conversations / args.turn_gap:.1f} requests/s"
            if args.turn_gap > 0 else f"closed loop at concurrency {args.concurrency}")


def describe(args: argparse.Namespace) -> str:
    """The workload and engine, with the working set against the device pools."""
    first = args.system_blocks + args.context_blocks + args.turn_blocks
    last = args.system_blocks + args.context_blocks + args.turns * args.turn_blocks
    working_set = args.system_blocks + args.conversations * (last - args.system_blocks)
    device = args.gpu_blocks * args.workers
    return (f"workload: {args.conversations} conversations x {args.turns} turns = {args.conversations * args.turns} "
            f"requests, {load_label(args)}, prompts {first * BLOCK}-{last * BLOCK} tokens (mean "
            f"{(first + last) * BLOCK // 2}), output {args.osl} tokens\n"
            f"KV blocks per worker: device {args.gpu_blocks}, host {args.host_blocks}, disk {args.disk_blocks}; "
            f"working set {working_set} blocks = {working_set / device:.2f}x the {device} device blocks, "
            f"{working_set / args.workers:.0f} per worker when each conversation stays on one\n"
            f"engine: --speedup-ratio {args.speedup:g}, --decode-speedup-ratio {args.decode_speedup:g}, block size "
            f"{BLOCK}; extra router flags: {args.router_args or '(none)'}")


if __name__ == "__main__":
    main()
