"""distlab.checkpoint: save and load throughput against numpy.save/numpy.load and torch's DCP, a training step while
an async_save is in flight, and the time from a rank's death to the first step after the restart.

Run: ``python -P benchmarks/bench_checkpoint.py`` (``--np 2 4`` by default, ``--mb 134`` of replicated float32
state in 32 arrays, ``--quick`` for a smoke run; ``--torch-python PATH`` names an interpreter with torch when this
one has none, for DCP's column). On each world size, side by side (round robin, the median of ``--rounds``
rounds):

- save, then load at once (each method in turn, the order rotating per round; every rank calls ``os.sync``
  between methods, untimed, so that no method's writeback lands in the next one's time):
  ``checkpoint.save`` of the replicated state (each array written once, by one rank; every file fsynced, the
  metadata last) against ``numpy.save`` of the same arrays split the same way among the ranks, twice: each
  rank's arrays into one file followed by an fsync of the file and of the directory (the same bytes, files and
  durability as distlab's: the target's baseline), and one file per array without fsync (the speed of the page
  cache); MB/s of the state's bytes;
- load: ``checkpoint.load`` into existing arrays (every rank reads every array and checks its hash) against
  ``numpy.load`` of every array on every rank (memory-mapped, copied into the same existing arrays). The arrays
  are allocated and touched once, before the rounds, as a model's are: filling freshly allocated memory would
  time the kernel's first-touch page faults (about 0.25 s for 134 MB here), not the load;
- DCP: ``torch.distributed.checkpoint.save``/``load`` of the same state as tensors (gloo on loopback, its
  default ``sync_files=True``) into existing tensors, run right after distlab's job on the same world size by an
  interpreter with torch (this one, or ``--torch-python``); that job times ``numpy.save`` plus fsync too, and
  DCP's figures are given as ratios to it, so that both columns compare within their own run;
- async: every rank runs training steps (matrix products over a working set, no communication) through the
  whole window of an ``async_save`` of the state, from its return to its future's completion, against as many
  steps with none (the ranks meet after the call, as training's next collective would make them); the mean
  step of each window (target: at most 1.1x), the time the ``async_save`` call itself blocks (the plan and the
  staging copy; the slowest rank's), the time from the call to the future's completion, and, from ``/proc/thread-self/schedstat``, where the step
  thread's time went: on a core, waiting for a core (the CPU is oversubscribed), or neither (blocked: the GIL,
  a page fault);
- restart: a job whose rank 1 is SIGKILLed after a step, run with ``max_restarts=1``: the seconds from the kill
  to the first step of the restarted attempt (the launcher's stop and restart, MPI's start, the load).

Targets: save at least 0.8x numpy's (with fsync) and load at least 0.8x numpy's, both at least DCP's; a step
at most 1.1x with an async_save in flight. Timings depend on the disk and the load on the machine: run it on a
quiet one and compare within one run. Prints a table, writes ``benchmarks/results/bench_checkpoint.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
RECORD = Path(__file__).resolve().parent.parent / "docs" / "_data" / "bench" / "checkpoint.json"
ARRAYS = 32


def make_state(megabytes: float, seed: int = 0) -> dict:
    import numpy as np

    per = max(1, int(megabytes * 2**20 / ARRAYS / 4))
    rng = np.random.default_rng(seed)
    return {f"layer{i}.weight": rng.standard_normal(per, dtype=np.float32) for i in range(ARRAYS)}


def touched_copy(state: dict) -> dict:
    """Arrays to load into: allocated and touched once, as a model's parameters are."""
    import numpy as np

    target = {k: np.empty_like(v) for k, v in state.items()}
    for array in target.values():
        array.fill(1)
    return target


def numpy_save(state, directory: Path, rank: int, size: int, fsync: bool) -> None:
    """``numpy.save`` of this rank's share (every ``size``-th array).

    Without ``fsync``, one ``.npy`` file per array (what :func:`numpy_load` reads). With ``fsync``, the share goes
    into one file, array after array, and the file and the directory are fsynced: the same bytes, the same
    number of files and the same durability as distlab's save (one fsync per file would cost numpy a flush per
    array).
    """
    import numpy as np

    mine = [(name, array) for i, (name, array) in enumerate(state.items()) if i % size == rank]
    if not fsync:
        for name, array in mine:
            np.save(directory / f"{name}.npy", array)
        return
    with open(directory / f"rank{rank}.npy", "wb") as fh:
        for _, array in mine:
            np.save(fh, array)
        fh.flush()
        os.fsync(fh.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def numpy_load(target, directory: Path) -> None:
    import numpy as np

    for name, out in target.items():
        np.copyto(out, np.load(directory / f"{name}.npy", mmap_mode="r"))


def round_robin(rounds: int, methods: list, barrier, rank: int, check) -> dict:
    """Each method's save then load, in turns rotating per round; ``{"<name> save": [s], "<name> load": [s]}``.

    ``methods`` holds ``(name, save(r), load(r) or None, clean(r))``; ``check()`` (untimed) follows each load.
    Between methods every rank calls ``os.sync`` (untimed): a save that left dirty pages does not hand their
    writeback to the next method.
    """
    times: dict = {}

    def timed(fn):
        barrier()
        start = time.perf_counter()
        fn()
        barrier()
        return time.perf_counter() - start

    for r in range(rounds):
        shift = r % len(methods)
        for name, save, load, clean in methods[shift:] + methods[:shift]:
            os.sync()
            times.setdefault(f"{name} save", []).append(timed(lambda: save(r)))
            if load is not None:
                times.setdefault(f"{name} load", []).append(timed(lambda: load(r)))
                check()
            barrier()
            if rank == 0:
                clean(r)
    os.sync()
    return times


def step_work(mats):
    """One 'training step': matrix products over a working set, no communication."""
    a, b = mats
    for _ in range(4):
        a = (a @ b) * 0.5
    return a


def thread_clock() -> tuple[float, float, float]:
    """(wall, on a core, waiting for a core) seconds of the calling thread; the last two 0 off Linux."""
    try:
        with open("/proc/thread-self/schedstat") as fh:
            on_cpu, waiting, _ = (int(x) for x in fh.read().split())
    except OSError:
        on_cpu = waiting = 0
    return time.perf_counter(), on_cpu / 1e9, waiting / 1e9


def window(mats, until=None, count=None) -> dict:
    """Steps until ``until()`` is true (or ``count`` of them): the mean step and where its time went."""
    start = thread_clock()
    n = 0
    while (until is not None and not until()) or (count is not None and n < count):
        step_work(mats)
        n += 1
    end = thread_clock()
    wall, cpu, wait = (b - a for a, b in zip(start, end))
    n = max(n, 1)
    return {"steps": n, "step ms": wall / n * 1e3, "on a core ms": cpu / n * 1e3,
            "waiting for a core ms": wait / n * 1e3, "blocked ms": max(0.0, wall - cpu - wait) / n * 1e3}


def async_rounds(group, state, base: Path, rounds: int) -> dict:
    """Per round: a window of steps with an async_save in flight, then as many steps with none (all ranks)."""
    import numpy as np

    from distlab import checkpoint

    rng = np.random.default_rng(group.rank)
    mats = (rng.standard_normal((384, 384)), rng.standard_normal((384, 384)) / 20)
    window(mats, count=3)  # warm
    during, plain, calls = [], [], []
    for r in range(rounds):
        group.barrier()
        start = time.perf_counter()
        future = checkpoint.async_save(state, base / f"async-{r}", group=group)
        calls.append((time.perf_counter() - start) * 1e3)
        # the ranks meet after the call, as training's next collective makes them: a rank's window holds its
        # steps beside the writing, not beside the other ranks' calls (the call's time is its own column)
        group.barrier()
        during.append(window(mats, until=future.done))
        during[-1]["save s"] = time.perf_counter() - start  # from the call to the future's completion
        future.wait()
        group.barrier()
        plain.append(window(mats, count=during[-1]["steps"]))
        group.barrier()
        if group.rank == 0:
            shutil.rmtree(base / f"async-{r}", ignore_errors=True)

    def mean_of(windows):  # the mean step over all the windows' steps
        steps = sum(w["steps"] for w in windows)
        return {k: sum(w[k] * w["steps"] for w in windows) / steps for k in windows[0]
                if k not in ("steps", "save s")} | {"steps": steps}

    return {"without": mean_of(plain), "during": mean_of(during), "async_save call ms": statistics.median(calls),
            "save s": statistics.median(w["save s"] for w in during)}


def worker(out: str, rounds: int, megabytes: float, directory: str) -> None:
    import numpy as np

    from distlab import checkpoint, comm

    group = comm.world()
    rank, size = group.rank, group.size
    state = make_state(megabytes)
    total = sum(a.nbytes for a in state.values())
    base = Path(directory)
    target = touched_copy(state)

    def place(name, r):
        path = base / f"{name}-{r}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def check():
        assert all(np.array_equal(target[k], state[k]) for k in state)
        for array in target.values():
            array.fill(0)  # in place: the next check sees what the next load wrote

    def clean(name):
        return lambda r: shutil.rmtree(base / f"{name}-{r}", ignore_errors=True)

    methods = [
        ("distlab", lambda r: checkpoint.save(state, place("distlab", r), group=group),
         lambda r: checkpoint.load(target, base / f"distlab-{r}", group=group), clean("distlab")),
        ("numpy", lambda r: numpy_save(state, place("numpy", r), rank, size, fsync=False),
         lambda r: numpy_load(target, base / f"numpy-{r}"), clean("numpy")),
        ("numpy+fsync", lambda r: numpy_save(state, place("fsync", r), rank, size, fsync=True), None,
         clean("fsync")),
    ]
    times = round_robin(rounds, methods, group.barrier, rank, check)
    row = {"rank": rank, "world_size": size, "bytes": total,
           "MB/s": {k: total / statistics.median(v) / 1e6 for k, v in times.items()},
           "async": async_rounds(group, state, base, rounds)}
    rows = group.allgather_object(row)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


# ------------------------------------------------------------------------------- DCP (needs only torch, numpy)
def _dcp_rank(rank, size, port, rounds, megabytes, directory, queue):
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    torch.set_num_threads(1)
    state = make_state(megabytes)
    tensors = {k: torch.from_numpy(v) for k, v in state.items()}
    into = {k: torch.from_numpy(v) for k, v in touched_copy(state).items()}
    base = Path(directory)

    def place(name, r):
        path = base / f"{name}-{r}"
        path.mkdir(parents=True, exist_ok=True)
        return str(path)

    def check():
        assert all(torch.equal(into[k], tensors[k]) for k in tensors)
        for t in into.values():
            t.zero_()

    methods = [("DCP", lambda r: dcp.save(tensors, checkpoint_id=place("dcp", r)),
                lambda r: dcp.load(into, checkpoint_id=str(base / f"dcp-{r}")),
                lambda r: shutil.rmtree(base / f"dcp-{r}", ignore_errors=True)),
               ("numpy+fsync", lambda r: numpy_save(state, Path(place("fsync", r)), rank, size, fsync=True), None,
                lambda r: shutil.rmtree(base / f"fsync-{r}", ignore_errors=True))]
    times = round_robin(rounds, methods, dist.barrier, rank, check)
    total = sum(a.nbytes for a in state.values())
    queue.put((rank, {k: total / statistics.median(v) / 1e6 for k, v in times.items()}, torch.__version__,
               np.__version__))
    dist.destroy_process_group()


def dcp_worker(out: str, size: int, rounds: int, megabytes: float, directory: str) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29800 + os.getpid() % 200
    procs = [ctx.Process(target=_dcp_rank, args=(r, size, port, rounds, megabytes, directory, queue))
             for r in range(size)]
    for p in procs:
        p.start()
    results = sorted((queue.get(timeout=1800) for _ in procs), key=lambda r: r[0])
    for p in procs:
        p.join(60)
    Path(out).write_text(json.dumps({"MB/s": results[0][1], "torch": results[0][2], "numpy": results[0][3]}))


def dcp_times(size: int, rounds: int, megabytes: float, directory: Path, python: str | None):
    """DCP's figures from this interpreter if it has torch, else from ``python``; None when neither has."""
    part = RESULTS / f"bench_checkpoint.dcp{size}.part.json"
    try:
        import torch  # noqa: F401

        command = [sys.executable]
    except ImportError:
        if not python:
            return None
        command = [python]
    command += [__file__, "--dcp-worker", str(part), "--np", str(size), "--rounds", str(rounds), "--mb",
                str(megabytes), "--dir", str(directory)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "MPI", "HYDRA"))}
    done = subprocess.run(command, env=env, timeout=3600)
    if done.returncode != 0 or not part.exists():
        print(f"DCP's run on {size} ranks failed (exit {done.returncode}); no DCP column")
        return None
    data = json.loads(part.read_text())
    part.unlink()
    return data


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


def tables(rows_by_size: dict, dcp: dict, restarts: dict) -> dict:
    """The record's tables: ``save``, ``load``, and ``async`` (a step with and without an async_save in flight).

    Throughputs are rank 0's medians (the rounds are timed between barriers, so every rank sees the same); the
    steps are the mean over ranks of each rank's mean step.
    """
    save = {"columns": ["ranks", "distlab [MB/s]", "numpy + fsync [MB/s]", "vs numpy + fsync [x]",
                        "numpy, no fsync [MB/s]", "vs no fsync [x]", "DCP [MB/s]", "DCP vs its numpy + fsync [x]"],
            "rows": []}
    load = {"columns": ["ranks", "distlab [MB/s]", "numpy [MB/s]", "vs numpy [x]", "DCP [MB/s]", "restart [s]"],
            "rows": []}
    steps = {"columns": ["ranks, window", "step [ms]", "vs no save [x]", "async_save call [ms]", "save [s]",
                         "on a core [ms]", "waiting for a core [ms]", "blocked [ms]"], "rows": []}
    for size, rows in rows_by_size.items():
        mbs = rows[0]["MB/s"]
        theirs = (dcp.get(size) or {}).get("MB/s", {})
        save["rows"].append([
            f"{size} ranks", round(mbs["distlab save"]), round(mbs["numpy+fsync save"]),
            round(mbs["distlab save"] / mbs["numpy+fsync save"], 2), round(mbs["numpy save"]),
            round(mbs["distlab save"] / mbs["numpy save"], 2), round(theirs["DCP save"]) if theirs else None,
            round(theirs["DCP save"] / theirs["numpy+fsync save"], 2) if theirs else None])
        load["rows"].append([
            f"{size} ranks", round(mbs["distlab load"]), round(mbs["numpy load"]),
            round(mbs["distlab load"] / mbs["numpy load"], 2), round(theirs["DCP load"]) if theirs else None,
            round(restarts[size], 2) if size in restarts else None])
        mean = {which: {k: statistics.mean(r["async"][which][k] for r in rows) for k in rows[0]["async"][which]}
                for which in ("without", "during")}
        call = max(r["async"]["async_save call ms"] for r in rows)
        took = max(r["async"].get("save s", float("nan")) for r in rows)
        for which, label in (("without", "no save"), ("during", "save in flight")):
            m = mean[which]
            steps["rows"].append([
                f"{size} ranks, {label}", round(m["step ms"], 2),
                round(m["step ms"] / mean["without"]["step ms"], 2) if which == "during" else None,
                round(call, 1) if which == "during" else None, round(took, 2) if which == "during" else None,
                round(m["on a core ms"], 2),
                round(m["waiting for a core ms"], 2), round(m["blocked ms"], 2)])
    return {"save": save, "load": load, "steps": steps}


def record(report: dict, machine: str) -> dict:
    """The docs' record of a run: what was measured, the command, the machine, the date, the tables."""
    return {"what": f"bench_checkpoint.py: save and load of {report['megabytes']:.0f} MB of replicated float32 state "
                    f"in {ARRAYS} arrays against numpy.save (with fsync: the same durability; and without) and "
                    f"numpy.load, torch {report['torch'] or '(not importable)'}'s DCP in a job of its own, a "
                    "training step with an async_save in flight, a rank's death to the first step after the "
                    f"restart; medians of {report['rounds']} rounds",
            "command": re.sub(r"(--torch-python[ =])\S+", r"\1PYTHON_WITH_TORCH", report["command"]),
            "machine": machine, "date": time.strftime("%Y-%m-%d"),
            "tables": report["tables"]}


def show(table: dict) -> str:
    cells = [[str(c) for c in table["columns"]]]
    cells += [["-" if v is None else str(v) for v in row] for row in table["rows"]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines[:1] + ["-" * len(lines[0])] + lines[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mb", type=float, default=134.0, help="megabytes of replicated state (default 134)")
    parser.add_argument("--quick", action="store_true", help="16 MB, 1 round: a smoke run")
    parser.add_argument("--np", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dir", help="where the checkpoints go (default: a temporary directory beside the results)")
    parser.add_argument("--torch-python", help="an interpreter with torch, for DCP's column (default: this one)")
    parser.add_argument("--record", metavar="MACHINE", help="also write the docs' record "
                        "(docs/_data/bench/checkpoint.json), saying the run was on MACHINE")
    parser.add_argument("--tables-from", metavar="JSON", help="tabulate a run's results again (no run)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--dcp-worker", help=argparse.SUPPRESS)
    parser.add_argument("--restart-worker", help=argparse.SUPPRESS)
    options = parser.parse_args()
    rounds, megabytes = (1, 16.0) if options.quick else (options.rounds, options.mb)
    if options.restart_worker:
        restart_worker(options.restart_worker)
        return
    if options.worker:
        worker(options.worker, rounds, megabytes, options.dir)
        return
    if options.dcp_worker:
        dcp_worker(options.dcp_worker, options.np[0], rounds, megabytes, options.dir)
        return
    if options.tables_from:
        finish(json.loads(Path(options.tables_from).read_text()), options.record)
        return
    from distlab.launch import launch_script

    RESULTS.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=options.dir or RESULTS))
    rows_by_size, dcp, restarts = {}, {}, {}
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
            dcp[size] = dcp_times(size, rounds, megabytes, scratch, options.torch_python)
            restarts[size] = measure_restart(scratch, size)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    versions = next((d for d in dcp.values() if d), {})
    report = {"benchmark": "bench_checkpoint", "command": " ".join(["python -P"] + sys.argv), "rounds": rounds,
              "host_cores": os.cpu_count(), "megabytes": megabytes, "torch": versions.get("torch"),
              "rows": rows_by_size, "dcp": dcp,
              "seconds from a rank's death to the first step after the restart": restarts}
    finish(report, options.record)


def finish(report: dict, machine: str | None) -> None:
    """Tabulate a run: print the tables, write the results (and the docs' record when ``machine`` is given)."""
    def by_size(values: dict) -> dict:
        return {int(k): v for k, v in values.items()}  # JSON keys are strings

    made = tables(by_size(report["rows"]), by_size(report["dcp"]),
                  by_size(report["seconds from a rank's death to the first step after the restart"]))
    report["tables"] = made
    (RESULTS / "bench_checkpoint.json").write_text(json.dumps(report, indent=1))
    if machine:
        RECORD.write_text(json.dumps(record(report, machine), indent=1) + "\n")
    print("save (MB/s of the state's bytes; medians of the rounds)")
    print(show(made["save"]))
    print("\nload, and a rank's death to the first step after the restart")
    print(show(made["load"]))
    print("\na training step, the mean over every step of the windows (the step thread's time split by schedstat)")
    print(show(made["steps"]))
    print("\ntargets: save / numpy+fsync >= 0.8 and >= DCP's; load / numpy >= 0.8; step in flight / without <= 1.1")
    print(f"written to {RESULTS / 'bench_checkpoint.json'}" + (f" and {RECORD}" if machine else ""))

if __name__ == "__main__":
    main()
