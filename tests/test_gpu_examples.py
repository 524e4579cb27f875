"""The five training examples with ``--device cuda`` on a real GPU (marker ``gpu``; 2 or 3 ranks sharing it),
against the same run on the CPU; skipped cleanly without cupy and a CUDA device. The device check runs them as a
step of their own (``scripts/gpu_check.py``), so that their time is bounded apart from the other GPU tests'. The
stand-in runs the same examples in ``test_examples.py``.
"""
import re

import pytest

from test_examples import DEVICE_RUNS, EXAMPLES
from test_gpu import requires_gpu


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
