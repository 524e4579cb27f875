"""Every public component on numpy and on the strict device stand-in (distlab.fakegpu), in one launch.

argv: impl ("reference", "core" or "mixed": even ranks reference, odd ranks core), output prefix.
Each section runs once per device from the same seeds: the comm layer's collectives, object collectives and
send/recv; the Horovod-style front (every op, grouped and fused, a process set, DistributedOptimizer,
broadcast_parameters / broadcast_optimizer_state); Join over DDP (default arguments), ZeroRedundancyOptimizer,
SyncBatchNorm and DistributedMean with uneven inputs; every optimizer; BatchNorm1d and Embedding. On the device
every result must stay on the device, equal the numpy run bit for bit, issue the same collectives, and no module
outside the comm layer may move data through the host. Beyond 2 ranks the floating-point results are compared in
dtype and shape only: the groups move device arrays through the ipc transport, which sums in rank order, and host
arrays through MPI, which groups more than two ranks its own way, and training amplifies those last bits (a bias
before a batch norm has a gradient of rounding noise, which Adam scales to whole steps). The twins and the mixed
world still agree bit for bit with each other there (test_device_mpi.py). Each rank writes <prefix>.rank<N>.pkl (results and
traces per device) for the test to compare twins.
"""
import os
import pickle
import sys

if sys.argv[1] == "mixed":
    os.environ["DISTLAB_IMPL"] = "reference" if int(os.environ["RANK"]) % 2 == 0 else "core"

import numpy as np  # noqa: E402

import distlab  # noqa: E402
from distlab import _backend, collectives as hvd, comm, fakegpu, nn, optim  # noqa: E402
from distlab.ddp import DistributedDataParallel as DDP  # noqa: E402
from distlab.metrics import DistributedMean  # noqa: E402
from distlab.optim import ZeroRedundancyOptimizer  # noqa: E402
from distlab.testing import RecordingGroup  # noqa: E402
from scenario_checks import DEVICES, host, on, staged_outside_comm, start_counting, to_device, twin_of  # noqa: E402

impl_arg, prefix = sys.argv[1], sys.argv[2]
world = comm.world()
rank, size = world.rank, world.size
impl = twin_of(rank, impl_arg)
Join = _backend.load("join", impl).Join
hvd.init()
loss_fn = nn.MSELoss()


def data(seed, *shape, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def stays(device, array):
    """A result is on the device it came from (the stand-in's arrays never turn into numpy ones)."""
    assert isinstance(array, fakegpu.ndarray if device == "cuda" else np.ndarray), (device, type(array))
    return host(array)


def comm_section(device, out):
    xp = fakegpu if device == "cuda" else np
    for op in ("sum", "avg", "min", "max"):
        a = on(device, data(rank, 5))
        world.allreduce(a, op=op)
        out[f"comm allreduce {op}"] = stays(device, a)
    bits = on(device, np.array([1 << rank, 3], dtype=np.int64))
    world.allreduce(bits, op="bor")
    out["comm allreduce bor"] = stays(device, bits)
    b = on(device, data(rank + 10, 4))
    world.broadcast(b, src=size - 1)
    out["comm broadcast"] = stays(device, b)
    out["comm allgather"] = stays(device, world.allgather(on(device, data(rank, 3))))
    inp, outp = on(device, data(rank, size * 2)), xp.zeros(2, dtype=np.float32)
    world.reduce_scatter(outp, inp)
    out["comm reduce_scatter"] = stays(device, outp)
    work = world.allreduce(on(device, data(rank + 20, 6)), async_op=True)
    work.wait()
    received = xp.zeros((size, 2), dtype=np.float32)
    world.alltoall(received, on(device, data(rank + 30, size, 2)))
    out["comm alltoall"] = stays(device, received)
    objs = world.allgather_object({"rank": rank, "array": on(device, data(rank, 2))})
    out["comm allgather_object"] = [stays(device, o["array"]) for o in objs]
    if size >= 2 and rank < 2:
        if rank == 0:
            world.send(on(device, data(40, 3)), dst=1)
        else:
            got = xp.zeros(3, dtype=np.float32)
            world.recv(got, src=0)
            out["comm send/recv"] = stays(device, got)
    world.barrier()


def collectives_section(device, out):
    out["hvd allreduce"] = stays(device, hvd.allreduce(on(device, data(rank, 7)), name=f"{device}.ar"))
    out["hvd allreduce pre/post"] = stays(device, hvd.allreduce(on(device, data(rank, 7)), name=f"{device}.arps",
                                                              op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0))
    for step in range(2):  # the second time through the response cache; five tensors fused in one buffer
        group = hvd.grouped_allreduce([on(device, data(rank + i, 3 + i)) for i in range(5)], name=f"{device}.grp")
    out["hvd grouped"] = [stays(device, g) for g in group]
    out["hvd allgather"] = stays(device, hvd.allgather(on(device, data(rank, rank + 1, 2)), name=f"{device}.ag"))
    out["hvd broadcast"] = stays(device, hvd.broadcast(on(device, data(rank, 4)), root_rank=size - 1,
                                                       name=f"{device}.bc"))
    received, splits = hvd.alltoall(on(device, data(rank, sum(range(1, size + 1)), 2)), splits=list(range(1, size + 1)),
                                    name=f"{device}.a2a")
    out["hvd alltoall"] = stays(device, received)
    out["hvd reducescatter"] = stays(device, hvd.reducescatter(on(device, data(rank, 2 * size, 3)),
                                                               name=f"{device}.rs", op=hvd.Sum))
    pairs = hvd.add_process_set([0, 1])
    if rank in (0, 1):
        out["hvd process set"] = stays(device, hvd.allreduce(on(device, data(rank, 3)), name=f"{device}.ps",
                                                             process_set=pairs))
    hvd.remove_process_set(pairs)
    distlab.manual_seed(rank)  # different weights per rank: broadcast_parameters makes them rank 0's
    model = to_device(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(optim.Adam(model.parameters(), lr=0.01), named_parameters=model.named_parameters())
    for step in range(3):
        opt.zero_grad()
        loss_fn(model(distlab.tensor(on(device, data(100 * rank + step, 4, 4)))),
                distlab.tensor(on(device, data(step, 4, 2)))).backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    out["hvd DistributedOptimizer"] = [stays(device, p.data) for p in model.parameters()]
    out["hvd optimizer state"] = [stays(device, s["exp_avg"]) for s in opt.state.values()]


class Net(nn.Module):
    def __init__(self, group):
        super().__init__()
        distlab.manual_seed(0)
        self.fc = nn.Linear(5, 6, seed=1)
        self.bn = nn.SyncBatchNorm(6, momentum=0.3, process_group=group)
        self.head = nn.Linear(6, 2, seed=2)

    def forward(self, x):
        return self.head(self.bn(self.fc(x)).tanh())


def join_section(device, out):
    for bucket_view in (False, True):
        group = RecordingGroup(world)
        model = DDP(to_device(Net(group), device), process_group=group, impl=impl, gradient_as_bucket_view=bucket_view)
        zero = ZeroRedundancyOptimizer(model.parameters(), optim.Adam, process_group=group, lr=0.01,
                                       parameters_as_bucket_view=bucket_view)
        mean = DistributedMean(group)
        with Join([model, model.module.bn, zero, mean], divide_by_initial_world_size=False):
            for i in range(2 + rank):  # uneven inputs
                zero.zero_grad()
                loss = loss_fn(model(distlab.tensor(on(device, data(1000 * rank + i, 4, 5)))),
                               distlab.tensor(on(device, data(i, 4, 2))))
                loss.backward()
                zero.step()
                mean.update(loss.data)
        if bucket_view:  # ZeRO's shards live in device buckets
            assert all(isinstance(b, type(model.module.fc.weight.data)) for b in zero._buckets)
        out[f"join view={bucket_view}"] = {
            "params": [stays(device, p.data) for p in model.module.parameters()],
            "running": [stays(device, model.module.bn.running_mean.data),
                        stays(device, model.module.bn.running_var.data)],
            "mean": mean.compute(), "trace": group.trace}


def optim_section(device, out):
    for name in ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "Adamax", "Rprop"):
        distlab.manual_seed(0)
        model = to_device(nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 3, seed=3)), device)
        kwargs = {"momentum": 0.9, "lr": 0.1} if name == "SGD" else {}
        opt = getattr(optim, name)(model.parameters(), **kwargs)
        for step in range(3):
            opt.zero_grad()
            tokens = distlab.tensor(on(device, np.array([[1, 2], [3, 1]]) + step))
            loss_fn(model(tokens).mean(axis=1), distlab.tensor(on(device, data(step, 2, 3)))).backward()
            opt.step()
        out[f"optim {name}"] = [stays(device, p.data) for p in model.parameters()]
    distlab.manual_seed(0)
    emb, bn = to_device(nn.Embedding(8, 3, sparse=True), device), to_device(nn.BatchNorm1d(3), device)
    opt = optim.SGD(emb.parameters(), lr=0.5)
    for step in range(2):
        opt.zero_grad()
        y = bn(emb(distlab.tensor(on(device, np.array([step, 2, 5, 2])))))
        (y * y).sum().backward()
        opt.step()
    out["nn sparse Embedding + BatchNorm1d"] = [stays(device, emb.weight.data), stays(device, bn.running_mean.data),
                                                stays(device, bn.running_var.data)]


results = {}
for device in DEVICES:  # numpy, then the strict device stand-in
    out = results[device] = {}
    start_counting(device)
    for section in (comm_section, collectives_section, join_section, optim_section):
        section(device, out)
        assert not staged_outside_comm(device), (section.__name__, staged_outside_comm(device))


def same(a, b, where):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and (np.array_equal(a, b) or not exact and a.dtype.kind in "fc"
                                       and a.shape == b.shape), (where, a, b)
    else:
        assert a == b or (a != a and b != b) or not exact and isinstance(a, float) and isinstance(b, float), \
            (where, a, b)


exact = size == 2  # see the module docstring


same(results["cpu"], results["cuda"], "cpu vs stand-in")
with open(f"{prefix}.rank{rank}.pkl", "wb") as fh:
    pickle.dump(results, fh)
print(f"rank {rank} ({impl}): {len(results['cuda'])} component checks equal on numpy and the device stand-in",
      flush=True)
