"""A rank that never arrives: the others time out naming it (found through the side channel), caught here; on
numpy arrays, through a chained future, and on a device array (the strict stand-in)."""
import time

import numpy as np

from distlab import comm
from distlab.errors import DistTimeoutError, ProcessGroupBrokenError
from scenario_checks import host, on, staged_outside_comm, start_counting

pg = comm.world()
r, n = pg.rank, pg.size
late = n - 1
chained = comm.ProcessGroup(name="chained")
on_device = comm.ProcessGroup(name="on device")
pg.barrier()
if r == late:
    time.sleep(6.0)  # busy elsewhere: never enters the allreduces
else:
    start = time.monotonic()
    try:
        pg.allreduce(np.ones(8, dtype=np.float32), name="grad.bucket3", async_op=True).wait(timeout=1.5)
        raise AssertionError("must time out")
    except DistTimeoutError as exc:
        elapsed = time.monotonic() - start
        assert 1.4 < elapsed < 10, elapsed
        assert exc.missing_ranks == [late], exc.missing_ranks
        assert exc.op == "allreduce" and exc.seq == 2 and exc.name == "grad.bucket3"
        text = str(exc)
        assert f"ranks [{late}] have not entered it" in text, text
        assert f"rank {late} last entered #1 barrier" in text, text
        assert "'grad.bucket3'" in text and "32 bytes" in text, text
    try:
        pg.barrier()
        raise AssertionError("a broken group must refuse further use")
    except ProcessGroupBrokenError as exc:
        assert "timed out" in str(exc)
    # A future chained with then() (what fp16 comm hooks and sparse buckets do) fails with the same error.
    work = chained.allreduce(np.ones(2), name="hooked", async_op=True)
    doubled = work.get_future().then(lambda f: f.value() * 2)
    try:
        doubled.wait(timeout=1.5)
        raise AssertionError("must time out")
    except DistTimeoutError as exc:
        assert exc.missing_ranks == [late] and f"ranks [{late}] have not entered it" in str(exc), str(exc)
        assert exc.name == "hooked" and work.exception() is exc and doubled.exception() is exc
    # A device array (the strict stand-in), staged through the host: the same error, nothing copied back.
    start_counting("cuda")
    grad = on("cuda", np.ones(4, dtype=np.float32))
    try:
        on_device.allreduce(grad, name="grad.device", async_op=True).wait(timeout=1.5)
        raise AssertionError("must time out")
    except DistTimeoutError as exc:
        assert exc.missing_ranks == [late] and exc.name == "grad.device" and "16 bytes" in str(exc), str(exc)
    assert host(grad).tolist() == [1.0] * 4 and not staged_outside_comm("cuda")
print(f"rank {r}: timeout reported: OK", flush=True)
