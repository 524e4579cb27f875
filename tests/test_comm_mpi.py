"""The comm layer on 2 and 4 ranks: collectives, device staging, DETAIL mismatches, timeouts, failure handling."""

import pytest

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("np_", [2, 4])
def test_collectives(mpirun, np_):
    result = mpirun("comm_collectives.py", np=np_)
    assert result.stdout.count("comm collectives OK") == np_
    assert result.stdout.count("comm collectives on cuda OK") == np_  # and on the strict device stand-in


# nccl: each rank on a node of its own (DISTLAB_RANKS_PER_NODE=1), so no two ranks share the stand-in's device;
# hierarchical: nodes of 2 ranks, the stand-in presenting 2 devices (local rank k on device k)
_NODES = {"nccl": "1", "hierarchical": "2"}


@pytest.mark.parametrize("transport, aware", [("staged", "0"), ("mpi", "1"), ("ipc", "0"), ("nccl", "0")])
def test_device_arrays_per_transport(mpirun, transport, aware):
    result = mpirun("comm_device.py", np=2, env={"DISTLAB_CUDA_AWARE": aware, "DISTLAB_DEVICE_COMM": transport,
                                                 "DISTLAB_RANKS_PER_NODE": _NODES.get(transport, "")})
    assert result.stdout.count(f"device path ({transport})") == 2


@pytest.mark.parametrize("transport, np_, devices", [
    ("staged", 2, ""), ("ipc", 2, ""), ("ipc", 4, ""), ("ipc", 4, "4"), ("nccl", 2, ""), ("nccl", 4, ""),
    ("hierarchical", 4, "2")])
def test_device_transport_conformance(mpirun, transport, np_, devices):
    """``devices``: how many devices the stand-in presents (ipc on 4: one reducing rank when all share one, each
    rank its block when each has its own)."""
    # small chunks and slots, so odd sizes cross chunk boundaries (and the staged path nccl falls back to)
    result = mpirun("comm_transports.py", np=np_, timeout=240, env={
        "DISTLAB_DEVICE_COMM": transport, "DISTLAB_IPC_SLOT_BYTES": "4096", "DISTLAB_STAGED_CHUNK_BYTES": "1000",
        "DISTLAB_RANKS_PER_NODE": _NODES.get(transport, devices), "DISTLAB_FAKEGPU_DEVICES": devices})
    assert result.stdout.count(f"transport {transport} conformance OK") == np_


@pytest.mark.parametrize("np_", [2, 4])
def test_detail_mismatch_raises_on_every_rank(mpirun, np_):
    result = mpirun("comm_mismatch.py", np=np_, env={"DISTLAB_DEBUG": "DETAIL"})
    assert result.stdout.count("mismatch reported: OK") == np_


@pytest.mark.parametrize("np_", [2, 4])
def test_missing_rank_is_named_on_timeout(mpirun, np_):
    result = mpirun("comm_timeout.py", np=np_, timeout=60)
    assert result.stdout.count("timeout reported: OK") == np_


@pytest.mark.parametrize("np_", [2, 3])
def test_shared_memory_allreduce_in_place(mpirun, np_):
    result = mpirun("comm_shared.py", np=np_, args=["one-node"], timeout=120)
    assert result.stdout.count("shared arena OK") == np_


def test_no_shared_memory_across_nodes(mpirun):
    result = mpirun("comm_shared.py", np=2, args=["two-nodes"], env={"DISTLAB_RANKS_PER_NODE": "1"})
    assert result.stdout.count("shared arena refused across nodes: OK") == 2


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


def test_world_setup_times_out_naming_the_rank_that_never_arrived(mpirun):
    result = mpirun("comm_setup.py", np=2, args=["world"], env={"DISTLAB_TIMEOUT": "2"}, timeout=90)
    assert result.stdout.count("setup timeout reported: OK") == 2


@pytest.mark.parametrize("np_", [2, 4])
def test_group_setup_times_out_naming_the_rank_that_never_arrived(mpirun, np_):
    result = mpirun("comm_setup.py", np=np_, args=["groups"], timeout=120)
    assert result.stdout.count("setup timeout reported: OK") == np_


def test_refused_calls_keep_the_group_in_step(mpirun):
    result = mpirun("comm_checks.py", np=2, env={"DISTLAB_DEBUG": "DETAIL"})
    assert result.stdout.count("kept the group in step: OK") == 2


def test_dropped_groups_are_freed_and_destroy_never_waits(mpirun):
    # 1020 groups: a group used to hold three MPI context ids until exit, and MPICH ran out near 681 groups.
    result = mpirun("comm_lifecycle.py", np=2, args=["1020"], timeout=240)
    assert result.stdout.count("lifecycle OK after 1020 groups") == 2


@pytest.mark.parametrize("per_node", ["2", "1"])
def test_missing_ranks_on_other_nodes_are_named(mpirun, per_node):
    result = mpirun("comm_nodes.py", np=4, env={"DISTLAB_RANKS_PER_NODE": per_node}, timeout=120)
    assert result.stdout.count(f"side channel across nodes OK ({per_node} per node)") == 4


@pytest.mark.cluster
def test_missing_rank_on_the_other_virtual_host_is_named(mpirun, virtual_cluster):
    # 2 hosts, ranks in blocks ({0, 1} and {2, 3}): the late rank 3 is read off host 2's board by rank 2 and
    # reported to host 1 over TCP; when both ranks of host 2 are late, host 1 names them as not answering.
    result = mpirun("comm_nodes.py", np=4, args=["2"], cluster=virtual_cluster, timeout=180)
    assert result.stdout.count("side channel across nodes OK (2 per node)") == 4


@pytest.mark.cluster
def test_setup_timeout_and_group_lifetime_across_virtual_hosts(mpirun, virtual_cluster):
    result = mpirun("comm_setup.py", np=4, args=["groups"], cluster=virtual_cluster, timeout=180)
    assert result.stdout.count("setup timeout reported: OK") == 4
    result = mpirun("comm_lifecycle.py", np=2, args=["60"], cluster=virtual_cluster, timeout=180)
    assert result.stdout.count("lifecycle OK after 60 groups") == 2


@pytest.mark.parametrize("np_", [2, 4])
def test_rooted_p2p_monitored_and_uneven_alltoall(mpirun, np_):
    # reduce, gather, scatter, object variants, object lists, isend/irecv, batch_isend_irecv, monitored_barrier,
    # all_to_all_single with splits; bad arguments refused in step; DETAIL mismatches named on every rank
    result = mpirun("comm_c10d.py", np=np_, env={"DISTLAB_DEBUG": "DETAIL"}, timeout=120)
    assert result.stdout.count("c10d collectives OK") == np_


@pytest.mark.parametrize("np_", [2, 4])
def test_rooted_p2p_and_monitored_timeouts_name_the_late_ranks(mpirun, np_):
    result = mpirun("comm_c10d_timeout.py", np=np_, timeout=120)
    assert result.stdout.count("c10d timeouts OK") == np_


@pytest.mark.parametrize("np_, per_node", [(2, "1"), (4, "2")])
def test_large_allreduce_across_nodes_goes_in_pieces_with_the_same_bits(mpirun, np_, per_node):
    result = mpirun("comm_pieces.py", np=np_, env={"DISTLAB_RANKS_PER_NODE": per_node}, timeout=120)
    assert result.stdout.count("allreduce pieces OK") == np_
