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


def test_a_checkpoint_of_shards_saved_at_4_ranks_resumes_at_2_and_3(mpirun, tmp_path):
    # fully_shard's state dicts (ShardedArrays of the live shards, and the optimizer state shaped like them) through
    # distlab.checkpoint: an MLP and its Adam state saved at 4 ranks, resharded and loaded in place at 2 and at 3,
    # the next step reaches the same parameters
    mpirun("fsdp_checkpoint.py", np=4, args=[str(tmp_path), "save"], timeout=120)
    for np_ in (2, 3):
        job = mpirun("fsdp_checkpoint.py", np=np_, args=[str(tmp_path), "load"], timeout=120)
        assert job.stdout.count("continues alike") == np_, job.stdout


def test_a_missing_rank_bad_state_dicts_and_the_timeline(mpirun, tmp_path):
    # a rank that skips a forward or a backward: the others' wait names the group's collective and the rank; bad
    # state dicts refused on every rank, changing nothing; the step's lanes: each group's compute and copies on
    # the fsdp lane, its all-gathers and reduce-scatters, named by group, on the comm lanes
    import json

    trace = tmp_path / "fsdp.json"
    job = mpirun("fsdp_faults.py", np=3, args=["mixed"], timeout=120, timeline=str(trace))
    for what in ("timeouts name the collective", "bad state dicts refused on every rank", "fsdp faults OK"):
        assert job.stdout.count(what) == 3, (what, job.stdout)
    events = json.load(open(trace))["traceEvents"]
    lanes = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"fsdp", "comm world"} <= lanes, lanes
    spans = {e["name"] for e in events if e["ph"] == "X"}
    for name in ("forward 0", "backward 0", "forward <root>", "backward <root>", "copy-out",
                 "reduce-scatter copy-in", "allgather fsdp all-gather 0", "allgather fsdp all-gather <root>",
                 "reduce_scatter fsdp reduce-scatter 0", "reduce_scatter fsdp reduce-scatter <root>"):
        assert name in spans, (name, sorted(spans))
    assert "copy-in" not in spans  # without mixed precision the all-gathers send the groups' packed shards
