"""ZeroRedundancyOptimizer: optimizer-state memory per rank, and the step's cost, against the plain optimizer.

Run: ``python -P benchmarks/bench_zero.py`` (``--np 2 4`` by default, ``--quick`` for a smoke run). For the big
model of bench_reducer (100 x Linear(256, 256): 200 tensors, 26 MB of float32 parameters) and Adam, on each rank:

- the optimizer state it holds (the bytes of every array in its optimizer's ``state``), plain Adam against ZeRO,
  after one step; the share of the unsharded state, against the target of ``1/world_size`` plus 10% of it;
- the time of ``step()`` (median over rounds, gradients already in ``.grad``): plain Adam, ZeRO with one
  broadcast per parameter, ZeRO with ``parameters_as_bucket_view`` (one broadcast per rank).

Memory is exact and load-independent; the timings are not (run it on a quiet machine, and compare within one run
only). Prints a table, writes ``benchmarks/results/bench_zero.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import distlab

distlab.keep_freed_memory()  # glibc keeps freed memory between steps, as docs/ measured (docs/autograd.md)

RESULTS = Path(__file__).resolve().parent / "results"
LAYERS, WIDTH = 100, 256


def state_bytes(optimizer) -> int:
    """Bytes of every array in ``optimizer.state`` (Adam: exp_avg and exp_avg_sq per parameter)."""
    return sum(value.nbytes for state in optimizer.state.values() for value in state.values()
               if hasattr(value, "nbytes"))


def worker(out: str, rounds: int) -> None:
    import numpy as np

    import distlab
    from distlab import comm, nn, optim
    from distlab.optim import ZeroRedundancyOptimizer

    pg = comm.world()

    def model():
        distlab.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
        for p in net.parameters():
            p.grad = distlab.tensor(np.full(p.data.shape, 1e-3, dtype=np.float32))
        return net

    optimizers = {
        "plain Adam": lambda params: optim.Adam(params, lr=1e-4),
        "ZeRO per parameter": lambda params: ZeroRedundancyOptimizer(params, optim.Adam, lr=1e-4),
        "ZeRO bucket view": lambda params: ZeroRedundancyOptimizer(params, optim.Adam, lr=1e-4,
                                                                   parameters_as_bucket_view=True),
    }
    runs = {name: make(list(model().parameters())) for name, make in optimizers.items()}
    params_bytes = sum(p.data.nbytes for p in next(iter(runs.values())).param_groups[0]["params"])
    times = {name: [] for name in runs}
    for name, opt in runs.items():
        opt.step()  # creates the state
    memory = {name: state_bytes(getattr(opt, "optim", opt)) for name, opt in runs.items()}
    for _ in range(rounds):
        for name, opt in runs.items():  # round robin: load changes hit every variant alike
            pg.barrier()
            start = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - start)
    row = {"rank": pg.rank, "world_size": pg.size, "parameter bytes": params_bytes,
           "state bytes": memory, "step ms": {name: statistics.median(t) * 1e3 for name, t in times.items()}}
    rows = pg.allgather_object(row)
    if pg.rank == 0:
        Path(out).write_text(json.dumps(rows))


def table(rows_by_size) -> str:
    head = (f"{'ranks':>5} {'rank':>4} {'Adam state MB':>13} {'ZeRO state MB':>13} {'share':>7} {'target':>7} "
            f"{'Adam step ms':>12} {'ZeRO/param ms':>13} {'ZeRO/bucket ms':>14}")
    lines = [head, "-" * len(head)]
    for size, rows in rows_by_size.items():
        for r in rows:
            plain, zero = r["state bytes"]["plain Adam"], r["state bytes"]["ZeRO per parameter"]
            lines.append(f"{size:>5} {r['rank']:>4} {plain / 2**20:>13.2f} {zero / 2**20:>13.2f} "
                         f"{zero / plain:>7.3f} {1.1 / size:>7.3f} {r['step ms']['plain Adam']:>12.2f} "
                         f"{r['step ms']['ZeRO per parameter']:>13.2f} {r['step ms']['ZeRO bucket view']:>14.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="3 rounds: a smoke run")
    parser.add_argument("--np", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    options = parser.parse_args()
    rounds = 3 if options.quick else options.rounds
    if options.worker:
        worker(options.worker, rounds)
        return
    from distlab.launch import launch_script

    RESULTS.mkdir(parents=True, exist_ok=True)
    rows_by_size = {}
    for size in options.np:
        part = RESULTS / f"bench_zero.{size}.part.json"
        job = launch_script(__file__, np=size, args=["--worker", str(part), "--rounds", str(rounds)], timeout=3600)
        if job.returncode != 0:
            sys.exit(f"bench_zero on {size} ranks failed (exit {job.returncode})")
        rows_by_size[size] = json.loads(part.read_text())
        part.unlink()
    worst = {size: max(r["state bytes"]["ZeRO per parameter"] / r["state bytes"]["plain Adam"] for r in rows)
             for size, rows in rows_by_size.items()}
    report = {"benchmark": "bench_zero", "command": " ".join(["python -P"] + sys.argv), "rounds": rounds,
              "host_cores": os.cpu_count(), "model": f"{LAYERS} x Linear({WIDTH}, {WIDTH})",
              "largest state share per world size": worst,
              "within 1/world_size + 10%": {size: share <= 1.1 / size for size, share in worst.items()},
              "rows": rows_by_size}
    (RESULTS / "bench_zero.json").write_text(json.dumps(report, indent=1))
    print(table(rows_by_size))
    print("\nlargest per-rank share of the unsharded Adam state: "
          + ", ".join(f"{size} ranks {share:.4f} (1/{size} = {1 / size:.4f})" for size, share in worst.items()))
    print(f"written to {RESULTS / 'bench_zero.json'}")


if __name__ == "__main__":
    main()
