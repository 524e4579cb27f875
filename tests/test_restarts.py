"""The launcher's restarts (``--max-restarts``, ``--monitor-interval``; distlab._restart)."""
import os
import subprocess
import sys

import pytest

import distlab
from distlab import _restart
from distlab.errors import RankFailedError

SCRIPT = os.path.join(os.path.dirname(__file__), "mpi", "launcher_restarts.py")


@pytest.mark.mpi
def test_gives_up_after_max_restarts_with_every_attempts_cause(mpirun):
    job = mpirun("launcher_restarts.py", np=2, args=["fail"], max_restarts=2, expect_failure=True)
    assert job.returncode == 1 and len(job.attempts) == 3
    for attempt in range(3):
        assert job.stdout.count(f"attempt {attempt} of at most 3, run dir kept: True") == 2, job.stdout
        cause = job.attempts[attempt].cause
        assert cause.startswith(f"rank {attempt % 2} raised ValueError: attempt {attempt} fails"), cause
        assert f"  attempt {attempt} (started " in job.stderr and cause in job.stderr
    assert "the job failed in each of its 3 attempts (no restart left (--max-restarts 2))" in job.stderr
    assert job.stderr.count("restarting every rank") == 2, job.stderr


@pytest.mark.mpi
def test_never_restarts_a_job_that_ended_cleanly(mpirun):
    job = mpirun("launcher_restarts.py", np=2, args=["ok"], max_restarts=3)
    assert job.returncode == 0 and len(job.attempts) == 1
    assert "restart" not in job.stderr and job.stdout.count("attempt 0 of at most 4") == 2


@pytest.mark.mpi
def test_command_line_restarts_a_failed_job():
    done = subprocess.run([sys.executable, "-m", "distlab", "run", "-n", "2", "--max-restarts", "1",
                           "--monitor-interval", "0.2", SCRIPT, "fail-once"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "attempt 0 failed (rank 1 raised ValueError: the first attempt fails" in done.stderr
    assert "restarting every rank (restart 1 of 1)" in done.stderr
    assert "the job finished in attempt 1, after 1 restart" in done.stderr
    assert done.stdout.count("attempt 1 of at most 2") == 2


@pytest.mark.parametrize("args,message", [(["--max-restarts", "-1"], "--max-restarts must be at least 0"),
                                          (["--monitor-interval", "0"], "--monitor-interval must be positive"),
                                          (["--cluster", "3:2"], "1 <= MIN <= MAX")])
def test_command_line_refuses_bad_restart_options(args, message):
    done = subprocess.run([sys.executable, "-m", "distlab", "run", *args, SCRIPT, "ok"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.mpi
def test_run_returns_the_results_of_the_attempt_that_finished():
    def work():
        if os.environ["DISTLAB_RESTART_COUNT"] == "0" and os.environ["RANK"] == "0":
            raise RuntimeError("first attempt")
        return int(os.environ["DISTLAB_RESTART_COUNT"])

    assert distlab.run(work, np=2, max_restarts=1) == [1, 1]
    with pytest.raises(RankFailedError, match="first attempt"):
        distlab.run(work, np=2)


def test_restart_policy_pieces():
    assert _restart.parse_hosts("1:3") == (3, 1) and _restart.parse_hosts(2) == (2, None)
    assert _restart.parse_hosts("dl") == ("dl", None)
    with pytest.raises(ValueError, match="1 <= MIN <= MAX"):
        _restart.parse_hosts("0:2")
    with pytest.raises(ValueError, match="whole number"):
        _restart.check_max_restarts(-1)

    class Result:
        interrupted, timed_out = None, False

    failed = _restart.Attempt(0, 1, 2, 0.0, "rank 1 raised ValueError: x")
    assert _restart.decide(Result(), [failed], 1) == (True, "")
    assert _restart.decide(Result(), [failed, failed], 1)[0] is False
    assert _restart.decide(Result(), [_restart.Attempt(0, 0, 2, 0.0)], 5) == (False, "")
    Result.timed_out = True
    assert _restart.decide(Result(), [failed], 3) == (False, "the time limit ran out: not restarted")
    lines = _restart.summary([failed, _restart.Attempt(1, 0, 2, 0.0)], 2, "")
    assert lines[0].startswith("the job finished in attempt 1, after 1 restart") and "rank 1 raised" in lines[1]
    assert _restart.summary([_restart.Attempt(0, 0, 2, 0.0)], 0, "") == []
