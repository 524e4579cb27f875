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


@pytest.mark.gpu
@pytest.mark.mpi
@requires_gpu
def test_gpu_scenarios_on_cupy(mpirun, impl):
    result = mpirun("gpu_scenarios.py", np=2, args=[impl, "cupy"], timeout=240)
    assert result.stdout.count(f"gpu scenarios OK ({impl}, cupy)") == 2


@pytest.mark.gpu
@pytest.mark.mpi
@requires_gpu
def test_gpu_scenarios_on_cupy_mixed_world(mpirun):
    result = mpirun("gpu_scenarios.py", np=2, args=["mixed", "cupy"], timeout=240)
    assert result.stdout.count("gpu scenarios OK (mixed, cupy)") == 2


@pytest.mark.gpu
@pytest.mark.mpi
@requires_gpu
def test_rpc_and_dist_autograd_with_a_device_map_on_cupy(mpirun, impl):
    result = mpirun("rpc_devices.py", np=2, args=[impl, "cupy"], timeout=240)
    assert result.stdout.count(f"rpc devices OK ({impl}, cupy)") == 2


@pytest.mark.gpu
@pytest.mark.mpi
@requires_gpu
def test_rpc_with_a_device_map_on_cupy_mixed_world(mpirun):
    result = mpirun("rpc_devices.py", np=2, args=["mixed", "cupy"], timeout=240)
    assert result.stdout.count("rpc devices OK (mixed, cupy)") == 2
