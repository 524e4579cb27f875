"""Record torch's own FSDP2 (``fully_shard``) training into ``fsdp_torch.npz`` (the parity check's anchor).

Needs torch (not a dependency of distlab): ``pip install torch`` into a scratch environment, then::

    python tests/data/make_fsdp_torch.py

Two gloo ranks on this machine's CPU build the network of ``tests/mpi/fsdp_train.py`` (three Linear blocks of
7, 6 and 6 rows with tanh, then a 3-row head the root owns) from weights drawn here with numpy, apply
``fully_shard`` to each block and then the root, and train it with Adam for a few steps on batches drawn here
too, per rank: ZeRO-3 (``reshard_after_forward=True``), the default (None) and ZeRO-2 (False). Recorded: the
weights and batches given, each rank's loss at each step, the whole parameters at the end (``full_tensor()``),
and how many all-gathers and reduce-scatters torch issued in the last step (counted by wrapping the
``torch.distributed`` functions FSDP2 calls: ``all_gather_single`` and ``reduce_scatter_single`` in 2.13,
``all_gather_into_tensor`` and ``reduce_scatter_tensor`` before).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "fsdp_torch.npz"
STEPS = 3
LAYERS = (("blocks.0.fc", 6, 7), ("blocks.1.fc", 7, 6), ("blocks.2.fc", 6, 6), ("head", 6, 3))
CONFIGS = {"zero3": True, "default": None, "zero2": False}


def weights() -> dict:
    """``{name: array}`` of every parameter (float32), the same on every rank."""
    rng = np.random.default_rng(2024)
    out = {}
    for name, fan_in, fan_out in LAYERS:
        bound = 1 / np.sqrt(fan_in)
        out[f"{name}.weight"] = rng.uniform(-bound, bound, (fan_out, fan_in)).astype(np.float32)
        out[f"{name}.bias"] = rng.uniform(-bound, bound, (fan_out,)).astype(np.float32)
    return out


def batch(step: int, rank: int) -> tuple:
    rng = np.random.default_rng([7, step, rank])
    return rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32)


def run(rank: int, world: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    counts = {"allgather": 0, "reduce_scatter": 0}
    calls = (("all_gather_into_tensor", "allgather"), ("all_gather_single", "allgather"),  # 2.13's names, and older
             ("reduce_scatter_tensor", "reduce_scatter"), ("reduce_scatter_single", "reduce_scatter"))
    for fn, kind in calls:
        original = getattr(dist, fn, None)
        if original is None:
            continue

        def counted(*args, _original=original, _kind=kind, **kwargs):
            counts[_kind] += 1
            return _original(*args, **kwargs)

        setattr(dist, fn, counted)

    class Block(nn.Module):
        def __init__(self, fan_in, fan_out):
            super().__init__()
            self.fc = nn.Linear(fan_in, fan_out)

        def forward(self, x):
            return torch.tanh(self.fc(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(6, 7), Block(7, 6), Block(6, 6)])
            self.head = nn.Linear(6, 3)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    record = {}
    mesh = init_device_mesh("cpu", (world,))
    try:
        for config, reshard in CONFIGS.items():
            model = Net()
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(torch.from_numpy(weights()[name]))
            for block in model.blocks:
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
            for step in range(STEPS):
                counts.update(allgather=0, reduce_scatter=0)
                x, y = (torch.from_numpy(a) for a in batch(step, rank))
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                record[f"{config}/r{rank}/loss{step}"] = np.array(loss.item())
            for kind, n in counts.items():
                record[f"{config}/r{rank}/{kind}"] = np.array(n)
            for name, p in model.named_parameters():
                record[f"{config}/r{rank}/{name}"] = p.full_tensor().detach().numpy().copy()
        queue.put((rank, record))
    finally:
        dist.destroy_process_group()


def main() -> None:
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=run, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    records = {}
    for _ in procs:
        _, rec = queue.get(timeout=120)
        records.update(rec)
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            sys.exit(f"a torch rank failed (exit {p.exitcode})")
    records.update({f"weights/{k}": v for k, v in weights().items()})
    records["torch_version"] = np.array(torch.__version__)
    np.savez_compressed(OUT, **records)
    print(f"{len(records)} arrays, {OUT.stat().st_size} bytes: {OUT}")


if __name__ == "__main__":
    main()
