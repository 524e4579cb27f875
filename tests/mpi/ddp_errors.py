"""DDP refuses models that differ across ranks, on every rank, naming the rank and the parameter."""
import sys

from distlab import comm, nn
from distlab.ddp import DistributedDataParallel as DDP

impl = sys.argv[1]
pg = comm.world()
last = pg.size - 1

# A different parameter count on the last rank.
layers = [nn.Linear(4, 4), nn.Linear(4, 2)] + ([nn.Linear(2, 2)] if pg.rank == last else [])
try:
    DDP(nn.Sequential(*layers), impl=impl)
    raise AssertionError("a model with more parameters on one rank must be refused")
except ValueError as exc:
    assert f"rank {last} has 6 parameters that require grad while rank 0 has 4" in str(exc), str(exc)

# A different shape on the last rank.
width = 5 if pg.rank == last else 4
try:
    DDP(nn.Sequential(nn.Linear(3, width)), impl=impl)
    raise AssertionError("a model with another shape on one rank must be refused")
except ValueError as exc:
    assert f"parameter '0.weight' is float32[{width if pg.rank == last else 5}, 3] on rank {last}" in str(exc), str(exc)

# Parameters start equal everywhere: rank 0's initialisation is broadcast.
import numpy as np  # noqa: E402

import distlab  # noqa: E402

distlab.manual_seed(pg.rank)  # deliberately different initialisation per rank
model = DDP(nn.Linear(3, 3), impl=impl)
gathered = pg.allgather(model.module.weight.data)
assert all(np.array_equal(gathered[0], g) for g in gathered), "parameters must be synchronised from rank 0"
print(f"rank {pg.rank}: model checks OK", flush=True)
