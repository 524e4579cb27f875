"""RPC lifecycle on N ranks: init twice is an error, shutdown then re-init, non-graceful shutdown fails the
requests still in flight, timeline events on the "rpc" lanes."""
import os
import threading
import time

import distlab.rpc as rpc
from distlab.errors import RpcError

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
_go = threading.Event()
_ready = threading.Semaphore(0)


def release():
    _go.set()


def ready():
    _ready.release()


def add(a, b):
    return a + b


rpc.init_rpc(f"w{rank}")
try:
    rpc.init_rpc(f"w{rank}")
    raise AssertionError("double init accepted")
except RpcError as exc:
    assert "already called" in str(exc)
assert rpc.rpc_sync((rank + 1) % world, add, (rank, 1)) == rank + 1
# With no traffic the listener sleeps between its polls and costs (almost) no CPU.
agent = rpc.get_agent()
deadline = time.monotonic() + 10
while not agent._idle:
    assert time.monotonic() < deadline, "the listener never went idle"
    time.sleep(0.02)
c0, t0 = time.process_time(), time.monotonic()
time.sleep(0.5)
cpu = (time.process_time() - c0) / (time.monotonic() - t0)
assert cpu < 0.25, f"an idle worker burnt {cpu:.2f} s of CPU per second"
assert rpc.rpc_sync((rank + 1) % world, add, (rank, 2)) == rank + 2   # idle listeners still answer
rpc.shutdown()

# A second life, with other names; then a non-graceful stop.
rpc.init_rpc(f"again{rank}")
assert rpc.get_worker_info().name == f"again{rank}"
assert rpc.rpc_sync(f"again{(rank + 1) % world}", add, (1, 1)) == 2
if rank != 0:
    rpc.rpc_sync(0, ready)  # rank 0 must not stop before every rank's call above was answered
if rank == 0:
    assert all(_ready.acquire(timeout=60) for _ in range(world - 1))
    slow = rpc.rpc_async(1, time.sleep, (1.0,))
    for dst in range(1, world):
        rpc.rpc_sync(dst, release)
    rpc.shutdown(graceful=False)
    try:
        slow.wait(5)
        raise AssertionError("in-flight request survived a non-graceful shutdown")
    except RpcError as exc:
        assert "shut down before the response arrived" in str(exc)
else:
    assert _go.wait(60)
    time.sleep(1.2)  # let the slow call finish and answer (rank 0 no longer listens)
    rpc.shutdown(graceful=False)
print(f"rpc lifecycle OK rank {rank}", flush=True)
