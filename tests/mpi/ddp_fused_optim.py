"""DistributedDataParallel._register_fused_optim on several ranks: the update of each bucket's parameters runs
as the bucket is reduced (inside backward), and training equals local training on the whole batch with the same
optimizer stepped after backward; under Join with uneven inputs the joined ranks shadow the reductions, and with
them the updates, so every rank ends with the same parameters.

argv: impl ("reference", "core" or "mixed": even ranks reference, odd ranks core).
"""
import sys

import numpy as np

from distlab import comm, nn, optim
from distlab.ddp import DistributedDataParallel as DDP
from scenario_checks import DEVICES, host, on, seeded_mlp, sharded_batch, staged_outside_comm, start_counting, \
    to_device, twin_of

impl_arg = sys.argv[1]
world = comm.world()
rank, size = world.rank, world.size
impl = twin_of(rank, impl_arg)
SHARD, WIDTH = 4, 64
HYPER = dict(lr=0.05, momentum=0.9, weight_decay=1e-3)


def mlp():
    return to_device(seeded_mlp(WIDTH), device)


def batch(step, rows):
    x, y = sharded_batch(step, rows, SHARD * size, WIDTH)
    return on(device, x), on(device, y)


for device in DEVICES:  # numpy, then the strict device stand-in, in one launch
    start_counting(device)
    # 16 KiB buckets: one layer's weight each, so the updates of the last layers run while earlier buckets reduce.
    model, local = DDP(mlp(), bucket_cap_mb=1 / 64, impl=impl), mlp()
    model._register_fused_optim(optim.SGD, **HYPER)
    local_opt = optim.SGD(local.parameters(), **HYPER)
    loss_fn = nn.MSELoss()
    before = [host(p.data) for p in model.parameters()]
    for step in range(4):
        model.zero_grad()
        local_opt.zero_grad()
        x, y = batch(step, np.arange(rank * SHARD, (rank + 1) * SHARD))
        loss_fn(model(x), y).backward()  # no step(): backward returns with the parameters updated
        x, y = batch(step, np.arange(SHARD * size))
        loss_fn(local(x), y).backward()
        local_opt.step()
    assert len(model.reducer.get_logging_data()["bucket_indices"]) > 4
    assert not any(np.array_equal(a, host(p.data)) for a, p in zip(before, model.parameters()))
    for (name, a), b in zip(model.module.named_parameters(), local.parameters()):
        a, b = host(a.data), host(b.data)
        assert np.allclose(a, b, atol=1e-5, rtol=1e-5), (name, np.abs(a - b).max())
    print(f"rank {rank} ({impl}, {device}): fused optimizer equals local training", flush=True)

    # Uneven inputs: the last rank trains 3 steps, the others 1; the joined ranks' shadow reductions update them too.
    model = DDP(mlp(), bucket_cap_mb=1 / 64, impl=impl)
    model._register_fused_optim(optim.SGD, **HYPER)
    with model.join():
        for step in range(3 if rank == size - 1 else 1):
            model.zero_grad()
            x, y = batch(step, np.arange(rank * SHARD, (rank + 1) * SHARD))
            loss_fn(model(x), y).backward()
    final = world.allgather_object([host(p.data) for p in model.module.parameters()])
    assert all(np.array_equal(a, b) for other in final for a, b in zip(other, final[0]))
    print(f"rank {rank} ({impl}, {device}): fused optimizer under Join OK", flush=True)
    assert not staged_outside_comm(device), staged_outside_comm(device)
