"""A rank that never arrives: the others time out naming it (found through the side channel), caught here."""
import time

import numpy as np

from distlab import comm
from distlab.errors import DistTimeoutError, ProcessGroupBrokenError

pg = comm.world()
r, n = pg.rank, pg.size
late = n - 1
chained = comm.ProcessGroup(name="chained")
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
print(f"rank {r}: timeout reported: OK", flush=True)
