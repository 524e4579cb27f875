"""DDP's overlap of communication with backward, on one host and across a link of a given rate.

Run (the cluster rates need root and the virtual cluster, ``python -m distlab cluster``)::

    python -P benchmarks/bench_overlap.py --rates local                    # one host (shared memory)
    sudo .venv/bin/python -P benchmarks/bench_overlap.py                   # local, 1gbit, 2.5gbit, 10gbit
    sudo .venv/bin/python -P benchmarks/bench_overlap.py --quick           # a smoke run

Model: 100 x Linear(256, 256) (26 MB of fp32 gradients in 200 tensors), batch 32, MSE loss, SGD, one rank per
host (2 ranks), BLAS on one thread. Per link rate it measures, round-robin over ``--rounds`` rounds:

- ``local``: the plain model's step (zero_grad, forward, loss, backward, SGD), and apart its forward (with the
  loss), backward and update;
- ``allreduce``: one blocking allreduce of the model's bytes through distlab (the wire's share of a step);
- ``wire``: the same bytes as 1 MiB allreduces all started at once, then waited for: the link kept busy, as
  DDP's small buckets keep it at best;
- ``ddp``: DistributedDataParallel's step for each bucket cap (``auto``, 25, 4, 1 MB), with and without
  ``gradient_as_bucket_view``, for each twin; with ``--fused`` also with auto caps and the optimizer fused into
  DDP's hook (``_register_fused_optim``: each bucket's parameters are updated as soon as it is reduced), shown
  as cap ``f<MB>``.

The *floor* of a DDP step is max(local step, allreduce alone): neither the computation nor the wire can be hidden
behind the other completely. Each DDP row reports its step and the step over the floor. Where the wire is the
longer, a DDP step whose optimizer steps after backward has a tighter *bound*: forward + wire + update (no bucket
can start before backward's first gradients, and the update needs the last bucket). The link rows report the
step over it too. With ``--cpu`` a second table gives each step's CPU time (user and system, from ``getrusage``)
beside its wall time: the MPI library busy-polls, so CPU time during a wait equals its wall time and is no
measure of the work done, but system time is the kernel's TCP work. Prints the tables and writes ``benchmarks/results/bench_overlap.json``; ``--timeline
RATE`` also records, in a job of its own, a trace of a few steps of the core twin with the automatic bucket size
at that rate (``benchmarks/results/overlap_timeline.json``, drawn by
``docs/_scripts/overlap_timeline_figure.py``). ``--progress`` measures instead whether an allreduce moves while
Python computes, and what moves it (:func:`progress_probe`). ``--horovod`` measures instead the Horovod-style
front on the same model (:func:`horovod_worker`): ``distlab.collectives.DistributedOptimizer`` submits each
gradient's ``allreduce_async`` from its hook during backward and a background thread negotiates and runs them
(nobody polls), for several fusion thresholds and cycle times (``DISTLAB_FUSION_THRESHOLD``,
``DISTLAB_CYCLE_TIME``: one job per setting, as they are read at ``init``); writes
``benchmarks/results/bench_overlap_horovod.json``. ``--pieces`` measures instead a 26 MB allreduce whole, in the
pieces distlab chooses across nodes, in fixed pieces, and as ``wire`` (:func:`pieces_probe`); writes
``benchmarks/results/bench_overlap_pieces.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import distlab

distlab.keep_freed_memory()  # glibc keeps freed memory between steps, as docs/ measured (docs/autograd.md)

RESULTS = Path(__file__).resolve().parent / "results"
LAYERS, WIDTH, BATCH = 100, 256, 32
CAPS = ("auto", 25, 4, 1)
RATES = ("local", "1gbit", "2.5gbit", "10gbit")
CLUSTER = "dloverlap"


def mlp():
    """The benchmark's model: LAYERS x Linear(WIDTH, WIDTH), the same weights on every rank."""
    import distlab
    from distlab import nn

    distlab.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def batch(rank: int):
    """This rank's input and target tensors (BATCH x WIDTH, seeded by the rank)."""
    import numpy as np

    import distlab

    rng = np.random.default_rng(rank)
    return tuple(distlab.tensor(rng.standard_normal((BATCH, WIDTH), dtype=np.float32)) for _ in range(2))


def worker(out: str, rounds: int, caps, twins, views, cpu: bool, trace_steps: int, fused: bool = False) -> None:
    """Runs on every rank: builds the models, times them round-robin, writes rank 0's (worst-rank) rows."""
    import numpy as np

    from distlab import comm, nn, optim
    from distlab.ddp import DistributedDataParallel

    pg = comm.world()
    # The allreduce-alone buffer first, in memory never used before: numpy asks for transparent huge pages for it,
    # which memory that model building freed and malloc keeps (4 KiB pages) would not give (MPI on one host then
    # reduces 26 MB 10-20% slower), so the row measures the allreduce at its best.
    buffer = np.ones(LAYERS * (WIDTH * WIDTH + WIDTH), dtype=np.float32)

    class Step:
        def __init__(self, model, fused=False):
            self.model = model
            self.fused = fused  # the optimizer runs inside DDP's hook, as each bucket is reduced
            self.opt = (model._register_fused_optim(optim.SGD, lr=1e-4) if fused
                        else optim.SGD(model.parameters(), lr=1e-4))
            self.x, self.y = batch(pg.rank)
            self.loss_fn = nn.MSELoss()

        def __call__(self):
            self.opt.zero_grad()
            self.loss_fn(self.model(self.x), self.y).backward()
            if not self.fused:
                self.opt.step()

        def phases(self):
            """Seconds of the forward pass (with the loss), of backward and of the optimizer's update."""
            self.opt.zero_grad()
            start = time.perf_counter()
            loss = self.loss_fn(self.model(self.x), self.y)
            forward = time.perf_counter()
            loss.backward()
            backward = time.perf_counter()
            self.opt.step()
            return forward - start, backward - forward, time.perf_counter() - backward

    if trace_steps:  # a separate job, with the timeline on: a few steps of the auto-capped core twin only
        step = Step(DistributedDataParallel(mlp(), bucket_cap_mb="auto", impl="core"))
        for _ in range(trace_steps):
            pg.barrier()
            step()
        return
    nbytes = buffer.nbytes
    assert nbytes == sum(p.data.nbytes for p in mlp().parameters())

    def allreduce():
        pg.allreduce(buffer, name="allreduce alone")

    pieces = [buffer[i:i + 2**18] for i in range(0, buffer.size, 2**18)]  # 1 MiB of float32 each

    def wire():
        for work in [pg.allreduce(piece, async_op=True, name="wire") for piece in pieces]:
            work.wait()

    steps = {"local": Step(mlp()), "allreduce": allreduce, "wire": wire}
    for impl in twins:
        for view in views:
            for cap in caps:
                key = f"ddp {impl} cap={cap} view={int(view)}"
                model = DistributedDataParallel(mlp(), bucket_cap_mb=cap, gradient_as_bucket_view=view, impl=impl)
                steps[key] = Step(model)
            if fused:
                model = DistributedDataParallel(mlp(), bucket_cap_mb="auto", gradient_as_bucket_view=view, impl=impl)
                steps[f"ddp {impl} cap=auto view={int(view)} fused"] = Step(model, fused=True)
    for step in steps.values():  # warm-up; DDP rebuilds its buckets (and chooses "auto" caps) after iteration 1
        for _ in range(3):
            step()
    samples = {key: [] for key in steps}
    cpu_samples = {key: [] for key in steps}
    phases = []
    for _ in range(rounds):
        for key, step in steps.items():
            pg.barrier()
            before = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            step()
            samples[key].append(time.perf_counter() - start)
            after = resource.getrusage(resource.RUSAGE_SELF)
            cpu_samples[key].append((after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime))
        pg.barrier()
        phases.append(steps["local"].phases())
    row = {"ranks": pg.size, "megabytes": nbytes / 1e6, "params": 2 * LAYERS}
    for i, phase in enumerate(("forward", "backward", "update")):
        row[f"{phase} ms"] = statistics.median(p[i] for p in phases) * 1e3
    for key in steps:
        row[f"{key} ms"] = statistics.median(samples[key]) * 1e3
        if cpu:
            row[f"{key} user ms"] = statistics.median(u for u, _ in cpu_samples[key]) * 1e3
            row[f"{key} sys ms"] = statistics.median(s for _, s in cpu_samples[key]) * 1e3
        if key.startswith("ddp"):
            data = steps[key].model.reducer.get_logging_data()
            row[f"{key} buckets"] = len(data["bucket_indices"])
            row[f"{key} cap MB"] = data["bucket_cap_bytes"] / 2**20
            row[f"{key} first cap MB"] = data["first_bucket_cap_bytes"] / 2**20
            if data["auto_bucket_cap"]:
                row[f"{key} auto"] = {k: v for k, v in data["auto_bucket_cap"].items() if k != "predicted_s"}
    gathered = pg.allgather_object(row)
    if pg.rank == 0:  # a step is as slow as its slowest rank
        worst = {k: (max(g[k] for g in gathered) if isinstance(v, float) else v) for k, v in row.items()}
        # (the auto choice is the same on every rank: rank 0's travels with its bucket layout)
        Path(out).write_text(json.dumps(worst))


def progress_probe(out: str, rounds: int, mib: float = 8.0) -> None:
    """Does an allreduce move while Python computes? (``--progress``; runs on every rank.)

    An allreduce of ``mib`` MiB is started, then the rank computes matrix products for as long as the allreduce
    takes alone, then waits. Three ways of computing: no MPI call until the wait; the request tested after every
    product (as the reducer's gradient hooks do); a thread testing it every 100 us. Each result is the time over
    max(allreduce alone, compute alone): 1 is perfect overlap, 2 none.
    """
    import threading

    import numpy as np

    from distlab import comm

    pg = comm.world()
    buffer = np.ones(int(mib * 2**20) // 4, dtype=np.float32)
    a, w = np.full((32, WIDTH), 0.5, dtype=np.float32), np.full((WIDTH, WIDTH), 0.5, dtype=np.float32)

    def compute(seconds, work=None):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            a @ w
            if work is not None:
                work.is_completed()

    def timed(fn):
        pg.barrier()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def overlapped(how, seconds):
        work = pg.allreduce(buffer, async_op=True, name="progress probe")
        if how == "thread":
            stop = threading.Event()

            def poll():
                while not stop.is_set() and not work.is_completed():
                    time.sleep(1e-4)

            poller = threading.Thread(target=poll)
            poller.start()
            compute(seconds)
            stop.set()
            poller.join()
        else:
            compute(seconds, work if how == "test" else None)
        work.wait()

    samples = {k: [] for k in ("alone", "compute", "wait", "test", "thread")}
    for _ in range(rounds):
        alone = timed(lambda: pg.allreduce(buffer, name="progress probe"))
        samples["alone"].append(alone)
        samples["compute"].append(timed(lambda: compute(alone)))
        for how in ("wait", "test", "thread"):
            samples[how].append(timed(lambda: overlapped(how, alone)))
    mine = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    gathered = pg.allgather_object(mine)
    if pg.rank == 0:
        Path(out).write_text(json.dumps({k: max(g[k] for g in gathered) for k in mine}))


PIECE_SETTINGS = ("off", "auto", "0.25", "0.5", "1", "2", "4")


def pieces_probe(out: str, rounds: int) -> None:
    """A 26 MB allreduce whole, in the pieces distlab chooses, and in fixed pieces (``--pieces``; every rank).

    One group per ``DISTLAB_ALLREDUCE_PIECES`` setting (read at each group's first large allreduce, where
    ``auto`` probes the link), and ``wire``: the same bytes as 1 MiB allreduces started at once from Python, then
    waited for (the figure the automatic pieces are judged by).
    """
    import numpy as np

    from distlab import comm
    from distlab.comm.pieces import PIECES_VAR

    pg = comm.world()
    buffer = np.ones(LAYERS * (WIDTH * WIDTH + WIDTH), dtype=np.float32)
    groups = {}
    for setting in PIECE_SETTINGS:
        os.environ[PIECES_VAR] = setting
        groups[setting] = comm.ProcessGroup(name=f"pieces {setting}")
        groups[setting].allreduce(buffer)  # reads the setting (auto: probes the link)
    whole = groups["off"]
    pieces = [buffer[i:i + 2**18] for i in range(0, buffer.size, 2**18)]  # 1 MiB of float32 each

    def wire():
        for work in [whole.allreduce(piece, async_op=True, name="wire") for piece in pieces]:
            work.wait()

    steps = {setting: (lambda g=group: g.allreduce(buffer)) for setting, group in groups.items()}
    steps["wire"] = wire
    samples = {key: [] for key in steps}
    for _ in range(rounds + 1):
        for key, step in steps.items():
            pg.barrier()
            start = time.perf_counter()
            step()
            samples[key].append(time.perf_counter() - start)
    mine = {key: statistics.median(v[1:]) * 1e3 for key, v in samples.items()}
    gathered = pg.allgather_object(mine)
    if pg.rank == 0:
        row = {key: max(g[key] for g in gathered) for key in mine}
        row["auto piece KiB"] = groups["auto"]._pieces.bytes_for(groups["auto"], buffer.nbytes) / 1024
        row["auto link"] = groups["auto"]._link if isinstance(groups["auto"]._link, tuple) else None
        row["megabytes"] = buffer.nbytes / 1e6
        Path(out).write_text(json.dumps(row))


def pieces_table(rows) -> str:
    head = (f"{'link':>8} {'whole':>8} {'auto':>8} {'piece':>8} {'wire':>8} {'auto/wire':>9} {'whole/wire':>10}  "
            + " ".join(f"{s + ' MiB':>9}" for s in PIECE_SETTINGS[2:]))
    lines = [head, "-" * len(head)]
    for r in rows:
        piece = f"{r['auto piece KiB']:.0f}K" if r["auto piece KiB"] else "whole"
        lines.append(f"{r['rate']:>8} {r['off']:>6.1f}ms {r['auto']:>6.1f}ms {piece:>8} {r['wire']:>6.1f}ms "
                     f"{r['auto'] / r['wire']:>9.3f} {r['off'] / r['wire']:>10.3f}  "
                     + " ".join(f"{r[s]:>7.1f}ms" for s in PIECE_SETTINGS[2:]))
    return "\n".join(lines)


def progress_table(rows) -> str:
    lines = [f"{'link':>8} {'allreduce':>9} {'compute':>8} {'no MPI call':>11} {'test per product':>16} "
             f"{'thread':>7}"]
    for r in rows:
        floor = max(r["alone"], r["compute"])
        lines.append(f"{r['rate']:>8} {r['alone']:>7.1f}ms {r['compute']:>6.1f}ms {r['wait'] / floor:>10.2f}x "
                     f"{r['test'] / floor:>15.2f}x {r['thread'] / floor:>6.2f}x")
    return "\n".join(lines)


def table(rows) -> str:
    """One line per (rate, twin, gradient_as_bucket_view, cap).

    ``floor`` is max(local step, allreduce alone); ``over/ar`` is DDP's step minus the local step over the
    allreduce alone (what DDP adds to the step, against what the allreduce alone costs); ``bound`` is forward +
    wire + update where the wire is longer than backward (a link), else blank.
    """
    head = (f"{'link':>8} {'twin':>9} {'view':>4} {'cap':>5} {'buckets':>7} {'DDP step':>9} {'floor':>7} "
            f"{'step/floor':>10} {'over/ar':>7} {'bound':>7} {'step/bound':>10}   {'local step':>10} "
            f"{'backward':>8} {'allreduce':>9} {'wire':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        floor = max(r["local ms"], r["allreduce ms"])
        bound = r["forward ms"] + r["wire ms"] + r["update ms"] if r["wire ms"] > r["backward ms"] else None
        for key in [k[:-3] for k in r if k.startswith("ddp") and k.endswith(" ms") and "user" not in k
                    and "sys" not in k]:
            _, impl, cap, view, *fused = key.split()
            cap_text = cap.split("=")[1]
            if cap_text == "auto":
                cap_text = f"{'f' if fused else 'a'}{r[key + ' cap MB']:.1f}"
            step = r[key + " ms"]
            lines.append(f"{r['rate']:>8} {impl:>9} {view.split('=')[1]:>4} {cap_text:>5} "
                         f"{r[key + ' buckets']:>7} {step:>7.1f}ms {floor:>5.1f}ms {step / floor:>10.2f} "
                         f"{(step - r['local ms']) / r['allreduce ms']:>7.2f} "
                         + (f"{bound:>5.1f}ms {step / bound:>10.2f}" if bound else f"{'':>7} {'':>10}")
                         + f"   {r['local ms']:>8.1f}ms {r['backward ms']:>6.1f}ms {r['allreduce ms']:>7.1f}ms"
                         f" {r['wire ms']:>5.1f}ms")
    return "\n".join(lines)


def cpu_table(rows) -> str:
    """With ``--cpu``: each step's CPU time (user, system) beside its wall time, each the largest over the ranks.

    The library busy-polls while it waits, so CPU during a wait is no measure of work; the allreduce alone's
    system time is the kernel's TCP work, which shares the rank's core with everything else.
    """
    head = f"{'link':>8} {'step':<34} {'wall':>8} {'user':>8} {'system':>8} {'cpu/wall':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        for key in [k[:-8] for k in r if k.endswith(" user ms")]:
            wall, user, system = r[f"{key} ms"], r[f"{key} user ms"], r[f"{key} sys ms"]
            lines.append(f"{r['rate']:>8} {key:<34} {wall:>6.1f}ms {user:>6.1f}ms {system:>6.1f}ms "
                         f"{(user + system) / wall:>8.2f}")
    return "\n".join(lines)


HOROVOD_SETTINGS = ((128 * 2**20, 1.0), (8 * 2**20, 1.0), (1 * 2**20, 1.0), (128 * 2**20, 5.0), (8 * 2**20, 5.0))


def horovod_worker(out: str, rounds: int) -> None:
    """Runs on every rank: the Horovod-style step against the local step and one negotiated allreduce alone.

    ``sync`` is the time from the end of backward to the end of ``synchronize()``: the communication the step
    still waits for. Less than the allreduce alone means the background thread moved the gradients while
    backward computed, without the training loop calling into MPI.
    """
    import numpy as np

    from distlab import collectives as hvd
    from distlab import nn, optim

    hvd.init()
    x, y = batch(hvd.rank())
    loss_fn = nn.MSELoss()
    local_model, model = mlp(), mlp()
    local_opt = optim.SGD(local_model.parameters(), lr=1e-4)
    opt = hvd.DistributedOptimizer(optim.SGD(model.parameters(), lr=1e-4), named_parameters=model.named_parameters())
    buffer = np.ones(sum(p.data.size for p in model.parameters()), dtype=np.float32)
    times = {"local": [], "allreduce": [], "step": [], "backward": [], "sync": []}

    def local_step():
        local_opt.zero_grad()
        loss_fn(local_model(x), y).backward()
        local_opt.step()

    def horovod_step():
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        start = time.perf_counter()
        loss.backward()  # each gradient's hook submits its allreduce_async
        ended = time.perf_counter()
        opt.synchronize()
        synced = time.perf_counter()
        with opt.skip_synchronize():
            opt.step()
        times["backward"].append(ended - start)
        times["sync"].append(synced - ended)

    for round_ in range(rounds + 3):  # 3 warm-up rounds (the response cache fills in the first)
        for key, step in (("local", local_step), ("allreduce", lambda: hvd.allreduce(buffer, name="alone")),
                          ("step", horovod_step)):
            hvd.barrier()
            start = time.perf_counter()
            step()
            times[key].append(time.perf_counter() - start)
    row = {key: statistics.median(values[-rounds:]) * 1e3 for key, values in times.items()}
    gathered = hvd.allgather_object(row)
    if hvd.rank() == 0:  # a step is as slow as its slowest rank
        Path(out).write_text(json.dumps({key: max(g[key] for g in gathered) for key in row}))
    hvd.shutdown()


def horovod_table(rows) -> str:
    head = (f"{'link':>8} {'fusion':>8} {'cycle':>6} {'step':>8} {'floor':>8} {'step/floor':>10} "
            f"{'backward':>8} {'sync after':>10} {'allreduce':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        floor = max(r["local"], r["allreduce"])
        lines.append(f"{r['rate']:>8} {r['fusion MiB']:>5.0f}MiB {r['cycle ms']:>4.0f}ms {r['step']:>6.1f}ms "
                     f"{floor:>6.1f}ms {r['step'] / floor:>10.2f} {r['backward']:>6.1f}ms {r['sync']:>8.1f}ms "
                     f"{r['allreduce']:>7.1f}ms")
    return "\n".join(lines)


def _run_rate(rate: str, options, part: Path, timeline: str | None = None, setting=None):
    """One job at ``rate``: the measurements into ``part``, or with ``timeline`` a few traced steps; with
    ``setting`` (fusion threshold, cycle time) the Horovod-style front's."""
    from distlab.launch import launch_script

    args = ["--worker", str(part), "--rounds", str(options.rounds), "--caps", *map(str, options.caps),
            "--twins", *options.twins, "--views", *map(str, options.views)]
    if options.progress:
        args.append("--progress")
    if options.horovod:
        args.append("--horovod")
    if options.pieces:
        args.append("--pieces")
    if options.cpu:
        args.append("--cpu")
    if options.fused:
        args.append("--fused")
    if timeline:
        args += ["--trace-steps", "6"]
    env = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if setting is not None:
        env.update(DISTLAB_FUSION_THRESHOLD=str(setting[0]), DISTLAB_CYCLE_TIME=str(setting[1]))
    if rate == "local":
        return launch_script(__file__, np=2, args=args, timeout=3600, env=env, timeline=timeline)
    import importlib.util

    if importlib.util.find_spec("distlab.cluster") is None:
        sys.exit(f"bench_overlap: the rate {rate} needs the virtual cluster (distlab.cluster), which this "
                 "installation lacks; run with --rates local")
    from distlab import cluster  # the virtual cluster (root)

    cluster.up(2, rate, options.cluster)
    return launch_script(__file__, np=2, args=args, timeout=3600, env=env, timeline=timeline,
                         cluster=options.cluster)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", nargs="+", default=list(RATES), help="local and/or tc rates (default: all)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="3 rounds, core twin, caps auto and 25: a smoke run")
    parser.add_argument("--caps", nargs="+", default=list(CAPS), type=lambda c: c if c == "auto" else float(c))
    parser.add_argument("--twins", nargs="+", default=["core", "reference"])
    parser.add_argument("--views", nargs="+", default=[0, 1], type=int, help="gradient_as_bucket_view values")
    parser.add_argument("--cpu", action="store_true", help="CPU time per step (user, system)")
    parser.add_argument("--fused", action="store_true",
                        help="also DDP with auto caps and the optimizer fused into its hook (_register_fused_optim)")
    parser.add_argument("--timeline", metavar="RATE", help="also record a trace of one auto-capped step here")
    parser.add_argument("--progress", action="store_true",
                        help="instead: does an 8 MiB allreduce move while Python computes (progress_probe)")
    parser.add_argument("--horovod", action="store_true",
                        help="instead: the Horovod-style DistributedOptimizer per fusion threshold and cycle time")
    parser.add_argument("--pieces", action="store_true",
                        help="instead: a 26 MB allreduce whole, in automatic pieces and in fixed ones (pieces_probe)")
    parser.add_argument("--cluster", default=CLUSTER, help="the virtual cluster's name (made and removed here)")
    parser.add_argument("--keep", action="store_true", help="leave the virtual cluster up")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--trace-steps", type=int, default=0, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.quick:
        options.rounds, options.twins, options.caps = 3, ["core"], ["auto", 25]
    if options.worker:
        if options.progress:
            progress_probe(options.worker, options.rounds)
        elif options.pieces:
            pieces_probe(options.worker, options.rounds)
        elif options.horovod:
            horovod_worker(options.worker, options.rounds)
        else:
            worker(options.worker, options.rounds, options.caps, options.twins, [bool(v) for v in options.views],
                   options.cpu, options.trace_steps, options.fused)
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    part = RESULTS / "bench_overlap.part.json"
    rows = []
    try:
        for rate in options.rates:
            if options.horovod:
                for setting in HOROVOD_SETTINGS:
                    if _run_rate(rate, options, part, setting=setting).returncode != 0:
                        sys.exit(f"bench_overlap --horovod at {rate}, {setting} failed")
                    rows.append({"rate": rate, "fusion MiB": setting[0] / 2**20, "cycle ms": setting[1],
                                 **json.loads(part.read_text())})
                    part.unlink()
                    print(horovod_table(rows[-1:]), flush=True)
                continue
            job = _run_rate(rate, options, part)
            if job.returncode != 0:
                sys.exit(f"bench_overlap at {rate} failed (exit {job.returncode})")
            row = json.loads(part.read_text())
            part.unlink()
            rows.append({"rate": rate, **row})
            print((progress_table if options.progress else pieces_table if options.pieces else table)(rows[-1:]),
                  flush=True)
            if options.timeline == rate:
                trace = RESULTS / "overlap_timeline.json"
                if _run_rate(rate, options, part, str(trace)).returncode != 0:
                    sys.exit(f"bench_overlap: the traced job at {rate} failed")
                print(f"trace of 6 auto-capped core steps at {rate}: {trace}", flush=True)
    finally:
        if not options.keep and any(rate != "local" for rate in options.rates):
            import importlib.util

            if importlib.util.find_spec("distlab.cluster") is not None:
                from distlab import cluster

                cluster.down(options.cluster)
    report = {"benchmark": "bench_overlap", "command": " ".join(["python -P"] + sys.argv), "rounds": options.rounds,
              "host_cores": os.cpu_count(), "rows": rows}
    name = ("bench_overlap_progress.json" if options.progress else "bench_overlap_pieces.json" if options.pieces
            else "bench_overlap_horovod.json" if options.horovod else "bench_overlap.json")
    (RESULTS / name).write_text(json.dumps(report, indent=1))
    print()
    print((progress_table if options.progress else pieces_table if options.pieces else
           horovod_table if options.horovod else table)(rows))
    if options.cpu and not (options.progress or options.horovod or options.pieces):
        print()
        print(cpu_table(rows))
    print(f"\nwritten to {RESULTS / name}")


if __name__ == "__main__":
    main()
