"""A job across a virtual cluster's hosts: where each rank runs, and what happens when one is lost.

Modes (first argument):
- ``env``: every rank checks RANK/WORLD_SIZE, that LOCAL_RANK/LOCAL_WORLD_SIZE count ranks per host (ranks in
  blocks), that it runs in the host its block says (its namespace's interface), and that an allreduce works.
- ``kill``: after a barrier, the last rank (on the last host) kills itself with SIGKILL while the others wait
  in an allreduce; the launcher must end the job on every host and name the lost rank.
- ``sleep DIR``: every rank writes its pid to DIR/rank<r>.pid and sleeps (for the launcher's SIGTERM/SIGINT
  handling).
"""
import os
import signal
import sys
import time

import numpy as np

from distlab import comm
from distlab.cluster import current_host, placement

mode = sys.argv[1]
pg = comm.world()
rank, size = pg.rank, pg.size
hosts = int(sys.argv[2]) if mode == "env" and len(sys.argv) > 2 else 2

if mode == "env":
    slots = placement(size, hosts)
    blocks = [h for h, n in enumerate(slots, start=1) for _ in range(n)]
    first = sum(slots[: blocks[rank] - 1])
    assert os.environ["RANK"] == str(rank) and os.environ["WORLD_SIZE"] == str(size)
    assert os.environ["LOCAL_WORLD_SIZE"] == str(slots[blocks[rank] - 1]), (rank, os.environ["LOCAL_WORLD_SIZE"])
    assert os.environ["LOCAL_RANK"] == str(rank - first), (rank, os.environ["LOCAL_RANK"])
    host = current_host()
    assert host == f"{os.environ['DISTLAB_CLUSTER']}-h{blocks[rank]}", (rank, host)
    a = np.full(1 << 16, rank, dtype=np.float64)
    pg.allreduce(a)
    assert a[0] == size * (size - 1) / 2
    print(f"rank {rank} on {host} local {os.environ['LOCAL_RANK']}/{os.environ['LOCAL_WORLD_SIZE']} OK",
          flush=True)
elif mode == "kill":
    pg.barrier()
    if rank == size - 1:
        print(f"rank {rank} on {current_host()} kills itself", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    a = np.ones(4)
    pg.allreduce(a)          # never completes: the last rank is gone
    raise AssertionError("the allreduce completed without the killed rank")
elif mode == "sleep":
    pg.barrier()
    with open(os.path.join(sys.argv[2], f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(300)
else:
    raise SystemExit(f"unknown mode {mode}")
