"""distlab.collectives end to end on N ranks: values, any-order async submission, fast path counted, fusion,
allgather/broadcast/barrier, every error path, join (pre-warmed cache), stall report and stall shutdown.

Argument: ``mixed`` makes even ranks use the reference twin and odd ranks the core twin.
"""
import os
import sys
import time
import warnings

import numpy as np

if "mixed" in sys.argv[1:]:
    os.environ["DISTLAB_IMPL"] = "reference" if int(os.environ["RANK"]) % 2 == 0 else "core"

from distlab import _backend, collectives as hvd  # noqa: E402
from distlab.collectives import _engine  # noqa: E402
from distlab.errors import StallWarning  # noqa: E402
from distlab import fakegpu  # noqa: E402
from scenario_checks import expect, staged_outside_comm, start_counting  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
assert hvd.stats()["impl"] == _backend.active_impl()


for device, xp in (("cpu", np), ("cuda", fakegpu)):  # numpy, then the strict device stand-in, in one launch
    start_counting(device)
    # -- values of every op, scale factors ----------------------------------------------------------------------
    x = xp.array([r + 1.0, -(r + 1.0), 2.0], dtype=np.float64)
    s = n * (n + 1) / 2
    assert hvd.allreduce(x, name="avg").tolist() == [s / n, -s / n, 2.0]
    assert hvd.allreduce(x, name="sum", op=hvd.Sum).tolist() == [s, -s, 2 * n]
    assert hvd.allreduce(x, name="min", op=hvd.Min).tolist() == [1.0, -n, 2.0]
    assert hvd.allreduce(x, name="max", op=hvd.Max).tolist() == [n, -1.0, 2.0]
    assert hvd.allreduce(x, name="prod", op=hvd.Product)[2] == 2.0 ** n
    y = hvd.allreduce(x, name="scaled", op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    assert np.allclose(y, [s / 2, -s / 2, n]), y
    assert x.tolist() == [r + 1.0, -(r + 1.0), 2.0]            # the input is not modified
    ints = hvd.allreduce(xp.arange(4, dtype=np.int32) * (r + 1), name="ints", op=hvd.Sum)
    assert ints.dtype == np.int32 and ints.tolist() == [0, s, 2 * s, 3 * s]
    # Average of integers as Horovod: the sum times 1/size in float64, truncated toward zero
    iavg = hvd.allreduce(xp.array([-7 * (r == 0), 7 * (r == 0), 1], np.int64), name="iavg")
    assert iavg.dtype == np.int64 and iavg.tolist() == [int(-7 / n), int(7 / n), int(n * (1 / n))], iavg
    auto = hvd.allreduce(xp.ones(2, np.float32))                  # auto-named: same call order on every rank
    assert auto.tolist() == [1.0, 1.0]

    # -- many tensors, different orders, repeated: the fast path ------------------------------------------------
    rng = np.random.default_rng(r)
    before = hvd.stats()
    names = [f"grad.{i}" for i in range(40)]
    for step in range(6):
        order = list(names)
        rng.shuffle(order)
        handles = {}
        for name in order:
            i = int(name.split(".")[1])
            handles[name] = hvd.allreduce_async(xp.full((i % 5 + 1, 3), r + step + i, np.float32), name=name,
                                                op=hvd.Sum)
        for name in names:
            i = int(name.split(".")[1])
            out = hvd.synchronize(handles[name])
            expected = sum(rank + step + i for rank in range(n))
            assert out.shape == (i % 5 + 1, 3) and np.all(out == expected), (name, out, expected)
            assert hvd.poll(handles[name])
    after = hvd.stats()
    fast = after["fast_path"] - before["fast_path"]
    slow = after["slow_path"] - before["slow_path"]
    capacity = int(os.environ.get("DISTLAB_CACHE_CAPACITY", "1024"))
    if capacity > 0:
        assert fast >= 5, (fast, slow)                   # steps 2..6 were negotiated by the bit vector alone
        assert after["cache_entries"] >= 40
    else:
        assert fast == 0 and slow >= 6, (fast, slow)
    assert after["fused_tensors"] - before["fused_tensors"] > after["responses"] - before["responses"]  # fused

    # -- allgather (different first dims), broadcast, barrier -----------------------------------------------------
    g = hvd.allgather(xp.full((r + 1, 2), r, np.int64), name="gather")
    assert g.shape == (n * (n + 1) // 2, 2) and g[:, 0].tolist() == [k for k in range(n) for _ in range(k + 1)]
    b = hvd.broadcast(xp.full(3, r, np.float32), root_rank=n - 1, name="bcast")
    assert b.tolist() == [n - 1] * 3
    hvd.barrier()
    hvd.barrier()
    assert not staged_outside_comm(device), staged_outside_comm(device)
    print(f"rank {r}: values, fast path, fusion, allgather, broadcast on {device} OK", flush=True)

# -- error paths: raised on every rank, naming the ranks and what each sent -----------------------------------
expect(hvd.CollectiveError, lambda: hvd.allreduce(np.ones(3 if r == 1 else 2), name="bad.shape"),
       "Mismatched shapes for tensor 'bad.shape'", "rank 1 sent [3]", "raised on every rank")
expect(hvd.CollectiveError, lambda: hvd.allreduce(np.ones(2, np.float64 if r == 0 else np.float32),
                                                  name="bad.dtype"), "rank 0 sent float64")
expect(hvd.CollectiveError, lambda: hvd.allreduce(np.ones(2), name="bad.op", op=hvd.Max if r == 0 else hvd.Sum),
       "Mismatched reduce ops", "rank 0 sent max")
expect(hvd.CollectiveError, lambda: hvd.allreduce(np.ones(2), name="bad.scale", prescale_factor=1.0 + (r == 1)),
       "prescale/postscale", "rank 1 sent (2, 1)")
expect(hvd.CollectiveError, lambda: hvd.broadcast(np.ones(2), root_rank=r % 2, name="bad.root"),
       "Mismatched root ranks", " sent root 0", " sent root 1")
expect(hvd.CollectiveError, lambda: hvd.allgather(np.ones((2, 2 + (r == 1))), name="bad.gather"),
       "shapes beyond the first dimension")
expect(hvd.CollectiveError, lambda: hvd.allgather(np.float64(r), name="bad.scalar"), "0-dimensional")
h = hvd.allreduce_async(np.ones(2), name="dup")
expect(hvd.DuplicateNameError, lambda: hvd.allreduce_async(np.ones(2), name="dup"), "'dup'", "in flight")
hvd.synchronize(h)
hvd.synchronize(hvd.allreduce_async(np.ones(2), name="dup"))          # free again once finished
# a cached name resubmitted with another shape: invalidated everywhere, renegotiated
hvd.allreduce(np.ones(4), name="reshaped")
hvd.allreduce(np.ones(4), name="reshaped")
assert hvd.allreduce(np.ones(5), name="reshaped").shape == (5,)
# (the first rank to submit the new shape sees INVALID and erases the entry everywhere; later ones see a MISS)
invalid_seen = hvd.allgather(np.array([hvd.stats()["invalid"]]), name="invalid.count")
assert invalid_seen.sum() >= 1 or capacity == 0, invalid_seen

# -- join: the last rank runs out of data early; cached and new tensors still reduce (zeros from it) ----------
late = n - 1
hvd.allreduce(np.ones(3), name="w", op=hvd.Sum)                  # pre-warm the cache
if r == late:
    last = hvd.join()
else:
    for step in range(3):
        out = hvd.allreduce(np.ones(3) * (r + 1), name="w", op=hvd.Sum)
        assert out.tolist() == [n * (n - 1) / 2] * 3, out             # the joined rank added zeros
        out = hvd.allreduce(np.ones(2), name=f"new.{step}")          # Average divides by n (zeros counted)
        assert np.allclose(out, (n - 1) / n), out
    mx = hvd.allreduce(np.full(2, -5.0 - r), name="jmax", op=hvd.Max)
    assert mx.tolist() == [-5.0, -5.0], mx                           # joined rank contributes the identity
    expect(hvd.CollectiveError, lambda: hvd.allgather(np.ones((1, 2)), name="gather.join"),
           "not supported once a rank has joined")
    time.sleep(1.0 if r == 0 else 0.2)                              # rank 0 joins last
    last = hvd.join()
assert last == 0, last                                                 # the same answer on every rank

# -- join on the device stand-in: the training ranks' device tensors (fused, on the device) meet the joined rank's
# host zeros; the results stay on the device
if r == late:
    assert hvd.join() == 0
else:
    for step in range(2):
        outs = hvd.grouped_allreduce([fakegpu.ones(3) * (r + 1), fakegpu.ones(2)], name=f"dev.join.{step}", op=hvd.Sum)
        assert all(isinstance(o, fakegpu.ndarray) for o in outs), outs
        assert outs[0].tolist() == [n * (n - 1) / 2] * 3 and outs[1].tolist() == [n - 1] * 2, outs
    time.sleep(0.5 if r == 0 else 0.1)
    assert hvd.join() == 0

from distlab.timeline import get_timeline  # noqa: E402

timeline = get_timeline()
if timeline.enabled:
    seen = {e["name"] for e in timeline.events()}
    assert "negotiate (slow path)" in seen and "fuse" in seen, sorted(e for e in seen if not e.startswith("allreduce"))
    assert capacity == 0 or "negotiate (fast path)" in seen
    assert any(e.startswith("allreduce grad.") and "+" in e for e in seen)       # a fused collective
    assert any(e.startswith("allgather gather") for e in seen)

stats = hvd.stats()
hvd.shutdown()
expect(hvd.NotInitializedError, lambda: hvd.allreduce(np.ones(1), name="after"), "init()")
hvd.shutdown()   # idempotent

# -- stall report, then stall shutdown ------------------------------------------------------------------------
os.environ["DISTLAB_STALL_CHECK_TIME"] = "0.5"
hvd.init()
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    if r == 0:
        h = hvd.allreduce_async(np.ones(2), name="straggler")
        time.sleep(2.0)
    else:
        time.sleep(2.0)
        h = hvd.allreduce_async(np.ones(2), name="straggler")
    hvd.synchronize(h)
if r == 0:
    reports = hvd.stall_reports()
    assert reports, "no stall report"
    missing = "rank 1" if n == 2 else "ranks " + ", ".join(map(str, range(1, n)))
    assert "'straggler' (allreduce): waiting" in reports[0] and f"ready on rank 0; missing {missing}" in reports[0], \
        reports[0]
    assert any(issubclass(w.category, StallWarning) for w in seen)
# a timed-out wait names the missing ranks (on rank 0, once the stall inspector has looked)
from distlab.errors import DistTimeoutError  # noqa: E402

if r == 0:
    h = hvd.allreduce_async(np.ones(2), name="lonely")
    exc = expect(DistTimeoutError, lambda: hvd.synchronize(h, timeout=1.5), "'lonely'", "did not complete within")
    assert exc.missing_ranks == list(range(1, n)) and exc.name == "lonely", (exc.missing_ranks, str(exc))
    hvd.barrier()
else:
    hvd.barrier()
    h = hvd.allreduce_async(np.ones(2), name="lonely")
hvd.synchronize(h)
hvd.shutdown()

os.environ["DISTLAB_STALL_SHUTDOWN_TIME"] = "1.0"
hvd.init()
if r == 0:
    h = hvd.allreduce_async(np.ones(2), name="never")
    expect(hvd.StallShutdownError, lambda: hvd.synchronize(h, timeout=30), "'never'", "Shutting down")
else:
    assert _engine.current.stopped.wait(30) and hvd.is_initialized()   # stopped, initialized until shutdown()
    expect(hvd.NotInitializedError, lambda: hvd.allreduce(np.ones(1), name="x"), "stopped")
hvd.shutdown()
del os.environ["DISTLAB_STALL_SHUTDOWN_TIME"], os.environ["DISTLAB_STALL_CHECK_TIME"]

print(f"rank {r}: collectives OK impl={_backend.active_impl()} fast={stats['fast_path']} "
      f"slow={stats['slow_path']} hits={stats['hits']} misses={stats['misses']}", flush=True)
