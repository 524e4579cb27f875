"""distlab on a real GPU: a local training step against torch, allreduce by size, a DDP step on 2 ranks.

Run: ``python benchmarks/bench_gpu.py`` (``--quick`` for the prepared device check, ``make gpu-check``). It needs
cupy and a CUDA device, and says so and exits (status 2) without one. Three tables, measured in one run:

1. one process: an MLP training step (forward, backward, SGD) on cupy through distlab's autograd, and the same
   model and batch in torch on the GPU when torch is importable (PyTorch's own step, the floor to compare with);
2. allreduce of float32 device arrays through ``distlab.comm`` on 2 ranks (sharing GPU 0 when there is one GPU),
   by size, with the bandwidth it reaches;
3. a DDP step on 2 ranks with ``DistributedDataParallel``'s default arguments, and the same step without
   communication (each rank trains its own copy: the floor when the ranks share a GPU).

Each figure is the median of ``--steps`` timed steps after ``--warmup`` untimed ones, each step ended by a device
synchronize. Prints the tables and writes JSON (``benchmarks/results/bench_gpu.json`` or ``--json``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = [64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [64 << 10, 4 << 20, 16 << 20]


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
    args = parser.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (10 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (3 if args.quick else 5)
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
    """One process: distlab on cupy, and torch on the GPU when importable."""
    import numpy as np

    import distlab
    from distlab import nn, optim

    model = _mlp(layers, width).to("cuda")
    opt = optim.SGD(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    x = distlab.tensor(cupy.asarray(rng.standard_normal((batch, width), dtype=np.float32)))
    y = distlab.tensor(cupy.asarray(rng.standard_normal((batch, width), dtype=np.float32)))
    loss_fn = nn.MSELoss()

    def step():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    sync = cupy.cuda.get_current_stream().synchronize
    row = {"what": f"{layers} x Linear({width}, {width}) + ReLU, batch {batch}",
           "distlab_ms": _median_ms(step, steps, warmup, sync), "torch_ms": None}
    if cupy.__name__ != "cupy":
        return row  # the stand-in: no torch comparison
    try:
        import torch
    except ImportError:
        return row
    if not torch.cuda.is_available():
        return row
    torch.manual_seed(0)
    tmodel = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width),
                                                                       torch.nn.ReLU())]).cuda()
    topt = torch.optim.SGD(tmodel.parameters(), lr=1e-3)
    tx = torch.as_tensor(x.data.get()).cuda()
    ty = torch.as_tensor(y.data.get()).cuda()

    def tstep():
        topt.zero_grad()
        torch.nn.functional.mse_loss(tmodel(tx), ty).backward()
        topt.step()

    row["torch_ms"] = _median_ms(tstep, steps, warmup, torch.cuda.synchronize)
    return row


def _use_device(device):
    import os

    cupy, _ = gpu_or_reason(device)
    cupy.cuda.Device(int(os.environ.get("RANK", "0")) % cupy.cuda.runtime.getDeviceCount()).use()
    return cupy


def allreduce_rank(device, sizes, steps, warmup):
    """On each rank: the median time of an in-place allreduce of a float32 device array, per size."""
    cupy = _use_device(device)
    from distlab import comm

    pg = comm.world()
    rows = []
    for nbytes in sizes:
        a = cupy.ones(nbytes // 4, dtype=cupy.float32)
        ms = _median_ms(lambda: pg.allreduce(a), steps, warmup, cupy.cuda.get_current_stream().synchronize)
        rows.append({"bytes": nbytes, "ms": ms, "GB/s": nbytes / ms / 1e6})
    return rows


def ddp_rank(device, layers, width, batch, steps, warmup):
    """On each rank: a DDP step (default arguments) and the same step without communication."""
    import numpy as np

    cupy = _use_device(device)
    import distlab
    from distlab import nn, optim
    from distlab.ddp import DistributedDataParallel

    from distlab import comm

    rng = np.random.default_rng(1 + comm.world().rank)
    x = distlab.tensor(cupy.asarray(rng.standard_normal((batch, width), dtype=np.float32)))
    y = distlab.tensor(cupy.asarray(rng.standard_normal((batch, width), dtype=np.float32)))
    loss_fn = nn.MSELoss()
    sync = cupy.cuda.get_current_stream().synchronize
    out = {}
    for name, wrap in (("ddp_ms", DistributedDataParallel), ("alone_ms", lambda m: m)):
        model = wrap(_mlp(layers, width).to("cuda"))
        opt = optim.SGD(model.parameters(), lr=1e-3)

        def step():
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()

        out[name] = _median_ms(step, steps, warmup, sync)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    cupy, reason = gpu_or_reason(args.device)
    if cupy is None:
        print(f"bench_gpu: needs cupy and a CUDA device: {reason}; nothing measured", file=sys.stderr)
        return 2
    import distlab

    if args.device == "fake":
        device = "distlab.fakegpu (the CI stand-in: figures mean nothing)"
    else:
        props = cupy.cuda.runtime.getDeviceProperties(0)
        device = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    layers, width, batch = (20, 256, 32) if args.quick else (100, 256, 32)
    report = {"device": device, "devices": cupy.cuda.runtime.getDeviceCount(), "impl": distlab.IMPL,
              "quick": args.quick, "steps": args.steps, "warmup": args.warmup, "np": args.np}
    report["local_step"] = local_step(cupy, layers, width, batch, args.steps, args.warmup)
    sizes = QUICK_SIZES if args.quick else SIZES
    per_rank = distlab.run(allreduce_rank, np=args.np, args=(args.device, sizes, args.steps, args.warmup),
                           timeout=240)
    report["allreduce"] = [{"bytes": r["bytes"], "ms": max(rank[i]["ms"] for rank in per_rank),
                            "GB/s": min(rank[i]["GB/s"] for rank in per_rank)} for i, r in enumerate(per_rank[0])]
    per_rank = distlab.run(ddp_rank, np=args.np, args=(args.device, 6, 1024, 64, args.steps, args.warmup),
                           timeout=240)
    report["ddp_step"] = {"what": "6 x Linear(1024, 1024) + ReLU, batch 64 per rank, default arguments",
                          "ddp_ms": max(r["ddp_ms"] for r in per_rank),
                          "alone_ms": max(r["alone_ms"] for r in per_rank)}
    print(f"bench_gpu on {device} ({report['devices']} device(s)), impl {distlab.IMPL}, medians of {args.steps} "
          f"steps after {args.warmup} warm-up")
    row = report["local_step"]
    torch_ms = "n/a" if row["torch_ms"] is None else f"{row['torch_ms']:.2f} ms"
    print(f"\n1. one process, {row['what']}: distlab {row['distlab_ms']:.2f} ms, torch {torch_ms}")
    print(f"\n2. allreduce through distlab.comm on {args.np} ranks (slowest rank)\n{'bytes':>12} {'ms':>9} "
          f"{'GB/s':>7}")
    for r in report["allreduce"]:
        print(f"{r['bytes']:>12} {r['ms']:>9.3f} {r['GB/s']:>7.2f}")
    ddp = report["ddp_step"]
    print(f"\n3. DDP step on {args.np} ranks, {ddp['what']}: {ddp['ddp_ms']:.2f} ms "
          f"(each rank alone, no communication: {ddp['alone_ms']:.2f} ms)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
