"""One rank's bad call is refused before it takes a sequence number: its group stays in step (run with
DISTLAB_DEBUG=DETAIL, which compares sequence numbers across ranks on every collective).

Rank 1 first tries each collective with a dtype or op MPI cannot take, gets a TypeError naming the call, the
tensor and the dtype, then makes the right call, which rank 0 makes once.
"""
import ml_dtypes
import numpy as np

from distlab import comm

pg = comm.world()
r, n = pg.rank, pg.size
assert comm.debug_level() == "DETAIL"

mistakes = [
    ("allreduce", "sum", np.array([None, 1], dtype=object)),
    ("allreduce", "sum", np.array(["ab", "cd"])),
    ("allreduce", "sum", np.zeros(2, dtype=[("a", "i4"), ("b", "f4")])),
    ("allreduce", "sum", np.zeros(2, dtype="datetime64[s]")),
    ("allreduce", "max", np.zeros(2, dtype="timedelta64[s]")),
    ("allreduce", "min", np.zeros(2, dtype=np.complex128)),
    ("allreduce", "max", np.zeros(2, dtype=np.complex64)),
    ("broadcast", None, np.array([{}, []], dtype=object)),
    ("allgather", None, np.array(["x", "y"])),
]
for i, (what, op, bad) in enumerate(mistakes):
    name = f"t{i}"
    good = np.full(2, r + 1.0)
    if r == 1:
        try:
            if what == "allreduce":
                pg.allreduce(bad, op=op, name=name)
            elif what == "broadcast":
                pg.broadcast(bad, name=name)
            else:
                pg.allgather(bad, name=name)
            raise AssertionError(f"{what} of {bad.dtype} must be refused")
        except TypeError as exc:
            assert str(exc).startswith(f"{what} of '{name}': ") and str(bad.dtype) in str(exc), exc
    if what == "allreduce":
        pg.allreduce(good, op=op, name=name)
        assert good[0] == (n * (n + 1) / 2 if op == "sum" else (n if op == "max" else 1.0)), (op, good)
    elif what == "broadcast":
        pg.broadcast(good, name=name)
        assert good[0] == 1.0
    else:
        assert pg.allgather(good, name=name)[:, 0].tolist() == [k + 1.0 for k in range(n)]

# bfloat16 (the dtype of compressed gradients): reduced by distlab's own op, moved as its bits.
bf = np.full(3, r + 1, dtype=ml_dtypes.bfloat16)
pg.allreduce(bf, op="avg")
assert bf.dtype == ml_dtypes.bfloat16 and float(bf[0]) == (n + 1) / 2, bf
b2 = np.full(2, r + 0.5, dtype=ml_dtypes.bfloat16)
pg.broadcast(b2, src=n - 1)
assert [float(x) for x in b2] == [n - 0.5] * 2
g = pg.allgather(np.full(1, r, dtype=ml_dtypes.bfloat16))
assert g.dtype == ml_dtypes.bfloat16 and [float(x) for x in g[:, 0]] == list(range(n))
pg.barrier()
print(f"rank {r}: refused calls kept the group in step: OK", flush=True)
