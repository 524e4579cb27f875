"""distlab.collectives' lifecycle on N ranks: who stopped the engine is said once, by rank and cause; init() after a
peer's shutdown is a no-op until the local shutdown() (it used to build a second engine and hang in destroy). On
numpy, then on the device stand-in, in one launch.

Argument: ``mixed`` makes even ranks use the reference twin and odd ranks the core twin.
"""
import os
import sys

import numpy as np

if "mixed" in sys.argv[1:]:
    os.environ["DISTLAB_IMPL"] = "reference" if int(os.environ["RANK"]) % 2 == 0 else "core"

from mpi4py import MPI  # noqa: E402

from distlab import collectives as hvd, fakegpu  # noqa: E402
from distlab.collectives import _engine  # noqa: E402
from scenario_checks import staged_outside_comm, start_counting  # noqa: E402

world = MPI.COMM_WORLD


def wait_stopped(seconds=30.0):
    """The engine's cycle thread ended (a peer stopped it); this rank stays initialized until its shutdown()."""
    assert _engine.current.stopped.wait(seconds), "the engine did not stop"
    assert hvd.is_initialized()


def expect_stopped(fn, *texts):
    try:
        fn()
    except hvd.NotInitializedError as exc:
        text = str(exc)
        for t in texts:
            assert t in text, (t, text)
        assert text.count("distlab.collectives stopped") == 1, text       # said once
        return text
    raise AssertionError("expected NotInitializedError")


def orphan(name, xp, *texts):
    """An allreduce the stopped peer never joins: waiting for it fails, naming who stopped and why. When the stop
    reached this rank before the submit did, the submit itself is refused with the same words."""
    try:
        pending = hvd.allreduce_async(xp.ones(2), name=name)
    except hvd.NotInitializedError:
        pending = None
    wait_stopped()
    if pending is None:
        return expect_stopped(lambda: hvd.allreduce_async(xp.ones(2), name=name), *texts)
    return expect_stopped(lambda: hvd.synchronize(pending), *texts)


for device, xp in (("cpu", np), ("cuda", fakegpu)):  # numpy, then the strict device stand-in, in one launch
    start_counting(device)
    # 1. The last rank calls shutdown(); every other rank is told so, by rank; its init() is a no-op; then it shuts
    #    down too and everyone starts again (before the fix, init() built a new engine and the job hung).
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    last = n - 1
    assert hvd.allreduce(xp.ones(2), name="warm", op=hvd.Sum).tolist() == [n, n]
    if r == last:
        hvd.shutdown()
    else:
        orphan("orphan", xp, f"rank {last} called shutdown()")
        hvd.init()                                            # a no-op: the local shutdown() has not happened
        assert hvd.is_initialized()                           # as Horovod's: until this rank's own shutdown()
        expect_stopped(lambda: hvd.allreduce(xp.ones(1), name="after"), f"rank {last} called shutdown()")
        hvd.shutdown()
    world.Barrier()
    hvd.init()
    assert hvd.is_initialized() and hvd.allreduce(xp.ones(1), name="again", op=hvd.Sum).tolist() == [n]

    # 2. Rank 1 crashes: its atexit handler shuts its collectives down; the survivors say which rank crashed and why.
    if r == 1:
        sys.last_exc = sys.last_value = ValueError("boom")   # what Python leaves behind an uncaught exception
        hvd.ops._shutdown_at_exit()
        del sys.last_exc, sys.last_value
    else:
        orphan("orphan.crash", xp, "rank 1 crashed (ValueError: boom)")
        hvd.shutdown()
    world.Barrier()

    # 3. A rank that ends without shutdown(): the others learn that it exited.
    hvd.init()
    if r == 0:
        hvd.ops._shutdown_at_exit()
    else:
        wait_stopped()
        expect_stopped(lambda: hvd.allreduce(xp.ones(1), name="x"), "rank 0 exited without calling shutdown()")
        hvd.shutdown()
    world.Barrier()

    assert not staged_outside_comm(device), staged_outside_comm(device)
    print(f"rank {r}: lifecycle on {device} OK", flush=True)
print(f"rank {r}: lifecycle OK", flush=True)
