"""A model split across workers (a pipeline of stages held by RRefs), trained with distributed autograd and
``DistributedOptimizer``.

Run: ``python -m distlab run -n 3 examples/dist_autograd_pipeline.py`` (any n >= 2; the stages go round-robin
over the workers, rank 0 drives). Each step, inside ``with dist_autograd.context() as context_id``, the input
flows through the stages with ``stage_rref.rpc_sync().forward(x)`` (each call records a send function on the
caller and a recv function on the stage's owner), the loss is computed on the driver, ``dist_autograd.backward``
runs backward across the workers (each stage's gradients stay in the context on its owner) and
``DistributedOptimizer.step(context_id)`` updates every stage where it lives. At the end the same model is
trained locally in one process from the same initial weights: the parameters agree to float tolerance.

``--device cuda`` puts every stage on its owner's GPU and the data on the driver's (cupy; ``--device fake``: the
CI stand-in): the driver sets a device map to every worker (``RpcBackendOptions(device_maps=...)``), so the
activations land on each stage's device, the results come back through the inverse maps, and distributed
autograd's gradients go back the way their tensors came.
"""
import argparse
import os
import sys
import threading

import numpy as np

import distlab.rpc as rpc
from distlab import distributed_autograd as dist_autograd
from distlab import nn, optim
from distlab.autograd import Tensor, to_numpy
from distlab.distributed_autograd import DistributedOptimizer
from distlab.rpc import RpcBackendOptions

from _device import add_device_argument, select, this_rank

SIZES = [1, 32, 32, 1]  # three stages: 1 -> 32 -> 32 -> 1
STEPS = 150
LR = 0.05

rank = int(os.environ.get("RANK", 0))
world = int(os.environ.get("WORLD_SIZE", 1))
_done = threading.Event()
xp = np  # the array module of --device (set on every rank before init_rpc)


class Stage(nn.Module):
    """One pipeline stage: a Linear layer, with tanh except on the last stage."""

    def __init__(self, index):
        super().__init__()
        self.lin = nn.Linear(SIZES[index], SIZES[index + 1], dtype=np.float64, seed=100 + index)
        self.last = index == len(SIZES) - 2
        if xp is not np:
            with this_rank(xp):  # built on an RPC thread (remote): on this rank's GPU
                self.to("cuda")

    def forward(self, x):
        with this_rank(xp):
            y = self.lin(x)
            return y if self.last else y.tanh()

    def parameter_rrefs(self):
        return [rpc.RRef(p) for p in self.parameters()]


def data():
    x = np.linspace(-3, 3, 64).reshape(-1, 1)
    return xp.asarray(x), xp.asarray(np.sin(x))


def mse(pred, target):
    diff = pred - Tensor(target)
    return (diff * diff).mean()


def finish():
    _done.set()


def train_distributed():
    owners = [(1 + i) % world for i in range(len(SIZES) - 1)]  # round-robin, the first stage off the driver
    stages = [rpc.remote(owner, Stage, (i,)) for i, owner in enumerate(owners)]
    param_rrefs = [p for s in stages for p in s.rpc_sync().parameter_rrefs()]
    opt = DistributedOptimizer(optim.SGD, param_rrefs, lr=LR)
    x, y = data()
    for step in range(STEPS):
        with dist_autograd.context() as context_id:
            h = Tensor(x)
            for stage in stages:
                h = stage.rpc_sync().forward(h)
            loss = mse(h, y)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        if step % 50 == 0 or step == STEPS - 1:
            print(f"step {step:3d}  loss {float(loss.data):.5f}  (stages on workers {owners})")
    return [p.to_here().data for p in param_rrefs]


def train_local():
    stages = [Stage(i) for i in range(len(SIZES) - 1)]
    params = [p for s in stages for p in s.parameters()]
    opt = optim.SGD(params, lr=LR)
    x, y = data()
    for _ in range(STEPS):
        opt.zero_grad()
        h = Tensor(x)
        for stage in stages:
            h = stage(h)
        mse(h, y).backward()
        opt.step()
    return [p.data for p in params]


def check_world_size():
    """The driver and at least one stage owner: with fewer ranks, say so and exit at once (non-zero)."""
    from mpi4py import MPI

    size = MPI.COMM_WORLD.Get_size()
    if size < 2:
        print(f"dist_autograd_pipeline.py needs 2 or more ranks (got {size}): rank 0 drives and the stages live "
              "on the other ranks; run it with `python -m distlab run -n 3 examples/dist_autograd_pipeline.py`",
              file=sys.stderr, flush=True)
        sys.exit(2)
    return size


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_argument(parser)
    device = parser.parse_args().device
    world = check_world_size()
    xp = select(device)
    options = None
    if device != "cpu" and rank == 0:  # the driver's device arrays land on each stage owner's device (itself too:
        count = xp.cuda.runtime.getDeviceCount()  # a stage it owns is called over RPC like the others)
        options = RpcBackendOptions(device_maps={f"worker{w}": {0: w % count} for w in range(world)})
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=options)
    if rank == 0:
        dist_params = train_distributed()
        local_params = train_local()
        worst = max(float(np.abs(to_numpy(a) - to_numpy(b)).max()) for a, b in zip(dist_params, local_params))
        print(f"distributed vs local training: max parameter difference {worst:.2e}")
        assert worst < 1e-9, worst
        for dst in range(1, world):
            rpc.rpc_sync(dst, finish)
    else:
        assert _done.wait(300), "the driver never finished"
    rpc.shutdown()
