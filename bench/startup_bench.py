"""How long a worker takes from being started to serving (its READY line: registered in discovery, engine
loaded): the start-up time the planner sizes ahead by. Each worker starts alone on an idle machine, on
file discovery, pinned to core 1; medians of `--repeat` starts.

    .venv/bin/python bench/startup_bench.py --repeat 3

Workers: `mocker` (no weights); `vllm-eager`, vLLM on CPU with SmolLM2-135M, eager and float32 as the
tests run it; `vllm-compiled`, the same with vLLM's default compilation.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from _common import Proc, model_path

WORKERS = {
    "mocker": ["-m", "tandem.mocker", "--model-path", "{model}"],
    "vllm-eager": ["-m", "tandem.vllm", "--model", "{model}", "--enforce-eager", "--dtype", "float32",
                                  "--kv-cache-memory-bytes", str(512 * 2**20), "--connector", "none"],
    "vllm-compiled": ["-m", "tandem.vllm", "--model", "{model}", "--kv-cache-memory-bytes", str(512 * 2**20),
                            "--connector", "none"],
}


def start_to_ready(argv: list[str], workdir: str, n: int) -> float:
    env = {**os.environ, "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": os.path.join(workdir, f"kv{n}"),
           "DYN_NAMESPACE": f"startup{n}"}
    start = time.monotonic()
    proc = Proc(f"worker{n}", [sys.executable, *argv], env, workdir, core=1)
    try:
        proc.wait_line("READY", timeout=600)
        return time.monotonic() - start
    finally:
        proc.stop(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", default=",".join(WORKERS), help="which of: " + ", ".join(WORKERS))
    args = parser.parse_args()
    model = model_path()
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        n = 0
        for name in args.workers.split(","):
            argv = [part.format(model=model) for part in WORKERS[name]]
            times = []
            for _ in range(args.repeat):
                n += 1
                times.append(start_to_ready(argv, workdir, n))
                print(f"{name}: {times[-1]:.2f} s", flush=True)
            rows.append((name, statistics.median(times), min(times), max(times)))
    print("\n| worker | start to ready, median (s) | min | max |\n|---|---|---|---|")
    for name, median, low, high in rows:
        print(f"| {name} | {median:.1f} | {low:.1f} | {high:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
