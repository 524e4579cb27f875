"""Join on uneven inputs (rank r gets 3 + r batches) on 2 and 4 ranks, both twins, mixed world, edge cases."""
import pickle

import numpy as np
import pytest

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from _mpi import run_scenario

    out = tmp_path_factory.mktemp("join")
    results = {}
    for np_ in (2, 4):
        for impl in ("reference", "core", "mixed"):
            prefix = str(out / f"{impl}{np_}")
            job = run_scenario("join_uneven.py", np=np_, args=[impl, prefix], timeout=300)
            assert job.stdout.count("join scenarios OK") == np_
            results[np_, impl] = [pickle.load(open(f"{prefix}.rank{r}.pkl", "rb")) for r in range(np_)]
    return results


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


def test_joined_rank_shadows_the_training_ranks_collectives(runs):
    """Rank 0 runs out first: its trace still pairs with rank 1's, collective for collective."""
    ranks = runs[2, "core"]
    assert len(ranks[0]["ddp divide_initial=True"]["trace"]) == len(ranks[1]["ddp divide_initial=True"]["trace"])
    kinds = lambda trace: [(op, shape, dtype) for op, _name, shape, dtype, _ in trace]  # noqa: E731
    assert kinds(ranks[0]["ddp divide_initial=True"]["trace"]) == kinds(ranks[1]["ddp divide_initial=True"]["trace"])


@pytest.mark.parametrize("impl", ["reference", "core"])
def test_skew_warning_after_1000_shadowed_iterations(mpirun, impl):
    job = mpirun("join_edge.py", np=2, args=[impl, "skew"], timeout=120)
    assert job.stdout.count("skew warning OK") == 2


@pytest.mark.parametrize("impl", ["reference", "core"])
def test_exception_in_forward_inside_join_propagates_without_a_hang(mpirun, impl):
    job = mpirun("join_edge.py", np=2, args=[impl, "raise"], timeout=120, expect_failure=True)
    assert "[1] ValueError: bad batch in forward" in job.stderr
    assert job.elapsed < 60


def test_uneven_inputs_example(mpirun):
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "uneven_inputs.py"
    job = mpirun(str(example), np=4, args=["--base", "4", "--divide-by-active"], timeout=120)
    assert "ranks had [4, 14, 24, 34] batches" in job.stdout
