"""Device arrays through the comm layer on the strict stand-in (distlab.fakegpu): staged (not CUDA-aware) or
direct, the stream synchronised before MPI touches the memory, and the staging counted where it happens."""
import os

import numpy as np

from distlab import comm
from distlab import fakegpu as xp

aware = os.environ["DISTLAB_CUDA_AWARE"] == "1"
pg = comm.world()
r, n = pg.rank, pg.size
xp.reset()

a = xp.full(4, r + 1.0, dtype=np.float32)
pg.allreduce(a, op="avg")
assert isinstance(a, xp.ndarray) and np.all(a.get() == (n + 1) / 2), a
b = xp.full(3, r, dtype=np.int64)
pg.broadcast(b, src=n - 1)
assert np.all(b.get() == n - 1)
g = pg.allgather(np.array([r], dtype=np.int32))
assert g[:, 0].tolist() == list(range(n))

counts = {kind: xp.total(kind, "distlab.comm") for kind in ("synchronize", "to_host", "from_host")}
assert counts["synchronize"] >= 2, xp.transfers()  # the stream is synchronised before MPI touches device memory
if aware:
    assert counts["to_host"] == 0 and counts["from_host"] == 0, xp.transfers()
else:
    assert counts["to_host"] == 2 and counts["from_host"] == 2, xp.transfers()
print(f"rank {r}: device path ({'direct' if aware else 'staged'}) OK {counts}", flush=True)
