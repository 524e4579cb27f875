"""Device arrays through the comm layer with a host-memory stand-in: staged (not CUDA-aware) or direct."""
import os

import numpy as np
from fakegpu import FakeDeviceArray, register

from distlab import comm

counts = register()
aware = os.environ["DISTLAB_CUDA_AWARE"] == "1"
pg = comm.world()
r, n = pg.rank, pg.size

a = FakeDeviceArray(np.full(4, r + 1.0, dtype=np.float32))
pg.allreduce(a, op="avg")
assert np.all(a.get() == (n + 1) / 2), a.get()
b = FakeDeviceArray(np.full(3, r, dtype=np.int64))
pg.broadcast(b, src=n - 1)
assert np.all(b.get() == n - 1)
g = pg.allgather(np.array([r], dtype=np.int32))
assert g[:, 0].tolist() == list(range(n))

assert counts["synchronize"] >= 2, counts  # the stream is synchronised before MPI touches device memory
if aware:
    assert counts["to_host"] == 0 and counts["from_host"] == 0, counts
else:
    assert counts["to_host"] == 2 and counts["from_host"] == 2, counts
print(f"rank {r}: device path ({'direct' if aware else 'staged'}) OK {counts}", flush=True)
