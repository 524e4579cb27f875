"""Negotiation cost per cycle: Horovod's response cache hit path vs the miss path, reference vs core twin.

Run ``python -P benchmarks/bench_negotiation.py`` (it launches itself on 2 and 4 ranks). It measures, for 1, 100
and 1000 tensors submitted per cycle:

- **hit**: every tensor is cached on every rank; the cycle is one bitwise-AND allreduce of the bit vector plus the
  cache bookkeeping (lookups, LRU updates, fusion);
- **miss**: no tensor is cached (two name sets alternate in a cache that holds one); the cycle gathers request
  lists on rank 0, validates, fuses, broadcasts the responses, and every rank updates its cache;
- **floor**: a raw mpi4py ``Allreduce`` of the same bit vector on a plain communicator (what the hit path cannot
  beat), and the same allreduce through :class:`distlab.comm.ProcessGroup` (what the controller actually calls);
- **bookkeeping**: a one-rank cycle with a no-op channel: the controller's own work, no communication;
- **grouped**: the same counts as one group (``grouped_allreduce``) on the hit path, to compare with singles;
- **data path** (2 ranks, one host): ``collectives.allreduce`` of 26 MB of float32 (op Sum, the same name every
  step, so the cache hits) against ``ProcessGroup.allreduce`` of the same bytes in a plain array (MPI), and, for
  reference, of an array of a shared-memory arena (DDP's buckets) and the negotiated allreduce with its arena
  turned off (its copies in private memory and MPI: the data path before the arena), interleaved round by round.
  ``--data-path`` runs only this part.

``--record docs/_data/bench/negotiation.json`` also writes the run as the docs' record (with ``--from-results``:
from the last run's ``benchmarks/results/bench_negotiation.json``, measuring nothing).
``--callgrind IMPL TENSORS CYCLES`` runs only one-rank hit cycles, for instruction counts (see
:func:`callgrind_cycles`, and docs/benchmarks.md for the commands).

Each cycle starts after a barrier; a figure is the median over iterations of the slowest rank (for the hit path
and the floors, the lowest of three such medians, measured in interleaved blocks). Prints a table and
writes ``benchmarks/results/bench_negotiation.json``. Timings on a shared 2-core machine are noisy: compare
within one run.
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import distlab

distlab.keep_freed_memory()  # glibc keeps freed memory between steps, as docs/ measured (docs/autograd.md)

COUNTS = (1, 100, 1000)
BLOCKS = 3          # hit-path figures: the best of 3 interleaved blocks (each a median of the slowest rank)
IMPLS = ("reference", "core")
RESULTS = Path(__file__).resolve().parent / "results"


def _requests(module, count, prefix, rank, grouped=False):
    """``count`` allreduce requests of 64 floats; ``grouped``: the members of one group named ``prefix``."""
    from distlab._common.negotiation import dtype_code, group_id_of
    from distlab._wire import NO_GROUP, RequestType

    group = (group_id_of(prefix), count) if grouped else (NO_GROUP, 0)
    return [module.Request(f"{prefix}.{i}", RequestType.ALLREDUCE, dtype_code("float32"), (64,), request_rank=rank,
                           reduce_op=1, group_id=group[0], group_size=group[1]) for i in range(count)]


def _enqueue(controller, requests, grouped):
    if grouped:
        controller.enqueue_group(requests)
    else:
        for r in requests:
            controller.enqueue(r)


class _NoComm:
    def allreduce_bits(self, words, op):
        return None

    def gather(self, payload):
        return [payload]

    def broadcast(self, payload):
        return payload


def bookkeeping(repeat=200):
    """One-rank hit cycles with a no-op channel: microseconds per cycle for each twin and count."""
    from distlab import _backend

    out = {}
    for impl in IMPLS:
        module = _backend.load("negotiation", impl)
        for count in COUNTS:
            for grouped in (False, True):
                controller = module.Controller(0, 1)
                requests = _requests(module, count, "grad", 0, grouped)
                channel = _NoComm()
                _enqueue(controller, requests, grouped)
                controller.compute_response_list(channel)
                times, queued = [], []
                n = repeat if impl == "core" or count < 1000 else max(repeat // 5, 10)
                for _ in range(n):
                    start = time.perf_counter()
                    _enqueue(controller, requests, grouped)
                    queued.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    response_list = controller.compute_response_list(channel)
                    times.append(time.perf_counter() - start)
                assert controller.counters["fast_path"] == n
                assert not grouped or len(response_list.responses) == 1
                key = f"{impl}{'-grouped' if grouped else ''}/{count}"
                out[key] = statistics.median(times) * 1e6
                # the submitting thread's side: queueing (the core looks each request up in the cache there)
                out[f"enqueue-{key}"] = statistics.median(queued) * 1e9 / count
    return out


def callgrind_cycles(impl, count, cycles):
    """``cycles`` one-rank hit cycles of ``count`` tensors, for callgrind: run it twice (say 100 and 300 cycles)
    with ``--toggle-collect`` on ``compute_response_list`` and divide the difference by the extra cycles."""
    from distlab import _backend

    module = _backend.load("negotiation", impl)
    controller = module.Controller(0, 1)
    requests = _requests(module, count, "grad", 0)
    channel = _NoComm()
    for _ in range(cycles + 5):
        _enqueue(controller, requests, False)
        controller.compute_response_list(channel)
    assert controller.counters["fast_path"] == cycles + 4


def worker(out_path):
    """Runs on every rank under MPI. Configurations are measured interleaved, round by round, so that a burst of
    load from other processes hits them all alike and the ratios stay meaningful."""
    import numpy as np
    from mpi4py import MPI

    from distlab import _backend, comm
    from distlab.collectives._engine import _MPIChannel

    raw = MPI.COMM_WORLD.Dup()
    group = comm.ProcessGroup(name="bench")
    channel = _MPIChannel(group)
    rank, size = group.rank, group.size
    modules = {impl: _backend.load("negotiation", impl) for impl in IMPLS}
    results = {}
    warnings.simplefilter("ignore")

    def once(fn, prepare=None):
        if prepare is not None:
            prepare()       # e.g. enqueueing: the submitting thread's cost, not the cycle's
        raw.Barrier()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def slowest_median(times):
        return max(raw.allgather(statistics.median(times) * 1e6))

    for count in () if "--data-path" in sys.argv else COUNTS:
        words = np.zeros((count + 3 + 63) // 64, dtype=np.uint64)
        cases = {
            "floor-mpi4py": (lambda: raw.Allreduce(MPI.IN_PLACE, words, op=MPI.BAND), None),
            "floor-group": (lambda: group.allreduce(words, op="band"), None),
        }
        hit_controllers = {}
        for impl, module in modules.items():
            for grouped in (False, True):
                # hit path: pre-warmed cache, the same tensors every cycle (one group of them, or singles)
                controller = module.Controller(rank, size, cache_capacity=2048)
                requests = _requests(module, count, "grad", rank, grouped)

                def enqueue(controller=controller, requests=requests, grouped=grouped):
                    _enqueue(controller, requests, grouped)

                enqueue()
                controller.compute_response_list(channel)
                label = f"hit-{impl}{'-grouped' if grouped else ''}"
                hit_controllers[label] = controller
                cases[label] = (lambda c=controller: c.compute_response_list(channel), enqueue)
        rounds = 90 if count == 1000 else 100   # at 1000 the reference runs every third round only
        best = {name: float("inf") for name in cases}
        for _block in range(BLOCKS):
            times = {name: [] for name in cases}
            gc.collect()        # garbage from earlier configurations must not be collected during these
            for i in range(rounds):
                for name, (fn, prepare) in cases.items():
                    if name.startswith("hit-reference") and count == 1000 and i % 3:
                        continue
                    times[name].append(once(fn, prepare))
            for name in cases:
                best[name] = min(best[name], slowest_median(times[name]))
        for name in cases:
            results[f"{name}/{count}"] = best[name]
        for impl, controller in hit_controllers.items():
            assert controller.counters["slow_path"] == 1, "hit cycles left the fast path"

        # miss path: two name sets alternate in a cache that holds one set
        miss_cases = {}
        for impl, module in modules.items():
            controller = module.Controller(rank, size, cache_capacity=count)
            sets = [_requests(module, count, "a", rank), _requests(module, count, "b", rank)]
            state = {"i": 0}

            def enqueue_next(controller=controller, sets=sets, state=state):
                for r in sets[state["i"] % 2]:
                    controller.enqueue(r)
                state["i"] += 1

            def miss(controller=controller):
                response_list = controller.compute_response_list(channel)
                assert sum(len(x.tensor_names) for x in response_list.responses) == count
                assert controller.counters["fast_path"] == 0

            miss_cases[f"miss-{impl}"] = (miss, enqueue_next)
        times = {name: [] for name in miss_cases}
        gc.collect()
        for i in range(8 if count == 1000 else 30):
            for name, (fn, prepare) in miss_cases.items():
                times[name].append(once(fn, prepare))
        for name in miss_cases:
            results[f"{name}/{count}"] = slowest_median(times[name])
    if size == 2:
        results.update(data_path(raw, group))
    if rank == 0:
        Path(out_path).write_text(json.dumps({"size": size, "results": results}))
    group.destroy()


DATA_BYTES = 26_000_000
DATA_ROUNDS = 40


def data_path(raw, group, rounds=DATA_ROUNDS):
    """The negotiated allreduce of 26 MB against the process group's, interleaved (ms, slowest rank's median)."""
    import numpy as np

    from distlab import collectives as hvd
    from distlab.collectives import _engine

    hvd.init()
    count = DATA_BYTES // 4
    plain = np.ones(count, dtype=np.float32)
    given = np.ones(count, dtype=np.float32)
    arena, (placed,) = group.shared_arrays([(count, np.float32)]) or (None, (None,))
    world = _engine.get().world
    hvd.allreduce(given, name="data", op=hvd.Sum)        # makes the collectives' arena (every rank, one host)
    placement = world.placement

    def negotiated(with_arena):
        world.placement = placement if with_arena else None
        hvd.allreduce(given, name="data" if with_arena else "data (arena off)", op=hvd.Sum)

    cases = {"process-group": lambda: group.allreduce(plain),
             "collectives": lambda: negotiated(True),
             "collectives-arena-off": lambda: negotiated(False)}
    if placed is not None:
        cases["process-group-arena"] = lambda: group.allreduce(placed)
    times = {name: [] for name in cases}
    for fn in cases.values():
        fn()
    gc.collect()
    for _ in range(rounds):
        for name, fn in cases.items():
            raw.Barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    world.placement = placement
    hvd.shutdown()
    out = {f"data-{name}": max(raw.allgather(statistics.median(t) * 1e3)) for name, t in times.items()}
    out["data-loadavg"] = os.getloadavg()[0]
    del arena
    return out


def main():
    from distlab.launch import launch_script

    RESULTS.mkdir(parents=True, exist_ok=True)
    record_to = sys.argv[sys.argv.index("--record") + 1] if "--record" in sys.argv else None
    if record_to and "--from-results" in sys.argv:      # rewrite the record from the last run's results
        record(json.loads((RESULTS / "bench_negotiation.json").read_text()), Path(record_to))
        return
    only_data = "--data-path" in sys.argv[1:]
    report = {"command": " ".join(sys.argv), "host_cores": os.cpu_count(),
              "bookkeeping_us": {} if only_data else bookkeeping(), "mpi": {}}
    for np_ in (2,) if only_data else (2, 4):
        out = RESULTS / f".bench_negotiation_np{np_}.json"
        # One BLAS thread per rank: idle OpenBLAS threads spin and steal the cores the ranks need.
        result = launch_script(__file__, np=np_, args=["--worker", str(out)] + (["--data-path"] if only_data else []),
                               timeout=600, capture=True, env={"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
        if result.returncode != 0:
            sys.exit(f"benchmark on {np_} ranks failed:\n{result.stdout}\n{result.stderr}")
        report["mpi"][np_] = json.loads(out.read_text())["results"]
        out.unlink()
    report["load_average"] = os.getloadavg()[0]
    name = "bench_negotiation_data_path.json" if only_data else "bench_negotiation.json"
    (RESULTS / name).write_text(json.dumps(report, indent=2))
    print(render(report))
    if record_to and not only_data:
        record(report, Path(record_to))


def _us(value):
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def record(report, path):
    """Write the run as the docs' record (``docs/_data/bench/negotiation.json``): the bookkeeping table ``t1``, the
    2-rank table ``t2``, the targets ``targets`` and the figures the pages quote, keeping the record's ``before``
    and ``instructions`` tables (the figures before the change the page describes, and callgrind's counts)."""
    old = json.loads(path.read_text()) if path.exists() else {}
    book, two, four = report["bookkeeping_us"], report["mpi"].get("2", report["mpi"].get(2)), \
        report["mpi"].get("4", report["mpi"].get(4))
    t1 = [[str(c), _us(book[f"reference/{c}"]), _us(book[f"core/{c}"]),
           f"{book[f'reference/{c}'] / book[f'core/{c}']:.0f}x", f"{book.get(f'enqueue-core/{c}', float('nan')):.0f}"]
          for c in COUNTS]
    t2 = [[str(c), _us(two[f"floor-mpi4py/{c}"]), _us(two[f"floor-group/{c}"]), _us(two[f"hit-core/{c}"]),
           _us(two[f"miss-core/{c}"]), _us(two[f"hit-reference/{c}"]), _us(two[f"miss-reference/{c}"]),
           _us(two[f"hit-core-grouped/{c}"])] for c in COUNTS]
    targets = [[f"hit cycle, {c} tensors, 2 ranks", f"floor + {limit} us", f"{two[f'floor-mpi4py/{c}']:.1f} us",
                f"{two[f'hit-core/{c}']:.1f} us", f"+{two[f'hit-core/{c}'] - two[f'floor-mpi4py/{c}']:.1f} us",
                "yes" if two[f"hit-core/{c}"] - two[f"floor-mpi4py/{c}"] <= limit else "no"]
               for c, limit in ((100, 5), (1000, 10))]
    grouped = [two[f"hit-core-grouped/{c}"] / two[f"hit-core/{c}"] for c in COUNTS]
    data = {
        "what": "A negotiation cycle for 1, 100 and 1000 tensors, hit and miss paths, both twins; bookkeeping on one "
                "rank (microseconds per cycle; enqueue: nanoseconds per tensor on the submitting thread; 2 ranks: "
                "median of the slowest rank, beside the same run's raw mpi4py allreduce, the floor)",
        "tables": {
            "t1": {"columns": ["tensors", "reference", "core", "ratio", "enqueue, core [ns]"], "rows": t1,
                   "align": "right"},
            "t2": {"columns": ["tensors", "raw (floor)", "floor through the group", "hit, core", "miss, core",
                               "hit, reference", "miss, reference", "grouped hit, core"], "rows": t2,
                   "align": "right"},
            "targets": {"columns": ["figure", "target", "floor, same run", "core", "above the floor", "met"],
                        "rows": targets},
        },
        "command": " ".join(["python -P benchmarks/bench_negotiation.py"] + [a for a in sys.argv[1:]
                                                                            if a != "--from-results"]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"the {report['host_cores']}-core development machine, load average "
                   f"{report.get('load_average', float('nan')):.1f} at the end of the run",
        "figures": {
            "hit_extra_us": f"{two['hit-core/1000'] - two['floor-mpi4py/1000']:.0f} us",
            "hit_bookkeeping_us": f"{book['core/1000']:.0f} us",
            "miss_over_hit": f"{two['miss-core/1000'] / two['hit-core/1000']:.0f}",
            "grouped_range": f"{min(grouped):.2f}x to {max(grouped):.2f}x",
            "four_ranks_raw_us": f"{four['floor-mpi4py/1000']:.0f} us",
            "four_ranks_pg_us": f"{four['floor-group/1000']:.0f} us",
            "four_ranks_hit_core_us": f"{four['hit-core/1000']:.0f} us",
        },
    }
    for kept in ("before", "instructions"):
        if kept in old.get("tables", {}):
            data["tables"][kept] = old["tables"][kept]
    for kept in ("before_source", "instructions_source"):
        if kept in old.get("figures", {}):
            data["figures"][kept] = old["figures"][kept]
    path.write_text(json.dumps(data, indent=1) + "\n")


def render(report):
    nan = float("nan")
    lines = []
    book = report["bookkeeping_us"]
    data = report["mpi"].get(2, report["mpi"].get("2", {}))
    if "data-collectives" in data:
        pg = data["data-process-group"]
        lines.append("collectives allreduce vs process group, 26 MB, one host, 2 ranks (ms, median of the "
                     f"slowest rank, {DATA_ROUNDS} interleaved rounds, load average {data['data-loadavg']:.1f}):")
        lines.append(f"{'process group':>14} {'collectives':>12} {'ratio':>6} {'arena off':>10} {'ratio':>6} "
                     f"{'group arena':>12}")
        lines.append(f"{pg:>14.2f} {data['data-collectives']:>12.2f} {data['data-collectives'] / pg:>5.2f}x "
                     f"{data['data-collectives-arena-off']:>10.2f} {data['data-collectives-arena-off'] / pg:>5.2f}x "
                     f"{data.get('data-process-group-arena', float('nan')):>12.2f}")
        lines.append("")
    if not book:
        return "\n".join(lines)
    lines.append("Cache bookkeeping, one-rank hit cycle, no communication (us per cycle; enqueue: the submitting "
                 "thread's ns per tensor):")
    lines.append(f"{'tensors':>8} {'reference':>11} {'core':>9} {'ratio':>7} {'ref grouped':>12} "
                 f"{'core grouped':>13} {'grouped/single core':>20} {'enqueue ref':>12} {'enqueue core':>13}")
    for count in COUNTS:
        ref, core = book[f"reference/{count}"], book[f"core/{count}"]
        gref, gcore = book[f"reference-grouped/{count}"], book[f"core-grouped/{count}"]
        eref, ecore = book.get(f"enqueue-reference/{count}", nan), book.get(f"enqueue-core/{count}", nan)
        lines.append(f"{count:>8} {ref:>11.1f} {core:>9.1f} {ref / core:>6.1f}x {gref:>12.1f} {gcore:>13.1f} "
                     f"{gcore / core:>19.2f}x {eref:>12.0f} {ecore:>13.0f}")
    for np_, res in report["mpi"].items():
        lines.append("")
        lines.append(f"{np_} ranks, us per cycle (median of the slowest rank):")
        lines.append(f"{'tensors':>8} {'floor mpi4py':>13} {'floor group':>12} {'hit ref':>9} {'hit core':>9} "
                     f"{'miss ref':>9} {'miss core':>10} {'miss/hit core':>14} {'hit core-floor':>15}")
        by_count = {count: {k.split("/")[0]: v for k, v in res.items() if k.endswith(f"/{count}")}
                    for count in COUNTS}
        for count, g in by_count.items():
            lines.append(f"{count:>8} {g['floor-mpi4py']:>13.1f} {g['floor-group']:>12.1f} {g['hit-reference']:>9.1f} "
                         f"{g['hit-core']:>9.1f} {g['miss-reference']:>9.1f} {g['miss-core']:>10.1f} "
                         f"{g['miss-core'] / g['hit-core']:>13.1f}x {g['hit-core'] - g['floor-mpi4py']:>15.1f}")
        lines.append("  grouped (one group of every tensor), hit path, us per cycle:")
        lines.append(f"{'tensors':>8} {'hit ref':>9} {'hit core':>9} {'grouped ref':>12} {'grouped core':>13} "
                     f"{'grouped/single core':>20}")
        for count, g in by_count.items():
            lines.append(f"{count:>8} {g['hit-reference']:>9.1f} {g['hit-core']:>9.1f} "
                         f"{g['hit-reference-grouped']:>12.1f} {g['hit-core-grouped']:>13.1f} "
                         f"{g['hit-core-grouped'] / g['hit-core']:>19.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[sys.argv.index("--worker") + 1])
    elif "--callgrind" in sys.argv:   # --callgrind IMPL TENSORS CYCLES
        at = sys.argv.index("--callgrind")
        callgrind_cycles(sys.argv[at + 1], int(sys.argv[at + 2]), int(sys.argv[at + 3]))
    else:
        main()
