"""Conformance of one device transport (``DISTLAB_DEVICE_COMM``, run by test_comm_mpi per transport) on the
stand-in: every collective it serves, every dtype and op, odd sizes across chunk boundaries, async work waited on
in reverse, 1,000 reuses of one buffer, the same bits on every rank, a joined rank's host zeros shadowing the
others' device collectives, and a timeout naming the missing rank."""
import os
import time

import numpy as np

from mpi4py import MPI

from distlab import comm
from distlab import fakegpu as xp
from distlab.comm.reduce_ops import mpi_reduction, parse_op
from distlab.errors import DistTimeoutError

pg = comm.world()
r, n = pg.rank, pg.size
transport = os.environ["DISTLAB_DEVICE_COMM"]
assert pg.device_comm == transport, pg
rng = np.random.default_rng(100 + r)
exact = n == 2 or transport == "staged"  # ipc sums in rank order, MPI's tree may group 4 ranks differently


plain = MPI.COMM_WORLD.Dup()  # the expected results come from plain MPI, never through the group's transport


def mpi_allreduce(host, op):
    out = host.copy()
    plain.Allreduce(MPI.IN_PLACE, out, op=mpi_reduction(host.dtype, parse_op(op), "expected"))
    if op == "avg":
        out /= n
    return out


def same_everywhere(device):
    """The result's bits, gathered: every rank must hold the very same."""
    bits = device.get().reshape(-1).view(np.uint8)
    table = np.empty((n, bits.size), dtype=np.uint8)
    plain.Allgather(bits, table)
    assert all(np.array_equal(row, table[0]) for row in table), "ranks disagree"


def agree(device, host, what, everywhere=True):
    got = device.get()
    if exact or host.dtype.kind in "biu":
        assert np.array_equal(got, host), (what, got, host)
    else:
        tolerance = 0.1 if host.dtype.itemsize == 2 else 1e-5  # float16: sums of ~50 in rank order
        np.testing.assert_allclose(got, host, rtol=tolerance, atol=tolerance, err_msg=str(what))
    if everywhere:
        same_everywhere(device)


DTYPES = {"float32": "sum avg min max product", "float64": "sum avg min max", "float16": "sum max",
          "int32": "sum min max product band bor", "int64": "sum", "uint8": "band bor max", "bool": "sum min max",
          "complex64": "sum avg"}
for dtype, ops in DTYPES.items():
    for size in (1, 7, 1023, 5001):
        values = rng.integers(0, 3, size) if dtype in ("bool", "uint8") else rng.standard_normal(size) * 4
        host = values.astype(dtype)
        for op in ops.split():
            expected = mpi_allreduce(host, op)
            device = xp.asarray(host)
            assert pg.allreduce(device, op=op, name=f"{dtype}.{op}.{size}") is device
            agree(device, expected, (dtype, op, size))
        device, expected = xp.asarray(host), host.copy()
        pg.broadcast(device, src=n - 1)
        plain.Bcast(expected, root=n - 1)
        agree(device, expected, ("broadcast", dtype, size))
        gathered = pg.allgather(xp.asarray(host.reshape(1, -1)))
        assert gathered.shape == (n, 1, size)
        expected = np.empty((n, 1, size), dtype=dtype)
        plain.Allgather(host.reshape(1, -1), expected)
        agree(gathered, expected, ("allgather", dtype, size))
        if dtype != "bool":
            block = host[:size].repeat(n)[:size * n] * (r + 1) if dtype != "uint8" else host.repeat(n)
            out = xp.empty(size, dtype=dtype)
            pg.reduce_scatter(out, xp.asarray(block), op="sum")
            reference = np.empty(size, dtype=dtype)
            plain.Reduce_scatter_block(block, reference, op=mpi_reduction(block.dtype, parse_op("sum"), "expected"))
            agree(out, reference, ("reduce_scatter", dtype, size), everywhere=False)

# async work waited on in reverse order; each keeps its arrays
works = [pg.allreduce(xp.full(3001, float(r + k), dtype=np.float64), async_op=True, name=f"async{k}")
         for k in range(6)]
for k, work in reversed(list(enumerate(works))):
    assert work.wait()
    assert np.all(work.result().get() == sum(range(n)) + n * k)

# 1,000 reuses of one buffer
buffer = xp.zeros(257, dtype=np.float32)
for step in range(1000):
    buffer[...] = float(step + r)
    pg.allreduce(buffer, name="reused")
    assert float(buffer[0]) == n * step + sum(range(n)), step
same_everywhere(buffer)

# a joined rank's shadow: its host zeros meet the others' device arrays (several chunks long), async too
for size in (5, 3001):
    shadow = r == n - 1
    array = np.zeros(size, np.float32) if shadow else xp.full(size, 1.0, dtype=np.float32)
    pg.allreduce(array, name="shadowed")
    pg.broadcast(array, src=0, async_op=True).wait()
    result = array if shadow else array.get()
    assert np.all(result == n - 1), (size, result[:3])

# a rank that never arrives is named
pg.barrier()
late = n - 1
if r == late:
    time.sleep(3.0)
else:
    try:
        pg.allreduce(xp.ones(64), name="dev.bucket", async_op=True).wait(timeout=1.0)
        raise AssertionError("must time out")
    except DistTimeoutError as exc:
        assert exc.missing_ranks == [late] and exc.name == "dev.bucket", exc
print(f"rank {r}: transport {transport} conformance OK", flush=True)
