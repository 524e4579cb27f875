"""Shared-memory arenas on one node: allreduce in place, out-of-order waits, mismatches, refusals, timeouts, DDP.

argv[1]: ``one-node`` (every rank shares the node) or ``two-nodes`` (DISTLAB_RANKS_PER_NODE splits them).
"""
import os
import sys
import time
import warnings

import numpy as np

import distlab
from distlab import comm, nn, optim
from distlab._wire import COLLECTIVE_OPS
from distlab.comm import shared as shared_module
from distlab.ddp import DistributedDataParallel
from distlab.errors import CollectiveMismatchError, DistTimeoutError

pg = comm.world()
r, n = pg.rank, pg.size
layout = sys.argv[1]

arena = pg.shared_arena(4096)
if layout == "two-nodes":  # the ranks do not share one node: no arena on any rank, and DDP stays on MPI
    assert arena is None, arena
    model = DistributedDataParallel(nn.Linear(4, 4), impl="core")
    assert all(bucket.arena is None for bucket in model.reducer.buckets)
    print(f"rank {r}: shared arena refused across nodes: OK", flush=True)
    raise SystemExit(0)
assert arena is not None and arena.slot_bytes == 4096
SHARED_OP = COLLECTIVE_OPS.index("shared_allreduce")

# Below SHARED_MIN_BYTES an arena array goes through MPI (its latency is lower); at or above it, in place.
small = arena.array(0, 16, np.float32)
small[:] = 1
pg.allreduce(small)
assert pg._steps.side.board.my_slot[1] != SHARED_OP and np.all(small == n)
shared_module.SHARED_MIN_BYTES = 64  # the rest of this script reduces small regions in place
pg.allreduce(small)
assert pg._steps.side.board.my_slot[1] == SHARED_OP and np.all(small == n * n)

# Sum and average in place, equal to the MPI path's result (integer-valued data: every order sums exactly).
for dtype in (np.float32, np.float64, np.int64):
    shared = arena.array(0, 300, dtype)
    shared[:] = np.arange(300) * (r + 1)
    private = shared.copy()
    assert pg.allreduce(shared, name="shared sum") is shared and pg._steps.side.board.my_slot[1] == SHARED_OP
    pg.allreduce(private, name="private sum")
    assert np.array_equal(shared, private) and shared[7] == 7 * n * (n + 1) // 2, (dtype, shared[:8])
# A sum that overflows is inf on both paths, and no warning on either (numpy would warn, MPI does not).
huge = arena.array(0, 64, np.float32)
huge[:] = np.finfo(np.float32).max
private = huge.copy()
with warnings.catch_warnings():
    warnings.simplefilter("error")
    pg.allreduce(huge, name="overflow")
    pg.allreduce(private, name="overflow, private")
assert np.array_equal(huge, private) and np.all(np.isinf(huge)), huge[:4]
averaged = arena.array(2048, 100, np.float64)
averaged[:] = r
pg.allreduce(averaged, op="avg")
assert np.all(averaged == (n - 1) / 2), averaged[:4]

# An op numpy's add does not compute (max) goes through MPI on every rank, still in place.
peak = arena.array(1024, 10, np.float32)
peak[:] = r
pg.allreduce(peak, op="max")
assert np.all(peak == n - 1)

# Several in flight, waited last first: each rank reduces its block when it gets to it; done messages match by
# tag, so the order each rank finishes in does not matter.
regions = [arena.array(i * 512, 128, np.float32) for i in range(4)]
for i, region in enumerate(regions):
    region[:] = (i + 1) * (r + 1)
works = [pg.allreduce(region, async_op=True, name=f"region{i}") for i, region in enumerate(regions)]
for work in reversed(works):
    work.wait()
for i, region in enumerate(regions):
    assert np.all(region == (i + 1) * n * (n + 1) // 2), (i, region[:4])
assert comm.progress() == 0

# Ranks passing different regions: the same CollectiveMismatchError on every rank; the group stays usable.
wrong = arena.array(0, 64 if r == 0 else 32, np.float32)
try:
    pg.allreduce(wrong, name="bucket7")
    raise AssertionError("different regions must be refused")
except CollectiveMismatchError as exc:
    text = str(exc)
    assert "'bucket7'" in text and "ranks [0]: region at byte 0, 64 elements of float32" in text, text
    assert f"ranks {list(range(1, n))}: region at byte 0, 32 elements of float32" in text, text
check = arena.array(0, 4, np.float32)
check[:] = 1
pg.allreduce(check)
assert np.all(check == n)

# Under fingerprint checks (DISTLAB_DEBUG=DETAIL), a rank passing an ordinary array where the others pass their
# arena views is named before anything is posted.
checked = comm.ProcessGroup(name="checked", fingerprint_checks=True)
checked_arena = checked.shared_arena(1024)
mixed = np.zeros(16, np.float32) if r == 0 else checked_arena.array(0, 16, np.float32)
try:
    checked.allreduce(mixed, name="bucket1")
    raise AssertionError("a private array among shared ones must be refused under fingerprint checks")
except CollectiveMismatchError as exc:
    assert "shared_allreduce" in str(exc) and exc.groups, str(exc)
checked.destroy()

# One rank turning shared memory off: no arena on any rank (they all fall back together).
if r == n - 1:
    os.environ["DISTLAB_SHARED_MEMORY"] = "0"
assert pg.shared_arena(1024) is None
os.environ.pop("DISTLAB_SHARED_MEMORY", None)

# DDP puts its dense host buckets in an arena and trains exactly as it does through MPI.
def train(shared_memory: bool, view: bool):
    os.environ["DISTLAB_SHARED_MEMORY"] = "1" if shared_memory else "0"
    rng = np.random.default_rng(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    for p in module.parameters():
        p.data[...] = rng.standard_normal(p.data.shape).astype(np.float32)
    model = DistributedDataParallel(module, bucket_cap_mb=0.0002, gradient_as_bucket_view=view, impl="core")
    assert len(model.reducer.buckets) > 1
    assert all((bucket.arena is not None) == shared_memory for bucket in model.reducer.buckets)
    opt = optim.SGD(model.parameters(), lr=0.1)
    data = np.random.default_rng(r).standard_normal((5, 8)).astype(np.float32)
    for _ in range(4):  # past the rebuild after iteration 1: the rebuilt buckets get a new arena
        opt.zero_grad()
        model(distlab.tensor(data)).sum().backward()
        opt.step()
    assert all((bucket.arena is not None) == shared_memory for bucket in model.reducer.buckets)
    os.environ.pop("DISTLAB_SHARED_MEMORY")
    return [p.data.copy() for p in model.parameters()]


# With the view the arena's buckets are averaged by their reduction, (a + b + c) / 3, where through MPI each
# gradient is divided on its way in, a/3 + b/3 + c/3: the same bits when dividing by a power of two, within
# rounding otherwise (without the view both divide on the way in).
for view in (False, True):
    shared, through_mpi = train(True, view), train(False, view)
    assert all(np.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(shared, through_mpi)), view  # a few ulp
    if n in (2, 4):
        assert all(np.array_equal(a, b) for a, b in zip(shared, through_mpi)), view

# Join over shared-memory buckets: the joined rank shadows each bucket by reducing its own arena bucket, zeroed
# (every rank must pass its view of the same region), and every rank ends with the same model as over MPI.
def train_uneven(shared_memory: bool):
    os.environ["DISTLAB_SHARED_MEMORY"] = "1" if shared_memory else "0"
    distlab.manual_seed(1)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)), bucket_cap_mb=0.0002,
                                    impl="core")
    assert all((bucket.arena is not None) == shared_memory for bucket in model.reducer.buckets)
    opt = optim.SGD(model.parameters(), lr=0.1)
    rng = np.random.default_rng(10 + r)
    with distlab.Join([model]):
        for _ in range(2 + r):  # rank r has 2 + r batches
            opt.zero_grad()
            model(distlab.tensor(rng.standard_normal((5, 8)).astype(np.float32))).sum().backward()
            opt.step()
    os.environ.pop("DISTLAB_SHARED_MEMORY")
    return [p.data.copy() for p in model.parameters()]


joined_shared, joined_mpi = train_uneven(True), train_uneven(False)
everyone = pg.allgather_object(joined_shared)
assert all(np.array_equal(a, b) for other in everyone for a, b in zip(other, joined_shared))
assert all(np.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(joined_shared, joined_mpi))
if n == 2:  # two addends: every summation order gives the same bits
    assert all(np.array_equal(a, b) for a, b in zip(joined_shared, joined_mpi))

# A rank that never arrives: the waiting ranks time out naming it, as on the MPI path.
late = n - 1
short = comm.ProcessGroup(timeout=1.5, name="short")
short_arena = short.shared_arena(1024)
short.barrier()
if r == late:
    time.sleep(4.0)
else:
    try:
        short.allreduce(short_arena.array(0, 16, np.float32), name="bucket0")
        raise AssertionError("must time out")
    except DistTimeoutError as exc:
        assert exc.missing_ranks == [late] and exc.name == "bucket0", (exc.missing_ranks, str(exc))
        assert f"ranks [{late}] have not entered it" in str(exc), str(exc)
print(f"rank {r}: shared arena OK", flush=True)
