"""An error nobody catches ends the whole job at once (no rank waits out its timeout).

argv[1] = "raise": rank 1 raises before a collective; "timeout": rank 1 never arrives and rank 0's timeout error
(naming rank 1) is left uncaught.
"""
import sys
import time

import numpy as np

from distlab import comm

mode = sys.argv[1]
pg = comm.world()
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
