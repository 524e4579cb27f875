"""distlab.collectives: settings and errors without MPI, and the MPI scenarios on 2 and 4 ranks (mixed twins)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from distlab import collectives as hvd


def test_settings_defaults_and_validation(monkeypatch):
    for var in ("DISTLAB_CACHE_CAPACITY", "DISTLAB_FUSION_THRESHOLD", "DISTLAB_CYCLE_TIME",
                "DISTLAB_STALL_CHECK_TIME", "DISTLAB_STALL_SHUTDOWN_TIME"):
        monkeypatch.delenv(var, raising=False)
    assert hvd.settings() == {"cache_capacity": 1024, "fusion_threshold": 128 * 1024 * 1024, "cycle_time_ms": 1.0,
                              "stall_check_time": 60.0, "stall_shutdown_time": 0.0}
    monkeypatch.setenv("DISTLAB_CACHE_CAPACITY", "0")
    monkeypatch.setenv("DISTLAB_CYCLE_TIME", "2.5")
    assert hvd.settings()["cache_capacity"] == 0 and hvd.settings()["cycle_time_ms"] == 2.5
    monkeypatch.setenv("DISTLAB_CACHE_CAPACITY", "lots")
    with pytest.raises(ValueError, match="DISTLAB_CACHE_CAPACITY='lots' is not a whole number"):
        hvd.settings()
    monkeypatch.setenv("DISTLAB_CACHE_CAPACITY", "-1")
    with pytest.raises(ValueError, match="at least 0"):
        hvd.settings()


def test_use_before_init_is_a_clear_error():
    assert not hvd.is_initialized()
    with pytest.raises(hvd.NotInitializedError, match=r"call collectives.init\(\)"):
        hvd.allreduce(np.ones(2), name="x")
    with pytest.raises(hvd.NotInitializedError):
        hvd.rank()
    hvd.shutdown()   # harmless when not initialized


@pytest.mark.mpi
@pytest.mark.parametrize("np_,args", [(2, ()), (4, ("mixed",))], ids=["2ranks", "4ranks-mixed-twins"])
def test_scenarios(mpirun, np_, args):
    result = mpirun("collectives_scenarios.py", np=np_, args=args, timeout=150)
    assert result.stdout.count("collectives OK") == np_
    assert result.stdout.count("broadcast on cuda OK") == np_  # the same sections on the device stand-in
    if args:
        assert result.stdout.count("impl=reference") == np_ // 2


@pytest.mark.mpi
def test_scenarios_without_cache_with_timeline(mpirun, tmp_path):
    trace = tmp_path / "collectives.json"
    result = mpirun("collectives_scenarios.py", np=2, timeout=150, env={"DISTLAB_CACHE_CAPACITY": "0"},
                    timeline=str(trace))
    assert result.stdout.count("collectives OK") == 2 and "fast=0" in result.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["name"] for e in events}
    assert "negotiate (slow path)" in names and "fuse" in names


@pytest.mark.mpi
def test_horovod_style_example(mpirun):
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "horovod_style_training.py"
    result = mpirun(str(example), np=2, timeout=150, args=["--epochs", "6", "--target", "0.8"])
    line = [x for x in result.stdout.splitlines() if "negotiation cycles" in x][0]
    fast = int(line.split("cycles: ")[1].split(" fast")[0])
    slow = int(line.split("fast path, ")[1].split(" slow")[0])
    assert fast > slow, line        # repeated steps take the fast path


@pytest.mark.mpi
@pytest.mark.parametrize("np_,args", [(2, ()), (4, ()), (4, ("mixed",))], ids=["2ranks", "4ranks", "4ranks-mixed"])
def test_coordinator_sync_over_mpi(mpirun, np_, args):
    result = mpirun("negotiation_sync.py", np=np_, args=args, timeout=60)
    assert result.stdout.count("sync OK") == np_


TWIN_RUNS = [(2, (), None), (2, (), {"DISTLAB_IMPL": "reference"}), (4, ("mixed",), None)]
TWIN_IDS = ["2ranks-core", "2ranks-reference", "4ranks-mixed-twins"]


@pytest.mark.mpi
@pytest.mark.parametrize("np_,args,env", TWIN_RUNS, ids=TWIN_IDS)
def test_horovod_front_ops_and_process_sets(mpirun, np_, args, env):
    result = mpirun("collectives_front.py", np=np_, args=args, timeout=200, env=env)
    assert result.stdout.count("front OK") == np_
    assert result.stdout.count("process sets on cuda OK") == np_  # the same sections on the device stand-in
    if args:
        assert result.stdout.count("impl=reference") == np_ // 2


@pytest.mark.mpi
@pytest.mark.parametrize("np_,args", [(2, ()), (4, ("mixed",))], ids=["2ranks", "4ranks-mixed-twins"])
def test_lifecycle_init_after_peer_shutdown_and_who_stopped(mpirun, np_, args):
    result = mpirun("collectives_lifecycle.py", np=np_, args=args, timeout=120)
    assert result.stdout.count("lifecycle OK") == np_
    assert result.stdout.count("lifecycle on cuda OK") == np_  # the same on the device stand-in


FAILURE_CAUSES = {"exception": "the last rank's cycle raises before its collective",
                  "refusal": "the last rank refuses the coordinator's response list",
                  "exception after": "the middle rank's cycle raises after its collective",
                  "set exception": "rank 0 raises in a process set's response",
                  "coordinator": "rank 0's coordinator raises (stopped in the protocol: rank 0 says so too)"}


@pytest.mark.mpi
@pytest.mark.parametrize("np_,args,env", TWIN_RUNS, ids=TWIN_IDS)
def test_staggered_reinit_pairs_up_and_every_engine_failure_reaches_every_rank(mpirun, np_, args, env):
    """Horovod's init(); shutdown(); init() with each rank entering 0, 0.5 and 2 s late, from a fresh process, a
    healthy engine, and after each cause of failure (FAILURE_CAUSES) on one rank: every other rank stops with that
    rank's cause long before DISTLAB_TIMEOUT (60 s here), then the staggered sequence pairs up again."""
    result = mpirun("collectives_stagger.py", np=np_, args=args, timeout=150,
                    env={**(env or {}), "DISTLAB_TIMEOUT": "60"})
    assert result.stdout.count("stagger OK") == np_
    for cause in FAILURE_CAUSES:   # heard by every other rank
        assert result.stdout.count(f": {cause} on rank") == np_ - (cause != "coordinator"), cause
    assert result.stdout.count(") paired") == (len(FAILURE_CAUSES) + 2) * np_   # two healthy rounds first


KILL_RUNS = [(2, (), None), (2, (), {"DISTLAB_IMPL": "reference"}), (4, ("mixed",), None),
             (4, ("mixed", "2"), {"DISTLAB_PROCESS_MANAGER": "mpiexec"})]


@pytest.mark.mpi
@pytest.mark.parametrize("np_,args,env", KILL_RUNS, ids=TWIN_IDS + ["4ranks-mixed-hydra"])
def test_a_killed_rank_ends_the_job_at_once_named_by_the_launcher(mpirun, np_, args, env):
    """SIGKILL on one rank while the others wait for it in a negotiated allreduce: the process manager (distlab's,
    or hydra) ends the job at once, and the launcher names the rank and the signal (DISTLAB_TIMEOUT is 600 s,
    far above this job's own bound)."""
    victim = int(args[1]) if len(args) > 1 else np_ - 1
    result = mpirun("collectives_killed.py", np=np_, args=args, timeout=90, expect_failure=True,
                    env={**(env or {}), "DISTLAB_TIMEOUT": "600"})
    assert result.stdout.count(": warm") == np_ and "survived" not in result.stdout
    summary = "\n".join(result.summary)
    assert f"rank {victim} (pid " in summary and "was killed by signal 9 (SIGKILL)" in summary, summary
    assert "timed out" not in result.stderr and result.returncode == 137, result.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("np_,args,env", TWIN_RUNS, ids=TWIN_IDS)
def test_distributed_optimizer_equals_ddp_and_local_training(mpirun, np_, args, env):
    result = mpirun("collectives_optimizer.py", np=np_, args=args, timeout=200, env=env)
    assert result.stdout.count("optimizer OK") == np_
    assert result.stdout.count("optimizer on cuda equals DDP and local training") == np_  # the device stand-in


@pytest.mark.mpi
@pytest.mark.parametrize("np_,per_node", [(2, None), (3, "2")], ids=["one-node", "3ranks-2-per-node"])
def test_local_and_cross_ranks_follow_the_node_layout(mpirun, np_, per_node):
    env = {"DISTLAB_RANKS_PER_NODE": per_node} if per_node else None
    result = mpirun("collectives_layout.py", np=np_, args=(), timeout=60, env=env)
    assert result.stdout.count("layout OK") == np_
    if per_node:  # rank 2 is alone on the second node
        assert "[2] layout OK (0, 1, 1, 2)" in result.stdout, result.stdout


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_scaling_rounds_once_from_horovods_precision(dtype):
    """scale_in_place computes half and single in float32 and double in float64, rounding once, as Horovod's
    ScaleBuffer does (and without copies of the buffer: the ufunc converts in chunks)."""
    from distlab.collectives._execute import scale_in_place

    values = (np.random.default_rng(3).standard_normal(50_000) * 100).astype(dtype)
    values[:4] = [1e-40, -3e-39, 3e38, 1.5e-45] if dtype == "float32" else values[:4]  # subnormals, near overflow
    compute = np.float64 if dtype == "float64" else np.float32
    for factor in (1 / 3, 0.5, 7.1, 1e-3, 0.25, 2.0, -0.125, 2.0**-30):
        with np.errstate(over="ignore"):  # 3e38 * 7.1 is inf in float32, as in Horovod
            expected = (values.astype(compute) * compute(factor)).astype(dtype)
            scaled = values.copy()
            scale_in_place(scaled, factor)
        assert np.array_equal(scaled, expected), factor
    half_factor_first = (values.astype(compute) * compute(np.asarray(1 / 3, dtype))).astype(dtype)
    if dtype == "float16":  # the factor itself is not rounded to the buffer's precision first
        scaled = values.copy()
        scale_in_place(scaled, 1 / 3)
        assert not np.array_equal(scaled, half_factor_first)


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
def test_large_allreduce_in_the_shared_arena_has_the_bits_of_mpi(mpirun, np_):
    result = mpirun("collectives_placement.py", np=np_, timeout=120)
    assert result.stdout.count("placement OK") == np_
