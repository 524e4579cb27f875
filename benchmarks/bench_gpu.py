"""distlab on a real GPU: a local training step against torch; allreduce and a DDP step per device transport.

Run: ``python benchmarks/bench_gpu.py`` (``--quick`` for the prepared device check, ``make gpu-check``). It needs
cupy and a CUDA device, and says so and exits (status 2) without one. Three tables, measured in one run:

1. one process: an MLP training step (forward, backward, SGD) on cupy through distlab's autograd, and the same
   model and batch in torch on the GPU when torch is importable (PyTorch's own step, the floor to compare with);
   with ``--device fake``, the kernel launches of one step as the stand-in counts them (its times mean nothing,
   its launch count is what a GPU step of this size is bound by);
2. allreduce of float32 device arrays on ``--np`` ranks (sharing GPU 0 when there is one GPU), by size (4 KiB to
   256 MiB), one column per device transport: ``none`` (the plain path, staged through pageable memory) and every
   other ``DISTLAB_DEVICE_COMM`` word (``ipc``, ``nccl``, ``staged``, ``mpi``), each in a launch and a process
   group of its own; a transport the ranks' placement refuses is skipped with the reason. Beside them, measured in
   the same run, the limits: the IPC floor (the reduction alone, in the ipc transport's buffers that every rank
   maps, one barrier included), the copies device to host and host to device of the size (pageable and pinned)
   and a host MPI allreduce of the same bytes. Every step's result is compared with the expected sum;
3. a DDP step on ``--np`` ranks with ``DistributedDataParallel``'s default arguments, per transport, for two
   models (small: 100 x Linear(256, 256), batch 32; wide: 8 x Linear(4096, 4096), batch 512; ``--quick``: the
   small one), beside the floor (each rank trains its own copy at the same time, no communication: the floor
   when the ranks share a GPU) and torch's DDP on gloo with CUDA tensors (and on nccl with a GPU per rank) when
   torch is importable. Checked: DDP's first gradients are the mean of every rank's local ones, and the
   parameters after the last step are the same bits on every rank.

``--device fake`` runs every path on the stand-in (``distlab.fakegpu``; ``--tiny`` shrinks the sizes and models
so a CPU run takes seconds); ``--timeline trace.json`` also records a Chrome trace of a few DDP steps per
transport (the reducer's buckets against backward).

Each figure is the median of ``--steps`` timed steps after ``--warmup`` untimed ones, each step ended by a device
synchronize. Each launch is bounded by ``--timeout``: one that fails or hangs is reported (exit status 1) and the
others still run. Prints the tables and writes JSON (``benchmarks/results/bench_gpu.json`` or ``--json``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import distlab

distlab.keep_freed_memory()  # glibc keeps freed memory between steps, as docs/ measured (docs/autograd.md)

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = [4 << 10 << 2 * k for k in range(9)]  # 4 KiB, 16 KiB, ... 256 MiB
QUICK_SIZES = [4 << 10, 1 << 20, 64 << 20]
TINY_SIZES = [4 << 10, 64 << 10, 256 << 10]
#: name: (layers, width, batch per rank)
MODELS = {"small": (100, 256, 32), "wide": (8, 4096, 512)}
TINY_MODELS = {"small": (4, 32, 8), "wide": (2, 128, 16)}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and steps (about a minute on one H100)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per figure (default 20, quick 10)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5, quick 3)")
    parser.add_argument("--np", type=int, default=2, help="ranks of the allreduce and DDP tables")
    parser.add_argument("--json", default=str(RESULTS / "bench_gpu.json"), help="where the JSON goes")
    parser.add_argument("--device", choices=("cuda", "fake"), default="cuda",
                        help="cuda (cupy); fake: the CI stand-in distlab.fakegpu, to check the code paths on a CPU "
                             "(its figures mean nothing)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes and models (the stand-in on a CPU: seconds)")
    parser.add_argument("--timeline", help="also write a Chrome trace of a few DDP steps per transport here")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds for each launch of --np ranks (default 600, quick 60); a launch past it is "
                             "stopped and reported, the others still run")
    args = parser.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (10 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (3 if args.quick else 5)
    args.timeout = args.timeout if args.timeout is not None else (60.0 if args.quick else 600.0)
    if args.steps < 1 or args.warmup < 0 or args.np < 1:
        parser.error("--steps must be >= 1, --warmup >= 0 and --np >= 1")
    return args


def gpu_or_reason(device="cuda"):
    """``(cupy, None)`` when cupy sees a CUDA device, else ``(None, why not)``; ``device="fake"``: the stand-in."""
    if device == "fake":
        from distlab import fakegpu

        fakegpu.use_as_cuda()
        return fakegpu, None
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - not installed, or no CUDA runtime for it
        return None, f"cupy cannot be imported ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no driver
        return None, f"cupy finds no CUDA driver ({type(exc).__name__}: {exc})"
    if count < 1:
        return None, "cupy sees no CUDA device"
    return cupy, None


def _median_ms(step, steps, warmup, sync):
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _mlp(layers, width):
    import distlab
    from distlab import nn

    distlab.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])


def local_step(cupy, layers, width, batch, steps, warmup):
    """One process: distlab on cupy, and torch on the GPU when importable; on the stand-in, the launches of a step.

    The step is the library's own path: ``Module.to``, the autograd engine, ``SGD`` with its default ``fused=None``
    (on a device, each parameter's update one fused body, run for 32 parameters a launch), ``zero_grad`` setting
    gradients to None."""
    import numpy as np

    import distlab

    model = _mlp(layers, width).to("cuda")
    rng = np.random.default_rng(0)
    x = distlab.tensor(cupy.asarray(rng.standard_normal((batch, width), dtype=np.float32)))
    y = distlab.tensor(cupy.asarray(rng.standard_normal((batch, width), dtype=np.float32)))
    step, _ = _trainer(model, x, y)

    sync = cupy.cuda.get_current_stream().synchronize
    row = {"what": f"{layers} x Linear({width}, {width}) + ReLU, batch {batch}",
           "distlab_ms": _median_ms(step, steps, warmup, sync), "torch_ms": None, "launches_per_step": None}
    if cupy.__name__ != "cupy":  # the stand-in: no torch comparison, but the launches of one step (after warm-up)
        cupy.reset()
        step()
        row["launches_per_step"] = cupy.launch_total()
        return row
    try:
        import torch
    except ImportError:
        return row
    if not torch.cuda.is_available():
        return row
    torch.manual_seed(0)
    tstep = _torch_trainer(_torch_mlp(torch, layers, width).cuda(), torch.as_tensor(x.data.get()).cuda(),
                           torch.as_tensor(y.data.get()).cuda())
    row["torch_ms"] = _median_ms(tstep, steps, warmup, torch.cuda.synchronize)
    return row


def _torch_mlp(torch, layers: int, width: int):
    """The benchmark's MLP in torch (``layers`` x Linear(width, width) + ReLU), on the CPU."""
    return torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])


def _torch_trainer(model, x, y):
    """One torch training step of ``model`` on ``(x, y)`` (MSE loss, SGD), as :func:`_trainer`'s in distlab."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    return step


def _use_device(device):
    import os

    cupy, _ = gpu_or_reason(device)
    cupy.cuda.Device(int(os.environ.get("RANK", "0")) % cupy.cuda.runtime.getDeviceCount()).use()
    return cupy


# -- tables 2 and 3: one launch per transport, one for the limits and the floors, one for torch ----------------------

def transports() -> list:
    """The columns: ``none`` (the plain path) and every other ``DISTLAB_DEVICE_COMM`` word but ``auto``."""
    from distlab.comm.transports import SETTINGS

    return ["none"] + [s for s in SETTINGS if s not in ("auto", "none")]


class _Rank:
    """What every rank function shares: the device module, a host communicator for barriers and checks (its own
    duplicate of COMM_WORLD), the device synchronize, and a progress bar on rank 0."""

    def __init__(self, device):
        from mpi4py import MPI

        self.xp = _use_device(device)
        self.mpi = MPI
        self.comm = MPI.COMM_WORLD.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.sync = self.xp.cuda.get_current_stream().synchronize

    def progress(self, total: int, what: str):
        from tqdm import tqdm

        return tqdm(total=total, desc=f"bench_gpu {what}", unit="figure", disable=self.rank != 0, mininterval=1.0)

    def everywhere(self, ok: bool) -> bool:
        """True on every rank when ``ok`` is true on every rank."""
        return bool(self.comm.allreduce(int(bool(ok)), op=self.mpi.MIN))

    def free(self) -> None:
        pool = getattr(self.xp, "get_default_memory_pool", None)
        if pool is not None:
            self.sync()
            pool().free_all_blocks()

    def checked_ms(self, step, prepare, check, steps: int, warmup: int) -> dict:
        """The median time of ``step`` plus a device synchronize, over ``steps`` steps after ``warmup``; before each
        step (untimed) ``prepare``, a synchronize and a barrier; after it (untimed) ``check``, which every step must
        pass on every rank."""
        times, ok = [], True
        for k in range(warmup + steps):
            prepare()
            self.sync()
            self.comm.Barrier()
            start = time.perf_counter()
            step()
            self.sync()
            elapsed = (time.perf_counter() - start) * 1e3
            ok = bool(check()) and ok
            if k >= warmup:
                times.append(elapsed)
        return {"ms": statistics.median(times), "ok": self.everywhere(ok)}


def _pattern(r, count: int):
    """This rank's input (``k % 251 + rank``) and the expected sum over the ranks: exact in float32."""
    import numpy as np

    base = np.arange(count, dtype=np.float32) % 251
    return base + r.rank, base * r.size + r.size * (r.size - 1) / 2


def _allreduce_figure(r, group, nbytes: int, steps: int, warmup: int, shared: bool = False) -> dict:
    """An in-place float32 allreduce of ``nbytes`` on ``group``, every step's result compared with the sum;
    ``shared``: of an array in memory every rank maps (``device_shared_arrays``, as DDP's buckets)."""
    mine_host, expected_host = _pattern(r, nbytes // 4)
    xp = r.xp
    mine, expected = xp.asarray(mine_host), xp.asarray(expected_host)
    memory, (a,) = group.device_shared_arrays([(mine.size, mine.dtype)]) if shared else (None, [xp.empty_like(mine)])

    def prepare():
        a[...] = mine

    return r.checked_ms(lambda: group.allreduce(a), prepare, lambda: xp.array_equal(a, expected), steps, warmup)


def _data(r, width: int, batch: int):
    import numpy as np

    import distlab

    rng = np.random.default_rng(1 + r.rank)
    return [distlab.tensor(r.xp.asarray(rng.standard_normal((batch, width), dtype=np.float32))) for _ in range(2)]


def _flat(xp, tensors):
    import numpy as np

    return np.concatenate([xp.asnumpy(t.data).ravel() for t in tensors])


def _same_bits_everywhere(r, host) -> bool:
    import hashlib

    digests = r.comm.allgather(hashlib.sha256(host.tobytes()).hexdigest())
    return len(set(digests)) == 1


def _trainer(model, x, y):
    """``(step, optimizer)``: one training step of ``model`` on ``(x, y)`` (MSE loss, SGD; ``step(update=False)``
    stops after backward)."""
    from distlab import nn, optim

    opt = optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()

    def step(update=True):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        if update:
            opt.step()

    return step, opt


def _ddp_figure(r, group, model_spec, steps: int, warmup: int) -> dict:
    """A DDP step (default arguments) on ``group``. Checked: the first step's gradients are the mean of every rank's
    local ones (within float32 rounding), and after the last step every rank's parameters are the same bits."""
    import numpy as np

    from distlab.ddp import DistributedDataParallel

    layers, width, batch = model_spec
    x, y = _data(r, width, batch)
    alone = _mlp(layers, width).to("cuda")
    _trainer(alone, x, y)[0](update=False)
    local = _flat(r.xp, [p.grad for p in alone.parameters()])
    del alone
    mean = np.empty_like(local)
    r.comm.Allreduce(local, mean)
    mean /= r.size
    model = DistributedDataParallel(_mlp(layers, width).to("cuda"), process_group=group)
    step, opt = _trainer(model, x, y)
    step(update=False)
    ok = bool(np.allclose(_flat(r.xp, [p.grad for p in model.parameters()]), mean, rtol=1e-4, atol=1e-6))
    opt.step()
    ms = _median_ms(step, steps, warmup, r.sync)
    ok = _same_bits_everywhere(r, _flat(r.xp, model.parameters())) and ok
    return {"ms": ms, "ok": r.everywhere(ok)}


def _group(transport: str, name: str | None = None):
    """``(group, None)``: a process group made with ``DISTLAB_DEVICE_COMM=transport`` (read when a group is made);
    or ``(None, why)`` on every rank when the ranks' placement refuses it."""
    import os

    from distlab import comm
    from distlab.comm.transports import DEVICE_COMM_VAR

    before = os.environ.get(DEVICE_COMM_VAR)
    os.environ[DEVICE_COMM_VAR] = transport
    try:
        group = comm.ProcessGroup(name=name or f"bench {transport}")
    except ValueError as exc:
        return None, str(exc)
    finally:
        if before is None:
            del os.environ[DEVICE_COMM_VAR]
        else:
            os.environ[DEVICE_COMM_VAR] = before
    if group.device_comm != transport:
        raise RuntimeError(f"DISTLAB_DEVICE_COMM={transport} made a group with device transport {group.device_comm}")
    return group, None


def transport_rank(device, transport, sizes, models, steps, warmup):
    """On each rank: every allreduce size and every model's DDP step through ``transport``, in a group of its own."""
    r = _Rank(device)
    group, why = _group(transport)
    if group is None:
        return {"refused": why}
    bar = r.progress(len(sizes) + len(models), transport)
    out = {"allreduce": [], "ddp": []}
    with group:
        for nbytes in sizes:
            out["allreduce"].append(_allreduce_figure(r, group, nbytes, steps, warmup))
            if transport == "ipc":  # and of an array every rank maps: no copy in or out
                out.setdefault(SHARED, []).append(_allreduce_figure(r, group, nbytes, steps, warmup, shared=True))
            r.free()
            bar.update()
        for spec in models.values():
            out["ddp"].append(_ddp_figure(r, group, spec, steps, warmup))
            r.free()
            bar.update()
    bar.close()
    return out


#: the column of allreduces of arrays in the ipc transport's shared memory (device_shared_arrays)
SHARED = "ipc shared"
LIMITS = ("ipc floor", "D2H pageable", "D2H pinned", "H2D pageable", "H2D pinned", "host MPI")


def _ipc_floor_slots(r, nbytes: int):
    """``(slots, block, None)``: the ipc transport's own buffers (one per rank, every rank mapping the others':
    CUDA IPC, emulated by the stand-in) and this rank's block to reduce (all of it on rank 0 when
    every rank shares one device, as the transport's leader does, else an even share); ``(None, None, why)`` when
    the placement refuses ipc."""
    from distlab.comm.transports.ipc import CudaSlots, _block

    group, why = _group("ipc", "bench ipc floor")
    if group is None:
        return None, None, why
    block = _block(nbytes // 4, r.rank, r.size, group._transport.mode)  # the transport's own split
    try:
        slots, failure = CudaSlots(group, r.xp, nbytes), None
    except Exception as exc:  # noqa: BLE001 - the floor is dropped on every rank; the other limits still run
        slots, failure = None, f"{type(exc).__name__}: {exc}"
    group.destroy()
    if not r.everywhere(failure is None):
        return None, None, f"failed: {failure or 'on another rank'}"
    return slots, block, None


def _limits(r, nbytes: int, slots, block, steps: int, warmup: int) -> dict:
    """The limits of an allreduce of ``nbytes`` float32 between the ranks, each checked after every step."""
    import numpy as np

    xp = r.xp
    count = nbytes // 4
    mine_host, expected_host = _pattern(r, count)
    mine, expected = xp.asarray(mine_host), xp.asarray(expected_host)
    out = {}
    if slots is not None:
        views = [slots.view(k, count, np.dtype(np.float32)) for k in range(r.size)]
        lo, hi = block
        others = [k for k in range(r.size) if k != r.rank]

        def floor():  # sum this rank's block of every slot into its own, write it into the others'; then a barrier
            if hi > lo:
                own = views[r.rank][lo:hi]
                for k in others:
                    xp.add(own, views[k][lo:hi], out=own)
                for k in others:
                    views[k][lo:hi] = own
            r.sync()
            r.comm.Barrier()

        def fill():
            views[r.rank][...] = mine

        out["ipc floor"] = r.checked_ms(floor, fill, lambda: xp.array_equal(views[r.rank], expected), steps, warmup)
    for kind in ("pageable", "pinned"):
        out.update(_copies(r, kind, mine, mine_host, steps, warmup))
    host = np.empty(count, np.float32)
    out["host MPI"] = r.checked_ms(lambda: r.comm.Allreduce(r.mpi.IN_PLACE, host), lambda: np.copyto(host, mine_host),
                                   lambda: np.array_equal(host, expected_host), steps, warmup)
    return out


def _copies(r, kind: str, mine, mine_host, steps: int, warmup: int) -> dict:
    """Device to host and host to device of ``mine``, through ``kind`` (pageable or pinned) host memory."""
    import numpy as np

    pinned = getattr(r.xp.cuda, "alloc_pinned_memory", None)  # the stand-in has none: plain memory
    memory = pinned(mine.nbytes) if kind == "pinned" and pinned is not None else None
    host = np.empty(mine.size, np.float32) if memory is None else np.frombuffer(memory, np.float32, mine.size)
    a = r.xp.empty_like(mine)

    def device_filled():
        a[...] = mine
        host.fill(0)

    def host_filled():
        np.copyto(host, mine_host)
        a.fill(0)

    return {f"D2H {kind}": r.checked_ms(lambda: a.get(out=host), device_filled,
                                        lambda: np.array_equal(host, mine_host), steps, warmup),
            f"H2D {kind}": r.checked_ms(lambda: a.set(host), host_filled, lambda: r.xp.array_equal(a, mine), steps,
                                        warmup)}


def limits_rank(device, sizes, models, steps, warmup):
    """On each rank: the allreduce's limits by size, and each model's floor (every rank trains its own copy at the
    same time, no communication)."""
    r = _Rank(device)
    bar = r.progress(len(sizes) + len(models), "limits and floors")
    slots, block, refused = _ipc_floor_slots(r, max(sizes))
    out = {"mpi": r.mpi.Get_library_version().splitlines()[0], "ipc floor refused": refused, "pinned":
           hasattr(r.xp.cuda, "alloc_pinned_memory"), "allreduce": [], "floor": []}
    for nbytes in sizes:
        out["allreduce"].append(_limits(r, nbytes, slots, block, steps, warmup))
        r.free()
        bar.update()
    del slots
    for spec in models.values():
        out["floor"].append(_floor_figure(r, spec, steps, warmup))
        r.free()
        bar.update()
    bar.close()
    return out


def _floor_figure(r, model_spec, steps: int, warmup: int) -> dict:
    """The step of a rank training its own copy, every rank at the same time (no communication)."""
    layers, width, batch = model_spec
    x, y = _data(r, width, batch)
    step, _ = _trainer(_mlp(layers, width).to("cuda"), x, y)
    r.comm.Barrier()  # the ranks train at the same time, as DDP's would
    return {"ms": _median_ms(step, steps, warmup, r.sync)}


def torch_rank(models, steps, warmup, backends):
    """On each rank: torch's DDP step (default arguments, CUDA tensors) per backend and model; checked: the
    parameters are the same bits on every rank after the last step."""
    import os
    import shutil
    import tempfile

    import torch
    import torch.distributed as dist

    r = _Rank("cuda")
    device = torch.device("cuda", r.rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    out = {}
    for backend in backends:
        store = r.comm.bcast(os.path.join(tempfile.mkdtemp(prefix="bench-gpu-"), "store") if r.rank == 0 else None)
        dist.init_process_group(backend, init_method=f"file://{store}", rank=r.rank, world_size=r.size)
        out[backend] = [_torch_figure(r, spec, steps, warmup) for spec in models.values()]
        dist.destroy_process_group()
        torch.cuda.empty_cache()
        r.comm.Barrier()
        if r.rank == 0:
            shutil.rmtree(os.path.dirname(store), ignore_errors=True)
    return out


def _torch_figure(r, model_spec, steps: int, warmup: int) -> dict:
    """torch's DDP step of one model, the parameters checked to be the same bits on every rank afterwards."""
    import numpy as np
    import torch
    from torch.nn.parallel import DistributedDataParallel

    layers, width, batch = model_spec
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = DistributedDataParallel(_torch_mlp(torch, layers, width).to(device), device_ids=[device.index])
    generator = torch.Generator().manual_seed(1 + r.rank)
    x, y = (torch.randn(batch, width, generator=generator).to(device) for _ in range(2))
    step = _torch_trainer(model, x, y)
    ms = _median_ms(step, steps, warmup, torch.cuda.synchronize)
    host = np.concatenate([p.detach().cpu().numpy().ravel() for p in model.parameters()])
    return {"ms": ms, "ok": r.everywhere(_same_bits_everywhere(r, host))}


def timeline_rank(device, names, spec, steps):
    """On each rank: ``steps`` DDP steps of the model ``spec`` per transport in ``names``, recorded on the timeline
    (``DISTLAB_TIMELINE``), each step a span ``DDP step (<transport>)`` on the lane ``bench``."""
    from distlab.ddp import DistributedDataParallel
    from distlab.timeline import get_timeline

    r = _Rank(device)
    layers, width, batch = spec
    x, y = _data(r, width, batch)
    for name in names:
        group, _ = _group(name)
        with group:
            step, _ = _trainer(DistributedDataParallel(_mlp(layers, width).to("cuda"), process_group=group), x, y)
            for _ in range(steps):
                with get_timeline().span(f"DDP step ({name})", cat="bench", lane="bench"):
                    step()
                    r.sync()


def _combine(per_rank: list) -> list:
    """One figure per position from every rank's list: the slowest rank's time, checked if checked everywhere."""
    return [{"ms": max(f["ms"] for f in figures), **({"ok": all(f["ok"] for f in figures)} if "ok" in figures[0]
                                                     else {})} for figures in zip(*per_rank)]


def _launch(fn, args, np_, timeout, env=None):
    """Every rank's result, or the failure (a string) when a rank raised or the launch timed out. Each blocking
    wait of the ranks is bounded by half the launch's time (unless ``DISTLAB_TIMEOUT`` is set), so a collective
    that never completes is named by distlab's own error before the launch is stopped."""
    import os

    import distlab
    from distlab.errors import RankFailedError

    env = {"DISTLAB_TIMEOUT": os.environ.get("DISTLAB_TIMEOUT") or f"{timeout / 2:g}", **(env or {})}
    try:
        return distlab.run(fn, np=np_, args=args, timeout=timeout, env=env, prefix=False)
    except RankFailedError as exc:
        return f"{type(exc).__name__}: {exc}"


def _transport_columns(args, common, allreduce: list, ddp: list, skipped: dict, problems: list) -> list:
    """One launch per transport: its figures into the rows; returns the transports that ran."""
    ran = []
    for name in transports():
        per_rank = _launch(transport_rank, (args.device, name) + common, args.np, args.timeout)
        if isinstance(per_rank, str):
            skipped[name] = f"failed: {per_rank}"
            problems.append(f"{name}: {per_rank}")
        elif "refused" in per_rank[0]:
            skipped[name] = per_rank[0]["refused"]
        else:
            ran.append(name)
            for row, figure in zip(allreduce, _combine([p["allreduce"] for p in per_rank])):
                row[name] = _with_bandwidth(figure, row["bytes"])
            if SHARED in per_rank[0]:
                for row, figure in zip(allreduce, _combine([p[SHARED] for p in per_rank])):
                    row[SHARED] = _with_bandwidth(figure, row["bytes"])
            for row, figure in zip(ddp, _combine([p["ddp"] for p in per_rank])):
                row[name] = figure
    return ran


def _limit_columns(args, common, report: dict, allreduce: list, ddp: list, skipped: dict, problems: list) -> None:
    """One launch: the allreduce's limits and each model's floor into the rows."""
    per_rank = _launch(limits_rank, (args.device,) + common, args.np, args.timeout)
    if isinstance(per_rank, str):
        problems.append(f"limits and floors: {per_rank}")
        return
    report["machine"]["mpi"] = per_rank[0]["mpi"]
    report["machine"]["pinned host memory"] = per_rank[0]["pinned"]
    why = next((p["ipc floor refused"] for p in per_rank if p["ipc floor refused"]), None)
    if why:
        skipped["ipc floor"] = why
        if why.startswith("failed"):
            problems.append(f"ipc floor: {why}")
    for k, row in enumerate(allreduce):
        for column in LIMITS:
            if column in per_rank[0]["allreduce"][k]:
                figure = _combine([[p["allreduce"][k][column]] for p in per_rank])[0]
                row[column] = _with_bandwidth(figure, row["bytes"])
    for row, figure in zip(ddp, _combine([p["floor"] for p in per_rank])):
        row["floor"] = figure


def _torch_columns(args, models, devices: int, ddp: list, skipped: dict, problems: list) -> list:
    """One launch: torch's DDP step per backend into the rows (when torch can run); returns the columns."""
    import importlib.util

    if args.device == "fake":
        skipped["torch"] = "the stand-in: torch runs on a GPU only here"
        return []
    if importlib.util.find_spec("torch") is None:
        skipped["torch"] = "torch is not importable"
        return []
    backends = ["gloo"] + (["nccl"] if devices >= args.np else [])
    per_rank = _launch(torch_rank, (models, args.steps, args.warmup, backends), args.np, args.timeout)
    if isinstance(per_rank, str):
        skipped["torch"] = f"failed: {per_rank}"
        problems.append(f"torch: {per_rank}")
        return []
    for backend in backends:
        for row, figure in zip(ddp, _combine([p[backend] for p in per_rank])):
            row[f"torch {backend}"] = figure
    return [f"torch {backend}" for backend in backends]


def _trace(args, names: list, spec, report: dict, problems: list) -> None:
    """One launch with the timeline on: three DDP steps per transport, merged into ``args.timeline``."""
    from distlab.timeline import merge

    path = Path(args.timeline).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(path.name + ".rank*"):
        stale.unlink()
    done = _launch(timeline_rank, (args.device, names, spec, 3), args.np, args.timeout,
                   env={"DISTLAB_TIMELINE": str(path)})
    merged = merge(str(path), expected_parts=args.np, wait=5.0)
    report["timeline"] = str(path) if merged else None
    if isinstance(done, str) or not merged:
        problems.append(f"timeline: {done if isinstance(done, str) else 'no trace was written'}")


def _with_bandwidth(figure: dict, nbytes: int) -> dict:
    """An allreduce figure with the bandwidth it reached (bytes per millisecond / 1e6 = GB/s)."""
    return {**figure, "GB/s": nbytes / figure["ms"] / 1e6}


def measure(args, report: dict, argv=None) -> list:
    """Tables 2 and 3 into ``report`` with the command line and the date (and the timeline when asked); returns
    the problems (failed launches or checks), empty when every figure was measured and checked."""
    import shlex

    report.update(command=shlex.join(["python", "benchmarks/bench_gpu.py", *(sys.argv[1:] if argv is None else argv)]),
                  date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    sizes = (TINY_SIZES[:2] if args.quick else TINY_SIZES) if args.tiny else (QUICK_SIZES if args.quick else SIZES)
    models = dict(list((TINY_MODELS if args.tiny else MODELS).items())[:1 if args.quick else None])
    common = (sizes, models, args.steps, args.warmup)
    allreduce = [{"bytes": n} for n in sizes]
    ddp = [{"model": name, "what": f"{layers} x Linear({width}, {width}) + ReLU, batch {batch} per rank, "
            f"{layers * (width + 1) * width * 4 / 1e6:.3g} MB of gradients"}
           for name, (layers, width, batch) in models.items()]
    skipped, problems = {}, []
    ran = _transport_columns(args, common, allreduce, ddp, skipped, problems)
    _limit_columns(args, common, report, allreduce, ddp, skipped, problems)
    torch_columns = _torch_columns(args, models, report["devices"], ddp, skipped, problems)
    for row in ddp:
        floor = row.get("floor", {}).get("ms")
        for column in ran + torch_columns:
            if column in row and floor:
                row[column]["x floor"] = row[column]["ms"] / floor
    report["transports"] = {"ran": ran, "skipped": skipped}
    shared = [SHARED] if any(SHARED in row for row in allreduce) else []
    report["allreduce"] = {"columns": ran + shared + [c for c in LIMITS if c not in skipped], "rows": allreduce}
    report["ddp_step"] = {"columns": ["floor"] + ran + torch_columns, "rows": ddp}
    problems += [f"{table} {row.get('model', row.get('bytes'))} {column}: the result check failed"
                 for table, rows in (("allreduce", allreduce), ("ddp", ddp)) for row in rows
                 for column, figure in row.items() if isinstance(figure, dict) and figure.get("ok") is False]
    report["checks_passed"] = not problems
    if args.timeline and ran:  # after the figures, so the trace's cost is in none of them
        _trace(args, ran, next(iter(models.values())), report, problems)
    report["problems"] = problems
    return problems


def machine(cupy, device: str) -> dict:
    """What the figures were measured on: the GPU, its driver and CUDA, cupy and NCCL, torch, the CPUs."""
    import os
    import platform

    import numpy

    info = {"cpus": os.cpu_count(), "python": platform.python_version(), "numpy": numpy.__version__}
    if device == "fake":
        return {"gpu": "distlab.fakegpu (the CI stand-in: figures mean nothing)", **info}
    runtime = cupy.cuda.runtime
    name = runtime.getDeviceProperties(0)["name"]
    info = {"gpu": name.decode() if isinstance(name, bytes) else str(name), "gpus": runtime.getDeviceCount(),
            "cuda driver API": runtime.driverGetVersion(), "cuda runtime": runtime.runtimeGetVersion(),
            "cupy": cupy.__version__, **info}
    try:
        info["driver"] = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except OSError:
        info["driver"] = None
    try:
        from distlab.comm.transports.nccl import nccl_module

        lib = nccl_module(cupy)
        info["nccl"] = int(lib.get_version()) if lib is not None else None
    except Exception:  # noqa: BLE001 - cupy without its NCCL library
        info["nccl"] = None
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        info["torch"] = None
    return info


def _cell(figure, floor=False) -> str:
    if figure is None:
        return "-"
    text = f"{figure['ms']:.3f}" if figure["ms"] < 10 else f"{figure['ms']:.1f}"
    if floor and "x floor" in figure:
        text += f" ({figure['x floor']:.2f}x)"
    return text + ("" if figure.get("ok", True) else " WRONG")


def print_tables(report: dict) -> None:
    """Tables 2 and 3 as the docs show them (markdown), and what was skipped and why."""
    print(f"\n{report['command']}  ({report['date']})")
    table = report["allreduce"]
    print(f"\n2. allreduce of float32 device arrays on {report['np']} ranks, ms (the slowest rank's median; every "
          "step's result checked)\n")
    print("| size | " + " | ".join(table["columns"]) + " |\n|" + " --- |" * (len(table["columns"]) + 1))
    for row in table["rows"]:
        size = f"{row['bytes'] >> 20} MiB" if row["bytes"] >= 1 << 20 else f"{row['bytes'] >> 10} KiB"
        print(f"| {size} | " + " | ".join(_cell(row.get(c)) for c in table["columns"]) + " |")
    table = report["ddp_step"]
    print(f"\n3. DDP step on {report['np']} ranks, default arguments, ms (x: over the floor, each rank training its "
          "own copy at the same time without communication)\n")
    print("| model | " + " | ".join(table["columns"]) + " |\n|" + " --- |" * (len(table["columns"]) + 1))
    for row in table["rows"]:
        print(f"| {row['model']}: {row['what']} | " + " | ".join(_cell(row.get(c), True) for c in table["columns"])
              + " |")
    for name, why in report["transports"]["skipped"].items():
        print(f"\nskipped {name}: {why}")


def main(argv=None) -> int:
    args = parse_args(argv)
    cupy, reason = gpu_or_reason(args.device)
    if cupy is None:
        print(f"bench_gpu: needs cupy and a CUDA device: {reason}; nothing measured", file=sys.stderr)
        return 2
    import distlab

    described = machine(cupy, args.device)
    device = described["gpu"]
    layers, width, batch = (20, 256, 32) if args.quick else (100, 256, 32)
    report = {"device": device, "devices": cupy.cuda.runtime.getDeviceCount(), "impl": distlab.IMPL,
              "quick": args.quick, "steps": args.steps, "warmup": args.warmup, "np": args.np, "machine": described}
    report["local_step"] = local_step(cupy, layers, width, batch, args.steps, args.warmup)
    problems = measure(args, report, argv)
    print(f"bench_gpu on {device} ({report['devices']} device(s)), impl {distlab.IMPL}, medians of {args.steps} "
          f"steps after {args.warmup} warm-up")
    row = report["local_step"]
    torch_ms = "n/a" if row["torch_ms"] is None else f"{row['torch_ms']:.2f} ms"
    launches = "" if row["launches_per_step"] is None else f", {row['launches_per_step']} launches per step"
    print(f"\n1. one process, {row['what']}: distlab {row['distlab_ms']:.2f} ms, torch {torch_ms}{launches}")
    print_tables(report)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    for problem in problems:
        print(f"bench_gpu: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
