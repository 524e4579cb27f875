"""Real-GPU checks: run only where cupy finds a CUDA device; skipped cleanly everywhere else.

The device code paths themselves are tested without a GPU through tests/mpi/fakegpu.py (test_comm_mpi.py).
"""
import pytest

pytestmark = pytest.mark.gpu


def _device_count() -> int:
    try:
        import cupy
    except Exception:  # noqa: BLE001 - not installed, or installed without a usable CUDA runtime
        return 0
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no driver or no device
        return 0


requires_gpu = pytest.mark.skipif(_device_count() == 0, reason="needs cupy and a CUDA device")


def _allreduce_on_device():
    import cupy

    from distlab import comm

    pg = comm.world()
    a = cupy.full(1024, pg.rank + 1, dtype=cupy.float32)
    pg.allreduce(a, op="avg")
    return float(a.sum().get())


@requires_gpu
def test_cupy_allreduce_on_two_ranks():
    import distlab

    assert distlab.run(_allreduce_on_device, np=2, timeout=120) == [1024 * 1.5] * 2
