"""Large negotiated allreduces on one host, reduced in the set's shared-memory arena: the same bits as MPI.

Checks on N ranks: results equal the sum in rank order (computed here from every rank's input), for Sum, Average,
integers and scale factors, single and fused and grouped; the arena is made at the first large allreduce and used
from then on (its reductions counted); the caller may change its input at once; a result kept alive is never
overwritten; a rank without room sends every rank through MPI with the same bits; a duplicate name gives its
region back; device arrays (the strict stand-in) never go to the host arena; ProcessGroup.allreduce_placed
refuses different element counts on every rank; every region is free again once the results are dropped.
"""
import numpy as np

from distlab import collectives as hvd, comm, fakegpu
from distlab.collectives import _engine
from distlab.errors import CollectiveMismatchError

hvd.init()
r, n = hvd.rank(), hvd.size()
pg = comm.ProcessGroup(name="placement check")
COUNT = 100_003  # 400 KB of float32: above the shared-memory threshold, not a multiple of the rank count


def inputs(seed, dtype, count=COUNT):
    rng = np.random.default_rng(seed + 7 * r)
    return (rng.standard_normal(count) * 100).astype(dtype)


def expected_sum(x):
    every = pg.allgather(x)
    total = every[0].copy()
    for k in range(1, n):
        total += every[k]       # rank order, as each rank sums its block in the arena
    return total


state = _engine.get().world
reductions = []
for step in range(3):   # the first makes the arena (through MPI), the others are reduced in it
    x = inputs(step, np.float32)
    got = hvd.allreduce(x, name="big", op=hvd.Sum)
    assert got.tobytes() == expected_sum(x).tobytes(), f"step {step}: not the rank-order sum"
    if step == 0:
        assert state.placement is not None, "no arena on one host"
        arena = state.placement.arena
        reduce_block = arena.reduce_block
        arena.reduce_block = lambda *a, **k: (reductions.append(a[1]), reduce_block(*a, **k))[1]
assert reductions == [COUNT, COUNT], reductions
kept = got.copy()   # the result is its arena region, leased: later allreduces never write into it
assert state.placement.in_use() >= got.nbytes

# Average, integers, scale factors, a 2-D shape
x = inputs(10, np.float64).reshape(-1, 1)
avg = hvd.allreduce(x, name="avg")
assert avg.shape == x.shape and avg.tobytes() == (expected_sum(x) * (1.0 / n)).tobytes()
i = (np.arange(COUNT, dtype=np.int32) - 5) * (r + 1)
assert hvd.allreduce(i, name="ints", op=hvd.Sum).tolist() == (i // (r + 1) * (n * (n + 1) // 2)).tolist()
x = inputs(11, np.float32)
scaled = hvd.allreduce(x, name="scaled", op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
assert scaled.tobytes() == ((expected_sum(x * np.float32(2.0))) * np.float32(0.5)).tobytes()

# the caller reuses its input at once; several in flight are fused into an arena region
xs = [inputs(20 + k, np.float32) for k in range(3)]
sums = [expected_sum(x) for x in xs]
handles = [hvd.allreduce_async(x, name=f"fused.{k}", op=hvd.Sum) for k, x in enumerate(xs)]
for x in xs:
    x[...] = -1.0
for k, h in enumerate(handles):
    assert hvd.synchronize(h).tobytes() == sums[k].tobytes(), f"fused member {k}"
group = [inputs(30 + k, np.float32, COUNT + k) for k in range(2)]
outs = hvd.grouped_allreduce(group, name="grouped", op=hvd.Sum)
assert all(o.tobytes() == expected_sum(g).tobytes() for o, g in zip(outs, group))
assert len(reductions) >= 7, f"only {len(reductions)} reductions in the arena"

# a rank without room: every rank goes through MPI, with the same bits
before = len(reductions)
holds = []   # the last rank takes every free region of its slot
for length in sorted((length for _start, length in state.placement.free), reverse=True) if r == n - 1 else ():
    holds.append(state.placement.region(length, np.uint8))
x = inputs(40, np.float32)
assert hvd.allreduce(x, name="full", op=hvd.Sum).tobytes() == expected_sum(x).tobytes()
assert len(reductions) == before, "reduced in the arena though a rank had no room"
for view, at in holds:
    state.placement.release(at, view.nbytes)

# a duplicate name gives its region back (rank 0 submits after the others checked, so the first is pending)
if r != 0:
    h = hvd.allreduce_async(inputs(50, np.float32), name="dup", op=hvd.Sum)
    try:
        hvd.allreduce_async(inputs(51, np.float32), name="dup", op=hvd.Sum)
        raise AssertionError("no DuplicateNameError")
    except hvd.DuplicateNameError:
        pass
pg.barrier()
if r == 0:
    h = hvd.allreduce_async(inputs(50, np.float32), name="dup", op=hvd.Sum)
hvd.synchronize(h)

# device arrays stay on their device: reduced through the comm layer's device path, not the host arena
before = len(reductions)
d = fakegpu.asarray(inputs(60, np.float32))
out = hvd.allreduce(d, name="device", op=hvd.Sum)
assert isinstance(out, fakegpu.ndarray) and fakegpu.asnumpy(out).tobytes() == expected_sum(
    fakegpu.asnumpy(d)).tobytes()
assert len(reductions) == before

# ProcessGroup.allreduce_placed with different element counts: the same clear error on every rank
try:
    pg.allreduce_placed(np.ones(10 + r, dtype=np.float32), name="mismatch")
    raise AssertionError("no CollectiveMismatchError")
except CollectiveMismatchError as exc:
    assert "passed different regions" in str(exc), exc
x = inputs(70, np.float32)
assert pg.allreduce_placed(x.copy(), name="unplaced").tobytes() == expected_sum(x).tobytes()

assert got.tobytes() == kept.tobytes(), "a result kept alive was overwritten"
del got, avg, scaled, outs, out, h, handles   # (a handle keeps its result)
assert state.placement.in_use() == 0, f"regions not given back: {state.placement.free}"
hvd.shutdown()
pg.destroy()
print(f"placement OK reductions={len(reductions)}", flush=True)
