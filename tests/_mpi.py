"""Run MPI scenario scripts from serial pytest: ``mpiexec -n N python -m distlab._bootstrap script``.

Why not ``mpiexec -n 2 python -m pytest``: when one rank fails, the ranks' test sequences desynchronise and
hang, and pytest-timeout's signal method cannot interrupt a rank blocked inside MPI. Here pytest stays serial and
each scenario is one bounded job run by the launcher (:func:`distlab.launch.launch_script`): its own session, a
hard timeout after which every rank is stopped and killed, and an uncaught exception on any rank ends the job
with that rank's traceback shown. A rank that ends without its completion record (``os._exit``, a signal) fails
the job as well, so a scenario cannot pass with a rank missing.
"""
from __future__ import annotations

import pickle
import time
from pathlib import Path

import pytest

from distlab.launch import JobResult, launch_script

SCENARIOS = Path(__file__).resolve().parent / "mpi"


def run_scenario(script, np: int = 2, timeout: float = 120, args=(), env=None, expect_failure: bool = False,
                 timeline=None, cluster=None, fault_tolerance: bool = False, max_restarts: int = 0,
                 min_hosts=None) -> JobResult:
    """Run ``tests/mpi/<script>`` on ``np`` ranks and fail the test (showing every rank's output) if it fails.

    With ``expect_failure=True`` a non-zero exit is returned for the test to inspect instead; a job that passes
    when it should have failed fails the test. A timeout always fails the test. ``cluster`` (a running virtual
    cluster's name, e.g. the ``virtual_cluster`` fixture's) runs the ranks across its hosts, in blocks.
    ``fault_tolerance`` runs it with MPI's ULFM (Open MPI only). ``max_restarts`` and ``min_hosts`` are the
    launcher's (a job that failed and was restarted passes if its last attempt does).
    """
    path = Path(script)
    if not path.is_absolute():
        path = SCENARIOS / path
    start = time.monotonic()
    result = launch_script(str(path), np=np, args=args, env=env, timeout=timeout, capture=True,
                           timeline=timeline, cluster=cluster, fault_tolerance=fault_tolerance,
                           max_restarts=max_restarts, min_hosts=min_hosts)
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


def load_ranks(prefix: str, np: int) -> list:
    """What each rank of a scenario pickled to ``<prefix>.rank<r>.pkl``, in rank order."""
    return [pickle.load(open(f"{prefix}.rank{r}.pkl", "rb")) for r in range(np)]


def run_worlds(script, out, worlds, done_line: str, env_for=None, timeout: float = 300) -> dict:
    """Run ``script`` once per ``(np, impl)`` of ``worlds`` (its arguments: the impl and a result prefix under
    ``out``); every rank must print ``done_line``. Returns ``{(np, impl): what each rank pickled}``."""
    results = {}
    for np_, impl in worlds:
        prefix = str(Path(out) / f"{impl}{np_}")
        env = env_for(np_, impl) if env_for else None
        job = run_scenario(script, np=np_, args=[impl, prefix], timeout=timeout, env=env)
        assert job.stdout.count(done_line) == np_, job.stdout
        results[np_, impl] = load_ranks(prefix, np_)
    return results
