"""Draw docs/_static/overlap_timeline.png: one DDP step's backward pass and bucket allreduces, from a trace.

The trace comes from the overlap benchmark, which records a few steps of the core twin with
``bucket_cap_mb="auto"`` on two virtual hosts::

    sudo .venv/bin/python -P benchmarks/bench_overlap.py --rates 2.5gbit --timeline 2.5gbit
    .venv/bin/python docs/_scripts/overlap_timeline_figure.py [benchmarks/results/overlap_timeline.json]

The drawing is :func:`distlab.viz.plot_bucket_overlap` (the tutorials use the same): for each rank, the last
recorded step's backward pass from its first gradient to its last (a tick per gradient hook) and, under it, each
bucket's allreduce from its launch to the moment the rank saw it complete. A bucket that starts left of the
dotted line is communication overlapped with backward; what lies right of it is the step's exposed
communication.
"""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from distlab.viz import plot_bucket_overlap  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = REPO / "benchmarks" / "results" / "overlap_timeline.json"
OUT = REPO / "docs" / "_static" / "overlap_timeline.png"


def main() -> None:
    trace = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_TRACE
    fig = plot_bucket_overlap(str(trace), title="one DDP step across a 2.5 Gbit/s link, bucket_cap_mb='auto', "
                              "core twin; ticks: gradients, dotted: end of backward")
    fig.savefig(OUT, dpi=100)
    print(OUT)


if __name__ == "__main__":
    main()
