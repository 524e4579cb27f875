"""Checkpoints and restarts across ranks: resharding, a killed rank's job restarted bit for bit, a save cut short,
and Horovod's elastic API over restarts (tests/mpi/ckpt_*.py).

- ckpt_reshard.py: saved at 4 ranks, loaded at 2 and 3 (DDP's replicated state, ZeRO's shards, sharded blocks).
- ckpt_train.py: a rank SIGKILLed at a random step, the job restarted (``max_restarts``): parameters, optimizer
  state, losses and DDP's buckets equal the uninterrupted run's, bit for bit; a rank killed halfway through a
  save: that checkpoint is refused, the one before it used, and the result is still the uninterrupted run's.
- ckpt_elastic.py: elastic.run resumes from the last commit on as many ranks (a job that also asked for fault
  tolerance fails over to the restarts on MPICH), and on fewer (a 4-rank job that
  crashed continued on 2; on a virtual cluster, the job restarted without a lost host): every sample of each
  epoch applied exactly once.
"""
import pickle
import random

import numpy as np
import pytest

from _mpi import load_ranks

pytestmark = pytest.mark.mpi


def test_saved_at_4_ranks_loads_at_2_and_3(mpirun, tmp_path):
    job = mpirun("ckpt_reshard.py", np=4, args=["save", str(tmp_path), "core"], timeout=240)
    assert job.stdout.count("ckpt_reshard save done") == 4
    for np_ in (2, 3):
        job = mpirun("ckpt_reshard.py", np=np_, args=["load", str(tmp_path), "mixed"], timeout=240)
        assert job.stdout.count("ckpt_reshard load done") == np_


def _assert_same_run(expected: list, got: list, context) -> None:
    for rank, (a, b) in enumerate(zip(expected, got)):
        for device in a:
            A, B = a[device], b[device]
            assert A["losses"] == B["losses"], (context, rank, device, A["losses"], B["losses"])
            assert A["buckets"] == B["buckets"], (context, rank, device)
            for name in A["params"]:
                assert np.array_equal(A["params"][name], B["params"][name]), (context, rank, device, name)
            assert A["optim"].keys() == B["optim"].keys()
            for name, state in A["optim"].items():
                for key, value in state.items():
                    assert np.array_equal(np.asarray(value), np.asarray(B["optim"][name][key])), \
                        (context, rank, device, name, key)


_uninterrupted: dict = {}


def uninterrupted(mpirun, tmp_path_factory, np_, impl):
    """The uninterrupted run's results (one launch per world, shared by the tests that compare with it)."""
    if (np_, impl) not in _uninterrupted:
        out = tmp_path_factory.mktemp(f"plain{np_}{impl}")
        mpirun("ckpt_train.py", np=np_, args=[impl, str(out / "plain"), str(out / "ckpt"), "none"], timeout=240)
        _uninterrupted[np_, impl] = load_ranks(str(out / "plain"), np_)
    return _uninterrupted[np_, impl]


@pytest.mark.parametrize("np_,impl", [(2, "mixed"), (4, "core")], ids=["2ranks-mixed", "4ranks-core"])
def test_killed_rank_restart_equals_uninterrupted_run(mpirun, tmp_path_factory, tmp_path, np_, impl):
    expected = uninterrupted(mpirun, tmp_path_factory, np_, impl)
    steps = expected[0]["cpu"]["step"]
    kill = f"{random.randrange(np_)}:{random.choice(['cpu', 'cuda'])}:{random.randrange(1, steps)}"
    job = mpirun("ckpt_train.py", np=np_, args=[impl, str(tmp_path / "killed"), str(tmp_path / "killed-ckpt"), kill],
                 timeout=300, max_restarts=2)
    assert len(job.attempts) == 2, (kill, job.stderr)
    assert "was killed by signal 9 (SIGKILL)" in job.attempts[0].cause, job.attempts[0]
    assert f"rank {kill.split(':')[0]} " in job.attempts[0].cause
    assert "the job finished in attempt 1, after 1 restart" in job.stderr
    _assert_same_run(expected, load_ranks(str(tmp_path / "killed"), np_), kill)


def test_rank_killed_while_saving_leaves_the_previous_checkpoint(mpirun, tmp_path_factory, tmp_path):
    expected = uninterrupted(mpirun, tmp_path_factory, 2, "mixed")
    job = mpirun("ckpt_train.py", np=2, args=["mixed", str(tmp_path / "cut"), str(tmp_path / "cut-ckpt"),
                                              "save:1:cpu:6"], timeout=300, max_restarts=1)
    assert len(job.attempts) == 2 and "rank 1" in job.attempts[0].cause
    assert job.stdout.count("refused step-6: a partial checkpoint") == 2, job.stdout
    assert job.stdout.count("resumed cpu from step 4") == 2, job.stdout
    _assert_same_run(expected, load_ranks(str(tmp_path / "cut"), 2), "save")
    # the partial checkpoint was saved again, whole, by the next attempt: no file of the partial one is left
    step6 = sorted(p.name for p in (tmp_path / "cut-ckpt" / "cpu" / "step-6").iterdir())
    assert step6 == [".metadata", "__0_2.distcp", "__1_2.distcp"], step6


def test_elastic_restart_resumes_from_the_last_commit_where_fault_tolerance_fails_over_to_it(mpirun, tmp_path):
    # asked for fault tolerance too, on MPICH (no ULFM): the launcher says why and fails over to the restarts
    job = mpirun("ckpt_elastic.py", np=2, args=["mixed", "run-dir", "1:5", str(tmp_path / "out")], timeout=240,
                 max_restarts=1, fault_tolerance=True)
    assert "which MPICH (the mpich wheel) lacks; failing over to the restart path (--max-restarts 1)" in \
        job.stderr, job.stderr
    assert len(job.attempts) == 2
    assert [r["resets"] for r in load_ranks(str(tmp_path / "out"), 2)] == [[2], [2]]


def test_elastic_job_continues_on_fewer_ranks_applying_each_sample_once(mpirun, tmp_path):
    commits = str(tmp_path / "commits")
    job = mpirun("ckpt_elastic.py", np=4, args=["core", commits, "2:7", str(tmp_path / "out4")], timeout=240,
                 expect_failure=True)
    assert "rank 2" in job.stderr and "SIGKILL" in job.stderr
    job = mpirun("ckpt_elastic.py", np=2, args=["core", commits, "none", str(tmp_path / "out2")], timeout=240)
    results = load_ranks(str(tmp_path / "out2"), 2)
    assert [r["resets"] for r in results] == [[2], [2]]  # the reset callbacks ran once, in the 2-rank world
    assert all(pickle.dumps(r["size"]) == pickle.dumps(2) for r in results)


@pytest.mark.cluster
def test_lost_host_restart_on_the_remaining_host(mpirun, virtual_cluster, tmp_path):
    from distlab.cluster.lifecycle import layout_of
    from distlab.cluster.netlink import configure

    try:
        job = mpirun("ckpt_elastic.py", np=4, args=["core", "run-dir", "host:3", str(tmp_path / "out")], timeout=300,
                     cluster=virtual_cluster, max_restarts=1, min_hosts=1)
    finally:
        for host in layout_of(virtual_cluster).hosts:  # the link the scenario cut, up again
            configure(host, host)
    assert [a.np for a in job.attempts] == [4, 2], job.attempts
    assert f"without host {virtual_cluster}-h2 (lost)" in job.stderr, job.stderr
    results = load_ranks(str(tmp_path / "out"), 2)
    assert [r["size"] for r in results] == [2, 2] and [r["resets"] for r in results] == [[2], [2]]
