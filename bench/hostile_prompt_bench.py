"""What an oversized prompt costs the frontend before it is refused, against a baseline tree.

    python bench/hostile_prompt_bench.py --baseline-tree WORKTREE   # e.g. a git worktree of the previous commit

For each hostile body, sent alone and --at-once copies concurrently, and each implementation (this
checkout, and tandem from --baseline-tree; interleaved), a fresh frontend + test engine is started on
file discovery (frontend pinned to core 0) and the body sent; recorded: the frontend's peak RSS growth
(VmHWM reset through /proc/PID/clear_refs just before), the RSS it still holds 1 s after the answer,
its CPU seconds (/proc/PID/stat), the wall time until the answer and the status. Medians of --repeat.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import httpx
from _common import REPO, Proc, fmt, wait_serving
from _common import cpu_seconds as _cpu_seconds
from _common import model_path as _model_path

MODEL = "SmolLM2-135M-Instruct"
FRONTEND_CORE, ENGINE_CORE = 0, 1


def _bodies() -> dict[str, bytes]:
    rng = random.Random(0)
    mixed = "".join(rng.choice("abcdefghij0123456789") for _ in range(600_000))
    words = " ".join(f"w{i}" for i in range(90_000))
    return {
        "8 MB of digits, no spaces": json.dumps({"model": MODEL, "prompt": "7" * 8_000_000, "max_tokens": 4}).encode(),
        "600k mixed letters+digits, no spaces": json.dumps({"model": MODEL, "prompt": mixed, "max_tokens": 4}).encode(),
        # one run with no boundary at all, under the character bound: the worst case left
        "600k digits, no spaces": json.dumps({"model": MODEL, "prompt": "7" * 600_000, "max_tokens": 4}).encode(),
        "600k chars of words (~200k tokens)": json.dumps({"model": MODEL, "prompt": words, "max_tokens": 4}).encode(),
        "chat, 2 MB message": json.dumps({"model": MODEL, "messages": [
            {"role": "user", "content": "9" * 2_000_000}]}).encode(),
    }


def _peak_reset(pid: int) -> int:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    return _status(pid, "VmRSS")


def _status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _measure(url: str, pid: int, body: bytes, at_once: int) -> dict[str, float]:
    path = "/v1/chat/completions" if b'"messages"' in body else "/v1/completions"
    before = _peak_reset(pid)
    cpu = _cpu_seconds(pid)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(at_once) as pool:
        replies = list(pool.map(lambda _: httpx.post(url + path, content=body, timeout=600,
                                                     headers={"Content-Type": "application/json"}), range(at_once)))
    wall = time.perf_counter() - start
    time.sleep(1.0)  # what stays resident once the answer is out
    return {"wall_s": wall, "cpu_s": _cpu_seconds(pid) - cpu, "peak_growth_mb": (_status(pid, "VmHWM") - before) / 2**20,
            "resident_growth_mb": (_status(pid, "VmRSS") - before) / 2**20, "status": replies[0].status_code}


def _deployment(tree: str, logdir: str) -> tuple[list[Proc], str, int]:
    env = {**os.environ, "PYTHONPATH": tree, "DYN_FILE_KV": os.path.join(logdir, "kv"), "DYN_NAMESPACE": "bench",
           "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_SYSTEM_ENABLED": "false"}
    engine = Proc("engine", [sys.executable, "-m", "tandem.testing.engine", "--model", _model_path(),
                             "--discovery-backend", "file"], env, logdir, ENGINE_CORE, cwd=tree)
    engine.wait_line("READY")
    frontend = Proc("frontend", [sys.executable, "-m", "tandem.frontend", "--http-host", "127.0.0.1", "--http-port",
                                 "0", "--discovery-backend", "file"], env, logdir, FRONTEND_CORE, cwd=tree)
    url = frontend.wait_line("READY").split()[1]
    wait_serving(url, [engine, frontend], MODEL)
    return [engine, frontend], url, frontend.pid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-tree", required=True, help="tandem checkout to compare with")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--at-once", type=int, default=2, help="copies of each body sent concurrently")
    args = parser.parse_args()
    trees = {"tandem": REPO, "baseline": os.path.abspath(args.baseline_tree)}
    bodies = _bodies()
    runs: dict[tuple[str, str, int], list[dict[str, float]]] = {}
    tmp = tempfile.mkdtemp(prefix="hostile-")
    try:  # a fresh deployment per measurement: memory a previous body left resident would hide the next peak
        for _ in range(args.repeat):
            for label, body in bodies.items():
                for at_once in (1, args.at_once):
                    for name, tree in trees.items():
                        logdir = tempfile.mkdtemp(dir=tmp)
                        procs, url, pid = _deployment(tree, logdir)
                        try:
                            runs.setdefault((label, name, at_once), []).append(_measure(url, pid, body, at_once))
                        finally:
                            for p in reversed(procs):
                                p.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nhostile_prompt_bench: frontend cost of a refused prompt, median of {args.repeat}; each cell: peak RSS "
          "growth (MB) / RSS still held 1 s after the answer (MB) / CPU (s) / wall (s) / status\n")
    print("| body | sent at once | tandem | baseline | peak RSS, baseline / tandem | CPU, baseline / tandem |")
    print("|---|---|---|---|---|---|")
    keys = ("peak_growth_mb", "resident_growth_mb", "cpu_s", "wall_s")
    for label in bodies:
        for at_once in (1, args.at_once):
            cells = {}
            for name in trees:
                r = runs[(label, name, at_once)]
                cells[name] = {k: statistics.median(x[k] for x in r) for k in keys} | {"status": r[0]["status"]}
            t, b = cells["tandem"], cells["baseline"]
            row = [f"{fmt(c['peak_growth_mb'])} / {fmt(c['resident_growth_mb'])} / {c['cpu_s']:.2f} / "
                   f"{c['wall_s']:.2f} / {c['status']:.0f}" for c in (t, b)]
            rss = b["peak_growth_mb"] / max(t["peak_growth_mb"], 1.0)
            cpu = b["cpu_s"] / max(t["cpu_s"], 0.01)
            print(f"| {label} | {at_once} | {row[0]} | {row[1]} | {rss:.1f}x | {cpu:.1f}x |")


if __name__ == "__main__":
    main()
