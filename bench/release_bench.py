"""A Helm release's life, pod by pod: how long from applying it until every pod passes its probes, and how
long deleting it takes until every process has exited (the kubelet SIGKILLs what is left when a pod's grace
period ends: 60 s for the frontend, 120 s for workers).

The chart is rendered by Helm's engine and its pods run here the way tests/support/kubelet.py runs them (a network
namespace per pod; needs root). The processes import tandem from this checkout, and from
`--baseline-tree` (a git worktree of an earlier commit) in the same run:

    git worktree add /tmp/base 2082850
    sudo .venv/bin/python bench/release_bench.py --baseline-tree /tmp/base --repeat 3

Variants: aggregated mocker workers on the TCP/ZMQ planes and on NATS, bundled etcd (and NATS).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.k8s import render  # noqa: E402
from tests.support.kubelet import Image, LocalCluster, venv_program  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
VARIANTS = {"tcp": ("agg.yaml", "mocker.yaml"), "nats": ("agg.yaml", "nats.yaml", "mocker.yaml")}


def one_release(files: tuple[str, ...], source: Path, smollm2: Path, workers: int) -> tuple[float, float, int]:
    """(seconds to ready, seconds to delete, containers killed at the end of their grace period)."""
    docs = render(*files, values={
        "model": {"name": "HuggingFaceTB/SmolLM2-135M-Instruct", "servedModelName": MODEL, "download": False,
                  "volume": {"hostPath": {"path": str(smollm2.parent)}}, "path": smollm2.name},
        "workers": {"agg": {"replicas": workers, "extraArgs": ["--speedup-ratio", "10"]}}})
    images = [Image("registry.example.com/tandem", {"tandem": venv_program("tandem")}),
              Image("quay.io/coreos/etcd", {"etcd": venv_program("etcd")}),
              Image("nats", {"nats-server": venv_program("nats-server")})]
    with tempfile.TemporaryDirectory() as root:
        start = time.monotonic()
        cluster = LocalCluster(docs, Path(root), images, namespace="bench", source=source)
        try:
            cluster.wait_ready(timeout=120)
            ready = time.monotonic() - start
            url = cluster.service_url("llm-tandem-frontend", "http")
            reply = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 4},
                               timeout=60)
            reply.raise_for_status()
            start = time.monotonic()
            killed = cluster.stop()
            return ready, time.monotonic() - start, len(killed)
        finally:
            cluster.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-tree", type=Path, help="a git worktree of the commit to compare with")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    from tandem.models import prepare_model

    smollm2 = Path(prepare_model())
    trees = {"tandem": REPO, **({"baseline": args.baseline_tree.resolve()} if args.baseline_tree else {})}
    rows = []
    for variant, files in VARIANTS.items():
        for name, source in trees.items():
            runs = [one_release(files, source, smollm2, args.workers) for _ in range(args.repeat)]
            ready = statistics.median(r[0] for r in runs)
            delete = statistics.median(r[1] for r in runs)
            killed = max(r[2] for r in runs)
            rows.append((variant, name, ready, delete, killed))
            print(f"{variant:5} {name:8} ready {ready:6.2f} s  delete {delete:7.2f} s  killed {killed}", flush=True)
    print("\n| planes | tandem | apply -> all pods ready (s) | delete -> all processes gone (s) | containers SIGKILLed |")
    print("|---|---|---|---|---|")
    for variant, name, ready, delete, killed in rows:
        print(f"| {variant} | {name} | {ready:.2f} | {delete:.2f} | {killed} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
