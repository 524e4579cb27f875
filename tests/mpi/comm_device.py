"""Device arrays through the comm layer on the strict stand-in (distlab.fakegpu), per transport: direct to a
"CUDA-aware" MPI (the stream synchronised before MPI touches the memory), staged through a host arena (a copy
down and up per allreduce, down on a broadcast's root and up elsewhere, counted where it happens), or through the ipc slots or NCCL (no host copy at all)."""
import os

import numpy as np

from distlab import comm
from distlab import fakegpu as xp

pg = comm.world()
transport = os.environ["DISTLAB_DEVICE_COMM"]
assert pg.device_comm == transport and f"device {transport}" in repr(pg), repr(pg)
r, n = pg.rank, pg.size
xp.reset()

a = xp.full(4, r + 1.0, dtype=np.float32)
pg.allreduce(a, op="avg")
assert isinstance(a, xp.ndarray) and np.all(a.get() == (n + 1) / 2), a
b = xp.full(3, r, dtype=np.int64)
pg.broadcast(b, src=n - 1)
assert np.all(b.get() == n - 1)
counts = {kind: xp.total(kind, "distlab.comm") for kind in ("synchronize", "to_host", "from_host")}
g = pg.allgather(np.array([r], dtype=np.int32))  # host arrays too (through the ipc slots on an ipc group)
assert g[:, 0].tolist() == list(range(n))
if transport == "mpi":
    assert counts["synchronize"] >= 2, xp.transfers()  # the stream is synchronised before MPI touches the memory
if transport == "staged":
    # allreduce: down and up; broadcast: down on its root, up on the others only
    assert counts["to_host"] + counts["from_host"] == 3, xp.transfers()
else:
    assert counts["to_host"] == 0 and counts["from_host"] == 0, xp.transfers()
# allgather and reduce_scatter of device arrays: a transport that takes them copies nothing to the host before
# it (no staging for MPI thrown away); staged copies happen only inside distlab.comm.transports
xp.reset()
gathered = pg.allgather(xp.full(2, r, dtype=np.int32))
assert isinstance(gathered, xp.ndarray) and gathered.get()[:, 0].tolist() == list(range(n)), gathered
scattered = xp.zeros(2, dtype=np.float64)
pg.reduce_scatter(scattered, xp.asarray(np.arange(2.0 * n) + r))
assert scattered.get().tolist() == [n * (2 * r + k) + n * (n - 1) / 2 for k in range(2)], scattered
outside = {key: count for key, count in xp.transfers().items() if key[0] in ("to_host", "from_host")
           and key[1].startswith("distlab.comm") and not key[1].startswith("distlab.comm.transports")}
assert not outside, xp.transfers()
# The rooted calls and all_to_all_single take device arrays the same way (lists on the root through host memory).
red = xp.asarray(np.full(3, r + 1.0))
pg.reduce(red, dst=n - 1)
assert red.get().tolist() == [n * (n + 1) / 2 if r == n - 1 else r + 1.0] * 3
targets = [xp.asarray(np.zeros(2, np.int32)) for _ in range(n)] if r == 0 else None
pg.gather(xp.asarray(np.full(2, r, np.int32)), targets, dst=0)
if r == 0:
    assert [t.get()[0] for t in targets] == list(range(n))
into = xp.asarray(np.zeros(2))
pg.scatter(into, [xp.asarray(np.full(2, 5.0 * k)) for k in range(n)] if r == 0 else None, src=0)
assert into.get().tolist() == [5.0 * r] * 2
out = xp.asarray(np.zeros((n, 2), np.float32))
pg.all_to_all_single(out, xp.asarray(np.arange(2 * n, dtype=np.float32).reshape(n, 2) + 100 * r))
assert out.get()[:, 0].tolist() == [100 * k + 2 * r for k in range(n)], out.get()
print(f"rank {r}: device path ({transport}) OK {counts}", flush=True)
