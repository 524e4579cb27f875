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
