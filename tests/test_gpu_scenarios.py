"""The real-GPU acceptance scenarios (marker ``gpu``: 2 ranks sharing one GPU, skipped cleanly without cupy and a
CUDA device), and the same scenario scripts on the strict stand-in, which runs them on every machine.

- ``tests/mpi/gpu_scenarios.py``: DDP with default arguments, Join over DDP with ZeroRedundancyOptimizer and
  SyncBatchNorm on uneven inputs, the Horovod-style front; each compared with the same seeded run on numpy
  (stand-in: bit-equal; cupy: float32 within ``rtol=1e-4, atol=1e-5``).
- ``tests/mpi/rpc_devices.py``: RPC and RRefs with a device map, and distributed autograd across the workers
  (stand-in: bit-equal; cupy: float64 within ``rtol=1e-12, atol=1e-12``).
"""
import pytest

from test_gpu import requires_gpu


@pytest.mark.mpi
def test_gpu_scenarios_on_the_stand_in(mpirun):
    result = mpirun("gpu_scenarios.py", np=2, args=["core", "fake"], timeout=180)
    assert result.stdout.count("gpu scenarios OK (core, fake)") == 2


SCRIPTS = [("gpu_scenarios.py", "gpu scenarios OK"), ("rpc_devices.py", "rpc devices OK")]


def _on_cupy(mpirun, script, success, twins):
    result = mpirun(script, np=2, args=[twins, "cupy"], timeout=240)
    assert result.stdout.count(f"{success} ({twins}, cupy)") == 2


@pytest.mark.gpu
@pytest.mark.mpi
@requires_gpu
@pytest.mark.parametrize("script, success", SCRIPTS, ids=[s for s, _ in SCRIPTS])
def test_on_cupy(mpirun, impl, script, success):
    _on_cupy(mpirun, script, success, impl)


@pytest.mark.gpu
@pytest.mark.mpi
@requires_gpu
@pytest.mark.parametrize("script, success", SCRIPTS, ids=[s for s, _ in SCRIPTS])
def test_on_cupy_mixed_world(mpirun, script, success):
    _on_cupy(mpirun, script, success, "mixed")

