"""bucket_cap_mb="auto" on several ranks: every rank chooses the same caps and layout (also in a mixed world),
training equals local training on the whole batch, a rank that joined early shadows the probes (Join), and,
through MPI (arenas off: DISTLAB_SHARED_MEMORY=0), the bucket layout does not change a bit of the result.

argv: impl ("reference", "core" or "mixed": even ranks reference, odd ranks core).
"""
import sys

import numpy as np

from distlab import comm, nn, optim
from distlab.comm.shared import shared_memory_enabled
from distlab.ddp import DistributedDataParallel as DDP
from scenario_checks import DEVICES, host, on, seeded_mlp, sharded_batch, staged_outside_comm, start_counting, \
    to_device, twin_of

impl_arg = sys.argv[1]
world = comm.world()
rank, size = world.rank, world.size
impl = twin_of(rank, impl_arg)
SHARD, WIDTH = 4, 128


def mlp():
    return to_device(seeded_mlp(WIDTH), device)


def batch(step, rows):
    x, y = sharded_batch(step, rows, SHARD * size, WIDTH)
    return on(device, x), on(device, y)


for device in DEVICES:  # numpy, then the strict device stand-in, in one launch
    start_counting(device)
    # Every rank agrees, and DDP equals one process training on the whole batch.
    model, local = DDP(mlp(), bucket_cap_mb="auto", impl=impl), mlp()
    opt, local_opt = optim.SGD(model.parameters(), lr=0.05), optim.SGD(local.parameters(), lr=0.05)
    loss_fn = nn.MSELoss()
    for step in range(4):
        opt.zero_grad()
        local_opt.zero_grad()
        x, y = batch(step, np.arange(rank * SHARD, (rank + 1) * SHARD))
        loss_fn(model(x), y).backward()
        x, y = batch(step, np.arange(SHARD * size))
        loss_fn(local(x), y).backward()
        opt.step()
        local_opt.step()
    for (name, a), b in zip(model.module.named_parameters(), local.parameters()):
        a, b = host(a.data), host(b.data)
        assert np.allclose(a, b, atol=1e-5, rtol=1e-5), (name, np.abs(a - b).max())
    data = model.reducer.get_logging_data()
    choice = data["auto_bucket_cap"]
    assert data["has_rebuilt_buckets"] and choice is not None
    assert data["bucket_cap_bytes"] == choice["cap_bytes"]
    assert data["first_bucket_cap_bytes"] == choice["first_cap_bytes"]
    agreed = world.allgather_object((data["bucket_indices"], choice))
    assert all(a == agreed[0] for a in agreed), agreed
    print(f"rank {rank} ({impl}, {device}): caps {choice['cap_bytes']} B / first {choice['first_cap_bytes']} B, "
          f"{len(data['bucket_indices'])} buckets, contention {choice['contention']:.2f}, agreed", flush=True)

    # Uneven inputs: the last rank trains 3 steps, the others 1; the joined ranks shadow the rebuild and its probes.
    model = DDP(mlp(), bucket_cap_mb="auto", impl=impl)
    opt = optim.SGD(model.parameters(), lr=0.05)
    steps = 3 if rank == size - 1 else 1
    with model.join():
        for step in range(steps):
            opt.zero_grad()
            x, y = batch(step, np.arange(rank * SHARD, (rank + 1) * SHARD))
            loss_fn(model(x), y).backward()
            opt.step()
    final = world.allgather_object([host(p.data) for p in model.module.parameters()])
    assert all(np.array_equal(a, b) for other in final for a, b in zip(other, final[0]))
    data = model.reducer.get_logging_data()
    agreed = world.allgather_object((data["has_rebuilt_buckets"], data["bucket_cap_bytes"], data["bucket_indices"]))
    assert all(a == agreed[0] for a in agreed) and agreed[0][0], agreed
    print(f"rank {rank} ({impl}, {device}): uneven inputs with auto caps OK", flush=True)

    # Across hosts, the layout does not change the bits: MPICH's allreduce sums every element in the same order
    # whatever the message's size (checked here through MPI, with the arenas off). So two runs in which "auto" measures
    # differently and chooses different caps still train the same parameters. On one node (the arenas on) "auto"
    # probes nothing and always picks the whole model, so its layout cannot differ there; a layout chosen by hand can
    # (on more than 2 ranks, buckets under SHARED_MIN_BYTES go through MPI, whose order of summation is not the
    # arena's rank order).
    def trained(cap, view):
        model = DDP(mlp(), bucket_cap_mb=cap, gradient_as_bucket_view=view, impl=impl)
        opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(3):
            opt.zero_grad()
            x, y = batch(step, np.arange(rank * SHARD, (rank + 1) * SHARD))
            loss_fn(model(x), y).backward()
            opt.step()
        buckets = len(model.reducer.get_logging_data()["bucket_indices"])
        return [host(p.data) for p in model.module.parameters()], buckets


    if not shared_memory_enabled():
        for view in (False, True):
            (whole, one), (split, many) = trained(25, view), trained(0.06, view)  # one bucket; one per weight
            assert one == 1 and many >= 6, (one, many)
            assert all(np.array_equal(a, b) for a, b in zip(whole, split)), max(
                float(np.abs(a - b).max()) for a, b in zip(whole, split))
        print(f"rank {rank} ({impl}, {device}): one bucket and one per layer train the same bits", flush=True)
    assert not staged_outside_comm(device), staged_outside_comm(device)
