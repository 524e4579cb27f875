"""Every collective of the comm layer, sync and async, on arrays of several dtypes, plus sub-groups: on numpy, then
on the strict device stand-in (distlab.fakegpu) in the same launch, where only the comm layer may stage through the
host."""
import numpy as np

from distlab import ReduceOp, comm
from distlab import fakegpu
from distlab.futures import Future
from scenario_checks import staged_outside_comm, start_counting

pg = comm.world()
r, n = pg.rank, pg.size
assert comm.world() is pg

for device, xp in (("cpu", np), ("cuda", fakegpu)):
    start_counting(device)
    # allreduce with every op, in place.
    for dtype in (np.float32, np.float64, np.int32, np.int64):
        a = xp.array([r + 1, -(r + 1), 2], dtype=dtype)
        assert pg.allreduce(a) is a
        assert a.tolist() == [n * (n + 1) // 2, -n * (n + 1) // 2, 2 * n], (dtype, a)
    for op, expect in [("max", n), ("min", 1),
                       ("product", float(np.prod(np.arange(1, n + 1)))), (ReduceOp.AVG, (n + 1) / 2)]:
        a = xp.array([r + 1.0])
        pg.allreduce(a, op=op)
        assert a[0] == expect, (op, a, expect)
    bits = xp.array([0b1111 ^ (1 << r % 4), 1 << r], dtype=np.uint64)
    pg.allreduce(bits, op="band")
    pg.allreduce(xp.zeros(1, np.uint64), op="bor")
    flags = xp.array([r == 0, True])
    pg.allreduce(flags, op="band")
    assert flags.tolist() == [n == 1, True]
    try:
        pg.allreduce(xp.ones(2, np.int32), op="avg")
        raise AssertionError("avg of ints must be refused")
    except TypeError as exc:
        assert "floating-point" in str(exc)
    try:
        pg.allreduce(xp.ones((4, 4))[:, 0])
        raise AssertionError("non-contiguous must be refused")
    except ValueError as exc:
        assert "C-contiguous" in str(exc)
    try:
        pg.allreduce([1.0, 2.0])
        raise AssertionError("lists must be refused")
    except TypeError as exc:
        assert "numpy or cupy" in str(exc)

    # float16 (fp16 compression hooks need it).
    h = xp.full(3, 0.5, dtype=np.float16)
    pg.allreduce(h)
    assert h.dtype == np.float16 and np.all(h == 0.5 * n), h

    # broadcast from every root.
    for src in range(n):
        b = xp.full((2, 3), r, dtype=np.float32)
        pg.broadcast(b, src=src)
        assert np.all(b == src)

    # allgather, with and without out.
    g = pg.allgather(xp.array([r, 10 * r], dtype=np.int64))
    assert g.tolist() == [[k, 10 * k] for k in range(n)]
    out = xp.empty((n, 1), dtype=np.float64)
    assert pg.allgather(xp.array([r * 0.5]), out=out) is out and out[:, 0].tolist() == [k * 0.5 for k in range(n)]

    # objects.
    objs = pg.allgather_object({"rank": r, "payload": "x" * r})
    assert objs == [{"rank": k, "payload": "x" * k} for k in range(n)]
    assert pg.broadcast_object({"from": r} if r == 1 else None, src=1) == {"from": 1}

    # reduce_scatter and alltoall.
    inp = xp.arange(2 * n, dtype=np.float64) + r
    outp = xp.empty(2)
    pg.reduce_scatter(outp, inp)
    expect = [sum(2 * r + k + q for q in range(n)) for k in range(2)]
    assert outp.tolist() == [float(e) for e in expect], (outp, expect)
    send = xp.array([100 * r + j for j in range(n)], dtype=np.int32)
    recv = xp.empty(n, dtype=np.int32)
    pg.alltoall(recv, send)
    assert recv.tolist() == [100 * i + r for i in range(n)]

    # point to point in a ring.
    right, left = (r + 1) % n, (r - 1) % n
    w = pg.send(xp.array([r], dtype=np.int64), dst=right, async_op=True)
    box = xp.empty(1, dtype=np.int64)
    assert pg.recv(box, src=left) == left and box[0] == left
    w.wait()

    # async: Work, futures, progress.
    works = [pg.allreduce(xp.full(1000, float(r)), async_op=True, name=f"t{i}") for i in range(8)]
    while comm.progress():
        pass
    assert all(w.is_completed() for w in works)
    assert all(np.all(w.result() == sum(range(n))) for w in works)
    fut = pg.allreduce(xp.ones(3), async_op=True).get_future()
    assert isinstance(fut, Future)
    doubled = fut.then(lambda f: f.value() * 2)
    assert np.all(doubled.wait() == 2 * n)
    pg.barrier()
    pg.barrier(async_op=True).wait(timeout=30)

    # sub-groups: even ranks and odd ranks.
    evens = comm.new_group([k for k in range(n) if k % 2 == 0], name="evens")
    if r % 2 == 0:
        assert evens is not None and evens.size == (n + 1) // 2 and evens.rank == r // 2
        x = xp.array([float(r)])
        evens.allreduce(x)
        assert x[0] == sum(k for k in range(n) if k % 2 == 0)
    else:
        assert evens is None
    if n >= 2:
        rev = comm.new_group([1, 0])
        if r in (0, 1):
            assert rev.rank == 1 - r
    try:
        comm.new_group([0, 0])
        raise AssertionError("duplicate ranks must be refused")
    except ValueError as exc:
        assert "distinct" in str(exc)
    pg.barrier()
    assert not staged_outside_comm(device), staged_outside_comm(device)
    print(f"rank {r}: comm collectives on {device} OK", flush=True)
print(f"rank {r}: comm collectives OK", flush=True)
