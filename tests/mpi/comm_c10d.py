"""The rest of c10d on every rank (run with DISTLAB_DEBUG=DETAIL): reduce, gather, scatter, their object
variants, object lists point to point, isend/irecv, batch_isend_irecv, monitored_barrier and all_to_all_single
with uneven splits; bad arguments refused on the rank that passed them, keeping the group in step (DETAIL
compares sequence numbers on every collective); mismatches named on every rank.
"""
import ml_dtypes
import numpy as np

from distlab import comm
from distlab.errors import CollectiveMismatchError
from scenario_checks import DEVICES, host, on, staged_outside_comm, start_counting

pg = comm.world()
r, n = pg.rank, pg.size
last = n - 1
assert comm.debug_level() == "DETAIL"


def refused(error, words, call):
    try:
        call()
    except error as exc:
        assert words in str(exc), (words, str(exc))
        return
    raise AssertionError(f"must raise {error.__name__}: {words}")


right, left = (r + 1) % n, (r - 1) % n
unchecked = comm.ProcessGroup(name="unchecked", fingerprint_checks=False)

# -- on numpy, then on the strict device stand-in ("cuda"): the rooted, point-to-point and all-to-all collectives
#    on device arrays give numpy's results, and nothing outside the comm layer stages through the host
for device in DEVICES:
    start_counting(device)

    def d(array):
        return on(device, array)

    # reduce: in place on dst, other ranks untouched; avg; bfloat16 (host only, as cupy has none); async
    a = d(np.full(3, r + 1.0))
    pg.reduce(a, dst=last, name="loss")
    assert host(a).tolist() == ([n * (n + 1) / 2] * 3 if r == last else [r + 1.0] * 3), a
    b = d(np.full(2, r + 1.0, dtype=np.float32))
    pg.reduce(b, dst=0, op="avg")
    assert float(b[0]) == ((n + 1) / 2 if r == 0 else r + 1.0), b
    bf = np.full(2, r + 1, dtype=ml_dtypes.bfloat16)
    comm.reduce(bf, dst=1, op=comm.ReduceOp.MAX)
    assert float(bf[0]) == (n if r == 1 else r + 1), bf
    dev = d(np.full(2, r, dtype=np.int64))
    pg.reduce(dev, dst=0, async_op=True).wait()
    assert host(dev).tolist() == ([n * (n - 1) // 2] * 2 if r == 0 else [r] * 2)

    # gather / scatter: lists on the root only
    dst = 1 % n
    out = [d(np.zeros((2, 2), dtype=np.int32)) for _ in range(n)] if r == dst else None
    got = comm.gather(d(np.full((2, 2), r, dtype=np.int32)), out, dst=dst)
    assert (got is None) == (r != dst)
    if r == dst:
        assert [int(x[0, 0]) for x in out] == list(range(n))
    bf_list = [np.zeros(1, dtype=ml_dtypes.bfloat16) for _ in range(n)] if r == 0 else None
    pg.gather(np.full(1, r + 0.5, dtype=ml_dtypes.bfloat16), bf_list, dst=0)
    if r == 0:
        assert [float(x[0]) for x in bf_list] == [k + 0.5 for k in range(n)]
    into = d(np.zeros(3, dtype=np.float64))
    sources = [d(np.full(3, 10.0 * k)) for k in range(n)] if r == last else None
    work = pg.scatter(into, sources, src=last, async_op=True)
    work.wait()
    assert host(into).tolist() == [10.0 * r] * 3 and work.result() is into
    dev = d(np.zeros(2, dtype=np.float32))
    comm.scatter(dev, [d(np.full(2, k, np.float32)) for k in range(n)] if r == 0 else None, src=0)
    assert host(dev).tolist() == [r, r]

    # isend/irecv and batch_isend_irecv in a ring
    recv_buf = d(np.zeros(4, dtype=np.int64))
    works = [comm.irecv(recv_buf, src=left, tag=3), comm.isend(d(np.full(4, r, dtype=np.int64)), dst=right, tag=3)]
    for w in works:
        w.wait()
    assert host(recv_buf).tolist() == [left] * 4 and works[0].result() == left
    from_left, from_right = d(np.zeros(2)), d(np.zeros(2))
    ops = [comm.P2POp(comm.isend, d(np.full(2, r + 0.25)), right),
           comm.P2POp(comm.isend, d(np.full(2, r + 0.5)), left),
           comm.P2POp(comm.irecv, from_left, left), comm.P2POp(comm.irecv, from_right, right)]
    for w in comm.batch_isend_irecv(ops):
        w.wait()
    assert float(from_left[0]) == left + 0.25 and float(from_right[0]) == right + 0.5, (from_left, from_right)

    # all_to_all_single: uneven splits, equal splits, on a checked and an unchecked group
    for group in (pg, unchecked):
        rows_to = [(r + j) % 3 for j in range(n)]  # rows rank r sends to rank j (zero rows allowed)
        rows_from = [(j + r) % 3 for j in range(n)]  # rows rank j sends to rank r
        inp = d(np.concatenate([np.full((k, 2), 100 * r + j, dtype=np.float32) for j, k in enumerate(rows_to)]))
        out = d(np.full((sum(rows_from), 2), -1, dtype=np.float32))
        group.all_to_all_single(out, inp, rows_from, rows_to)
        expect = np.concatenate([np.full((k, 2), 100 * j + r, dtype=np.float32) for j, k in enumerate(rows_from)])
        assert np.array_equal(host(out), expect), (host(out), expect)
        even = d(np.zeros(2 * n, dtype=np.int16))
        comm.all_to_all_single(even, d(np.repeat(np.arange(n, dtype=np.int16) + 10 * r, 2)), group=group)
        assert host(even).tolist() == [10 * k + r for k in range(n) for _ in range(2)], even
    assert not staged_outside_comm(device), staged_outside_comm(device)

# -- objects: gather_object, scatter_object_list, send/recv_object_list ----------------------------------------
objects = [None] * n if r == 0 else None
comm.gather_object({"rank": r, "tail": "x" * r}, objects, dst=0)
if r == 0:
    assert objects == [{"rank": k, "tail": "x" * k} for k in range(n)]
box = [None]
assert comm.scatter_object_list(box, [("item", k) for k in range(n)] if r == last else None, src=last) == \
    ("item", r)
assert box == [("item", r)]
sending = pg.send_object_list([r, {"from": r}, None], right, async_op=True)
inbox = [0, 0, 0]
assert comm.recv_object_list(inbox, src=left) == left and inbox == [left, {"from": left}, None]
sending.wait()
sending = pg.send_object_list(["any"], right, async_op=True)
one = [None]
assert pg.recv_object_list(one) == left and one == ["any"]  # from any rank
sending.wait()

# -- monitored_barrier ------------------------------------------------------------------------------------------
comm.monitored_barrier()
pg.monitored_barrier(timeout=30, wait_all_ranks=True, name="checkpoint")

# -- module functions on a sub-group take and return global ranks ------------------------------------------------
odds = comm.new_group(list(range(1, n, 2)))
if odds is not None:
    v = np.ones(2)
    comm.reduce(v, dst=n - 1, group=odds)  # the last odd rank, group rank odds.size - 1
    assert v[0] == (odds.size if r == n - 1 else 1), v
    refused(ValueError, "global rank 0 is not part of group", lambda: comm.reduce(v, dst=0, group=odds))
    peer = 1 if r == n - 1 else n - 1  # the first and the last odd rank (the same one on 2 ranks)
    sending = odds.send_object_list([r], odds.size - 1 - odds.rank, async_op=True)
    got = [None]
    assert comm.recv_object_list(got, group=odds) == peer and got == [peer], (got, peer)
    sending.wait()

# -- bad arguments: refused where passed, the group stays in step (DETAIL checks every sequence number) ---------
if r == 0:
    refused(ValueError, "must NOT be specified on non-destination ranks",
            lambda: pg.gather(np.zeros(1), [np.zeros(1)] * n, dst=last))
if r == last:
    refused(ValueError, "must be specified on the destination rank", lambda: pg.gather(np.zeros(1), None, dst=last))
    refused(ValueError, f"one array per rank ({n})", lambda: pg.gather(np.zeros(1), [np.zeros(1)], dst=last))
    refused(ValueError, "every entry must match the array",
            lambda: pg.gather(np.zeros(1), [np.zeros(2)] * n, dst=last))
    refused(ValueError, "must be specified on the source rank", lambda: pg.scatter(np.zeros(1), [], src=last))
    refused(ValueError, "must be a list of", lambda: pg.gather_object(1, [None], dst=last))
    refused(ValueError, "scatter_object_input_list", lambda: pg.scatter_object_list([None], None, src=last))
refused(ValueError, "is not a rank of group", lambda: pg.reduce(np.zeros(1), dst=n))
refused(TypeError, "reduce: arrays of dtype <U1", lambda: pg.reduce(np.array(["x"]), dst=0))
refused(ValueError, "list of size at least 1", lambda: pg.scatter_object_list([], [1] * n))
refused(ValueError, "sum to", lambda: pg.all_to_all_single(np.zeros(n), np.zeros(n), None, [1] * (n - 1) + [2]))
refused(ValueError, "one entry per rank", lambda: pg.all_to_all_single(np.zeros(n), np.zeros(n), [n]))
refused(ValueError, "not divisible", lambda: pg.all_to_all_single(np.zeros(n + 1), np.zeros(n)))
refused(ValueError, "same dtype", lambda: pg.all_to_all_single(np.zeros(n, np.float32), np.zeros(n)))
refused(ValueError, "Invalid ``op``", lambda: comm.P2POp(print, np.zeros(1), 0))
refused(ValueError, "Invalid ``p2p_op_list``", lambda: comm.batch_isend_irecv([]))
refused(ValueError, "same group",
        lambda: comm.batch_isend_irecv([comm.P2POp(comm.isend, np.zeros(1), 0),
                                        comm.P2POp(comm.isend, np.zeros(1), 0, group=unchecked)]))
refused(ValueError, "reserved by distlab",
        lambda: comm.batch_isend_irecv([comm.P2POp(comm.isend, np.zeros(1), right, tag=32765)]))
refused(TypeError, "wait_all_ranks must be True or False", lambda: pg.monitored_barrier(wait_all_ranks=1))
refused(ValueError, "monitored_barrier(timeout)", lambda: comm.monitored_barrier(timeout=-1))
refused(TypeError, "must be a list", lambda: pg.send_object_list((1,), right))
x = np.ones(2)
pg.allreduce(x)  # still in step
assert x[0] == n

# -- DETAIL: mismatches named on every rank -------------------------------------------------------------------------
# reduce to different roots
try:
    pg.reduce(np.ones(2), dst=0 if r else last)
    raise AssertionError("a root mismatch must raise")
except CollectiveMismatchError as exc:
    assert "reduce(sum)" in str(exc) and "root" in str(exc), str(exc)
# split sizes that disagree: rank 0 expects one row more from rank last (and one fewer from itself)
rows_from = [1] * n
if r == 0:
    rows_from[last] += 1
    rows_from[0] -= 1
try:
    pg.all_to_all_single(np.zeros(n), np.zeros(n), rows_from, [1] * n)
    raise AssertionError("disagreeing split sizes must raise")
except CollectiveMismatchError as exc:
    assert f"rank {last} sends 1 rows to rank 0, which expects 2" in str(exc), str(exc)
# a rank a collective ahead meets the others at a monitored barrier: rank 0 compares the fingerprints
if r == last:
    pg._steps.next_seq()  # as if it had run one collective more on this group
try:
    pg.monitored_barrier(timeout=30)
    raise AssertionError("a sequence mismatch must raise")
except CollectiveMismatchError as exc:
    assert "monitored_barrier" in str(exc) and exc.groups, str(exc)
print(f"rank {r}: c10d collectives OK", flush=True)
