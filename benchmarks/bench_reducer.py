"""DDP's per-step overhead, reference twin vs core twin, side by side in one run on 2 ranks.

Run: ``python -P benchmarks/bench_reducer.py`` (``--quick`` for a smoke run). It launches itself on 2 ranks
and, for the two models of bench_autograd (big: 100 x Linear(256, 256), 26 MB in 200 tensors; small:
500 x Linear(16, 16), 1000 tensors), times one training step (zero_grad, forward, MSE loss, backward, SGD) at
batch 32, round-robin over:

- ``local``: the plain model, no DDP (the floor);
- ``ddp reference`` / ``ddp core``: DistributedDataParallel, default arguments, with each reducer twin;
- ``bookkeeping reference`` / ``bookkeeping core``: the same with a no-op communication hook, so only the
  reducer's own work is left (hooks, ready marking, copies into buckets and back).

DDP overhead = DDP step - local step (median of the per-round differences). Bookkeeping per parameter is
measured directly: inside one backward pass, every parameter's ``autograd_hook`` is called (gradients already
in ``.grad``, communication stubbed by the no-op hook's completed future) and ``finalize_backward`` runs; the
time of an empty backward pass is subtracted. Prints a table, writes ``benchmarks/results/bench_reducer.json``.
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
MODELS = {"big": (100, 256), "small": (500, 16)}
BATCH = 32


def worker(out: str, rounds: int) -> None:
    import numpy as np
    from tqdm import tqdm

    import distlab
    from distlab import comm, nn, optim
    from distlab.ddp import DistributedDataParallel
    from distlab.ddp_comm_hooks import noop_hook

    pg = comm.world()

    def mlp(layers, width):
        distlab.manual_seed(0)
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    class Step:
        def __init__(self, model, width):
            self.model = model
            self.opt = optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
            rng = np.random.default_rng(pg.rank)
            self.x = distlab.tensor(rng.standard_normal((BATCH, width), dtype=np.float32))
            self.y = distlab.tensor(rng.standard_normal((BATCH, width), dtype=np.float32))
            self.loss_fn = nn.MSELoss()

        def __call__(self):
            self.opt.zero_grad()
            self.loss_fn(self.model(self.x), self.y).backward()
            self.opt.step()

    rows = []
    for name, (layers, width) in MODELS.items():
        steps = {"local": Step(mlp(layers, width), width)}
        for impl in ("reference", "core"):
            steps[f"ddp {impl}"] = Step(DistributedDataParallel(mlp(layers, width), impl=impl), width)
            quiet = DistributedDataParallel(mlp(layers, width), impl=impl)
            quiet.register_comm_hook(None, noop_hook)
            steps[f"bookkeeping {impl}"] = Step(quiet, width)
        for step in steps.values():  # warm-up, and the buckets' rebuild after the first iteration
            for _ in range(3):
                step()
        samples = {k: [] for k in steps}
        for _ in tqdm(range(rounds), desc=f"bench_reducer {name}", disable=pg.rank != 0, unit="round"):
            for key, step in steps.items():
                pg.barrier()
                start = time.perf_counter()
                step()
                samples[key].append(time.perf_counter() - start)
        nparams = len(list(steps["local"].model.parameters()))
        nbytes = sum(p.data.nbytes for p in steps["local"].model.parameters())
        row = {"model": name, "params": nparams, "megabytes": nbytes / 1e6}
        local = samples["local"]
        for key in steps:
            row[f"{key} ms"] = statistics.median(samples[key]) * 1e3
            if key != "local":
                diffs = [a - b for a, b in zip(samples[key], local)]
                row[f"{key} overhead ms"] = statistics.median(diffs) * 1e3
        for impl in ("reference", "core"):
            # where DDP's overhead goes: the reducer's own work (the step with a no-op comm hook, minus local) and
            # communication with waiting for the other ranks (the step minus the no-op-hook step)
            diffs = [a - b for a, b in zip(samples[f"ddp {impl}"], samples[f"bookkeeping {impl}"])]
            row[f"comm and wait {impl} ms"] = statistics.median(diffs) * 1e3
        for impl in ("reference", "core"):
            row[f"bookkeeping {impl} us/param"] = bookkeeping_per_param(impl, layers, width, rounds)
        row["buckets"] = len(steps["ddp core"].model.reducer.get_grad_buckets())
        gathered = pg.allgather_object(row)
        if pg.rank == 0:  # a step is as slow as its slowest rank
            worst = dict(row)
            for key, value in row.items():
                if isinstance(value, float):
                    worst[key] = max(g[key] for g in gathered)
            rows.append(worst)
    if pg.rank == 0:
        Path(out).write_text(json.dumps(rows))


def bookkeeping_per_param(impl: str, layers: int, width: int, rounds: int) -> float:
    """Microseconds per parameter of the reducer's hooks plus finalize, communication stubbed (see above)."""
    import numpy as np

    import distlab
    from distlab import _backend, comm
    from distlab.autograd import Node, run_backward
    from distlab.ddp_comm_hooks import noop_hook

    class Driver(Node):
        """A backward node that runs ``fn``: the hooks fire inside a real backward pass, as in training."""

        def __init__(self, fn):
            super().__init__(())
            self.fn = fn

        def apply(self, grad):
            self.fn()
            return ()

    shapes = [s for _ in range(layers) for s in ((width, width), (width,))]
    params = [distlab.nn.Parameter(np.ones(shape, dtype=np.float32)) for shape in shapes]
    for p in params:
        p.grad = distlab.tensor(np.ones_like(p.data))
    reducer = _backend.load("reducer", impl).Reducer(params, [list(range(len(params)))[::-1]], comm.world())
    reducer.register_comm_hook(None, noop_hook)
    hook, order = reducer.autograd_hook, range(len(params) - 1, -1, -1)

    def hooks():
        for i in order:
            hook(i)

    full, empty = [], []
    for _ in range(max(rounds, 20) + 12):  # the first 10 iterations sample runtime stats: skip them
        reducer.prepare_for_forward()
        reducer.prepare_for_backward([])
        start = time.perf_counter()
        run_backward([Driver(hooks)], [np.ones(1)])
        full.append(time.perf_counter() - start)
        start = time.perf_counter()
        run_backward([Driver(lambda: None)], [np.ones(1)])
        empty.append(time.perf_counter() - start)
    return (statistics.median(full[12:]) - statistics.median(empty[12:])) * 1e6 / len(params)


def table(rows) -> str:
    lines = []
    head = f"{'model':6} {'params':>6} {'MB':>6} {'local ms':>9} {'DDP ref ms':>11} {'DDP core ms':>12} " \
           f"{'overhead ref':>13} {'overhead core':>14} {'bookkeeping ref':>16} {'bookkeeping core':>17} {'ratio':>6}"
    lines += [head, "-" * len(head)]
    for r in rows:
        ratio = r["bookkeeping reference us/param"] / max(r["bookkeeping core us/param"], 1e-9)
        lines.append(
            f"{r['model']:6} {r['params']:>6} {r['megabytes']:>6.1f} {r['local ms']:>9.2f} "
            f"{r['ddp reference ms']:>11.2f} {r['ddp core ms']:>12.2f} {r['ddp reference overhead ms']:>10.2f} ms "
            f"{r['ddp core overhead ms']:>11.2f} ms {r['bookkeeping reference us/param']:>10.2f} us/p "
            f"{r['bookkeeping core us/param']:>11.2f} us/p {ratio:>6.1f}")
    lines.append("")
    lines.append("where the overhead goes (ms per step, medians of per-round differences): the reducer's own work "
                 "(DDP with a no-op comm hook - local), communication and waiting for the other rank (DDP - no-op hook)")
    head = f"{'model':6} {'own work ref':>13} {'own work core':>14} {'comm+wait ref':>14} {'comm+wait core':>15}"
    lines += [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['model']:6} {r['bookkeeping reference overhead ms']:>13.2f} "
                     f"{r['bookkeeping core overhead ms']:>14.2f} {r['comm and wait reference ms']:>14.2f} "
                     f"{r['comm and wait core ms']:>15.2f}")
    return "\n".join(lines)


def callgrind_steps(impl: str, steps: int) -> None:
    """``steps`` training steps of the small model on one rank after 12 warm-up steps (runtime stats are sampled
    on the first 10), for callgrind: run it twice (say 2 and 5 steps) and divide the difference by the extra steps;
    ``impl`` ``local`` is the plain model. Toggle on ``*Reducer_autograd_hook*`` and ``*finalize_backward*`` for
    the reducer's own instructions."""
    import numpy as np

    from distlab import nn, optim
    from distlab.ddp import DistributedDataParallel

    layers, width = MODELS["small"]
    distlab.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    if impl != "local":
        model = DistributedDataParallel(model, impl=impl)
    opt = optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    rng = np.random.default_rng(0)
    x = distlab.tensor(rng.standard_normal((BATCH, width), dtype=np.float32))
    y = distlab.tensor(rng.standard_normal((BATCH, width), dtype=np.float32))
    loss_fn = nn.MSELoss()
    for _ in range(12 + steps):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="5 rounds: a smoke run")
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--callgrind", nargs=2, metavar=("IMPL", "STEPS"),
                        help="only STEPS one-rank steps of the small model (IMPL: local, reference, core), for callgrind")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    options = parser.parse_args()
    rounds = 5 if options.quick else options.rounds
    if options.callgrind:
        callgrind_steps(options.callgrind[0], int(options.callgrind[1]))
        return
    if options.worker:
        worker(options.worker, rounds)
        return
    from distlab.launch import launch_script

    RESULTS.mkdir(parents=True, exist_ok=True)
    part = RESULTS / "bench_reducer.part.json"
    job = launch_script(__file__, np=options.np, args=["--worker", str(part), "--rounds", str(rounds)],
                        timeout=3600)
    if job.returncode != 0:
        sys.exit(f"bench_reducer failed (exit {job.returncode})")
    rows = json.loads(part.read_text())
    part.unlink()
    report = {"benchmark": "bench_reducer", "command": " ".join(["python -P"] + sys.argv), "ranks": options.np,
              "rounds": rounds, "host_cores": os.cpu_count(), "rows": rows}
    (RESULTS / "bench_reducer.json").write_text(json.dumps(report, indent=1))
    print(table(rows))
    print(f"\nwritten to {RESULTS / 'bench_reducer.json'}")


if __name__ == "__main__":
    main()
