"""Run MPI scenario scripts from serial pytest: ``mpiexec -n N python -m distlab._bootstrap script``.

Why not ``mpiexec -n 2 python -m pytest``: when one rank fails, the ranks' test sequences desynchronise and
hang, and pytest-timeout's signal method cannot interrupt a rank blocked inside MPI. Here pytest stays serial and
each scenario is one bounded job: its own session, a hard timeout, ``killpg`` of every rank on expiry, and an
uncaught exception on any rank aborts the job (``distlab._bootstrap``) with that rank's traceback shown.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from distlab.launch import JobResult, launch_script

SCENARIOS = Path(__file__).resolve().parent / "mpi"


def run_scenario(script, np: int = 2, timeout: float = 120, args=(), env=None, expect_failure: bool = False,
                 timeline=None, cluster=None) -> JobResult:
    """Run ``tests/mpi/<script>`` on ``np`` ranks and fail the test (showing every rank's output) if it fails.

    With ``expect_failure=True`` a non-zero exit is returned for the test to inspect instead; a job that passes
    when it should have failed fails the test. A timeout always fails the test. ``cluster`` (a running virtual
    cluster's name, e.g. the ``virtual_cluster`` fixture's) runs the ranks across its hosts, in blocks.
    """
    path = Path(script)
    if not path.is_absolute():
        path = SCENARIOS / path
    start = time.monotonic()
    result = launch_script(str(path), np=np, args=args, env=env, timeout=timeout, capture=True,
                           timeline=timeline, cluster=cluster)
    result.elapsed = time.monotonic() - start
    shown = f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
    if result.timed_out:
        pytest.fail(f"{path.name} on {np} ranks did not finish within {timeout} s and was killed\n{shown}")
    if expect_failure:
        if result.returncode == 0:
            pytest.fail(f"{path.name} on {np} ranks should have failed but exited 0\n{shown}")
    elif result.returncode != 0:
        pytest.fail(f"{path.name} on {np} ranks failed (exit status {result.returncode})\n{shown}")
    return result
