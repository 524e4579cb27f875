"""Group lifetime: dropped groups free their communicator, destroy() never waits for a peer, ``with`` destroys.

MPICH has about 2000 context ids (each communicator takes one); a group used to keep three (its duplicate, its
node communicator and the board's window) until the end of the job, so a job making groups in a loop died near
681 of them.
"""
import gc
import sys
import time

import numpy as np

from distlab import comm
from distlab.errors import DistTimeoutError, ProcessGroupBrokenError

pg = comm.world()
r, n = pg.rank, pg.size
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 1200

# Create and drop groups in a loop: sub-groups through new_group (some as context managers), plain groups.
for i in range(ROUNDS):
    if i % 3 == 0:
        with pg.new_group(list(range(n))) as g:
            assert g.size == n
        try:
            g.barrier()
            raise AssertionError("a destroyed group must refuse use")
        except ProcessGroupBrokenError as exc:
            assert "destroyed" in str(exc)
    elif i % 3 == 1:
        g = comm.ProcessGroup(name=f"dropped{i}")
        g.allreduce(np.ones(1))
        del g  # no cycle: freed here, by its finalizer
    else:
        g = comm.new_group(list(range(n)))
        g.allreduce(np.ones(2), async_op=True)  # dropped with work in flight: kept alive until it completes
        del g
        while comm.progress():
            pass
gc.collect()

# destroy() with a vanished peer (rank n-1 sleeps, never calls it): local, so it ends at once on the others;
# work in flight fails with ProcessGroupBrokenError instead of waiting on the peer.
late = n - 1
victim = comm.ProcessGroup(name="victim", timeout=30)
pg.barrier()
if r == late:
    time.sleep(3)
else:
    work = victim.allreduce(np.ones(4), async_op=True, name="orphan")
    start = time.monotonic()
    victim.destroy()
    victim.destroy()  # twice is fine
    assert time.monotonic() - start < 1.0, time.monotonic() - start  # 30 s timeout: it did not wait
    try:
        work.wait()
        raise AssertionError("work in flight on a destroyed group must fail")
    except ProcessGroupBrokenError as exc:
        assert "allreduce #1 on process group 'victim' was still in flight" in str(exc), exc
pg.barrier()

# A destroyed world group is replaced on the next world() call.
short = comm.ProcessGroup(name="short", timeout=1.0)
if r != late:
    try:
        short.barrier()
    except DistTimeoutError:
        pass  # broken; destroying it must still be immediate
start = time.monotonic()
short.destroy()
assert time.monotonic() - start < 1.0
pg.destroy()
fresh = comm.world()
assert fresh is not pg and fresh.size == n
fresh.barrier()
print(f"rank {r}: lifecycle OK after {ROUNDS} groups", flush=True)
