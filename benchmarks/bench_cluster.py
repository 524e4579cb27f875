"""Allreduce and RPC across 2 virtual hosts (distlab.cluster) at several link rates, against raw mpi4py and the
link's floor.

Run as root: ``sudo .venv/bin/python -P benchmarks/bench_cluster.py`` (``--rates unshaped 10gbit 1gbit`` is the
default). For each rate it brings a 2-host cluster (``dlbench``) up or reshapes it, runs one job of 2 ranks, one
per host (``--np 4``: two per host, allreduce only), and takes the cluster down at the end (``--keep`` leaves
it). In each job, for every size from 4 KiB to 64 MiB, raw mpi4py ``Allreduce``, distlab's ``allreduce`` and
distlab's ``allreduce(async_op=True).wait()`` are timed round by round, interleaved, so the machine's drift falls
on all three alike; then an RPC round trip (no-op, and a 1 MiB echo) against a raw ``Send``/``Recv`` ping-pong.

The floor is what the link allows: a ring allreduce sends ``2 (n-1)/n`` times the buffer per rank, so with n = 2
ranks ``bytes / rate``; with 2 ranks per host it is the same, each host's half of the data crossing once each way
(MPI's allreduce over 4 ranks may send more). MPICH does not run a ring here: for a sum of floats it takes
recursive doubling up to 2 KiB and Rabenseifner's reduce-scatter + allgather above; with 2 ranks each sends its
whole buffer once either way, the same bytes as the ring. The floor counts payload only; Ethernet, IP and TCP
headers add about 4% on the wire, which the ``wire/payload`` column measures from the link's byte counter.

Prints a table and writes ``benchmarks/results/bench_cluster.json``. Timings on a loaded 2-core machine are
noisy: compare within a table (same rate, same launch), and run it on a quiet machine for figures to quote.
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
CLUSTER = "dlbench"
HOSTS = 2  # the cluster's hosts; ranks are placed on them in blocks


def _tx_bytes() -> int:
    """Bytes this process's network namespace has sent on its cluster link (not loopback)."""
    with open("/proc/self/net/dev") as f:
        rows = [line.split(":", 1) for line in f.readlines()[2:]]
    return sum(int(stats.split()[8]) for name, stats in rows if name.strip().startswith(f"{CLUSTER}-h"))


def _plan(seconds_per_call: float) -> tuple[int, int]:
    """(rounds, calls per timed batch): about 4 s of measuring per method and size, 5 to 40 rounds."""
    batch = max(1, int(0.002 / seconds_per_call))
    rounds = int(4.0 / (batch * seconds_per_call))
    return min(40, max(5, rounds)), batch


def allreduce_rows(pg, raw_comm, sizes, rate_bps):
    import numpy as np
    from mpi4py import MPI

    rows = []
    for nbytes in sizes:
        a = np.ones(nbytes // 4, dtype=np.float32)
        methods = {"raw_mpi4py": lambda: raw_comm.Allreduce(MPI.IN_PLACE, a),
                   "distlab_sync": lambda: pg.allreduce(a),
                   "distlab_async": lambda: pg.allreduce(a, async_op=True).wait()}
        raw_comm.Barrier()
        start = time.perf_counter()
        for fn in methods.values():      # warm-up, and a first estimate of one call
            fn()
        estimate = raw_comm.allreduce((time.perf_counter() - start) / 3, op=MPI.MAX)
        rounds, batch = _plan(estimate)
        samples = {name: [] for name in methods}
        wire = 0
        for _ in range(rounds):
            for name, fn in methods.items():
                raw_comm.Barrier()
                sent = _tx_bytes()
                t0 = time.perf_counter()
                for _ in range(batch):
                    fn()
                samples[name].append((time.perf_counter() - t0) / batch)
                if name == "raw_mpi4py":
                    wire += _tx_bytes() - sent
        medians = {name: statistics.median(v) for name, v in samples.items()}
        worst = {name: raw_comm.allreduce(m, op=MPI.MAX) * 1e6 for name, m in medians.items()}
        floor = nbytes * 2 * (HOSTS - 1) / HOSTS / (rate_bps / 8) * 1e6 if rate_bps else None
        rows.append({"bytes": nbytes, **worst, "floor_us": floor, "rounds": rounds, "batch": batch,
                     "wire_per_payload": wire / (rounds * batch * nbytes)})
    return rows


def rpc_rows(raw_comm, quick: bool):
    import numpy as np

    import distlab.rpc as rpc

    rank = raw_comm.Get_rank()
    results = {}
    n = 200 if quick else 1000
    for label, arr, count in (("8 B", np.zeros(1), n), ("1 MiB", np.zeros(1 << 17), max(n // 20, 10))):
        buf = np.empty_like(arr)
        raw_comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(count):
            if rank == 0:
                raw_comm.Send(arr, 1, 7)
                raw_comm.Recv(buf, 1, 7)
            else:
                raw_comm.Recv(buf, 0, 7)
                raw_comm.Send(buf, 0, 7)
        results[f"raw ping-pong {label}"] = (time.perf_counter() - t0) / count * 1e6
    rpc.init_rpc(f"w{rank}")
    if rank == 0:
        noop, echo = rpc.cheap(_noop), rpc.cheap(_echo)
        for label, fn, args, count in (("rpc_sync no-op", noop, (), n),
                                       ("rpc_sync echo 1 MiB", echo, (np.zeros(1 << 17),), max(n // 20, 10))):
            rpc.rpc_sync(1, fn, args)
            samples = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(count // 5):
                    rpc.rpc_sync(1, fn, args)
                samples.append((time.perf_counter() - t0) / (count // 5))
            results[label] = statistics.median(samples) * 1e6
    rpc.shutdown()
    return results


def _noop():
    return None


def _echo(x):
    return x


def worker(out_path: str, sizes: list[int], rate_bps: int | None, quick: bool) -> None:
    from mpi4py import MPI

    from distlab import comm

    pg = comm.world()
    raw_comm = MPI.COMM_WORLD.Dup()
    rows = allreduce_rows(pg, raw_comm, sizes, rate_bps)
    rpc = rpc_rows(raw_comm, quick) if pg.size == 2 else {}  # the round trips are between one rank per host
    if pg.rank == 0:
        Path(out_path).write_text(json.dumps({"allreduce": rows, "rpc": rpc}))


def _human(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def table(runs: list[dict]) -> str:
    head = (f"{'link':>9} {'size':>7} {'raw us':>10} {'sync us':>10} {'ratio':>6} {'async us':>10} {'ratio':>6} "
            f"{'floor us':>10} {'raw/floor':>9} {'wire/payload':>12}")
    lines = [head, "-" * len(head)]
    for run in runs:
        for r in run["allreduce"]:
            raw, sync, asy, floor = r["raw_mpi4py"], r["distlab_sync"], r["distlab_async"], r["floor_us"]
            lines.append(f"{run['rate']:>9} {_human(r['bytes']):>7} {raw:>10.1f} {sync:>10.1f} {sync / raw:>6.2f} "
                         f"{asy:>10.1f} {asy / raw:>6.2f} {floor if floor else float('nan'):>10.1f} "
                         f"{raw / floor if floor else float('nan'):>9.2f} {r['wire_per_payload']:>12.3f}")
    lines += ["", f"{'link':>9} {'round trip':<24} {'us':>10}", "-" * 45]
    for run in runs:
        for label, us in run["rpc"].items():
            lines.append(f"{run['rate']:>9} {label:<24} {us:>10.1f}")
    return "\n".join(lines)


def acceptance(runs: list[dict]) -> list[str]:
    """At 1 Gbit/s, distlab's allreduce (sync and async) within 10% of raw mpi4py from 1 MiB up."""
    verdicts = []
    for run in runs:
        if run["rate"] != "1gbit":
            continue
        for r in run["allreduce"]:
            if r["bytes"] < 1 << 20:
                continue
            for name in ("distlab_sync", "distlab_async"):
                ratio = r[name] / r["raw_mpi4py"]
                verdicts.append(f"{'ok  ' if ratio <= 1.10 else 'SLOW'} 1gbit {_human(r['bytes'])} {name}: "
                                f"{ratio:.3f} x raw")
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", nargs="+", default=["unshaped", "10gbit", "1gbit"])
    parser.add_argument("--max-mib", type=int, default=64, help="largest size in MiB (default 64)")
    parser.add_argument("--quick", action="store_true", help="fewer RPC round trips")
    parser.add_argument("--np", type=int, choices=(2, 4), default=2,
                        help="ranks: 2 (one per host, default) or 4 (two per host; no RPC rows)")
    parser.add_argument("--keep", action="store_true", help="leave the cluster up at the end")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    options = parser.parse_args()
    sizes = [s for s in SIZES if s <= options.max_mib << 20]
    if options.worker:
        out, rate = options.worker
        worker(out, sizes, int(rate) or None, options.quick)
        return

    from distlab.cluster import down, format_rate, parse_rate, require_privileges, up
    from distlab.errors import ClusterPermissionError
    from distlab.launch import launch_script

    try:
        require_privileges("up")
    except ClusterPermissionError as exc:
        sys.exit(f"bench_cluster builds a virtual cluster: {exc}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    runs = []
    try:
        for rate in options.rates:
            bps = parse_rate(rate)
            up(HOSTS, bps, CLUSTER)
            part = RESULTS / "bench_cluster.part.json"
            args = ["--worker", str(part), str(bps or 0), "--max-mib", str(options.max_mib)]
            job = launch_script(__file__, np=options.np, args=args + (["--quick"] if options.quick else []),
                                timeout=1800, cluster=CLUSTER)
            if job.returncode != 0:
                sys.exit(f"bench_cluster at {rate} failed (exit {job.returncode})")
            runs.append({"rate": format_rate(bps), "rate_bps": bps, **json.loads(part.read_text())})
            part.unlink()
    finally:
        if not options.keep:
            down(CLUSTER)
    import distlab

    load = os.getloadavg()
    report = {"benchmark": "bench_cluster", "impl": distlab.IMPL, "command": " ".join(sys.argv),
              "host_cores": os.cpu_count(), "load_average": load, "hosts": HOSTS, "ranks": options.np,
              "mpich_allreduce": "recursive doubling <= 2 KiB, Rabenseifner reduce-scatter + allgather above",
              "runs": runs, "acceptance_1gbit": acceptance(runs)}
    (RESULTS / "bench_cluster.json").write_text(json.dumps(report, indent=1))
    print(table(runs))
    print(f"\nload average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores")
    for line in report["acceptance_1gbit"]:
        print(line)


if __name__ == "__main__":
    main()
