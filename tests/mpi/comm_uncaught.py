"""A rank that fails, or ends, mid-job ends the whole job at once (no rank waits out its timeout).

argv[1] = "raise": rank 1 raises before a collective; "timeout": rank 1 never arrives and rank 0's timeout error
(naming rank 1) is left uncaught; "exit": rank 1 calls sys.exit(3); "vanish": rank 1 leaves with os._exit(0)
between two collectives (no error, no completion record); "kill": rank 1 is killed by SIGKILL there.
"""
import os
import signal
import sys
import time

import numpy as np

from distlab import comm

mode = sys.argv[1]
pg = comm.world()
print(f"rank {pg.rank} pid {os.getpid()}", flush=True)
if mode == "raise":
    if pg.rank == 1:
        raise ValueError("rank 1 ran out of data")
    pg.allreduce(np.ones(4))  # rank 0 would wait 300 s here; the abort ends it instead
elif mode == "timeout":
    if pg.rank == 1:
        time.sleep(120)
    pg.allreduce(np.ones(4), name="loss")
elif mode == "exit":
    if pg.rank == 1:
        sys.exit(3)
    pg.barrier()
elif mode in ("vanish", "kill"):
    pg.allreduce(np.ones(4), name="step 1")
    if pg.rank == 1:
        if mode == "vanish":
            os._exit(0)
        os.kill(os.getpid(), signal.SIGKILL)
    pg.allreduce(np.ones(4), name="step 2")
    print(f"rank {pg.rank} finished", flush=True)
