"""The comm layer on 2 and 4 ranks: collectives, device staging, DETAIL mismatches, timeouts, failure handling."""
import time

import pytest

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("np_", [2, 4])
def test_collectives(mpirun, np_):
    result = mpirun("comm_collectives.py", np=np_)
    assert result.stdout.count("comm collectives OK") == np_


@pytest.mark.parametrize("aware", ["0", "1"])
def test_device_arrays_staged_or_direct(mpirun, aware):
    result = mpirun("comm_device.py", np=2, env={"DISTLAB_CUDA_AWARE": aware})
    assert result.stdout.count("device path") == 2


@pytest.mark.parametrize("np_", [2, 4])
def test_detail_mismatch_raises_on_every_rank(mpirun, np_):
    result = mpirun("comm_mismatch.py", np=np_, env={"DISTLAB_DEBUG": "DETAIL"})
    assert result.stdout.count("mismatch reported: OK") == np_


@pytest.mark.parametrize("np_", [2, 4])
def test_missing_rank_is_named_on_timeout(mpirun, np_):
    result = mpirun("comm_timeout.py", np=np_, timeout=60)
    assert result.stdout.count("timeout reported: OK") == np_


def test_raising_rank_aborts_the_job_with_its_traceback(mpirun):
    result = mpirun("comm_uncaught.py", np=2, args=["raise"], expect_failure=True, timeout=60)
    assert "[1] Traceback" in result.stderr and "[1] ValueError: rank 1 ran out of data" in result.stderr
    assert "distlab: rank 1 raised ValueError: rank 1 ran out of data" in result.stderr
    assert result.elapsed < 30  # rank 0 did not wait out its 300 s timeout


def test_uncaught_timeout_names_the_missing_rank_and_ends_the_job(mpirun):
    result = mpirun("comm_uncaught.py", np=2, args=["timeout"], expect_failure=True, timeout=60,
                    env={"DISTLAB_TIMEOUT": "2"})
    assert "[0] Traceback" in result.stderr and "DistTimeoutError" in result.stderr
    assert "allreduce #1 of 'loss'" in result.stderr and "ranks [1] have not entered it" in result.stderr
    assert result.elapsed < 30  # rank 1's 120 s sleep was cut short by the abort


def test_nonzero_exit_status_is_forwarded(mpirun):
    result = mpirun("comm_uncaught.py", np=2, args=["exit"], expect_failure=True, timeout=60)
    assert result.returncode == 3
    # told by the launcher from rank 1's failure record, whatever mpiexec forwarded before the end
    assert result.stderr.splitlines()[-2:] == ["distlab: rank 1 called sys.exit(3)",
                                               "distlab: the job failed with exit status 3; rank 0 was stopped"]


def test_launcher_sets_rank_environment(mpirun):
    result = mpirun("launcher_env.py", np=2, args=["alpha", "--beta", "3"])
    assert result.stdout.count("env OK") == 2


def test_debug_info_logs_every_collective(mpirun):
    info = mpirun("comm_collectives.py", np=2, env={"DISTLAB_DEBUG": "INFO"})
    assert info.stdout.count("comm collectives OK") == 2
    for rank in (0, 1):
        assert f"[rank {rank}] distlab.comm: group world rank {rank}: allreduce #1" in info.stderr
        assert f"[rank {rank}] distlab.comm: group world rank {rank}: broadcast_object #" in info.stderr
