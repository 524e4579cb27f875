"""The optimizers of distlab.optim under distributed autograd's DistributedOptimizer (2 workers).

Worker 0 drives: for each optimizer, every worker owns one fresh parameter ``p``; in a distributed autograd
context the loss is ``sum over owners of sum((p * x)**2)`` with ``x`` = ones, so each owner's gradient is
``2 p``; ``DistributedOptimizer.step(context_id)`` must move each remote parameter exactly as the same optimizer
stepping a local copy with that gradient.
"""
import os
import threading

import numpy as np

import distlab.rpc as rpc
from distlab import distributed_autograd as dist_autograd
from distlab import nn, optim
from distlab.autograd import Tensor
from distlab.distributed_autograd import DistributedOptimizer

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
_done = threading.Event()
CASES = [(optim.Adagrad, dict(lr=0.1, lr_decay=0.01)), (optim.RMSprop, dict(lr=0.01, momentum=0.9, centered=True)),
         (optim.Adadelta, dict(rho=0.8)), (optim.Adamax, dict(lr=0.1)), (optim.Rprop, dict(lr=0.05)),
         (optim.Adam, dict(lr=0.1))]


def start_value(owner):
    return np.arange(4.0) - 1.5 + owner


def fresh_param():
    return rpc.RRef(nn.Parameter(start_value(rank)))


def finish():
    _done.set()


rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_timeout=30)
if rank == 0:
    for opt_cls, kw in CASES:
        rrefs = [rpc.rpc_sync(dst, fresh_param) for dst in range(world)]
        opt = DistributedOptimizer(opt_cls, rrefs, **kw)
        for _ in range(3):
            with dist_autograd.context() as cid:
                x = Tensor(np.ones(4), requires_grad=True)
                loss = None
                for r in rrefs:
                    out = r.rpc_sync().__mul__(x)
                    s = (out * out).sum()
                    loss = s if loss is None else loss + s
                dist_autograd.backward(cid, [loss])
                opt.step(cid)
        for owner, r in enumerate(rrefs):
            local = nn.Parameter(start_value(owner))
            local_opt = opt_cls([local], **kw)
            for _ in range(3):
                local.grad = Tensor(2 * local.data)
                local_opt.step()
            np.testing.assert_allclose(r.to_here().data, local.data, rtol=1e-12, err_msg=opt_cls.__name__)
            assert not np.allclose(local.data, start_value(owner)), opt_cls.__name__  # it did move
        print(f"DistributedOptimizer({opt_cls.__name__}) OK", flush=True)
        del rrefs, r, opt
    for dst in range(1, world):
        rpc.rpc_sync(dst, finish)
else:
    assert _done.wait(120), "worker 0 never finished"
rpc.shutdown()
print(f"rank {rank}: optimizers under DistributedOptimizer OK", flush=True)
