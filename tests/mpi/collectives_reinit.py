"""distlab.collectives re-initialised after earlier use, as Horovod's test_horovod_reinit with rank 0 ahead: rank 0
calls shutdown() then init() at once; the others, 0.5 s later, init() (a no-op while initialised), shutdown(), init().

1. From a healthy engine on every rank.
2. After an earlier use left the engine stopped on rank 0's account: its coordinator failed in a cycle (a bug, or
   input nothing foresaw; simulated by a failing Coordinator subclass on rank 0). It used to die alone, the others
   waiting in its broadcast until DISTLAB_TIMEOUT, so their shutdown() took that long and rank 0's new init() timed
   out ("ranks [1] have not entered it"). Now every rank stops at once with the reason, and the sequence pairs up.

Run with a short DISTLAB_TIMEOUT (the test sets 4 s): every wait below must end well before it.
Argument: ``mixed`` makes even ranks use the reference twin and odd ranks the core twin.
"""
import os
import sys
import time

import numpy as np

if "mixed" in sys.argv[1:]:
    os.environ["DISTLAB_IMPL"] = "reference" if int(os.environ["RANK"]) % 2 == 0 else "core"

from distlab import collectives as hvd  # noqa: E402
from distlab.collectives import _engine  # noqa: E402

PROMPT = 1.5   # seconds: far below DISTLAB_TIMEOUT (4 s), far above a cycle


def reinit_ahead_of_the_others(step):
    """The issue's sequence; the late ranks' shutdown() must return at once, and the new engines must pair."""
    if hvd.rank() == 0:
        hvd.shutdown()
        hvd.init()
    else:
        time.sleep(0.5)
        hvd.init()                       # a no-op: this rank's own shutdown() has not happened
        start = time.monotonic()
        hvd.shutdown()
        took = time.monotonic() - start
        assert took < PROMPT, f"step {step}: shutdown() took {took:.1f} s"
        hvd.init()
    assert hvd.is_initialized()
    assert hvd.allreduce(np.ones(2), name=f"after.{step}", op=hvd.Sum).tolist() == [n, n]


hvd.init()
r, n = hvd.rank(), hvd.size()
assert hvd.allreduce(np.ones(2), name="warm", op=hvd.Sum).tolist() == [n, n]

# 1. healthy
reinit_ahead_of_the_others(1)

# 2. rank 0's coordinator fails in the cycle that negotiates "boom"
if r == 0:
    controller = _engine.current.world.controller

    class Failing(type(controller.coordinator)):
        def coordinate(self, gathered, cache, cache_hits):
            raise RuntimeError("coordinator bug")

    old = controller.coordinator
    controller.coordinator = Failing(old.size, old.process_set_id, old.fusion_threshold, old.stall)
start = time.monotonic()
handle = hvd.allreduce_async(np.ones(2), name="boom")
try:
    hvd.synchronize(handle)
    failure = None
except Exception as exc:  # noqa: BLE001 - checked after the re-init, which must pair up first
    failure = exc
took = time.monotonic() - start
reinit_ahead_of_the_others(2)       # before the fix: rank 0's init() timed out, "ranks [1] have not entered it"
assert isinstance(failure, hvd.NotInitializedError), repr(failure)
assert ("distlab.collectives stopped: the coordinator (rank 0) failed in its negotiation cycle (RuntimeError: "
        "coordinator bug); see rank 0's log") in str(failure), str(failure)
assert took < PROMPT, f"the ranks learned of the failure after {took:.1f} s"
hvd.shutdown()
print(f"rank {r}: reinit OK impl={os.environ.get('DISTLAB_IMPL', 'auto')}", flush=True)
