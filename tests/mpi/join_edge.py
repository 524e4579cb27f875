"""Join edge cases. argv: impl, mode, and for "raise" the device ("cpu", or "cuda": the device stand-in).

skew: rank 0 has no input at all, the last rank 1002 iterations: rank 0 warns once about the skew (on numpy, then
on the device stand-in with device scalars, in one launch).
raise: the last rank raises inside the Join body (in forward): the error propagates and ends the job.
"""
import sys
import warnings

import numpy as np

import distlab
from distlab import _backend, comm, nn
from distlab.ddp import DistributedDataParallel as DDP
from distlab.metrics import DistributedMean
from scenario_checks import DEVICES, on, staged_outside_comm, start_counting, to_device

impl, mode = sys.argv[1], sys.argv[2]
device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
Join = _backend.load("join", impl).Join
pg = comm.world()

if mode == "skew":
    for device in DEVICES:  # numpy, then the strict device stand-in (the values as device scalars), in one launch
        start_counting(device)
        metric, one = DistributedMean(), on(device, np.ones((), np.float32))
        iterations = 0 if pg.rank == 0 else 1002
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with Join([metric]):
                for i in range(iterations):
                    metric.update(one)
        skew = [w for w in caught if "shadowed more than 1000 iterations" in str(w.message)]
        assert len(skew) == (1 if pg.rank == 0 else 0), [str(w.message) for w in caught]
        assert metric.count == 1002 * (pg.size - 1) and metric.compute() == 1.0
        assert not staged_outside_comm(device), staged_outside_comm(device)
        print(f"rank {pg.rank}: skew warning on {device} OK", flush=True)
elif mode == "raise":
    class Fragile(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2, seed=0)

        def forward(self, x):
            if pg.rank == pg.size - 1:
                raise ValueError("bad batch in forward")
            return self.fc(x)

    model = DDP(to_device(Fragile(), device), impl=impl)
    with model.join():
        for _ in range(3):
            model(distlab.tensor(on(device, np.ones((1, 2), np.float32)))).sum().backward()
