"""FSDP on 2, 3 and 4 ranks: DDP's results (checked inside the scenario, on every rank), and here: both twins
bit-identical with identical collective traces, the mixed world equal to either, the device stand-in equal to
numpy, every rank issuing the same collectives."""
import numpy as np
import pytest

pytestmark = pytest.mark.mpi

#: (ranks, twin) of each launch: the twins side by side on 2 and 4 ranks, and the mixed world (both twins in one
#: job, each rank checking against DDP) on 2, 3 and 4.
WORLDS = [(2, "reference"), (2, "core"), (2, "mixed"), (3, "mixed"), (4, "reference"), (4, "core"), (4, "mixed")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from _mpi import load_ranks, run_scenario

    out = tmp_path_factory.mktemp("fsdp")
    results = {}
    for np_, impl in WORLDS:
        prefix = str(out / f"{impl}{np_}")
        job = run_scenario("fsdp_train.py", np=np_, args=[impl, prefix], timeout=400)
        assert job.stdout.count("fsdp scenario done") == np_, job.stdout
        # with 2 ranks, torch's own fully_shard (recorded in tests/data/fsdp_torch.npz) is trained alongside
        assert job.stdout.count("torch's fully_shard") == (2 * np_ if np_ == 2 else 0), job.stdout
        results[np_, impl] = load_ranks(prefix, np_)
    return results


def _same_results(a, b, what):
    assert a.keys() == b.keys(), what
    for config in a:
        for key in a[config]["params"]:
            assert np.array_equal(a[config]["params"][key], b[config]["params"][key]), (what, config, key)
        assert a[config]["losses"] == b[config]["losses"], (what, config)
        assert a[config]["trace"] == b[config]["trace"], (what, config)


@pytest.mark.parametrize("np_", [2, 4])
def test_twins_are_bit_identical_with_identical_traces(runs, np_):
    for rank in range(np_):
        _same_results(runs[np_, "reference"][rank], runs[np_, "core"][rank], f"rank {rank}")


@pytest.mark.parametrize("np_", [2, 4])
def test_mixed_world_matches_the_reference(runs, np_):
    for rank in range(np_):
        _same_results(runs[np_, "reference"][rank], runs[np_, "mixed"][rank], f"rank {rank}")


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_the_device_stand_in_trains_the_numpy_bits_with_the_numpy_trace(runs, np_):
    for (n, impl), ranks in runs.items():
        if n != np_:
            continue
        for rank, result in enumerate(ranks):
            configs = [key[len("cpu:"):] for key in result if key.startswith("cpu:")]
            assert configs and len(result) == 2 * len(configs)
            _same_results({c: result[f"cpu:{c}"] for c in configs}, {c: result[f"cuda:{c}"] for c in configs},
                          f"{impl} rank {rank}")


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_every_rank_issues_the_same_collectives_and_gathers_the_same_model(runs, np_):
    ranks = runs[np_, "mixed"]
    for config in ranks[0]:
        names = [[(op, name) for op, name, *_ in r[config]["trace"]] for r in ranks]
        assert all(n == names[0] for n in names), config  # shapes differ only where shards do (none here)
        for key, value in ranks[0][config]["params"].items():
            for rank in range(1, np_):
                assert np.array_equal(value, ranks[rank][config]["params"][key]), (config, key, rank)


def test_hybrid_sharding_reduces_shards_among_replicas(runs):
    # 2 replicas x 2 shards: each group reduce-scatters over its 2 shard ranks, then all-reduces its reduced half
    # among the 2 replicas (the ranks with the same shard): half the reduce-scatter's input, per group
    trace = runs[4, "reference"][0]["cpu:hybrid"]["trace"]
    scattered = {name.split()[-1]: shape[0] for op, name, shape, _, _ in trace if op == "reduce_scatter"}
    reduced = {name.split()[-1]: shape[0] for op, name, shape, _, _ in trace if op == "allreduce"}
    assert len(reduced) == 4 and reduced.keys() == scattered.keys()
    assert all(2 * reduced[group] == scattered[group] for group in reduced)


def test_a_checkpoint_of_shards_saved_at_2_ranks_resumes_at_3(mpirun, tmp_path):
    # fully_shard's state dicts (ShardedArrays, and the optimizer state shaped like the shards) through
    # distlab.checkpoint: saved at 2 ranks, resharded and loaded at 3, the next step reaches the same parameters
    mpirun("fsdp_checkpoint.py", np=2, args=[str(tmp_path), "save"], timeout=120)
    job = mpirun("fsdp_checkpoint.py", np=3, args=[str(tmp_path), "load"], timeout=120)
    assert job.stdout.count("continues alike") == 3
