"""PowerSGD across a slow link: distlab's ``powerSGD_hook`` beside torch's, and its convergence on a real task.

Run (the link rates need root and the virtual cluster, ``python -m distlab cluster``)::

    sudo .venv/bin/python -P benchmarks/bench_powersgd.py                       # 1gbit, 2.5gbit, 10gbit
    sudo .venv/bin/python -P benchmarks/bench_powersgd.py --rates 1gbit --rounds 5
    python -P benchmarks/bench_powersgd.py --convergence                         # one host, no root needed

Step times: bench_overlap's model (100 x Linear(256, 256), 26 MB of fp32 gradients in 200 tensors, batch 32,
MSE, SGD), 2 hosts with one rank each, BLAS and torch on one thread. Per link rate, round-robin over
``--rounds`` rounds after 4 warm-up steps (PowerSGD starts at iteration 2): the local step; DDP without a hook;
DDP with ``powerSGD_hook`` at rank 1 and 4 (``start_powerSGD_iter=2``, other arguments default) for each twin
of the reducer; and, when torch is importable, torch's DDP over gloo on the same link, without a hook and with
torch's own ``powerSGD_hook`` (the anchor: its rows are measured in the same job, on the same link). For
distlab's PowerSGD rows the step is split: *wait* is the time spent in waits on PowerSGD's allreduces (the
wire not hidden), *orth* the orthogonalisation, *hook* the rest of the hook's work (matrix products, error
feedback, packing), *other* the remainder of the step (forward, backward, update, the reducer).

``--convergence`` runs ``examples/train_ddp.py`` on 2 local ranks with plain DDP and with PowerSGD at rank 1,
2 and 4 (``--powersgd R``) for 3, 10 and 30 epochs (``--epochs``), and reports each one's loss over its last
epoch and its accuracy.

Prints the tables and writes ``benchmarks/results/bench_powersgd.json`` (``bench_powersgd_convergence.json``).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import distlab

distlab.keep_freed_memory()  # glibc keeps freed memory between steps, as docs/ measured (docs/autograd.md)

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
RATES = ("1gbit", "2.5gbit", "10gbit")
RANKS = (1, 4)
CLUSTER = "powersgd"
PORT = 29461


def _overlap():
    """bench_overlap's model and batches (the same benchmark model)."""
    spec = importlib.util.spec_from_file_location("bench_overlap", HERE / "bench_overlap.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Clock:
    """Seconds spent in PowerSGD's waits and orthogonalisation, and in its hook altogether, this step."""

    def __init__(self):
        self.wait = self.orth = self.hook = 0.0

    def install(self):
        """Wrap powerSGD_hook's stages (the same functions every state uses) to time them."""
        from distlab.ddp_comm_hooks import powersgd as module

        clock = self
        flight = module._Flight
        for name in ("send_q", "finish"):  # the hook call itself is timed by timed()
            original = getattr(flight, name)

            def timed(self_, *args, _original=original, **kwargs):
                start = time.perf_counter()
                try:
                    return _original(self_, *args, **kwargs)
                finally:
                    clock.hook += time.perf_counter() - start
            setattr(flight, name, timed)
        orthogonalize = module._orthogonalize

        def timed_orth(*args, **kwargs):
            start = time.perf_counter()
            try:
                return orthogonalize(*args, **kwargs)
            finally:
                clock.orth += time.perf_counter() - start
        module._orthogonalize = timed_orth
        return self

    def timed(self, hook):
        """``hook``, its calls timed into this clock's ``hook`` (the Q stage and the finish are timed by install)."""
        clock = self

        def timed_hook(state, bucket):
            start = time.perf_counter()
            try:
                return hook(state, bucket)
            finally:
                clock.hook += time.perf_counter() - start
        return timed_hook

    def group(self, group):
        """``group`` whose async allreduces time their waits."""
        clock = self

        class TimedWork:
            def __init__(self, work):
                self.work = work

            def wait(self, timeout=None):
                start = time.perf_counter()
                try:
                    return self.work.wait(timeout)
                finally:
                    clock.wait += time.perf_counter() - start

            def __getattr__(self, name):
                return getattr(self.work, name)

        class TimedGroup:
            def __getattr__(self, name):
                return getattr(group, name)

            def allreduce(self, array, op="sum", async_op=False, name=None):
                work = group.allreduce(array, op=op, async_op=async_op, name=name)
                return TimedWork(work) if async_op and "powerSGD" in (name or "") else work

        return TimedGroup()


def ordered(hook):
    """torch's hook, each bucket's future chain finished before the next bucket's hook starts.

    torch's powerSGD_hook issues its P and Q allreduces from ``Future.then`` callbacks, which gloo runs on its
    worker threads when the previous allreduce completes: with two buckets or more, a callback's allreduce and
    the next bucket's, issued from backward, can be issued in a different order on each rank, and gloo then
    aborts ("Received data size doesn't match expected size"), as it did here at 1 Gbit/s. Waiting for the
    previous bucket's chain at the next bucket's launch fixes the order; DDP's first bucket is small (1 MiB), so
    the wait is short.
    """
    previous = [None]

    def ordered_hook(state, bucket):
        if previous[0] is not None:
            previous[0].wait()
        future = hook(state, bucket)
        previous[0] = None if bucket.is_last() else future
        return future

    return ordered_hook


def torch_steps(pg, master: str, nic: str | None, x, y):
    """torch's DDP over gloo on the same ranks and link: no hook, and powerSGD_hook at each rank of RANKS."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    torch.set_num_threads(1)
    if nic:
        os.environ["GLOO_SOCKET_IFNAME"] = nic
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{PORT}", rank=pg.rank, world_size=pg.size)
    ov = _overlap()
    tx, ty = torch.from_numpy(x.data.copy()), torch.from_numpy(y.data.copy())

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(ov.WIDTH, ov.WIDTH) for _ in range(ov.LAYERS)])

    def step_of(module):
        opt = torch.optim.SGD(module.parameters(), lr=1e-4)
        loss_fn = torch.nn.MSELoss()

        def step():
            opt.zero_grad()
            loss_fn(module(tx), ty).backward()
            opt.step()
        return step

    steps = {"torch local": step_of(model()),
             "torch ddp": step_of(torch.nn.parallel.DistributedDataParallel(model()))}
    for r in RANKS:
        ddp = torch.nn.parallel.DistributedDataParallel(model())
        ddp.register_comm_hook(ps.PowerSGDState(None, matrix_approximation_rank=r, start_powerSGD_iter=2),
                               ordered(ps.powerSGD_hook))
        steps[f"torch powerSGD r{r}"] = step_of(ddp)
    return steps


def worker(out: str, rounds: int, twins, cluster_name: str | None, variants: bool = False) -> None:
    """Runs on every rank: builds every model, times them round-robin, writes the worst rank's medians."""
    from distlab import comm, nn, optim
    from distlab.ddp import DistributedDataParallel
    from distlab.ddp_comm_hooks import PowerSGDState, powerSGD_hook

    ov = _overlap()
    pg = comm.world()
    x, y = ov.batch(pg.rank)
    clocks = {}

    def step_of(model, clock=None):
        opt = optim.SGD(model.parameters(), lr=1e-4)
        loss_fn = nn.MSELoss()

        def step():
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        step.clock = clock
        return step

    steps = {"local": step_of(ov.mlp())}
    clock_all = Clock().install()
    for impl in twins:
        steps[f"ddp {impl}"] = step_of(DistributedDataParallel(ov.mlp(), impl=impl))
        for r in RANKS:
            for when in ("end", "launch"):  # when Q is sent: after backward (default), or at the next launch
                if when == "launch" and not variants:
                    continue
                key = f"powerSGD r{r} {impl}" + ("" if when == "end" else " q-at-launch")
                model = DistributedDataParallel(ov.mlp(), impl=impl)
                clock = Clock()
                clocks[key] = clock
                state = PowerSGDState(clock.group(pg), matrix_approximation_rank=r, start_powerSGD_iter=2)
                state._q_at_launch = when == "launch"
                model.register_comm_hook(state, clock_all.timed(powerSGD_hook))
                steps[key] = step_of(model, clock)
    if importlib.util.find_spec("torch") is not None:
        master, nic = "127.0.0.1", None
        if cluster_name:
            from distlab.cluster import layout

            lay = layout(cluster_name, 2)
            master = lay.addresses[lay.hosts[0]]
            nic = lay.nic(lay.hosts[pg.rank])
        steps.update(torch_steps(pg, master, nic, x, y))
    for step in steps.values():
        for _ in range(4):
            step()
    samples = {key: [] for key in steps}
    parts = {key: [] for key in clocks}
    for _ in range(rounds):
        for key, step in steps.items():
            pg.barrier()
            clock = step.clock if hasattr(step, "clock") else None
            if clock is not None:
                clock_all.orth = clock_all.hook = clock.wait = 0.0
            start = time.perf_counter()
            step()
            samples[key].append(time.perf_counter() - start)
            if clock is not None:
                parts[key].append((clock.wait, clock_all.orth, clock_all.hook))
    row = {f"{key} ms": statistics.median(v) * 1e3 for key, v in samples.items()}
    for key, values in parts.items():
        for i, what in enumerate(("wait", "orth", "hook")):
            row[f"{key} {what} ms"] = statistics.median(v[i] for v in values) * 1e3
    gathered = pg.allgather_object(row)
    if pg.rank == 0:
        Path(out).write_text(json.dumps({k: max(g[k] for g in gathered) for k in row}))


def table(rows) -> str:
    head = (f"{'link':>8} {'step':<26} {'ms':>7} {'/torch psgd':>11} {'/local':>7}   {'wait':>6} {'orth':>6} "
            f"{'hook':>6} {'other':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        local = r["local ms"]
        for key in [k[:-3] for k in r if k.endswith(" ms") and not k.endswith(("wait ms", "orth ms", "hook ms"))]:
            step = r[f"{key} ms"]
            anchor = None
            for rank in RANKS:
                if f"r{rank}" in key.split():
                    anchor = r.get(f"torch powerSGD r{rank} ms")
            ratio = f"{step / anchor:>11.2f}" if anchor and not key.startswith("torch") else f"{'':>11}"
            line = f"{r['rate']:>8} {key:<26} {step:>7.1f} {ratio} {step / local:>7.2f}"
            if f"{key} wait ms" in r:
                wait, orth, hook = (r[f"{key} {w} ms"] for w in ("wait", "orth", "hook"))
                line += f"   {wait:>6.1f} {orth:>6.1f} {hook - wait - orth:>6.1f} {step - hook:>6.1f}"
            lines.append(line)
    return "\n".join(lines)


def convergence(epoch_counts) -> list[dict]:
    """examples/train_ddp.py on 2 local ranks for each number of epochs: plain DDP, then PowerSGD at rank 1, 2
    and 4 (from step 10, the example's default)."""
    rows = []
    example = HERE.parent / "examples" / "train_ddp.py"
    for epochs, rank in [(e, r) for e in epoch_counts for r in (0, 1, 2, 4)]:
        args = [sys.executable, "-P", "-m", "distlab", "run", "-n", "2", str(example), "--epochs", str(epochs),
                "--target", "0"]
        if rank:
            args += ["--powersgd", str(rank)]
        start = time.perf_counter()
        done = subprocess.run(args, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            sys.exit(f"train_ddp.py {' '.join(args[5:])} failed:\n{done.stdout}\n{done.stderr}")
        line = next(x for x in done.stdout.splitlines() if "accuracy" in x and "loss" in x)
        words = line.split()
        rows.append({"hook": f"powerSGD r{rank}" if rank else "none", "epochs": epochs,
                     "last epoch loss": float(words[words.index("loss") + 1]),
                     "accuracy": float(words[words.index("accuracy") + 1]),
                     "seconds": time.perf_counter() - start})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", nargs="+", default=list(RATES))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--twins", nargs="+", default=["core", "reference"])
    parser.add_argument("--cluster", default=CLUSTER, help="the virtual cluster's name (made and removed here)")
    parser.add_argument("--convergence", action="store_true", help="instead: train_ddp.py with and without PowerSGD")
    parser.add_argument("--epochs", type=int, nargs="+", default=[3, 10, 30], help="with --convergence")
    parser.add_argument("--variants", action="store_true",
                        help="also PowerSGD sending each Q at the next bucket's launch (not after backward)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--on-cluster", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        worker(options.worker, options.rounds, options.twins, options.on_cluster, options.variants)
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    if options.convergence:
        rows = convergence(options.epochs)
        (RESULTS / "bench_powersgd_convergence.json").write_text(json.dumps(
            {"benchmark": "bench_powersgd --convergence", "command": " ".join(["python -P"] + sys.argv),
             "rows": rows}, indent=1))
        return
    from distlab import cluster
    from distlab.launch import launch_script

    part = RESULTS / "bench_powersgd.part.json"
    env = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    rows = []
    try:
        for rate in options.rates:
            cluster.up(2, rate, options.cluster)
            args = ["--worker", str(part), "--rounds", str(options.rounds), "--twins", *options.twins,
                    "--on-cluster", options.cluster] + (["--variants"] if options.variants else [])
            job = launch_script(__file__, np=2, args=args, timeout=3600, env=env, cluster=options.cluster)
            if job.returncode != 0:
                sys.exit(f"bench_powersgd at {rate} failed (exit {job.returncode})")
            rows.append({"rate": rate, **json.loads(part.read_text())})
            part.unlink()
            print(table(rows[-1:]), flush=True)
    finally:
        cluster.down(options.cluster)
    report = {"benchmark": "bench_powersgd", "command": " ".join(["python -P"] + sys.argv),
              "rounds": options.rounds, "host_cores": os.cpu_count(), "rows": rows}
    (RESULTS / "bench_powersgd.json").write_text(json.dumps(report, indent=1))
    print()
    print(table(rows))
    print(f"\nwritten to {RESULTS / 'bench_powersgd.json'}")


if __name__ == "__main__":
    main()
