"""The real-GPU acceptance scenarios (marker ``gpu``: 2 ranks sharing one GPU, skipped cleanly without cupy and a
CUDA device), and the same scenario scripts on the strict stand-in, which runs them on every machine.

- ``tests/mpi/gpu_scenarios.py``: DDP with default arguments, Join over DDP with ZeroRedundancyOptimizer and
  SyncBatchNorm on uneven inputs, the Horovod-style front; each compared with the same seeded run on numpy
  (stand-in: bit-equal; cupy: float32 within ``rtol=1e-4, atol=1e-5``).
- ``tests/mpi/rpc_devices.py``: RPC and RRefs with a device map, and distributed autograd across the workers
  (stand-in: bit-equal; cupy: float64 within ``rtol=1e-12, atol=1e-12``).
- the five training examples with ``--device cuda``, against the same run on the CPU (the stand-in runs them in
  ``test_examples.py``).
"""
import re

import pytest

from test_examples import DEVICE_RUNS, EXAMPLES
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


def _figures(line: str) -> list:
    return [float(x) for x in re.findall(r"[-+]?\d+\.\d+(?:e[-+]?\d+)?", line)]


@pytest.mark.gpu
@pytest.mark.mpi
@requires_gpu
@pytest.mark.parametrize("script, np_, args, success", DEVICE_RUNS, ids=[r[0] for r in DEVICE_RUNS])
def test_examples_reach_their_cpu_figures_on_a_gpu(mpirun, script, np_, args, success):
    # The five training examples with --device cuda (ranks sharing the GPU): the same success line as on the CPU,
    # its figures (accuracy, loss, parameter difference) within float32 rounding of the CPU run's.
    gpu = mpirun(str(EXAMPLES / script), np=np_, args=[*args, "--device", "cuda"], timeout=300)
    cpu = mpirun(str(EXAMPLES / script), np=np_, args=args, timeout=300)
    key = re.split(r" [-+]?\d", success)[0]  # the success line without its figures
    on_gpu = [line for line in gpu.stdout.splitlines() if key in line]
    on_cpu = [line for line in cpu.stdout.splitlines() if key in line]
    assert on_gpu and len(on_gpu) == len(on_cpu), (gpu.stdout, cpu.stdout)
    for g, c in zip(on_gpu, on_cpu):
        assert _figures(g) == pytest.approx(_figures(c), rel=1e-3, abs=1e-4), (g, c)
