"""distlab's process manager for one host (:mod:`distlab._process_manager`): its PMI-1 answers, and jobs under it.

The launcher's own tests (``test_launch.py``) run every job on one host through it; these check its pieces and
the behaviour the launcher relies on, with plain MPI programs and no launcher in between.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from distlab._process_manager import PmiServer, main, parse_request
from distlab.launch import find_mpiexec, mpiexec_command, process_manager

mpi = pytest.mark.mpi


def test_requests_parse_as_pmi_1_writes_them():
    assert parse_request("cmd=get kvsname=k key=x\n") == {"cmd": "get", "kvsname": "k", "key": "x"}
    assert parse_request("cmd=put kvsname=k key=a value=b=c") == {"cmd": "put", "kvsname": "k", "key": "a",
                                                                  "value": "b=c"}
    for bad, why in (("cmd=get junk", "'junk' is not key=value"), ("key=x", "no cmd")):
        with pytest.raises(ValueError, match=why):
            parse_request(bad)


def serve(size):
    replies = []
    return PmiServer(size, lambda rank, line: replies.append((rank, line))), replies


def test_the_server_answers_what_an_mpich_rank_asks_when_it_starts():
    server, replies = serve(3)
    for command in ("init pmi_version=1 pmi_subversion=1", "get_maxes", "get_appnum", "get_my_kvsname",
                    "get_universe_size", "get kvsname=distlab_kvs key=PMI_process_mapping",
                    "get kvsname=distlab_kvs key=PMI_hwloc_xmlfile"):
        server.handle(1, parse_request("cmd=" + command))
    assert [line for _, line in replies] == [
        "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0",
        "cmd=maxes kvsname_max=256 keylen_max=64 vallen_max=1024 rc=0",
        "cmd=appnum appnum=0 rc=0",
        f"cmd=my_kvsname kvsname={server.kvs_name} rc=0",
        "cmd=universe_size size=3 rc=0",
        "cmd=get_result rc=0 value=(vector,(0,1,3))",  # every rank on one node
        "cmd=get_result rc=-1 msg=key_not_found",
    ]
    assert {rank for rank, _ in replies} == {1}
    # MPICH names the job's shared memory after its key-value space: two jobs never share one
    assert serve(3)[0].kvs_name != server.kvs_name


def test_puts_are_seen_by_every_rank_and_the_barrier_waits_for_all():
    server, replies = serve(2)
    server.handle(0, parse_request("cmd=put kvsname=distlab_kvs key=card0 value=abc"))
    server.handle(0, parse_request("cmd=barrier_in"))
    assert replies == [(0, "cmd=put_result rc=0")]  # rank 0 waits in the barrier
    server.handle(1, parse_request("cmd=barrier_in"))
    assert replies[1:] == [(0, "cmd=barrier_out rc=0"), (1, "cmd=barrier_out rc=0")]
    server.handle(1, parse_request("cmd=get kvsname=distlab_kvs key=card0"))
    assert replies[-1] == (1, "cmd=get_result rc=0 value=abc")
    server.handle(1, parse_request("cmd=finalize"))
    assert replies[-1] == (1, "cmd=finalize_ack rc=0")


def test_an_abort_is_recorded_and_an_unknown_command_refused():
    server, replies = serve(2)
    server.handle(1, parse_request("cmd=abort exitcode=7 message=abort"))
    assert server.aborted == 7 and replies == []
    with pytest.raises(ValueError, match="rank 0 sent the PMI command 'spawn'.*DISTLAB_PROCESS_MANAGER=mpiexec"):
        server.handle(0, parse_request("cmd=spawn nprocs=2"))


def test_its_command_line_is_checked():
    for argv, why in (([], "usage"), (["-n", "0", "x"], "positive number of ranks, not '0'"),
                      (["-n"], "-n needs a value"), (["-n", "2"], "usage")):
        with pytest.raises(SystemExit, match=why):
            main(argv)


def test_the_launcher_chooses_it_for_mpich_on_one_host_unless_told_otherwise():
    mpiexec = find_mpiexec()
    assert process_manager(mpiexec, {}) == "distlab"
    assert process_manager(mpiexec, {"DISTLAB_PROCESS_MANAGER": " MPIEXEC "}) == "mpiexec"
    command = mpiexec_command(2, ["x"], env={})
    assert command[1:3] == ["-m", "distlab._process_manager"] and command[3:5] == ["-n", "2"]
    assert mpiexec_command(2, ["x"], env={"DISTLAB_PROCESS_MANAGER": "mpiexec"})[0] == mpiexec
    with pytest.raises(ValueError, match="DISTLAB_PROCESS_MANAGER='slurm' is not one of distlab, mpiexec"):
        mpiexec_command(2, ["x"], env={"DISTLAB_PROCESS_MANAGER": "slurm"})


def manage(np, source, *options, timeout=60):
    """Run ``python -c source`` on ``np`` ranks under the process manager alone (no launcher)."""
    command = [sys.executable, "-P", "-m", "distlab._process_manager", *options, "-n", str(np),
               sys.executable, "-c", source]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "UCX_TLS": "sm,self"})
    return done, time.monotonic() - started


def leftovers(since: float) -> list:
    """MPICH's shared-memory files changed since ``since`` that no process holds."""
    from distlab._leftovers import PREFIX, SHM_DIR, held_shm_paths

    held = held_shm_paths()
    return [e.path for e in os.scandir(SHM_DIR) if e.name.startswith(PREFIX) and e.stat().st_ctime >= since
            and e.path not in held]


@mpi
def test_ranks_start_talk_and_tag_each_line_of_their_output():
    # Two lines in one write: each gets its tag (the launcher's demultiplexer takes untagged lines for the
    # process manager's own).
    source = ("from mpi4py import MPI\nimport os, sys\nc = MPI.COMM_WORLD\n"
              "sys.stdout.write(f'{c.rank} of {c.size} sum {c.allreduce(c.rank)}\\n'\n"
              "                 f'{c.rank} local {os.environ[\"MPI_LOCALNRANKS\"]}\\n')\n")
    done, _ = manage(3, source, "-prepend-pattern", "<%r>")
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == sorted([f"<{r}>{r} of 3 sum 3" for r in range(3)]
                                                      + [f"<{r}>{r} local 3" for r in range(3)])


@mpi
def test_an_mpi_abort_or_a_killed_rank_ends_the_job_at_once():
    abort = "from mpi4py import MPI\nimport time\nc = MPI.COMM_WORLD\nc.Barrier()\nc.Abort(7) if c.rank == 1 " \
            "else time.sleep(60)\n"
    started = time.time() - 1.0
    done, took = manage(2, abort)
    assert done.returncode == 7 and took < 30, (done, took)
    killed = "from mpi4py import MPI\nimport os, signal, time\nc = MPI.COMM_WORLD\nc.Barrier()\n" \
             "os.kill(os.getpid(), signal.SIGKILL) if c.rank == 0 else time.sleep(60)\n"
    done, took = manage(2, killed)
    assert done.returncode == 128 + signal.SIGKILL and took < 30, (done, took)
    # the killed ranks never finalized: their shared-memory files went with the job, as under the launcher
    assert leftovers(started) == [], leftovers(started)


@mpi
def test_a_spawn_is_refused_with_what_to_set_and_ends_the_job(tmp_path):
    # MPI_Comm_spawn sends PMI-1's multi-line request (mcmd=spawn ... endcmd): read whole, refused once, by name.
    source = ("from mpi4py import MPI\nimport sys\n"
              "MPI.COMM_SELF.Spawn(sys.executable, args=['-c', 'pass'], maxprocs=1)\n")
    done, took = manage(1, source)
    assert done.returncode == 1 and took < 30, (done, took)
    refusals = [line for line in done.stderr.splitlines() if line.startswith("distlab process manager:")]
    assert refusals == ["distlab process manager: rank 0 sent the PMI command 'spawn', which this process manager does "
                        "not serve (spawning processes and publishing names need hydra: "
                        "DISTLAB_PROCESS_MANAGER=mpiexec)"], done.stderr
    # under the launcher the refusal is shown (not taken for hydra's noise), before the launcher's summary
    script = tmp_path / "spawn.py"
    script.write_text(source)
    launched = subprocess.run([sys.executable, "-P", "-m", "distlab", "run", "-n", "1", str(script)],
                              capture_output=True, text=True, timeout=60)
    assert launched.returncode == 1 and refusals[0] in launched.stderr.splitlines(), launched.stderr
