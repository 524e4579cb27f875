"""DISTLAB_DEBUG=DETAIL: a collective called with different shapes raises the same error on every rank
(numpy arrays, then device arrays of the strict stand-in)."""
import numpy as np

from distlab import comm
from distlab.errors import CollectiveMismatchError
from scenario_checks import DEVICES, host, on

pg = comm.world()
r, n = pg.rank, pg.size
for device in DEVICES:  # numpy, then the strict device stand-in, in one launch
    seq = 2 + 4 * DEVICES.index(device)  # four collectives a pass

    def d(array):
        return on(device, array)

    pg.allreduce(d(np.ones(3)))  # a matching call passes the check

    shape = (5,) if r == n - 1 else (4,)
    try:
        pg.allreduce(d(np.ones(shape, dtype=np.float32)), name="grad.bucket0")
        raise AssertionError("a shape mismatch must raise")
    except CollectiveMismatchError as exc:
        text = str(exc)
        others = ", ".join(str(k) for k in range(n - 1))
        who = f"rank {others}" if n == 2 else f"ranks {others}"
        assert f"{who} called #{seq} allreduce(sum) float32[4]" in text, text
        assert f"rank {n - 1} called #{seq} allreduce(sum) float32[5]" in text, text
        assert "grad.bucket0" in text, text
        assert exc.seq == seq and len(exc.groups) == 2

    # A different op on one rank (broadcast vs allreduce) is named too; the group stays usable afterwards.
    try:
        if r == 0:
            pg.broadcast(d(np.ones(2)), src=0)
        else:
            pg.allreduce(d(np.ones(2)))
        raise AssertionError("an op mismatch must raise")
    except CollectiveMismatchError as exc:
        assert "broadcast" in str(exc) and "allreduce" in str(exc), str(exc)
    x = d(np.ones(2))
    pg.allreduce(x)
    assert host(x).tolist() == [n, n]
print(f"rank {r}: mismatch reported: OK", flush=True)
