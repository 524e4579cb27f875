"""A rank's process is killed (SIGKILL) while the others wait for it in a negotiated allreduce.

Without ULFM, MPI reports nothing to the survivors, and a peer blocked on the dead rank would wait for its
DISTLAB_TIMEOUT. The launcher reports it instead: the process manager (distlab's on one host, or hydra) ends the
whole job as soon as one rank ends badly, and the launcher's summary names the rank and the signal. The test runs
this with DISTLAB_TIMEOUT far above its own bound, and checks that the job ended through the launcher, not a
timeout. Arguments: the rank to kill (default: the last), and ``mixed`` (even ranks reference, odd ranks core).
"""
import os
import signal
import sys
import time

import numpy as np

if "mixed" in sys.argv[1:]:
    os.environ["DISTLAB_IMPL"] = "reference" if int(os.environ["RANK"]) % 2 == 0 else "core"

from distlab import collectives as hvd  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
victim = int(next((a for a in sys.argv[1:] if a.isdigit()), n - 1))
assert hvd.allreduce(np.ones(2), name="warm", op=hvd.Sum).tolist() == [n, n]
print(f"rank {r}: warm", flush=True)
if r == victim:
    time.sleep(0.3)                         # the others are waiting in "after" by now
    os.kill(os.getpid(), signal.SIGKILL)
handle = hvd.allreduce_async(np.ones(2), name="after")
hvd.synchronize(handle)
print(f"rank {r}: survived the kill of rank {victim}", flush=True)   # never: the launcher ends the job first
