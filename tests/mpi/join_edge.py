"""Join edge cases. argv: impl, mode.

skew: rank 0 has no input at all, the last rank 1002 iterations: rank 0 warns once about the skew.
raise: the last rank raises inside the Join body (in forward): the error propagates and ends the job.
"""
import sys
import warnings

import numpy as np

import distlab
from distlab import _backend, comm, nn
from distlab.ddp import DistributedDataParallel as DDP
from distlab.metrics import DistributedMean

impl, mode = sys.argv[1], sys.argv[2]
Join = _backend.load("join", impl).Join
pg = comm.world()

if mode == "skew":
    metric = DistributedMean()
    iterations = 0 if pg.rank == 0 else 1002
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Join([metric]):
            for i in range(iterations):
                metric.update(1.0)
    skew = [w for w in caught if "shadowed more than 1000 iterations" in str(w.message)]
    assert len(skew) == (1 if pg.rank == 0 else 0), [str(w.message) for w in caught]
    assert metric.count == 1002 * (pg.size - 1) and metric.compute() == 1.0
    print(f"rank {pg.rank}: skew warning OK", flush=True)
elif mode == "raise":
    class Fragile(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2, seed=0)

        def forward(self, x):
            if pg.rank == pg.size - 1:
                raise ValueError("bad batch in forward")
            return self.fc(x)

    model = DDP(Fragile(), impl=impl)
    with model.join():
        for _ in range(3):
            model(distlab.tensor(np.ones((1, 2), np.float32))).sum().backward()
