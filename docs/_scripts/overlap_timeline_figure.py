"""Draw docs/_static/overlap_timeline.png: one DDP step's backward pass and bucket allreduces, from a trace.

The trace comes from the overlap benchmark, which records a few steps of the core twin with
``bucket_cap_mb="auto"`` on two virtual hosts::

    sudo .venv/bin/python -P benchmarks/bench_overlap.py --rates 2.5gbit --timeline 2.5gbit
    .venv/bin/python docs/_scripts/overlap_timeline_figure.py [benchmarks/results/overlap_timeline.json]

For each rank it draws the last recorded step: the backward pass as a bar from the step's first gradient to its
last (a tick per gradient, as its hook fired) and, under it, each bucket's allreduce from its launch to the
moment the rank saw it complete. A bucket that starts left of the backward bar's end is communication
overlapped with backward; what lies right of it is the step's exposed communication.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = REPO / "benchmarks" / "results" / "overlap_timeline.json"
OUT = REPO / "docs" / "_static" / "overlap_timeline.png"


def last_step(events, rank):
    """(gradient times, [(bucket, start, end, bytes)]) of the last step recorded on ``rank``, in ms."""
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    mine = [e for e in events if e.get("pid") == rank]
    spans = [e for e in mine if e.get("ph") == "X" and lanes.get((rank, e["tid"])) == "reducer buckets"]
    if not spans:
        raise SystemExit(f"no bucket spans for rank {rank} in the trace")
    last = max(s["args"]["iteration"] for s in spans)
    spans = sorted((s for s in spans if s["args"]["iteration"] == last), key=lambda s: s["ts"])
    end = max(s["ts"] + s["dur"] for s in spans)
    grads = sorted(e["ts"] for e in mine if e.get("ph") == "i" and lanes.get((rank, e["tid"])) == "reducer grads")
    count = len({e["name"] for e in mine if e.get("ph") == "i" and lanes.get((rank, e["tid"])) == "reducer grads"})
    grads = [t for t in grads if t <= end][-count:]
    origin = grads[0]
    buckets = [(int(s["name"].split()[1]), (s["ts"] - origin) / 1e3, (s["ts"] + s["dur"] - origin) / 1e3,
                s["args"]["bytes"]) for s in spans]
    return [(t - origin) / 1e3 for t in grads], buckets


def main() -> None:
    trace = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_TRACE
    events = json.loads(trace.read_text())["traceEvents"]
    ranks = sorted({e["pid"] for e in events if e.get("ph") == "X"})
    fig, axes = plt.subplots(len(ranks), 1, figsize=(9, 1.2 + 1.5 * len(ranks)), dpi=100, sharex=True,
                             squeeze=False)
    for ax, rank in zip(axes[:, 0], ranks):
        grads, buckets = last_step(events, rank)
        rows = len(buckets)
        ax.broken_barh([(0, grads[-1])], (rows + 0.2, 0.6), facecolors="#9bbcd9", edgecolor="black", linewidth=0.5)
        ax.vlines(grads, rows + 0.2, rows + 0.8, color="#2d5d8a", linewidth=0.6)
        for b, start, end, nbytes in buckets:
            y = rows - 1 - b
            ax.broken_barh([(start, end - start)], (y + 0.2, 0.6), facecolors="#e07b5f", edgecolor="black",
                           linewidth=0.5)
            ax.text(end + 0.5, y + 0.5, f"{nbytes / 2**20:.1f} MiB", va="center", fontsize=6)
        ax.axvline(grads[-1], color="black", linestyle=":", linewidth=1)
        ax.set_yticks([rows + 0.5] + [rows - 1 - b + 0.5 for b, *_ in buckets])
        ax.set_yticklabels(["backward"] + [f"bucket {b}" for b, *_ in buckets], fontsize=6)
        ax.set_ylim(0, rows + 1)
        ax.set_title(f"rank {rank}: gradients (ticks), bucket allreduces (red), end of backward (dotted)",
                     fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
    axes[-1, 0].set_xlabel("ms since the step's first gradient", fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT)
    print(OUT)


if __name__ == "__main__":
    main()
