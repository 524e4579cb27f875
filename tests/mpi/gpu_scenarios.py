"""The real-GPU acceptance scenarios, runnable on the strict stand-in too: DDP with default arguments, Join over
DDP with ZeroRedundancyOptimizer and SyncBatchNorm on uneven inputs, and the Horovod-style front, each run on
numpy and on the device from the same seeds and compared.

argv: the twin (``reference``, ``core`` or ``mixed``) and the device module: ``fake`` (``distlab.fakegpu``,
results bit-equal to numpy) or ``cupy`` (ranks share GPU 0 when there are fewer GPUs than ranks; float32 results
within ``rtol=1e-4, atol=1e-5`` of numpy after a few steps: cupy's matmuls and reductions round differently).
"""
import os
import sys

IMPL = sys.argv[1] if len(sys.argv) > 1 else "core"
DEVICE = sys.argv[2] if len(sys.argv) > 2 else "fake"
if IMPL == "mixed":
    os.environ["DISTLAB_IMPL"] = "reference" if int(os.environ["RANK"]) % 2 == 0 else "core"

import numpy as np  # noqa: E402

if DEVICE == "cupy":
    import cupy as xp  # noqa: E402
else:
    from distlab import fakegpu as xp  # noqa: E402

    xp.use_as_cuda()

import distlab  # noqa: E402
from distlab import _backend, collectives as hvd, comm, nn, optim  # noqa: E402
from distlab.autograd import to_numpy  # noqa: E402
from distlab.ddp import DistributedDataParallel as DDP  # noqa: E402
from distlab.optim import ZeroRedundancyOptimizer  # noqa: E402

from scenario_checks import twin_of  # noqa: E402

world = comm.world()
rank, size = world.rank, world.size
xp.cuda.Device(rank % xp.cuda.runtime.getDeviceCount()).use()
impl = twin_of(rank, IMPL)
Join = _backend.load("join", impl).Join
TOL = {"rtol": 0.0, "atol": 0.0} if DEVICE == "fake" else {"rtol": 1e-4, "atol": 1e-5}
loss_fn = nn.MSELoss()
hvd.init()


def data(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def on(device, array):
    return xp.asarray(array) if device == "cuda" else array


def host(device, array):
    """A host copy of a result, which must still be on the device it was computed on."""
    assert isinstance(array, xp.ndarray if device == "cuda" else np.ndarray), (device, type(array))
    return to_numpy(array)


def ddp_section(device, out):
    """DDP with default arguments (automatic bucket caps), 3 steps on different data per rank."""
    distlab.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(device), impl=impl)
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        opt.zero_grad()
        loss_fn(model(distlab.tensor(on(device, data(10 * rank + step, 6, 8)))),
                distlab.tensor(on(device, data(step, 6, 4)))).backward()
        opt.step()
    out["ddp"] = [host(device, p.data) for p in model.parameters()]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        distlab.manual_seed(0)
        self.fc = nn.Linear(5, 6, seed=1)
        self.bn = nn.SyncBatchNorm(6, momentum=0.3)
        self.head = nn.Linear(6, 2, seed=2)

    def forward(self, x):
        return self.head(self.bn(self.fc(x)).tanh())


def join_section(device, out):
    """Join over DDP, ZeroRedundancyOptimizer and SyncBatchNorm, rank r running 2 + r steps."""
    model = DDP(Net().to(device), impl=impl)
    # SGD, not Adam: Adam's first steps divide by |g| + eps, so a gradient that is 0 on numpy and 1e-9 on the
    # GPU would move a weight by lr and no tolerance could compare them
    zero = ZeroRedundancyOptimizer(model.parameters(), optim.SGD, lr=0.05, momentum=0.9)
    with Join([model, model.module.bn, zero]):
        for i in range(2 + rank):
            zero.zero_grad()
            loss_fn(model(distlab.tensor(on(device, data(1000 * rank + i, 4, 5)))),
                    distlab.tensor(on(device, data(i, 4, 2)))).backward()
            zero.step()
    out["join"] = [host(device, p.data) for p in model.module.parameters()]
    out["join running stats"] = [host(device, model.module.bn.running_mean.data),
                                 host(device, model.module.bn.running_var.data)]


def collectives_section(device, out):
    out["hvd allreduce"] = host(device, hvd.allreduce(on(device, data(rank, 7)), name=f"{device}.ar"))
    out["hvd allgather"] = host(device, hvd.allgather(on(device, data(rank, rank + 1, 2)), name=f"{device}.ag"))
    out["hvd grouped"] = [host(device, g) for g in hvd.grouped_allreduce(
        [on(device, data(rank + i, 3 + i)) for i in range(4)], name=f"{device}.grp")]
    out["hvd broadcast"] = host(device, hvd.broadcast(on(device, data(rank, 4)), root_rank=size - 1,
                                                      name=f"{device}.bc"))


results = {}
for device in ("cpu", "cuda"):
    results[device] = {}
    for section in (ddp_section, join_section, collectives_section):
        section(device, results[device])

for key, want in results["cpu"].items():
    got = results["cuda"][key]
    for i, (g, w) in enumerate(zip(got, want) if isinstance(want, list) else [(got, want)]):
        np.testing.assert_allclose(g, w, err_msg=f"{key}[{i}]", **TOL)
print(f"gpu scenarios OK ({IMPL}, {DEVICE}): {len(results['cuda'])} results equal on numpy and the device",
      flush=True)
