"""distlab's allreduce (sync and async) against raw mpi4py ``Allreduce`` on the same buffers.

Run: ``python benchmarks/bench_comm.py`` (or ``make bench``). It launches itself on 2 and 4 ranks
(``--np 2 4``), and in each job measures, for every size from 4 KiB to 64 MiB, the four methods interleaved
round by round (raw, distlab sync, distlab async+wait, and distlab sync on an array of a shared-memory arena,
reduced in place as DDP's buckets are: see ``distlab.comm.shared``), so the machine's state drifts equally for all.
Bandwidth on this 2-core machine switches between two levels from one launch to the next: compare within a
table, never across runs. Prints a table and writes ``benchmarks/results/bench_comm.json``.
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
SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _rounds(nbytes: int) -> tuple[int, int]:
    """(rounds, calls per timed batch): many short batches for small sizes, a few single calls for large."""
    if nbytes <= 64 << 10:
        return 60, 50
    if nbytes <= 1 << 20:
        return 40, 10
    if nbytes <= 16 << 20:
        return 20, 2
    return 8, 1


def worker(out_path: str, sizes: list[int]) -> None:
    import numpy as np
    from mpi4py import MPI
    from tqdm import tqdm

    from distlab import comm

    pg = comm.world()
    raw_comm = MPI.COMM_WORLD.Dup()
    rows = []
    for nbytes in tqdm(sizes, desc=f"bench_comm np={pg.size}", disable=pg.rank != 0, unit="size"):
        a = np.ones(nbytes // 4, dtype=np.float32)
        rounds, batch = _rounds(nbytes)

        def raw():
            raw_comm.Allreduce(MPI.IN_PLACE, a)

        def sync():
            pg.allreduce(a)

        def async_wait():
            pg.allreduce(a, async_op=True).wait()

        placed = pg.shared_arrays([(a.size, a.dtype)])  # None when the ranks span nodes: no such column then

        def shared():
            pg.allreduce(placed[1][0])

        methods = {"raw_mpi4py": raw, "distlab_sync": sync, "distlab_async": async_wait}
        if placed is not None:
            placed[1][0][:] = 1
            methods["distlab_shared"] = shared
        samples = {name: [] for name in methods}
        for fn in methods.values():  # warm-up
            fn()
        for _ in range(rounds):
            for name, fn in methods.items():
                raw_comm.Barrier()
                start = time.perf_counter()
                for _ in range(batch):
                    fn()
                samples[name].append((time.perf_counter() - start) / batch)
        # Every rank's median, then the slowest rank's (a collective is as slow as its slowest member).
        medians = {name: statistics.median(v) for name, v in samples.items()}
        gathered = raw_comm.gather(medians, root=0)
        if pg.rank == 0:
            worst = {name: max(m[name] for m in gathered) for name in methods}
            rows.append({"np": pg.size, "bytes": nbytes, **{k: v * 1e6 for k, v in worst.items()}})
    if pg.rank == 0:
        Path(out_path).write_text(json.dumps(rows))


def _human(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def table(rows: list[dict]) -> str:
    head = f"{'ranks':>5} {'size':>8} {'raw mpi4py us':>14} {'distlab sync us':>16} {'ratio':>6} " \
           f"{'distlab async us':>17} {'ratio':>6} {'sync-raw us':>12} {'shared us':>10} {'ratio':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        raw, sync, asy = r["raw_mpi4py"], r["distlab_sync"], r["distlab_async"]
        shared = f"{r['distlab_shared']:>10.1f} {r['distlab_shared'] / raw:>6.2f}" if "distlab_shared" in r else ""
        lines.append(f"{r['np']:>5} {_human(r['bytes']):>8} {raw:>14.1f} {sync:>16.1f} {sync / raw:>6.2f} "
                     f"{asy:>17.1f} {asy / raw:>6.2f} {sync - raw:>12.1f} {shared}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, nargs="+", default=[2, 4], help="rank counts (default 2 4)")
    parser.add_argument("--max-mib", type=int, default=64, help="largest size in MiB (default 64)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    options = parser.parse_args()
    sizes = [s for s in SIZES if s <= options.max_mib << 20]
    if options.worker:
        worker(options.worker, sizes)
        return
    from distlab.launch import launch_script

    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = []
    for np_ in options.np:
        part = RESULTS / f"bench_comm.np{np_}.json"
        job = launch_script(__file__, np=np_, args=["--worker", str(part), "--max-mib", str(options.max_mib)],
                            timeout=1800)
        if job.returncode != 0:
            sys.exit(f"bench_comm on {np_} ranks failed (exit {job.returncode})")
        rows += json.loads(part.read_text())
        part.unlink()
    import distlab

    report = {"benchmark": "bench_comm", "impl": distlab.IMPL, "command": " ".join(sys.argv),
              "host_cores": os.cpu_count(), "rows": rows}
    (RESULTS / "bench_comm.json").write_text(json.dumps(report, indent=1))
    print(table(rows))
    print(f"\nwritten to {RESULTS / 'bench_comm.json'}")


if __name__ == "__main__":
    main()
