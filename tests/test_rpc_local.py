"""distlab.rpc in one process (MPI singleton): the thread-level refusal and a world of one worker."""
import os
import subprocess
import sys

SNIPPET_LEVEL = """
import mpi4py
mpi4py.rc.thread_level = "serialized"
from mpi4py import MPI
import distlab.rpc as rpc
from distlab.errors import RpcThreadLevelError
try:
    rpc.init_rpc("solo")
except RpcThreadLevelError as exc:
    print("refused:", exc)
"""

SNIPPET_SOLO = """
import distlab.rpc as rpc
import numpy as np
rpc.init_rpc("solo")
r = rpc.remote("solo", np.arange, (4,))
assert r.is_owner() and r.to_here().tolist() == [0, 1, 2, 3]
assert rpc.rpc_sync("solo", sum, ([1, 2, 3],)) == 6
assert rpc.rpc_sync(0, lambda rr: rr.local_value().sum(), (r,)) == 6
info = rpc.rref_debug_info()
rpc.shutdown()
print("solo OK", info)
"""


def _run(code):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    return subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=60, env=env)


def test_refuses_without_thread_multiple():
    result = _run(SNIPPET_LEVEL)
    assert "refused:" in result.stdout, result.stdout + result.stderr
    assert "MPI_THREAD_MULTIPLE" in result.stdout and "MPI_THREAD_SERIALIZED" in result.stdout


def test_single_worker_world():
    result = _run(SNIPPET_SOLO)
    assert "solo OK" in result.stdout, result.stdout + result.stderr
