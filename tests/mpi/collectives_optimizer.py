"""hvd.DistributedOptimizer on N ranks equals DDP and single-process training on the whole batch (the tolerance of
tests/mpi/ddp_train.py), and behaves as Horovod's: backward_passes_per_step, gradient_predivide_factor,
Compression.fp16, synchronize()/skip_synchronize(), zero_grad between backward and step refused, and clear errors.

Argument: ``mixed`` makes even ranks use the reference twin and odd ranks the core twin.
"""
import os
import sys
import warnings

import numpy as np

if "mixed" in sys.argv[1:]:
    os.environ["DISTLAB_IMPL"] = "reference" if int(os.environ["RANK"]) % 2 == 0 else "core"

import distlab  # noqa: E402
from distlab import collectives as hvd, comm, nn, optim  # noqa: E402
from distlab.ddp import DistributedDataParallel as DDP  # noqa: E402
from scenario_checks import DEVICES, expect, on, staged_outside_comm, start_counting, to_device  # noqa: E402

hvd.init()
rank, size = hvd.rank(), hvd.size()
SHARD = 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16, seed=1)
        self.fc2 = nn.Linear(16, 16, seed=2)
        self.head = nn.Linear(16, 3, seed=3)

    def forward(self, x):
        return self.head(self.fc2(self.fc1(x).tanh()).tanh())


def batch(step, rows):
    rng = np.random.default_rng(step)
    x = rng.standard_normal((SHARD * size, 6)).astype(np.float32)
    y = rng.standard_normal((SHARD * size, 3)).astype(np.float32)
    return distlab.tensor(on(device, x[rows])), distlab.tensor(on(device, y[rows]))


def make():
    distlab.manual_seed(0)
    return to_device(Net(), device)


mine = np.arange(rank * SHARD, (rank + 1) * SHARD)
everything = np.arange(SHARD * size)
loss_fn = nn.MSELoss()

for device in DEVICES:  # numpy, then the strict device stand-in, in one launch
    start_counting(device)
    for config in ({}, {"gradient_predivide_factor": 2.0}, {"backward_passes_per_step": 2},
                   {"compression": hvd.Compression.fp16, "tol": 2e-3}):
        tol = config.pop("tol", 1e-5)
        passes = config.get("backward_passes_per_step", 1)
        model, local, ddp_model = make(), make(), DDP(make(), process_group=comm.world())
        opt = hvd.DistributedOptimizer(optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=model.named_parameters(), **config)
        local_opt = optim.SGD(local.parameters(), lr=0.05, momentum=0.9)
        ddp_opt = optim.SGD(ddp_model.parameters(), lr=0.05, momentum=0.9)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        for step in range(4):
            opt.zero_grad()
            local_opt.zero_grad()
            ddp_opt.zero_grad()
            for micro in range(passes):
                x, y = batch(10 * step + micro, mine)
                (loss_fn(model(x), y) / passes).backward()          # gradients accumulate locally between passes
                if passes == 1:
                    loss_fn(ddp_model(x), y).backward()
                x, y = batch(10 * step + micro, everything)
                (loss_fn(local(x), y) / passes).backward()
            opt.step()
            local_opt.step()
            if passes == 1:
                ddp_opt.step()
        for (name, a), b, c in zip(model.named_parameters(), local.parameters(), ddp_model.module.parameters()):
            assert np.allclose(a.data, b.data, atol=tol, rtol=tol), (config, name, np.abs(a.data - b.data).max())
            if passes == 1:
                assert np.allclose(a.data, c.data, atol=tol, rtol=tol), (config, name, np.abs(a.data - c.data).max())
        opt.remove_hooks()

    # synchronize() then step() inside skip_synchronize(): no second allreduce, no warning; a bare step() warns
    model = make()
    opt = hvd.DistributedOptimizer(optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    x, y = batch(99, mine)
    loss_fn(model(x), y).backward()
    expect(RuntimeError, opt.zero_grad, "before optimizer.step() or optimizer.synchronize()")
    opt.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with opt.skip_synchronize():
            opt.step()
    loss_fn(model(x), y).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.step()
    assert any("skip_synchronize" in str(w.message) for w in seen)
    loss_fn(model(x), y).backward()
    expect(RuntimeError, lambda: loss_fn(model(x), y).backward(), "more than backward_passes_per_step")
    opt.synchronize()
    opt.remove_hooks()
    assert not staged_outside_comm(device), staged_outside_comm(device)
    print(f"rank {rank}: optimizer on {device} equals DDP and local training", flush=True)

params = list(make().named_parameters())
expect(ValueError, lambda: hvd.DistributedOptimizer(optim.SGD([p for _n, p in params], lr=0.1),
                                                    named_parameters=params[:1]), "are not named")
expect(ValueError, lambda: hvd.DistributedOptimizer(optim.SGD([p for _n, p in params], lr=0.1),
                                                    named_parameters=[("a", p) for _n, p in params]), "duplicates")
expect(ValueError, lambda: hvd.DistributedOptimizer(optim.SGD([p for _n, p in params], lr=0.1), op=hvd.Sum,
                                                    gradient_predivide_factor=2.0), "only supported with op=Average")
expect(NotImplementedError, lambda: hvd.DistributedOptimizer(optim.SGD([p for _n, p in params], lr=0.1),
                                                             op=hvd.Adasum), "Adasum")
print(f"rank {rank}: optimizer OK", flush=True)
hvd.shutdown()
