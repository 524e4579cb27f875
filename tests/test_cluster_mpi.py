"""The MPI scenarios across 2 virtual hosts (root only): DDP, Join, negotiated collectives, RPC/RRefs and
distributed autograd on 2 ranks (one per host) and 4 (two per host, even ranks reference, odd ranks core), each
checking that bytes crossed the link; where ranks run; what the job listens on; a rank lost on host 2;
SIGTERM/SIGINT to the launcher.

Every scenario runs in the session's own cluster (the ``virtual_cluster`` fixture), unshaped: the tests assert
behaviour, the link's rate is for ``benchmarks/bench_cluster.py``.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.mpi]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def link_bytes(name: str) -> list[int]:
    """Bytes each host has sent on its link so far."""
    from distlab.cluster import status

    return [h["tx_bytes"] for h in status(name)["hosts"]]


def run_across(mpirun, cluster, script, np_, args=(), env=None, at_least=1 << 14, **kwargs):
    """Run a scenario across the cluster and check that every host sent at least ``at_least`` bytes."""
    before = link_bytes(cluster)
    job = mpirun(script, np=np_, args=args, env=env, cluster=cluster, timeout=300, **kwargs)
    sent = [after - b for after, b in zip(link_bytes(cluster), before)]
    assert all(s >= at_least for s in sent), f"{script}: bytes sent per host {sent}, expected >= {at_least}"
    return job


# (np, twin args, env): 2 ranks are one per host (core twin); 4 ranks are two per host, mixed twins, so a
# reference rank and a core rank sit on each host and talk across the link.
WORLDS = [pytest.param(2, "core", id="2ranks-core"), pytest.param(4, "mixed", id="4ranks-mixed")]


@pytest.mark.parametrize("np_,world", WORLDS)
def test_ddp_matches_local_training_across_hosts(mpirun, virtual_cluster, tmp_path, np_, world):
    job = run_across(mpirun, virtual_cluster, "ddp_train.py", np_, args=[world, str(tmp_path / "ddp")])
    assert job.stdout.count("devices match local training") == np_  # numpy, then the device stand-in


@pytest.mark.parametrize("np_,world", WORLDS)
def test_auto_bucket_caps_across_hosts(mpirun, virtual_cluster, np_, world):
    # The probes measure a real link here (contention included), and the bucket layout leaves the bits alone
    # (DISTLAB_SHARED_MEMORY=0 only tells the script so: a group spanning hosts has no arena anyway).
    job = run_across(mpirun, virtual_cluster, "ddp_auto.py", np_, args=[world], env={"DISTLAB_SHARED_MEMORY": "0"})
    runs = 2 * np_  # on numpy, then on the device stand-in
    assert job.stdout.count("agreed") == runs and job.stdout.count("train the same bits") == runs


@pytest.mark.parametrize("np_,world", WORLDS)
def test_join_uneven_inputs_across_hosts(mpirun, virtual_cluster, tmp_path, np_, world):
    job = run_across(mpirun, virtual_cluster, "join_uneven.py", np_, args=[world, str(tmp_path / "join")])
    assert job.stdout.count("join scenarios OK") == np_


@pytest.mark.parametrize("np_,args", [(2, ()), (4, ("mixed",))], ids=["2ranks", "4ranks-mixed"])
def test_negotiated_collectives_across_hosts(mpirun, virtual_cluster, np_, args):
    job = run_across(mpirun, virtual_cluster, "collectives_scenarios.py", np_, args=args)
    assert job.stdout.count("collectives OK") == np_


@pytest.mark.parametrize("np_", [2, 4])
def test_rpc_rrefs_across_hosts(mpirun, virtual_cluster, np_):
    job = run_across(mpirun, virtual_cluster, "rpc_rref.py", np_, args=["mixed"])
    assert job.stdout.count("impl reference") == (np_ + 1) // 2 and job.stdout.count("impl core") == np_ // 2


@pytest.mark.parametrize("np_", [2, 4])
def test_dist_autograd_across_hosts(mpirun, virtual_cluster, np_):
    job = run_across(mpirun, virtual_cluster, "dist_autograd.py", np_, args=["mixed"])
    assert job.returncode == 0


def test_ranks_run_in_blocks_per_host_with_local_ranks(mpirun, virtual_cluster):
    job = run_across(mpirun, virtual_cluster, "cluster_job.py", 4, args=["env"])
    for rank, (host, local) in enumerate([(1, 0), (1, 1), (2, 0), (2, 1)]):
        assert f"rank {rank} on {virtual_cluster}-h{host} local {local}/2 OK" in job.stdout, job.stdout


def test_a_cluster_job_listens_on_the_cluster_s_interfaces_only(mpirun, virtual_cluster):
    # Two ranks per host: mpiexec's host and a host reached through a proxy. Every listening socket of the ranks,
    # their watchers and hydra's processes is on loopback, the host's cluster address, or the wildcard address
    # of a namespace whose interfaces are loopback and the host's cluster link alone.
    job = mpirun("job_listeners.py", np=4, args=["cluster", "2"], cluster=virtual_cluster, timeout=300)
    assert job.stdout.count("listeners OK") == 4, job.stdout


def test_run_a_function_on_the_cluster(virtual_cluster):
    from distlab.launch import run

    def where():
        import os

        from distlab.cluster import current_host

        return os.environ["RANK"], os.environ["LOCAL_RANK"], current_host()

    c = virtual_cluster
    assert run(where, np=4, cluster=c, timeout=120) == [("0", "0", f"{c}-h1"), ("1", "1", f"{c}-h1"),
                                                         ("2", "0", f"{c}-h2"), ("3", "1", f"{c}-h2")]


def test_hosts_on_one_machine_share_its_cores(virtual_cluster):
    # The virtual hosts are two nodes to MPI but one machine: the poll loop yields the core when the ranks of the
    # machine outnumber its cores, as on one host (without it a 4 KiB allreduce took 5.2-5.7 ms here, not 0.15).
    from distlab.launch import run

    def layout():
        from distlab import comm

        group = comm.world()
        return group.node_keys.tolist(), group._steps.oversubscribed

    cores = len(os.sched_getaffinity(0))
    for np_ in (2, 4):
        seen = run(layout, np=np_, cluster=virtual_cluster, timeout=120)
        keys = [0] * (np_ // 2) + [np_ // 2] * (np_ // 2)
        assert seen == [(keys, np_ > cores)] * np_, (np_, cores, seen)


def no_processes_left(cluster: str) -> None:
    from distlab.cluster import layout, netlink

    for namespace in layout(cluster, 2).namespaces:
        assert netlink.namespace_pids(namespace) == [], f"processes left in {namespace}"


def test_a_rank_killed_on_host_2_ends_the_job_on_host_1_naming_it(mpirun, virtual_cluster):
    start = time.monotonic()
    job = mpirun("cluster_job.py", np=4, args=["kill"], cluster=virtual_cluster, timeout=120,
                 expect_failure=True)
    assert time.monotonic() - start < 60
    assert f"rank 3 on {virtual_cluster}-h2 kills itself" in job.stdout
    assert "rank 3 (pid " in job.stderr and f"on host {virtual_cluster}-h2 was killed by signal 9 (SIGKILL)" in \
        job.stderr, job.stderr
    no_processes_left(virtual_cluster)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_launcher_ends_every_rank_on_every_host(virtual_cluster, tmp_path, sig):
    script = Path(__file__).resolve().parent / "mpi" / "cluster_job.py"
    env = {**os.environ, "DISTLAB_CLUSTER_NAME": virtual_cluster}
    launcher = subprocess.Popen([sys.executable, "-P", "-m", "distlab", "run", "-n", "4", "--cluster", "2",
                                 str(script), "sleep", str(tmp_path)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("rank*.pid"))) < 4 and time.monotonic() < deadline:
            assert launcher.poll() is None, "the launcher ended before every rank started"
            time.sleep(0.1)
        time.sleep(0.2)   # every pid file written through
        ranks = [int(p.read_text()) for p in sorted(tmp_path.glob("rank*.pid"))]
        assert len(ranks) == 4, f"the ranks did not all start: {ranks}"
        launcher.send_signal(sig)
        assert launcher.wait(timeout=30) != 0
        for pid in ranks:
            status = Path(f"/proc/{pid}/status")
            state = status.read_text().split("State:")[1].split("\n")[0].strip() if status.exists() else "gone"
            assert state == "gone" or state.startswith("Z"), f"rank pid {pid} survived {sig.name}: {state}"
        no_processes_left(virtual_cluster)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
