"""Join on uneven inputs (rank r gets 3 + r batches) on 2 and 4 ranks, both twins, mixed world, edge cases."""
import pickle

import numpy as np
import pytest

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from _mpi import run_worlds

    return run_worlds("join_uneven.py", tmp_path_factory.mktemp("join"),
                      [(np_, impl) for np_ in (2, 4) for impl in ("reference", "core", "mixed")], "join scenarios OK")


@pytest.mark.parametrize("np_", [2, 4])
@pytest.mark.parametrize("other", ["core", "mixed"])
def test_twins_and_mixed_world_agree_bit_for_bit_and_trace_for_trace(runs, np_, other):
    for rank in range(np_):
        for case, ref in runs[np_, "reference"][rank].items():
            theirs = runs[np_, other][rank][case]
            assert all(np.array_equal(a, b) for a, b in zip(ref["params"], theirs["params"])), (rank, case)
            assert ref["trace"] == theirs["trace"], (rank, case)


@pytest.mark.parametrize("np_", [2, 4])
def test_final_model_is_the_same_on_every_rank(runs, np_):
    for case in runs[np_, "core"][0]:
        first = runs[np_, "core"][0][case]["params"]
        for rank in range(1, np_):
            assert all(np.array_equal(a, b) for a, b in zip(first, runs[np_, "core"][rank][case]["params"]))


@pytest.mark.parametrize("np_", [2, 4])
def test_join_on_the_device_stand_in_trains_the_numpy_bits(runs, np_):
    """DDP + DistributedMean under Join ran again on the strict device stand-in in the same launch (no host copy
    outside comm, checked there): the same bits and collectives as on numpy, for both twins and the mixed world.
    Device buckets never sit in a host arena, so a bucket "avg" there reads as "sum" here."""
    for (n, impl), ranks in runs.items():
        if n == np_:
            assert _device_runs_equal_numpy_runs(ranks, impl) == 4


def _device_runs_equal_numpy_runs(ranks, impl) -> int:
    """Each case "... on cpu" against its "... on cuda" (the stand-in) on every rank; returns how many cases."""
    def blind(trace):
        return [(o, n, s, d, "sum" if o == "allreduce" and str(n).startswith("bucket") and x == "avg" else x)
                for o, n, s, d, x in trace]

    for rank, result in enumerate(ranks):
        cpu_cases = [case for case in result if case.endswith(" on cpu")]
        for case in cpu_cases:
            cpu, cuda = result[case], result[case[:-len("cpu")] + "cuda"]
            assert all(np.array_equal(a, b) for a, b in zip(cpu["params"], cuda["params"])), (impl, rank, case)
            assert blind(cpu["trace"]) == blind(cuda["trace"]), (impl, rank, case)
    return len(cpu_cases)


def test_join_over_shared_memory_buckets_equals_join_through_mpi(runs, tmp_path):
    # Every bucket through the shared-memory arena (size threshold lifted), the joined rank shadowing with its
    # own zeroed buckets: the same collectives and, on 2 ranks, the same bits as through MPI.
    from _mpi import run_scenario

    prefix = str(tmp_path / "shared")
    job = run_scenario("join_uneven.py", np=2, args=["core", prefix], timeout=300,
                       env={"DISTLAB_SHARED_MIN_BYTES": "0"})
    assert job.stdout.count("join scenarios OK") == 2
    for rank in range(2):
        shared = pickle.load(open(f"{prefix}.rank{rank}.pkl", "rb"))
        for case, through_mpi in runs[2, "core"][rank].items():
            assert all(np.array_equal(a, b) for a, b in zip(shared[case]["params"], through_mpi["params"])), case
            assert shared[case]["trace"] == through_mpi["trace"], case


def test_joined_rank_shadows_the_training_ranks_collectives(runs):
    """Rank 0 runs out first: its trace still pairs with rank 1's, collective for collective, reduce op included
    (a bucket averaged by its reduction in shared memory is shadowed with "avg" too)."""
    ranks = runs[2, "core"]
    kinds = lambda trace: [(op, shape, dtype, detail) for op, _name, shape, dtype, detail in trace]  # noqa: E731
    cases = [case for case in ranks[0] if case.startswith("ddp ")]
    assert len(cases) == 8  # 4 configurations, on numpy and on the device stand-in
    for case in cases:
        assert kinds(ranks[0][case]["trace"]) == kinds(ranks[1][case]["trace"]), case


@pytest.mark.parametrize("impl", ["reference", "core"])
def test_skew_warning_after_1000_shadowed_iterations(mpirun, impl):
    job = mpirun("join_edge.py", np=2, args=[impl, "skew"], timeout=120)
    assert job.stdout.count("skew warning on cpu OK") == job.stdout.count("skew warning on cuda OK") == 2


@pytest.mark.parametrize("impl, device", [("reference", "cpu"), ("core", "cuda")])
def test_exception_in_forward_inside_join_propagates_without_a_hang(mpirun, impl, device):
    """The error ends the job, so one device a launch: the core twin's runs on the device stand-in."""
    job = mpirun("join_edge.py", np=2, args=[impl, "raise", device], timeout=120, expect_failure=True)
    assert "[1] ValueError: bad batch in forward" in job.stderr
    assert job.elapsed < 60


@pytest.mark.parametrize("np_,args,batches", [(2, ["--batches", "9"], "[25, 20]"),
                                               (4, ["--batches", "30", "--divide-by-active"], "[40, 40, 35, 35]")])
def test_uneven_inputs_example(mpirun, np_, args, batches):
    """SyncBatchNorm + DDP + ZeroRedundancyOptimizer under one Join; the example checks the models are equal."""
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "uneven_inputs.py"
    job = mpirun(str(example), np=np_, args=args, timeout=180)
    assert f"ranks had {batches} iterations; every rank ends with the same model" in job.stdout


# -- More joinables: ZeroRedundancyOptimizer and SyncBatchNorm (both twins on 2 ranks, a mixed world on 4) ----------
JOINABLE_RUNS = [(2, "reference"), (2, "core"), (4, "mixed")]


def _run_all(script, tmp_path_factory, done_line, detail_for=None):
    """Every run of JOINABLE_RUNS; the one named by ``detail_for`` under DISTLAB_DEBUG=DETAIL."""
    from _mpi import run_worlds

    return run_worlds(script, tmp_path_factory.mktemp(script.split(".")[0]), JOINABLE_RUNS, done_line,
                      env_for=lambda np_, impl: {"DISTLAB_DEBUG": "DETAIL"} if (np_, impl) == detail_for else None)


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    return _run_all("join_zero.py", tmp_path_factory, "zero scenarios OK")


@pytest.fixture(scope="module")
def syncbn_runs(tmp_path_factory):
    # DETAIL on one run: its blocking fingerprint checks must not reach the layers' own communicators, or a
    # joined rank's posted-ahead shadows would wait for the training ranks (and time out)
    return _run_all("join_syncbn.py", tmp_path_factory, "syncbn scenarios OK", detail_for=(2, "core"))


@pytest.mark.parametrize("runs_fixture", ["zero_runs", "syncbn_runs"])
def test_joinables_equal_the_single_process_schedule_on_both_twins_and_a_mixed_world(request, runs_fixture):
    """The scenarios assert the equalities on every rank (see their docstrings); here, the twins agree too."""
    runs = request.getfixturevalue(runs_fixture)
    for rank in range(2):
        for case, ref in runs[2, "reference"][rank].items():
            theirs = runs[2, "core"][rank][case]
            assert all(np.array_equal(a, b) for a, b in zip(ref["params"], theirs["params"])), (rank, case)
            assert ref["trace"] == theirs["trace"], (rank, case)
    for case in runs[4, "mixed"][0]:
        first = runs[4, "mixed"][0][case]["params"]
        assert all(all(np.array_equal(a, b) for a, b in zip(first, runs[4, "mixed"][r][case]["params"]))
                   for r in range(1, 4)), case


@pytest.mark.parametrize("runs_fixture, cases", [("zero_runs", 2), ("syncbn_runs", 1)])
def test_joinables_on_the_device_stand_in_train_the_numpy_bits(request, runs_fixture, cases):
    """ZeRO (shards on the device) and SyncBatchNorm under Join ran again on the device stand-in in the same launch,
    with no host copy outside comm beyond the batch norm's count (checked there): the numpy bits and collectives."""
    for (_np, impl), ranks in request.getfixturevalue(runs_fixture).items():
        assert _device_runs_equal_numpy_runs(ranks, impl) == cases


def test_zero_joined_ranks_take_part_in_every_broadcast(zero_runs):
    """Rank 0 (3 batches) joins first on 4 ranks: it still issues each remaining step's broadcasts."""
    for case in zero_runs[4, "mixed"][0]:
        broadcasts = [[entry for entry in zero_runs[4, "mixed"][r][case]["trace"] if entry[0] == "broadcast"]
                      for r in range(4)]
        assert broadcasts[0] == broadcasts[3] and len(broadcasts[0]) > 0, case


def test_syncbatchnorm_without_join_times_out_naming_the_missing_rank(mpirun):
    job = mpirun("join_syncbn.py", np=2, args=["core", "nojoin"], timeout=120, env={"DISTLAB_TIMEOUT": "3"},
                 expect_failure=True)
    assert "allreduce" in job.stderr and "'SyncBatchNorm forward statistics'" in job.stderr
    assert "ranks [0] have not entered it" in job.stderr
    assert job.elapsed < 60
