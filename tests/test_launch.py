"""distlab.run: functions on several ranks, results per rank, remote errors with their rank and traceback."""
import pytest

import distlab
from distlab.errors import RankFailedError

pytestmark = pytest.mark.mpi


def allreduce_rank(scale):
    import numpy as np

    from distlab import comm

    pg = comm.world()
    a = np.array([pg.rank * scale], dtype=np.float64)
    pg.allreduce(a)
    return {"rank": pg.rank, "size": pg.size, "sum": float(a[0])}


def fail_on_rank_one():
    import os

    if os.environ["RANK"] == "1":
        raise KeyError("missing shard 7")
    return "fine"


def test_run_returns_per_rank_results():
    results = distlab.run(allreduce_rank, np=2, args=(10.0,), timeout=120)
    assert results == [{"rank": 0, "size": 2, "sum": 10.0}, {"rank": 1, "size": 2, "sum": 10.0}]


def test_run_carries_lambdas_and_closures():
    offset = 7
    assert distlab.run(lambda: offset + 1, np=2, timeout=120) == [8, 8]


def test_run_reraises_with_rank_and_remote_traceback():
    with pytest.raises(RankFailedError) as info:
        distlab.run(fail_on_rank_one, np=2, timeout=120)
    err = info.value
    assert err.rank == 1 and "KeyError: 'missing shard 7'" in err.remote_traceback
    assert "fail_on_rank_one" in err.remote_traceback and "rank 1 of 2 raised" in str(err)


def test_command_line_launcher(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "hello.py"
    script.write_text("import os, sys\nsys.stdout.write(f\"hello from {os.environ['RANK']} {sys.argv[1]}\\n\")\n"
                      "sys.exit(0)\n")
    done = subprocess.run([sys.executable, "-P", "-m", "distlab", "run", "-n", "2", str(script), "x"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split("\n"))[-2:] == ["hello from 0 x", "hello from 1 x"]
    bad = subprocess.run([sys.executable, "-P", "-m", "distlab", "run", "-n", "2", str(script)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "IndexError" in bad.stderr
    # the launcher repeats each failing rank's error at the end, even if mpiexec lost the forwarded lines
    # (one rank or both: the first abort may end the other rank before it reports)
    tail = bad.stderr.rsplit("first failure first:\n", 1)[1].splitlines()
    assert 1 <= len(tail) <= 2
    assert {line.split("] ", 1)[1] for line in tail} == {"IndexError: list index out of range"}


def test_failure_report_keeps_each_rank_s_error_in_order(tmp_path, monkeypatch):
    from distlab import _bootstrap
    from distlab.launch import FAILURE_REPORT_VAR, _failure_summary

    report = tmp_path / "failures.log"
    monkeypatch.setenv(FAILURE_REPORT_VAR, str(report))
    _bootstrap._report_failure("[rank 2] Traceback (most recent call last):\n[rank 2] KeyError: 'x'\n")
    _bootstrap._report_failure("[rank 0] exited with status 4\n")
    summary = _failure_summary(report, 4)
    assert summary.splitlines() == [
        "distlab: the job failed with exit status 4; what the failing ranks reported, first failure first:",
        "[rank 2] KeyError: 'x'", "[rank 0] exited with status 4"]
    assert _failure_summary(report, 0) == "" and _failure_summary(tmp_path / "absent", 1) == ""
