"""The KV router's catch-up of quiet workers (DYN_ROUTER_EVENT_CATCH_UP_SECS): what it costs an idle
deployment, and what it recovers when KV events are lost on the way. Both settings run in the same
invocation, one deployment after the other, interleaved over --rounds; medians are reported.

    .venv/bin/python bench/kv_catch_up_bench.py                  # 8 workers, 2 rounds
    .venv/bin/python bench/kv_catch_up_bench.py --workers 16 --idle 60 --rounds 3

Deployment: `tandem run --engine mocker --workers N --router-mode kv` (predicted blocks off,
--router-predicted-ttl-secs 0, so the index holds only what KV events said), mockers at --speedup-ratio
100 with 64-token blocks; catch-up every 2 s ("catch-up") or off ("off", DYN_ROUTER_EVENT_CATCH_UP_SECS=0).

Cost: CPU seconds the frontend and the workers spend over --idle seconds with no traffic (the catch-up asks
each worker for its newest events every 2 s), per minute.

Recovery: the workers drop every --drop-every'th KV event before publishing it (DYN_MOCKER_DROP_KV_EVENTS,
a test hook standing for events lost on the way: a subscription still connecting, a full queue). --prompts
conversations each send a long first turn (8 at a time); after --quiet seconds each sends a follow-up that
extends it. Reported: the share of the follow-ups' prompt tokens found cached (usage cached_tokens), and the
router's own estimate (estimated hit blocks / prompt blocks) over the follow-ups. A lost event whose worker
sends another one later is fetched as a gap either way; the catch-up also recovers a worker's last events.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from _common import MODEL_NAME, Deployment, bench_run, scrape, total, tree_cpu_seconds

SETTINGS = {"catch-up": "2", "off": "0"}
ENGINE = ["--speedup-ratio", "100", "--block-size", "64", "--num-gpu-blocks-override", "4096"]
PREDICTED_OFF = ["--router-predicted-ttl-secs", "0"]


def _conversation(n: int) -> str:
    return f"conversation {n}: " + " ".join(f"subject{n}-{i}" for i in range(240))


def _complete(url: str, prompt: str) -> tuple[int, int]:
    """(cached prompt tokens, prompt tokens) of one completion."""
    r = httpx.post(f"{url}/v1/completions", timeout=60,
                   json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2})
    r.raise_for_status()
    usage = r.json()["usage"]
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0, usage["prompt_tokens"]


def _deployment(workdir: str, setting: str, workers: int, drop_every: int) -> Deployment:
    os.environ["DYN_ROUTER_EVENT_CATCH_UP_SECS"] = SETTINGS[setting]
    if drop_every:
        os.environ["DYN_MOCKER_DROP_KV_EVENTS"] = str(drop_every)
    else:
        os.environ.pop("DYN_MOCKER_DROP_KV_EVENTS", None)
    return Deployment("tandem", ENGINE, workdir, "", workers=workers, router_mode="kv", frontend_args=PREDICTED_OFF)


def idle_cost(setting: str, args: argparse.Namespace) -> dict[str, float]:
    with bench_run(f"{setting} idle", args.keep_logs, "catchup-idle-") as run:
        deployment = run.deployment = _deployment(run.workdir, setting, args.workers, 0)
        time.sleep(3)  # past start-up work (model cards, first dumps)
        frontend, workers = tree_cpu_seconds([deployment.frontend_pid]), tree_cpu_seconds(deployment.engine_pids)
        time.sleep(args.idle)
        per_minute = 60 / args.idle
        return {"frontend_cpu": (tree_cpu_seconds([deployment.frontend_pid]) - frontend) * per_minute,
                "workers_cpu": (tree_cpu_seconds(deployment.engine_pids) - workers) * per_minute}


def recovery(setting: str, args: argparse.Namespace) -> dict[str, float]:
    with bench_run(f"{setting} recovery", args.keep_logs, "catchup-lossy-") as run:
        deployment = run.deployment = _deployment(run.workdir, setting, args.workers, args.drop_every)
        url = deployment.url
        firsts = [_conversation(n) for n in range(args.prompts)]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda p: _complete(url, p), firsts))
            time.sleep(args.quiet)
            before = scrape(url)
            follow_ups = list(pool.map(lambda p: _complete(url, f"{p} and then?"), firsts))
        after = scrape(url)

        def grew(name: str) -> float:
            return total(after, name) - total(before, name)

        prompt_blocks = grew("dynamo_component_router_prompt_blocks_total")
        return {"hit_rate": 100 * sum(c for c, _ in follow_ups) / sum(p for _, p in follow_ups),
                "estimated_hit_rate": 100 * grew("dynamo_component_router_estimated_hit_blocks_total") / prompt_blocks,
                "events_applied": total(after, "dynamo_component_kv_cache_events_applied_total"),
                "gaps_recovered": total(after, "dynamo_router_event_gaps_recovered_total")}


ROWS = [("frontend_cpu", "frontend CPU s per idle minute", "low"),
        ("workers_cpu", "workers' CPU s per idle minute (all of them)", "low"),
        ("hit_rate", "follow-ups' prompt tokens cached (%)", "high"),
        ("estimated_hit_rate", "router's estimated hit rate on follow-ups (%)", "high"),
        ("events_applied", "KV events applied by the router", "high"),
        ("gaps_recovered", "lost event ranges recovered", None)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--idle", type=float, default=30.0, help="seconds of idle time measured")
    parser.add_argument("--prompts", type=int, default=32, help="conversations in the recovery part")
    parser.add_argument("--drop-every", type=int, default=3, help="workers drop every n-th KV event")
    parser.add_argument("--quiet", type=float, default=5.0, help="seconds between the first turns and the follow-ups")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    for round_ in range(args.rounds):
        order = list(SETTINGS) if round_ % 2 == 0 else list(reversed(SETTINGS))
        for setting in order:
            result = {**idle_cost(setting, args), **recovery(setting, args)}
            runs[setting].append(result)
            print(f"round {round_ + 1} {setting}: " + ", ".join(f"{k} {v:.3g}" for k, v in result.items()),
                  file=sys.stderr)
    medians = {name: {key: statistics.median(r[key] for r in results) for key in results[0]}
               for name, results in runs.items()}
    print("| metric | catch-up (2 s) | off | ratio |\n|---|---|---|---|")
    for key, label, better in ROWS:
        on, off = medians["catch-up"][key], medians["off"][key]
        ratio = f"{on / off:.3f}x" if better and off > 0 else "—"
        print(f"| {label} | {on:.3g} | {off:.3g} | {ratio} |")


if __name__ == "__main__":
    main()
