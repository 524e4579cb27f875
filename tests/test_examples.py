"""Examples that need several ranks say so up front, at once, with a non-zero exit status."""
from __future__ import annotations

from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.mpi
@pytest.mark.parametrize("script, message", [
    ("parameter_server.py", "parameter_server.py needs 2 or more ranks (a server and at least one trainer), got 1"),
    ("dist_autograd_pipeline.py", "dist_autograd_pipeline.py needs 2 or more ranks (got 1)"),
])
def test_rpc_examples_refuse_one_rank_at_once(mpirun, script, message):
    # DISTLAB_TIMEOUT far above the job's timeout: an example that waited for a missing peer would be killed at
    # 60 s and fail the test, rather than end with a timeout error of its own.
    job = mpirun(str(EXAMPLES / script), np=1, timeout=60, expect_failure=True, env={"DISTLAB_TIMEOUT": "600"})
    assert job.returncode != 0
    assert message in job.stdout + job.stderr
    assert "step " not in job.stdout and "OK" not in job.stdout  # it stopped before doing anything


@pytest.mark.mpi
def test_the_link_rates_driver_refuses_to_run_as_a_rank(mpirun):
    job = mpirun(str(EXAMPLES / "link_rates.py"), np=1, timeout=60, expect_failure=True)
    assert job.returncode != 0
    assert "run it with plain python (as root), not under `python -m distlab run`" in job.stdout + job.stderr


# -- --device: the device code paths of every training example, on the CI stand-in (bit-equal to numpy) ---------
DEVICE_RUNS = [
    ("train_ddp.py", 2, [], "accuracy 1.000 on 1800 examples across 2 ranks"),
    ("uneven_inputs.py", 2, [], "final model's loss on the whole data set"),
    ("horovod_style_training.py", 2, [], "accuracy 1.000"),
    ("parameter_server.py", 3, [], "parameter server example OK"),
    ("dist_autograd_pipeline.py", 3, [], "max parameter difference 0.00e+00"),
]


@pytest.mark.mpi
@pytest.mark.parametrize("script, np_, args, success", DEVICE_RUNS, ids=[r[0] for r in DEVICE_RUNS])
def test_examples_run_on_the_device_stand_in(mpirun, script, np_, args, success):
    job = mpirun(str(EXAMPLES / script), np=np_, args=[*args, "--device", "fake"], timeout=240)
    assert success in job.stdout
    if script == "uneven_inputs.py":  # as on the CPU, to the last digit (the stand-in computes with numpy)
        cpu = mpirun(str(EXAMPLES / script), np=np_, args=args, timeout=240)
        summary = [line for line in job.stdout.splitlines() if success in line]
        assert summary and summary == [line for line in cpu.stdout.splitlines() if success in line]


def test_device_cuda_without_cupy_exits_clearly(tmp_path):
    import subprocess
    import sys

    pytest.importorskip("numpy")
    try:
        import cupy  # noqa: F401
        pytest.skip("cupy is installed here: --device cuda would run")
    except ImportError:
        pass
    # as a user runs it (the script's directory on sys.path, so it finds examples/_device.py); MPI is not needed
    done = subprocess.run([sys.executable, str(EXAMPLES / "train_ddp.py"), "--device", "cuda"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode != 0
    assert "--device cuda needs cupy and a CUDA device (ModuleNotFoundError" in done.stderr
    assert "Traceback" not in done.stderr
