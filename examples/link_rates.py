"""One DDP training run (examples/train_ddp.py) on 2 virtual hosts at two link rates, side by side.

Needs root (it builds a virtual cluster, see ``python -m distlab cluster --help``)::

    sudo .venv/bin/python examples/link_rates.py                      # 10gbit vs 100mbit
    sudo .venv/bin/python examples/link_rates.py --rates 10gbit 1gbit 100mbit --hidden 1024

Each run trains the same MLP (wide enough that its gradients weigh a few MB) with one rank per host and writes
a timeline. From the timeline of rank 0 it reports, per training step: the step time, and the part of it
spent *waiting for allreduce*: from the last gradient's arrival (backward is done) to the end of the last
bucket's allreduce (communication that did not hide behind backward); the rest is forward, backward and the
optimizer. The link's byte counters give the bytes each step put on the wire, and with the rate, the least
time the link needs to carry them (the floor). On a fast link the exposed time is small (communication
hides behind backward); on a slow one it dominates the step. On a small machine, TCP through the virtual links
is itself CPU-bound at a few hundred MB/s (every byte is copied by the same cores that train), so rates above
about 1 Gbit/s look alike there: compare a fast link with a clearly slow one.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent / "train_ddp.py"
CLUSTER = "dlrates"


def step_breakdown(trace_path: str) -> dict:
    """Per-step times (ms) from rank 0's events: the step, and the wait for allreduce after backward."""
    events = [e for e in json.loads(Path(trace_path).read_text())["traceEvents"] if e.get("pid", 0) == 0]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    buckets = sorted((e for e in events if e.get("ph") == "X" and lanes.get(e["tid"]) == "reducer buckets"),
                     key=lambda e: e["ts"])
    grads = sorted(e["ts"] for e in events if e.get("ph") == "i" and lanes.get(e["tid"]) == "reducer grads")
    starts = [e["ts"] for e in events if e.get("name") == "bucket 0 ready"]
    steps = []
    for first, nxt in zip(starts, starts[1:] + [float("inf")]):
        mine = [b for b in buckets if first <= b["ts"] < nxt]
        arrived = [g for g in grads if first - 1e6 < g < nxt]
        if not mine or not arrived:
            continue
        last_grad = max(g for g in arrived if g < mine[-1]["ts"] + mine[-1]["dur"])
        end = max(b["ts"] + b["dur"] for b in mine)
        steps.append({"exposed": max(0.0, end - last_grad), "start": first})
    if len(steps) < 3:
        raise SystemExit(f"too few steps in {trace_path} to measure")
    steps = steps[1:]  # the first step rebuilds the buckets
    period = (steps[-1]["start"] - steps[0]["start"]) / (len(steps) - 1)
    mean = lambda key: sum(s[key] for s in steps) / len(steps) / 1e3  # noqa: E731
    return {"steps": len(steps), "step_ms": period / 1e3, "exposed_ms": mean("exposed")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", nargs="+", default=["10gbit", "100mbit"])
    parser.add_argument("--hidden", type=int, default=512, help="MLP width (512: 2.1 MB of gradients per step)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="leave the cluster up")
    options = parser.parse_args()
    if "RANK" in os.environ:  # set for every rank by `python -m distlab run` (and torchrun)
        sys.exit("examples/link_rates.py starts its own 2-rank jobs on a virtual cluster: run it with plain python "
                 "(as root), not under `python -m distlab run` or mpiexec")

    from distlab.cluster import down, parse_rate, status, up
    from distlab.launch import launch_script

    rows = []
    try:
        for rate in options.rates:
            up(2, rate, CLUSTER)
            with tempfile.TemporaryDirectory() as tmp:
                trace = f"{tmp}/ddp.json"
                before = status(CLUSTER)["hosts"][0]["tx_bytes"]
                job = launch_script(str(EXAMPLE), np=2, cluster=CLUSTER, timeline=trace, capture=True,
                                    timeout=900, args=["--hidden", str(options.hidden), "--epochs",
                                                       str(options.epochs), "--bucket-cap-mb", "1",
                                                       "--lr", "0.05", "--target", "0"])
                if job.returncode != 0:
                    raise SystemExit(f"training at {rate} failed:\n{job.stderr[-3000:]}")
                sent = status(CLUSTER)["hosts"][0]["tx_bytes"] - before
                row = {"rate": rate, **step_breakdown(trace)}
                accuracy = [line for line in job.stdout.splitlines() if line.startswith("accuracy")]
                row["accuracy"] = accuracy[-1].split()[1] if accuracy else "?"
                row["MB_per_step"] = sent / 1e6 / max(1, row["steps"] + 1)
                rows.append(row)
    finally:
        if not options.keep:
            down(CLUSTER)
    print(f"{'link':>8} {'step ms':>8} {'waiting for allreduce ms':>25} {'rest of the step ms':>20} "
          f"{'MB sent/step':>13} {'link floor ms':>14} {'accuracy':>9}")
    for r in rows:
        floor = r["MB_per_step"] * 8e6 / parse_rate(r["rate"]) * 1e3
        print(f"{r['rate']:>8} {r['step_ms']:>8.1f} {r['exposed_ms']:>25.1f} {r['step_ms'] - r['exposed_ms']:>20.1f} "
              f"{r['MB_per_step']:>13.2f} {floor:>14.1f} {r['accuracy']:>9}")

if __name__ == "__main__":
    main()
