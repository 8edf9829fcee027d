"""KV routing end to end: tandem's KV router against tandem round-robin and Dynamo 1.6.1's KV router,
8 mocker workers each with a small KV cache, on a multi-turn workload whose requests share long
prefixes; same timing model, same aiperf 0.13 workload, one stack after the other.

    .venv/bin/python bench/router_bench.py                 # tandem kv, tandem round-robin, Dynamo kv
    .venv/bin/python bench/router_bench.py --quick         # a short smoke run (fewer conversations)
    .venv/bin/python bench/router_bench.py --stacks tandem-kv,dynamo-kv,dynamo-rr --json out.json
    .venv/bin/python bench/router_bench.py --stacks tandem-kv,base-kv --baseline-tree WORKTREE --rounds 2

Needs .bench/dynamo-venv and .bench/aiperf-venv (`bash bench/setup_baselines.sh`).

Workload: a Mooncake-format trace (JSONL: timestamp, input_length, output_length, hash_ids) replayed by
aiperf (`--custom-dataset-type mooncake_trace --isl-block-size 64`: each hash id is one 64-token block
of synthetic text), closed loop at --concurrency (`--no-fixed-schedule`), rows in order. There are
--conversations conversations of --turns turns; every prompt starts with one system prompt shared by
all (--system-blocks blocks), then the conversation's own context (--context-blocks blocks), then the
user text of every turn so far (--turn-blocks new blocks per turn): turn k's prompt is turn k-1's plus
new text. The rows go turn by turn (turn 1 of every conversation, then turn 2, ...), so a conversation's
previous turn has finished when its next one is sent. Outputs are --osl tokens (ignore_eos).

Engine (both mockers, same flags): --speedup-ratio 1 and --decode-speedup-ratio 4 (prefill in real
time per Dynamo's polynomial, decode 4x faster: prefill dominates), block size 64, --num-gpu-blocks-override
(default 1024 per worker: about a quarter of the working set of ~4,400 blocks, so round-robin, which
spreads every conversation over all 8 workers, keeps evicting, while a router that keeps each
conversation on one worker fits them), max-num-seqs 256, max-num-batched-tokens 8192, prefix caching on.
Frontends: tandem `tandem run --engine mocker --workers 8 --router-mode kv|round-robin`; Dynamo
`dynamo.frontend --router-mode kv|round-robin --kv-cache-block-size 64` + `dynamo.mocker --num-workers 8`
(file discovery, tcp request plane, zmq event plane). Router settings are each side's defaults plus
--router-args, the same flags on both (e.g. `--router-prefill-load-scale 4` for a prefill-dominated workload).
--rounds N runs the stacks N times, interleaved, and reports medians.

Hit rate = sum of `usage.prompt_tokens_details.cached_tokens` / sum of prompt tokens, as reported by
the mockers to aiperf (aiperf's usage_prompt_cache_read_tokens / usage_prompt_tokens); for KV runs the
router's own estimate (frontend /metrics: estimated hit blocks / prompt blocks) is shown when exposed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time

from _common import (
    MODEL_NAME,
    Deployment,
    add_output_args,
    bench_run,
    fmt,
    hub_cache_tokenizer,
    interrupt_on_sigterm,
    machine_busy_seconds,
    model_path,
    parse_aiperf,
    require_dynamo,
    run_aiperf,
    scrape,
    wait_quiet,
    write_json,
)

WORKERS = 8
TOKENIZER_REPO = "local/SmolLM2-135M-Instruct"
BLOCK = 64
STACKS = {  # name -> (implementation, router mode, label)
    "tandem-kv": ("tandem", "kv", "tandem kv"),
    "tandem-rr": ("tandem", "round-robin", "tandem round-robin"),
    "dynamo-kv": ("dynamo", "kv", "Dynamo 1.6.1 kv"),
    "dynamo-rr": ("dynamo", "round-robin", "Dynamo 1.6.1 round-robin"),
    "base-kv": ("base", "kv", "tandem kv, baseline tree"),  # tandem from --baseline-tree
}


# -- workload ---------------------------------------------------------------------------------------
def write_trace(path: str, args: argparse.Namespace) -> tuple[int, int]:
    """The Mooncake trace (rows turn-major); returns (rows, mean prompt tokens)."""
    next_id = 0

    def ids(n: int) -> list[int]:
        nonlocal next_id
        out = list(range(next_id, next_id + n))
        next_id += n
        return out

    system = ids(args.system_blocks)
    history = [system + ids(args.context_blocks) for _ in range(args.conversations)]
    rows = []
    for _turn in range(args.turns):
        for c in range(args.conversations):
            history[c] = history[c] + ids(args.turn_blocks)
            rows.append({"timestamp": len(rows), "input_length": len(history[c]) * BLOCK,
                         "output_length": args.osl, "hash_ids": history[c]})
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return len(rows), sum(r["input_length"] for r in rows) // len(rows)


def aiperf_command(args: argparse.Namespace, url: str, trace: str, requests: int, artifacts: str) -> list[str]:
    return [args.aiperf, "profile", "--model", MODEL_NAME, "--url", url, "--endpoint-type", "chat", "--streaming",
            "--tokenizer", TOKENIZER_REPO, "--input-file", trace, "--custom-dataset-type", "mooncake_trace",
            "--isl-block-size", str(BLOCK), "--no-fixed-schedule", "--dataset-sampling-strategy", "sequential",
            "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
            "--concurrency", str(args.concurrency), "--request-count", str(requests),
            "--random-seed", "1", "--request-timeout-seconds", "300",
            "--artifact-dir", artifacts, "--export-level", "summary", "--ui", "none",
            "--no-server-metrics", "--no-gpu-telemetry"]


def cache_stats(path: str) -> dict[str, float]:
    """Hit rate from aiperf's export: mean cached prompt tokens / mean prompt tokens per request."""
    with open(path) as f:
        d = json.load(f)
    out: dict[str, float] = {}
    prompt = d.get("usage_prompt_tokens") or d.get("input_sequence_length") or {}
    cached = d.get("usage_prompt_cache_read_tokens") or {}
    if prompt.get("avg"):
        out["prompt_tokens_mean"] = float(prompt["avg"])
        if cached.get("avg") is not None:
            out["hit_rate_pct"] = float(cached["avg"]) / float(prompt["avg"]) * 100
    return out


def router_metrics(url: str) -> dict[str, float]:
    """Frontend /metrics: the router's estimated hit blocks / prompt blocks, when exposed."""
    samples = scrape(url)
    prompt = sum(v for (name, _), v in samples.items() if name.endswith("router_prompt_blocks_total"))
    hit = sum(v for (name, _), v in samples.items() if name.endswith("router_estimated_hit_blocks_total"))
    return {"router_est_hit_pct": hit / prompt * 100} if prompt else {}


# -- one run ----------------------------------------------------------------------------------------
def engine_flags(args: argparse.Namespace) -> list[str]:
    return ["--speedup-ratio", f"{args.speedup:g}", "--decode-speedup-ratio", f"{args.decode_speedup:g}",
            "--block-size", str(BLOCK),
            "--num-gpu-blocks-override", str(args.gpu_blocks), "--max-num-seqs", "256",
            "--max-num-batched-tokens", "8192", "--enable-prefix-caching"]


def run_stack(stack: str, args: argparse.Namespace, trace: str, requests: int,
              aiperf_env: dict[str, str]) -> dict[str, float]:
    impl, mode, _ = STACKS[stack]
    frontend_args = ["--kv-cache-block-size", str(BLOCK)] if impl == "dynamo" else []
    if mode == "kv":
        frontend_args += shlex.split(args.router_args)
    with bench_run(stack, args.keep_logs, prefix=f"router-bench-{stack}-") as run:
        workdir = run.workdir
        deployment = run.deployment = Deployment(impl, engine_flags(args), workdir, args.dynamo_python, workers=WORKERS,
                                router_mode=mode, frontend_args=frontend_args,
                                tree=args.baseline_tree if impl == "base" else None)
        artifacts = os.path.join(workdir, "aiperf")
        busy0, t0 = machine_busy_seconds(), time.monotonic()
        run_aiperf(aiperf_command(args, deployment.url, trace, requests, artifacts),
                   os.path.join(deployment.logdir, "aiperf.log"), timeout=args.run_timeout, env_extra=aiperf_env)
        busy = (machine_busy_seconds() - busy0) / (time.monotonic() - t0) * 100
        for p in deployment.procs:
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.name} exited ({p.proc.returncode}) during the run")
        export = os.path.join(artifacts, "profile_export_aiperf.json")
        result = parse_aiperf(export)
        result.pop("_start"), result.pop("_end")
        result.update(cache_stats(export))
        result["machine_busy_pct"] = busy  # whole machine, aiperf start to exit (incl. its startup)
        if mode == "kv":
            result.update(router_metrics(deployment.url))
        if result["errors"] or result["requests_ok"] < requests or result["completion_tokens_min"] < args.osl:
            raise RuntimeError(f"{stack}: {result['errors']:.0f} errors, {result['requests_ok']:.0f} of {requests} "
                               f"requests, shortest answer {result['completion_tokens_min']:.0f} tokens")
        return result


# -- report -------------------------------------------------------------------------------------------
ROWS = [("rps", "requests/s"), ("output_tokens_per_s", "output tokens/s"), ("ttft_p50_ms", "TTFT p50 (ms)"),
        ("ttft_p50_min_ms", "TTFT p50, lowest round (ms)"), ("ttft_p50_max_ms", "TTFT p50, highest round (ms)"),
        ("ttft_p99_ms", "TTFT p99 (ms)"), ("latency_p50_ms", "request latency p50 (ms)"),
        ("itl_p50_ms", "ITL p50 (ms)"), ("hit_rate_pct", "prefix cache hit rate (%, from usage)"),
        ("router_est_hit_pct", "router's estimated hit rate (%)"), ("prompt_tokens_mean", "prompt tokens (mean)"),
        ("duration_s", "duration (s)"),
        ("machine_busy_pct", "machine busy during aiperf (% of a core, 2 cores = 200)"), ("errors", "errors")]


def medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Per metric, the median over the rounds (with the TTFT p50 range when there are several)."""
    out = {key: statistics.median(r[key] for r in rounds) for key in rounds[0] if all(key in r for r in rounds)}
    if len(rounds) > 1:
        out["ttft_p50_min_ms"] = min(r["ttft_p50_ms"] for r in rounds)
        out["ttft_p50_max_ms"] = max(r["ttft_p50_ms"] for r in rounds)
    return out


def report(results: dict[str, dict[str, float]]) -> str:
    names = list(results)
    lines = ["| metric | " + " | ".join(STACKS[n][2] for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    for key, label in ROWS:
        if any(key in results[n] for n in names):
            lines.append(f"| {label} | " + " | ".join(fmt(results[n][key]) if key in results[n] else "n/a"
                                                      for n in names) + " |")
    lines.append("")

    def ratio(a: str, b: str, key: str) -> float | None:
        if a in results and b in results and results[b].get(key):
            return results[a][key] / results[b][key]
        return None

    checks = []
    r = ratio("tandem-rr", "tandem-kv", "ttft_p50_ms")
    if r is not None:
        checks.append(f"- TTFT p50, tandem round-robin / tandem kv: **{r:.2f}x** (target >= 3x: "
                      f"{'met' if r >= 3 else 'NOT met'})")
    r = ratio("tandem-kv", "dynamo-kv", "ttft_p50_ms")
    if r is not None:
        r99 = ratio("tandem-kv", "dynamo-kv", "ttft_p99_ms")
        rps = ratio("tandem-kv", "dynamo-kv", "rps")
        checks.append(f"- tandem kv / Dynamo kv: TTFT p50 **{r:.2f}x**, TTFT p99 {r99:.2f}x, requests/s {rps:.2f}x "
                      f"(target: no worse than Dynamo, i.e. TTFT p50 <= ~1.05x: {'met' if r <= 1.05 else 'NOT met'})")
    r = ratio("tandem-kv", "base-kv", "ttft_p50_ms")
    if r is not None:
        checks.append(f"- tandem kv / the baseline tree: TTFT p50 {r:.3f}x, TTFT p99 "
                      f"{ratio('tandem-kv', 'base-kv', 'ttft_p99_ms'):.3f}x, requests/s "
                      f"{ratio('tandem-kv', 'base-kv', 'rps'):.3f}x, hit rate "
                      f"{ratio('tandem-kv', 'base-kv', 'hit_rate_pct'):.3f}x")
    r = ratio("dynamo-rr", "dynamo-kv", "ttft_p50_ms")
    if r is not None:
        checks.append(f"- TTFT p50, Dynamo round-robin / Dynamo kv: {r:.2f}x")
    return "\n".join(lines + checks)


# -- main ---------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stacks", default="tandem-kv,tandem-rr,dynamo-kv",
                        help=f"comma-separated, run in this order: {', '.join(STACKS)}")
    parser.add_argument("--conversations", type=int, default=None, help="[61; --quick 21]: not a multiple of 8, else round-robin in turn order sends a conversation back to the same worker every turn")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-blocks", type=int, default=8, help="64-token blocks shared by every prompt")
    parser.add_argument("--context-blocks", type=int, default=48, help="blocks of each conversation's own context")
    parser.add_argument("--turn-blocks", type=int, default=4, help="new blocks of user text per turn")
    parser.add_argument("--osl", type=int, default=16, help="output tokens per request")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--speedup", type=float, default=1.0, help="mocker --speedup-ratio")
    parser.add_argument("--decode-speedup", type=float, default=4.0, help="mocker --decode-speedup-ratio")
    parser.add_argument("--gpu-blocks", type=int, default=1024, help="mocker --num-gpu-blocks-override (per worker)")
    parser.add_argument("--router-args", default="",
                        help="extra router flags for both KV frontends, e.g. '--router-prefill-load-scale 4'")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every stack this many times, interleaved; the report shows medians")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--max-others", type=float, default=30.0, help="wait until the machine is this quiet first")
    parser.add_argument("--quiet-timeout", type=float, default=300, help="... for at most this many seconds")
    parser.add_argument("--run-timeout", type=float, default=900, help="seconds one aiperf run may take")
    parser.add_argument("--baseline-tree", default=None,
                        help="tandem from this source tree (a git worktree of an older commit), as stack base-kv")
    add_output_args(parser)
    args = parser.parse_args()
    if args.conversations is None:
        args.conversations = 21 if args.quick else 61
    stacks = [s.strip() for s in args.stacks.split(",") if s.strip()]
    for s in stacks:
        if s not in STACKS:
            parser.error(f"unknown stack {s!r} ({', '.join(STACKS)})")
    if "base-kv" in stacks and not args.baseline_tree:
        parser.error("the base-kv stack needs --baseline-tree")
    if not os.access(args.aiperf, os.X_OK):
        raise SystemExit(f"no aiperf at {args.aiperf}: run bash bench/setup_baselines.sh")
    if any(STACKS[s][0] == "dynamo" for s in stacks):
        require_dynamo(args.dynamo_python)

    interrupt_on_sigterm()
    tmp = tempfile.mkdtemp(prefix="router-bench-trace-")
    trace = os.path.join(tmp, "trace.jsonl")
    requests, mean_isl = write_trace(trace, args)
    aiperf_env = hub_cache_tokenizer(model_path(), os.path.join(tmp, "hub"), TOKENIZER_REPO)
    started = time.monotonic()
    rounds: dict[str, list[dict[str, float]]] = {stack: [] for stack in stacks}
    try:
        for n in range(args.rounds):
            for stack in stacks:
                wait_quiet(args.max_others, timeout=args.quiet_timeout)
                r = run_stack(stack, args, trace, requests, aiperf_env)
                rounds[stack].append(r)
                print(f"  round {n + 1} {STACKS[stack][2]:26} {r['rps']:6.2f} req/s  TTFT p50 {r['ttft_p50_ms']:8.1f} ms"
                      f"  p99 {r['ttft_p99_ms']:8.1f} ms  hit {r.get('hit_rate_pct', float('nan')):5.1f}%",
                      file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        sys.exit(130)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    working_set = args.system_blocks + args.conversations * (args.context_blocks + args.turns * args.turn_blocks)
    print(f"\nrouter_bench: {WORKERS} mocker workers per stack, aiperf 0.13, {os.cpu_count()} cores, "
          f"{time.monotonic() - started:.0f} s\n"
          f"workload: {args.conversations} conversations x {args.turns} turns = {requests} requests, concurrency "
          f"{args.concurrency}, prompts {(args.system_blocks + args.context_blocks + args.turn_blocks) * BLOCK}-"
          f"{(args.system_blocks + args.context_blocks + args.turns * args.turn_blocks) * BLOCK} tokens "
          f"(mean {mean_isl}; {args.system_blocks * BLOCK} shared by all, "
          f"{args.context_blocks * BLOCK} per conversation, +{args.turn_blocks * BLOCK} per turn), "
          f"output {args.osl} tokens\n"
          f"engine: --speedup-ratio {args.speedup:g}, --decode-speedup-ratio {args.decode_speedup:g}, block size {BLOCK}, {args.gpu_blocks} KV blocks per worker "
          f"(x{WORKERS} = {args.gpu_blocks * WORKERS}; working set {working_set} blocks)\n")
    results = {stack: medians(runs) for stack, runs in rounds.items()}
    print(f"router flags of both KV frontends: {args.router_args or '(defaults)'}; {args.rounds} round(s), "
          f"figures are medians over the rounds\n")
    print(report(results))
    write_json(args.json, {"args": vars(args), "results": results, "rounds": rounds})


if __name__ == "__main__":
    main()
