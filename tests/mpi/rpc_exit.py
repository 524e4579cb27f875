"""Ends of an RPC job, run under plain ``mpiexec`` (no distlab launcher, so nothing catches an uncaught error).

``forget``: every rank exits without ``rpc.shutdown()``; ``raise``: rank 1 raises an uncaught error while
rank 0 exits normally, neither shut down. Both used to crash in MPI_Finalize (a segmentation fault: the
listener thread was still inside MPI); the agent now stops at exit. ``late``: rank 1 never calls init_rpc;
rank 0's init_rpc must fail within its timeout, naming rank 1.
"""
import sys
import time

from mpi4py import MPI

import distlab.rpc as rpc
from distlab.errors import DistTimeoutError

mode = sys.argv[1]
rank = MPI.COMM_WORLD.Get_rank()


def where():
    return rpc.get_worker_info().name


if mode == "late":
    if rank == 0:
        start = time.monotonic()
        try:
            rpc.init_rpc("early", rpc_timeout=1.5)
            raise AssertionError("init_rpc returned without rank 1")
        except DistTimeoutError as exc:
            elapsed = time.monotonic() - start
            assert exc.missing_ranks == [1] and "init_rpc (worker 'early') timed out after 1.5 s" in str(exc), exc
            assert "ranks [1] have not entered it" in str(exc), exc
            assert elapsed < 10, elapsed
        print("late: init_rpc timed out naming rank 1", flush=True)
    else:
        time.sleep(3)
    sys.exit(0)

rpc.init_rpc(f"w{rank}")
assert rpc.rpc_sync((rank + 1) % MPI.COMM_WORLD.Get_size(), where) == f"w{(rank + 1) % MPI.COMM_WORLD.Get_size()}"
MPI.COMM_WORLD.Barrier()
print(f"{mode}: rank {rank} leaves without shutdown", flush=True)
if mode == "raise" and rank == 1:
    raise RuntimeError("an uncaught error on purpose")
