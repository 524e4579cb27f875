"""distlab.checkpoint: save and load throughput against numpy.save/numpy.load and torch's DCP, a training step while
an async_save is in flight, and the time from a rank's death to the first step after the restart.

Run: ``python -P benchmarks/bench_checkpoint.py`` (``--np 2 4`` by default, ``--mb 134`` of replicated float32
state in 32 arrays, ``--quick`` for a smoke run). On each world size, side by side in one job (round robin, the
median of ``--rounds`` rounds):

- save, then load at once (each method in turn, the order rotating per round, so that the page cache favours
  none): ``checkpoint.save`` of the replicated state (each array written once, by one rank; every file fsynced,
  the metadata last) against ``numpy.save`` of the same arrays split the same way among the ranks (no fsync), and
  against ``torch.distributed.checkpoint.save`` (gloo, fsync on) where torch imports; MB/s of the state's bytes;
- load: ``checkpoint.load`` into existing arrays (every rank reads every array and checks its hash) against
  ``numpy.load`` of every array on every rank (memory-mapped, copied into the same existing arrays), and DCP's
  load into existing tensors. The arrays are allocated and touched once, before the rounds, as a model's are:
  filling freshly allocated memory would time the kernel's first-touch page faults (about 0.25 s for 134 MB here),
  not the load;
- async: the median time of a training step (matrix products over a working set, no communication) while an
  ``async_save`` of the state is in flight, against the same step with none (target: at most 1.1x);
- restart: a job whose rank 1 is SIGKILLed after a step, run with ``max_restarts=1``: the seconds from the kill
  to the first step of the restarted attempt (the launcher's stop and restart, MPI's start, the load).

Targets: save and load at least 0.8x numpy's, and at least DCP's. Timings depend on the disk and the load on the
machine: run it on a quiet one and compare within one run. Prints a table, writes
``benchmarks/results/bench_checkpoint.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ARRAYS = 32


def make_state(megabytes: float, seed: int = 0) -> dict:
    import numpy as np

    per = max(1, int(megabytes * 2**20 / ARRAYS / 4))
    rng = np.random.default_rng(seed)
    return {f"layer{i}.weight": rng.standard_normal(per, dtype=np.float32) for i in range(ARRAYS)}


def timed(group, fn) -> float:
    group.barrier()
    start = time.perf_counter()
    fn()
    group.barrier()
    return time.perf_counter() - start


def numpy_save(state, directory: Path, rank: int, size: int) -> None:
    import numpy as np

    for i, (name, array) in enumerate(state.items()):
        if i % size == rank:
            np.save(directory / f"{name}.npy", array)


def numpy_load(target, directory: Path) -> None:
    import numpy as np

    for name, out in target.items():
        np.copyto(out, np.load(directory / f"{name}.npy", mmap_mode="r"))


def torch_dcp():
    """torch.distributed.checkpoint over gloo on loopback, or None where torch does not import."""
    try:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
    except ImportError:
        return None
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    return torch, dcp


def step_work(mats):
    """One 'training step': matrix products over a working set, no communication."""
    a, b = mats
    for _ in range(4):
        a = (a @ b) * 0.5
    return a


def worker(out: str, rounds: int, megabytes: float, directory: str) -> None:
    import numpy as np

    from distlab import checkpoint, comm

    group = comm.world()
    rank, size = group.rank, group.size
    state = make_state(megabytes)
    total = sum(a.nbytes for a in state.values())
    base = Path(directory)
    dcp = torch_dcp()
    if dcp is not None:
        torch, dcp_module = dcp
        tensors = {k: torch.from_numpy(v) for k, v in state.items()}
    target = {k: np.zeros_like(v) for k, v in state.items()}
    for array in target.values():
        array.fill(1)  # touched once: the arrays a load fills exist, as a model's do
    times = {k: [] for k in ("distlab save", "numpy save", "DCP save", "distlab load", "numpy load", "DCP load")}
    for r in range(rounds):
        where = {k: base / f"{k.split()[0]}-{r}" for k in ("distlab", "numpy", "DCP")}
        if rank == 0:
            for path in where.values():
                path.mkdir(parents=True, exist_ok=True)
        group.barrier()
        for array in target.values():
            array.fill(0)  # in place: the check below sees what this round's load wrote
        into = {k: torch.empty_like(v) for k, v in tensors.items()} if dcp is not None else None
        # each load right after its own save (the page cache then favours none of them), in turns per round
        runs = [("distlab", lambda: checkpoint.save(state, where["distlab"], group=group),
                 lambda: checkpoint.load(target, where["distlab"], group=group)),
                ("numpy", lambda: numpy_save(state, where["numpy"], rank, size),
                 lambda: numpy_load(target, where["numpy"]))]
        if dcp is not None:
            runs.append(("DCP", lambda: dcp_module.save(tensors, checkpoint_id=str(where["DCP"])),
                         lambda: dcp_module.load(into, checkpoint_id=str(where["DCP"]))))
        for name, save, load in runs[r % len(runs):] + runs[:r % len(runs)]:
            times[f"{name} save"].append(timed(group, save))
            times[f"{name} load"].append(timed(group, load))
        assert all(np.array_equal(target[k], state[k]) for k in state)
        group.barrier()
        if rank == 0:
            for path in where.values():
                shutil.rmtree(path, ignore_errors=True)
    rng = np.random.default_rng(rank)
    mats = (rng.standard_normal((384, 384)), rng.standard_normal((384, 384)) / 20)
    plain, during = [], []
    for r in range(rounds):
        for _ in range(5):
            start = time.perf_counter()
            step_work(mats)
            plain.append(time.perf_counter() - start)
        group.barrier()
        future = checkpoint.async_save(state, base / f"async-{r}", group=group)
        while not future.done():
            start = time.perf_counter()
            step_work(mats)
            during.append(time.perf_counter() - start)
        future.wait()
        group.barrier()
        if rank == 0:
            shutil.rmtree(base / f"async-{r}", ignore_errors=True)
    row = {"rank": rank, "world_size": size, "bytes": total,
           "MB/s": {k: total / statistics.median(v) / 1e6 for k, v in times.items() if v},
           "step ms": statistics.median(plain) * 1e3, "step ms during async_save": statistics.median(during) * 1e3,
           "steps during async_save": len(during)}
    rows = group.allgather_object(row)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def restart_worker(marks: str) -> None:
    """Rank 1 dies after step 3 of the first attempt; the restarted attempt loads the last checkpoint and steps."""
    import signal

    from distlab import checkpoint, comm

    group = comm.world()
    attempt = int(os.environ["DISTLAB_RESTART_COUNT"])
    state = make_state(16)
    ckpt = Path(marks).with_suffix(".ckpt")
    if attempt == 0:
        checkpoint.save(state, ckpt, group=group)
        for step in range(1, 4):
            group.barrier()
        if group.rank == 1:
            Path(marks + ".death").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        group.barrier()  # the others wait here until the launcher stops them
        time.sleep(60)
    checkpoint.load(state, ckpt, group=group)
    group.barrier()  # the first step after the restart
    if group.rank == 0:
        Path(marks + ".resumed").write_text(str(time.time()))


def measure_restart(directory: Path, np_: int) -> float:
    from distlab.launch import launch_script

    marks = str(directory / "restart")
    job = launch_script(__file__, np=np_, args=["--restart-worker", marks], capture=True, timeout=600,
                        max_restarts=1)
    if job.returncode != 0:
        sys.exit(f"the restart measurement failed:\n{job.stderr}")
    return float(Path(marks + ".resumed").read_text()) - float(Path(marks + ".death").read_text())


def table(rows_by_size, restarts) -> str:
    head = (f"{'ranks':>5} {'MB':>6} {'save MB/s':>9} {'numpy':>7} {'ratio':>6} {'DCP':>7} {'load MB/s':>9} "
            f"{'numpy':>7} {'ratio':>6} {'DCP':>7} {'step ms':>8} {'async':>7} {'ratio':>6} {'restart s':>9}")
    lines = [head, "-" * len(head)]
    for size, rows in rows_by_size.items():
        r = rows[0]
        mbs = r["MB/s"]
        lines.append(
            f"{size:>5} {r['bytes'] / 1e6:>6.0f} {mbs['distlab save']:>9.0f} {mbs['numpy save']:>7.0f} "
            f"{mbs['distlab save'] / mbs['numpy save']:>6.2f} {mbs.get('DCP save', float('nan')):>7.0f} "
            f"{mbs['distlab load']:>9.0f} {mbs['numpy load']:>7.0f} {mbs['distlab load'] / mbs['numpy load']:>6.2f} "
            f"{mbs.get('DCP load', float('nan')):>7.0f} {r['step ms']:>8.2f} {r['step ms during async_save']:>7.2f} "
            f"{r['step ms during async_save'] / r['step ms']:>6.2f} {restarts.get(size, float('nan')):>9.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mb", type=float, default=134.0, help="megabytes of replicated state (default 134)")
    parser.add_argument("--quick", action="store_true", help="16 MB, 1 round: a smoke run")
    parser.add_argument("--np", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dir", help="where the checkpoints go (default: a temporary directory beside the results)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--restart-worker", help=argparse.SUPPRESS)
    options = parser.parse_args()
    rounds, megabytes = (1, 16.0) if options.quick else (options.rounds, options.mb)
    if options.restart_worker:
        restart_worker(options.restart_worker)
        return
    if options.worker:
        worker(options.worker, rounds, megabytes, options.dir)
        return
    from distlab.launch import launch_script

    RESULTS.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=options.dir or RESULTS))
    rows_by_size, restarts = {}, {}
    try:
        for size in options.np:
            part = RESULTS / f"bench_checkpoint.{size}.part.json"
            job = launch_script(__file__, np=size, timeout=3600,
                                args=["--worker", str(part), "--rounds", str(rounds), "--mb", str(megabytes),
                                      "--dir", str(scratch)] + (["--quick"] if options.quick else []))
            if job.returncode != 0:
                sys.exit(f"bench_checkpoint on {size} ranks failed (exit {job.returncode})")
            rows_by_size[size] = json.loads(part.read_text())
            part.unlink()
            restarts[size] = measure_restart(scratch, size)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report = {"benchmark": "bench_checkpoint", "command": " ".join(["python -P"] + sys.argv), "rounds": rounds,
              "host_cores": os.cpu_count(), "megabytes": megabytes, "rows": rows_by_size,
              "seconds from a rank's death to the first step after the restart": restarts}
    (RESULTS / "bench_checkpoint.json").write_text(json.dumps(report, indent=1))
    print(table(rows_by_size, restarts))
    print("\nratios: distlab / numpy (target >= 0.8), step with an async_save in flight / without (target <= 1.1)")
    print(f"written to {RESULTS / 'bench_checkpoint.json'}")


if __name__ == "__main__":
    main()
