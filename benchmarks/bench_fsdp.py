"""Fully sharded data parallel against DDP and ZeRO-1: memory per rank, bytes per step, step time.

Run: ``python -P benchmarks/bench_fsdp.py`` (one host, 2 and 4 ranks). As root, under the cluster lock,
``flock /tmp/distlab-cluster.lock .venv/bin/python -P benchmarks/bench_fsdp.py --cluster`` runs 4 ranks on 2
virtual hosts (2 per host) joined by a 1 Gbit/s link. ``--torch-python PATH`` names an interpreter with torch
(``pip install torch`` into a scratch environment) to time torch's own DDP and FSDP2 on the same model beside
distlab's, in the same run (or torch is imported here, where it is installed). ``--quick``: a smoke run.

The model is the issue's: 8 x Linear(512, 512) with ReLU (2.1 M float32 parameters, 8.4 MB), Adam, a batch of 64
rows per rank; every Linear is one FSDP group, the root (holding nothing) last. Side by side, in one launch per
world, round robin (so the machine's drift falls on every variant alike):

- DDP (distlab's reducer), ZeRO-1 (DDP + ``ZeroRedundancyOptimizer``), ZeRO-2 (``reshard_after_forward=False``)
  and ZeRO-3 (True) with each twin, and hybrid sharding (a 2-D mesh of hosts x ranks, from 4 ranks);
- per rank: the peak bytes tracemalloc sees during a step (a one-row batch, so activations are negligible:
  parameters, gradients, optimizer state and FSDP's buffers), beside ZeRO's formula for Adam in float32
  (16 bytes a parameter: DDP 16P, ZeRO-1 8P + 8P/N, ZeRO-2 4P + 12P/N, ZeRO-3 16P/N) and, for ZeRO-3, the bound
  16P/N + the largest unsharded group (its parameters and gradients: 8 bytes a parameter); the target is at most
  1.1x that bound;
- bytes sent per rank per step: from the recorded collectives, with the ring algorithm's cost (an all-gather or
  reduce-scatter sends (N-1)/N of the whole buffer, an allreduce twice that); on the cluster also the bytes each
  host sent on its link, measured;
- the step time (median): the targets are ZeRO-3 at most 1.3x DDP on one host, at most 1.6x DDP on the 1 Gbit/s
  link and hybrid at most 1.1x DDP there, and distlab's ZeRO-3 at most half of torch's on 2 ranks.

Prints a table, writes ``benchmarks/results/bench_fsdp.json``. Timings on a loaded machine are noisy: compare
within one table, and take figures to quote from a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
LAYERS, WIDTH, BATCH = 8, 512, 64
CLUSTER = "dlfsdp"
#: bytes a parameter for Adam in float32 (parameter, gradient, two moments)
PARAM, GRAD, STATE = 4, 4, 8


# ---------------------------------------------------------------------------------------------- distlab worker
def _variants(size: int, hosts: int) -> list:
    names = ["DDP", "ZeRO-1", "ZeRO-2 reference", "ZeRO-2 core", "ZeRO-3 reference", "ZeRO-3 core"]
    if size >= 4 and size % 2 == 0:
        names.append("hybrid core")
    return names


def _build(name, group, batch_rows):
    import numpy as np

    import distlab
    from distlab import nn, optim
    from distlab.ddp import DistributedDataParallel as DDP
    from distlab.fsdp import DeviceMesh, fully_shard
    from distlab.optim import ZeroRedundancyOptimizer

    distlab.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(LAYERS)])
    if name in ("DDP", "ZeRO-1"):
        model = DDP(net, process_group=group, bucket_cap_mb=25)
        opt = optim.Adam(model.parameters(), lr=1e-4) if name == "DDP" else \
            ZeroRedundancyOptimizer(model.parameters(), optim.Adam, process_group=group, lr=1e-4,
                                    parameters_as_bucket_view=True)
    else:
        impl = name.split()[-1]
        mesh = group
        if name.startswith("hybrid"):  # 2 replicas (the hosts, on the cluster) of size / 2 shards
            mesh = DeviceMesh((2, group.size // 2), ("replicate", "shard"), group=group)
        for block in net:
            fully_shard(block, group=mesh, reshard_after_forward=not name.startswith("ZeRO-2"), impl=impl)
        model = fully_shard(net, group=mesh, impl=impl)
        opt = optim.Adam(model.parameters(), lr=1e-4)
    rng = np.random.default_rng(group.rank)
    x = distlab.tensor(rng.standard_normal((batch_rows, WIDTH)).astype(np.float32))
    return model, opt, x


def _step(model, opt, x):
    opt.zero_grad()
    (model(x) ** 2).mean().backward()
    opt.step()


def _wire_bytes(trace, size: int, replicas: int = 1) -> int:
    """Bytes a rank sends for the recorded collectives, by the ring algorithm's cost; with ``replicas`` (hybrid
    sharding) FSDP's all-gathers and reduce-scatters run over size / replicas ranks, its all-reduces over
    ``replicas``."""
    import numpy as np

    total = 0
    for op, name, shape, dtype, _ in trace:
        if shape is None:
            continue
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if replicas > 1 and str(name).startswith("fsdp"):
            size_of = replicas if "all-reduce" in str(name) else size // replicas
            total += _ring_bytes(op, nbytes, size_of)
        else:
            total += _ring_bytes(op, nbytes, size)
    return total


def _ring_bytes(op: str, nbytes: int, size: int) -> int:
    """What one rank sends for a collective of ``nbytes`` (its input) over ``size`` ranks, ring algorithm."""
    if op == "allgather":
        return (size - 1) * nbytes
    if op in ("reduce_scatter", "broadcast"):
        return (size - 1) * nbytes // size
    if op == "allreduce":
        return 2 * (size - 1) * nbytes // size
    return 0


def _link_bytes() -> int:
    """Bytes this rank's host (network namespace) sent on its cluster link; 0 on one host."""
    try:
        with open("/proc/self/net/dev") as f:
            rows = [line.split(":", 1) for line in f.readlines()[2:]]
    except OSError:
        return 0
    return sum(int(stats.split()[8]) for name, stats in rows if name.strip().startswith(f"{CLUSTER}-h"))


def worker(out: str, rounds: int, hosts: int) -> None:
    import tracemalloc

    from distlab import comm
    from distlab.testing import RecordingGroup

    world = comm.world()
    names = _variants(world.size, hosts)
    rows = {name: {} for name in names}
    for name in names:  # every module each variant imports, imported before memory is measured
        _step(*_build(name, world, 1))
    # memory: one variant at a time, a one-row batch, tracemalloc on
    for name in names:
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        model, opt, x = _build(name, world, 1)
        for _ in range(2):
            _step(model, opt, x)
        tracemalloc.reset_peak()
        _step(model, opt, x)
        current, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rows[name]["peak bytes"] = peak - base
        rows[name]["resting bytes"] = current - base
        del model, opt
    # bytes on the wire: one step through a recording group
    for name in names:
        recording = RecordingGroup(world)
        model, opt, x = _build(name, recording, BATCH)
        _step(model, opt, x)
        recording.trace.clear()
        world.barrier()
        sent = _link_bytes()
        _step(model, opt, x)
        world.barrier()
        rows[name]["link bytes"] = _link_bytes() - sent
        rows[name]["wire bytes"] = _wire_bytes(recording.trace, world.size, 2 if name.startswith("hybrid") else 1)
        rows[name]["collectives"] = {op: sum(1 for t in recording.trace if t[0] == op)
                                     for op in ("allgather", "reduce_scatter", "allreduce", "broadcast")}
    # time: round robin
    built = {name: _build(name, world, BATCH) for name in names}
    for name in names:
        _step(*built[name])
    times = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            world.barrier()
            start = time.perf_counter()
            _step(*built[name])
            world.barrier()
            times[name].append(time.perf_counter() - start)
    for name in names:
        rows[name]["step ms"] = statistics.median(times[name]) * 1e3
    everyone = world.allgather_object(rows)
    if world.rank == 0:
        Path(out).write_text(json.dumps(everyone))


# ---------------------------------------------------------------------------------------------- torch worker
def _torch_rank(rank, size, port, rounds, queue):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (size,))
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))

    def build(kind):
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(LAYERS)])
        if kind == "torch DDP":
            model = DDP(net)
        else:
            for block in net:
                fully_shard(block, mesh=mesh, reshard_after_forward=kind.endswith("ZeRO-3"))
            model = fully_shard(net, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=1e-4)

    def step(model, opt):
        opt.zero_grad()
        (model(x) ** 2).mean().backward()
        opt.step()

    kinds = ["torch DDP", "torch FSDP2 ZeRO-2", "torch FSDP2 ZeRO-3"]
    built = {kind: build(kind) for kind in kinds}
    for kind in kinds:
        step(*built[kind])
    times = {kind: [] for kind in kinds}
    for _ in range(rounds):
        for kind in kinds:
            dist.barrier()
            start = time.perf_counter()
            step(*built[kind])
            dist.barrier()
            times[kind].append(time.perf_counter() - start)
    queue.put((rank, {kind: statistics.median(t) * 1e3 for kind, t in times.items()}, torch.__version__))
    dist.destroy_process_group()


def torch_worker(out: str, size: int, rounds: int) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29700 + os.getpid() % 200
    procs = [ctx.Process(target=_torch_rank, args=(r, size, port, rounds, queue)) for r in range(size)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(60)
    rows = [{k: {"step ms": v} for k, v in r[1].items()} for r in sorted(results, key=lambda r: r[0])]
    Path(out).write_text(json.dumps({"rows": rows, "version": results[0][2]}))


def _torch_times(size: int, rounds: int, python: str | None):
    """torch's rows, from this interpreter if it has torch, else from ``python``; None when neither has."""
    part = RESULTS / f"bench_fsdp.torch{size}.part.json"
    try:
        import torch  # noqa: F401

        command = [sys.executable]
    except ImportError:
        if not python:
            return None
        command = [python]
    command += [__file__, "--torch-worker", str(part), "--np", str(size), "--rounds", str(rounds)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "MPI", "HYDRA"))}
    done = subprocess.run(command, env=env, timeout=3600)
    if done.returncode != 0 or not part.exists():
        print(f"torch's run on {size} ranks failed (exit {done.returncode}); no torch rows")
        return None
    data = json.loads(part.read_text())
    part.unlink()
    return data


# ------------------------------------------------------------------------------------------------------ report
def formula(name: str, params: int, size: int, largest: int) -> tuple[float, float]:
    """(ZeRO's bytes per rank for ``name``, the bound the target compares to)."""
    total = (PARAM + GRAD + STATE) * params
    if name == "DDP":
        value = total
    elif name == "ZeRO-1":
        value = (PARAM + GRAD) * params + STATE * params / size
    elif name.startswith("ZeRO-2"):
        value = PARAM * params + (GRAD + STATE) * params / size
    else:
        value = total / (size // 2 if name.startswith("hybrid") else size)
    bound = value + (PARAM + GRAD) * largest if not name.startswith(("DDP", "ZeRO-1")) else value
    return value, bound


def table(worlds: dict, params: int, largest: int) -> str:
    head = (f"{'world':>10} {'variant':<20} {'peak MB':>8} {'formula MB':>10} {'bound MB':>9} {'peak/bound':>10} "
            f"{'sent MB/step':>12} {'link MB/step':>12} {'step ms':>8} {'x DDP':>6}")
    lines = [head, "-" * len(head)]
    for label, world in worlds.items():
        size = world["size"]
        ranks = world["rows"]
        ddp = statistics.median(r["DDP"]["step ms"] for r in ranks) if ranks else None
        for name in ranks[0]:
            peak = max(r[name].get("peak bytes", 0) for r in ranks)
            value, bound = formula(name, params, size, largest)
            step = statistics.median(r[name]["step ms"] for r in ranks)
            sent = max(r[name].get("wire bytes", 0) for r in ranks)
            link = max(r[name].get("link bytes", 0) for r in ranks)
            lines.append(f"{label:>10} {name:<20} {peak / 2**20:>8.2f} {value / 2**20:>10.2f} {bound / 2**20:>9.2f} "
                         f"{peak / bound:>10.3f} {sent / 2**20:>12.2f} {link / 2**20:>12.2f} {step:>8.2f} "
                         f"{step / ddp:>6.2f}")
        for name, row in world.get("torch", {}).items():
            lines.append(f"{label:>10} {name:<20} {'':>8} {'':>10} {'':>9} {'':>10} {'':>12} {'':>12} "
                         f"{row['step ms']:>8.2f} {row['step ms'] / ddp:>6.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="3 rounds: a smoke run")
    parser.add_argument("--np", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--cluster", action="store_true", help="4 ranks on 2 virtual hosts, a 1 Gbit/s link (root)")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--torch-python", help="an interpreter with torch, to time torch's DDP and FSDP2")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--torch-worker", help=argparse.SUPPRESS)
    parser.add_argument("--hosts", type=int, default=1, help=argparse.SUPPRESS)
    options = parser.parse_args()
    rounds = 3 if options.quick else options.rounds
    if options.torch_worker:
        torch_worker(options.torch_worker, options.np[0], rounds)
        return
    if options.worker:
        worker(options.worker, rounds, options.hosts)
        return
    from distlab.launch import launch_script

    RESULTS.mkdir(parents=True, exist_ok=True)
    params = LAYERS * (WIDTH * WIDTH + WIDTH)
    largest = WIDTH * WIDTH + WIDTH
    plan = [("4 on 2 hosts", 4, 2)] if options.cluster else [(f"{n} ranks", n, 1) for n in options.np]
    worlds = {}
    for label, size, hosts in plan:
        part = RESULTS / f"bench_fsdp.{size}.part.json"
        kwargs = {}
        if hosts > 1:
            from distlab.cluster import up

            up(hosts=hosts, rate=options.rate, name=CLUSTER)
            kwargs = dict(cluster=CLUSTER)
        try:
            job = launch_script(__file__, np=size, timeout=3600,
                                args=["--worker", str(part), "--rounds", str(rounds), "--hosts", str(hosts)],
                                **kwargs)
        finally:
            if hosts > 1:
                from distlab.cluster import down

                down(CLUSTER)
        if job.returncode != 0:
            sys.exit(f"bench_fsdp on {label} failed (exit {job.returncode})")
        worlds[label] = {"size": size, "hosts": hosts, "rows": json.loads(part.read_text())}
        part.unlink()
        if hosts == 1:
            torch_rows = _torch_times(size, rounds, options.torch_python)
            if torch_rows is not None:
                ranks = torch_rows["rows"]
                worlds[label]["torch"] = {k: {"step ms": statistics.median(r[k]["step ms"] for r in ranks)}
                                          for k in ranks[0]}
                worlds[label]["torch version"] = torch_rows["version"]
    report = {"benchmark": "bench_fsdp", "command": " ".join(["python -P"] + sys.argv), "rounds": rounds,
              "host_cores": os.cpu_count(), "model": f"{LAYERS} x Linear({WIDTH}, {WIDTH}) + ReLU, Adam",
              "parameters": params, "largest group": largest, "worlds": worlds, "targets": targets(worlds, params,
                                                                                               largest)}
    (RESULTS / ("bench_fsdp_cluster.json" if options.cluster else "bench_fsdp.json")).write_text(
        json.dumps(report, indent=1))
    print(table(worlds, params, largest))
    print()
    for line in report["targets"]:
        print(line)


def targets(worlds: dict, params: int, largest: int) -> list[str]:
    """The issue's targets, each with its measured figure."""
    out = []
    for label, world in worlds.items():
        ranks, size = world["rows"], world["size"]

        def step(name, ranks=ranks):
            return statistics.median(r[name]["step ms"] for r in ranks)

        zero3 = "ZeRO-3 core"
        peak = max(r[zero3]["peak bytes"] for r in ranks)
        _, bound = formula(zero3, params, size, largest)
        if size == 4:
            out.append(f"{label}: ZeRO-3 peak state {peak / bound:.3f}x (16P/N + largest group) (target <= 1.1)")
        ratio = step(zero3) / step("DDP")
        limit = 1.6 if world["hosts"] > 1 else 1.3
        out.append(f"{label}: ZeRO-3 step {ratio:.2f}x DDP's (target <= {limit})")
        if world["hosts"] > 1 and "hybrid core" in ranks[0]:
            out.append(f"{label}: hybrid step {step('hybrid core') / step('DDP'):.2f}x DDP's (target <= 1.1)")
        if size == 2 and "torch" in world:
            theirs = world["torch"]["torch FSDP2 ZeRO-3"]["step ms"]
            out.append(f"{label}: distlab ZeRO-3 {step(zero3):.1f} ms, torch FSDP2 ZeRO-3 {theirs:.1f} ms: "
                       f"{step(zero3) / theirs:.2f}x (target <= 0.5)")
    return out


if __name__ == "__main__":
    main()
