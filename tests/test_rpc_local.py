"""distlab.rpc in one process (MPI singleton): the thread-level refusal and a world of one worker; and the ends
of a job under plain mpiexec (no launcher): no shutdown, an uncaught error, a rank that never calls init_rpc."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distlab.launch import find_mpiexec

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
import os
import distlab.rpc as rpc
import numpy as np
for bad in (-1, "5", None.__class__):
    try:
        rpc.init_rpc("solo", rpc_timeout=bad)
        raise AssertionError("bad timeout accepted")
    except ValueError as exc:
        assert "number of seconds" in str(exc)
os.environ["DISTLAB_TIMEOUT"] = "123"   # the default timeout of every RPC wait, as of every wait in distlab
rpc.init_rpc("solo")
assert rpc.get_agent().rpc_timeout == 123.0
r = rpc.remote("solo", np.arange, (4,))
assert r.is_owner() and r.to_here().tolist() == [0, 1, 2, 3]
assert rpc.rpc_sync("solo", sum, ([1, 2, 3],)) == 6
assert rpc.rpc_sync(0, lambda rr: rr.local_value().sum(), (r,)) == 6
info = rpc.rref_debug_info()

@rpc.cheap
def two():
    return 2

# Inline handlers reply from the listener thread; a reply to its own rank used to block the listener for good.
assert rpc.rpc_sync(0, two, timeout=10) == 2
assert [f.wait(10) for f in [rpc.rpc_async("solo", two) for _ in range(50)]] == [2] * 50
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


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["forget", "raise", "late"])
def test_job_ends_under_plain_mpiexec(mode):
    script = Path(__file__).resolve().parent / "mpi" / "rpc_exit.py"
    bindir = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""), PYTHONPATH="")
    # plain mpiexec on purpose (not distlab's launcher): the rank itself must stop the agent before MPI_Finalize;
    # subprocess.run's timeout kills mpiexec (and with it the ranks) should the job hang
    result = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, "-P", str(script), mode], timeout=90,
                            capture_output=True, text=True, env=env)
    shown = result.stdout + result.stderr
    assert "Segmentation" not in shown and "signal 11" not in shown and result.returncode not in (139, -11), shown
    if mode == "raise":
        assert result.returncode != 0 and "an uncaught error on purpose" in shown, shown
    else:
        assert result.returncode == 0, shown
    expected = {"forget": 2, "raise": 2, "late": 1}[mode]
    assert result.stdout.count(f"{mode}:") == expected, shown
