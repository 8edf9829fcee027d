"""The frontend's CPU per request, commit by commit: the table and the plot of bench/frontend_cpu_history.csv.

    .venv/bin/python bench/frontend_history.py     # prints the markdown table, writes docs/images/frontend-cpu-history.png

Each row is one `bench/frontend_bench.py` run of a commit that touched the frontend against its baseline in the
same run (the commit before it, or Dynamo 1.6.1): absolute figures compare only within a row (the machine and
the benchmark's load changed over time); the ratio this/baseline is what a creeping cost shows in. Add a row per
commit that touches the request path.
"""

from __future__ import annotations

import csv
import os

from _common import REPO

CSV = os.path.join(REPO, "bench", "frontend_cpu_history.csv")
PLOT = os.path.join(REPO, "docs", "images", "frontend-cpu-history.png")


def _ratio(this: str, baseline: str) -> str:
    return f"{float(this) / float(baseline):.3f}" if this and baseline else ""


def main() -> None:
    with open(CSV) as f:
        rows = list(csv.DictReader(f))
    print("| date | issue | commit | baseline | CPU µs/request c=64 (this / baseline) | ratio c=64 | "
          "CPU µs/request c=1 (this / baseline) | ratio c=1 | note |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c64 = f"{r['cpu_c64_us']} / {r['baseline_cpu_c64_us']}" if r["cpu_c64_us"] else ""
        c1 = f"{r['cpu_c1_us']} / {r['baseline_cpu_c1_us']}" if r["cpu_c1_us"] else ""
        print(f"| {r['date']} | {r['issue']} | {r['commit']} | {r['baseline']} | {c64} | "
              f"{_ratio(r['cpu_c64_us'], r['baseline_cpu_c64_us'])} | {c1} | "
              f"{_ratio(r['cpu_c1_us'], r['baseline_cpu_c1_us'])} | {r['note']} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if r["cpu_c64_us"]]
    labels = [f"#{r['issue']}\n{r['commit'][:7]}\nvs {r['baseline'][:12]}" for r in measured]
    ratios = [float(r["cpu_c64_us"]) / float(r["baseline_cpu_c64_us"]) for r in measured]
    fig, ax = plt.subplots(figsize=(max(6, len(measured) * 1.1), 4))
    ax.bar(range(len(measured)), ratios, color=["tab:green" if x <= 1 else "tab:red" for x in ratios])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(measured)), labels, fontsize=7)
    ax.set_ylabel("frontend CPU per request, c=64\nthis commit / its baseline (same run)")
    ax.set_title("The frontend's CPU per request, commit by commit (below 1: cheaper)")
    for i, x in enumerate(ratios):
        ax.text(i, x + 0.01, f"{x:.2f}", ha="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    print(f"\n(plot: {os.path.relpath(PLOT, REPO)})")


if __name__ == "__main__":
    main()
