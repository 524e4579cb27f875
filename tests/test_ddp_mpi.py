"""DDP on 2 and 4 ranks: equals single-process training; twins bit-identical with identical traces; mixed world."""
import json
import pickle

import numpy as np
import pytest

pytestmark = pytest.mark.mpi


def _load(prefix, np_):
    return [pickle.load(open(f"{prefix}.rank{r}.pkl", "rb")) for r in range(np_)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run the DDP scenario once per (ranks, twin) and keep every rank's parameters and traces."""
    from _mpi import run_scenario

    out = tmp_path_factory.mktemp("ddp")
    results = {}
    for np_, impls in ((2, ("reference", "core", "mixed")), (4, ("reference", "core", "mixed"))):
        for impl in impls:
            prefix = str(out / f"{impl}{np_}")
            job = run_scenario("ddp_train.py", np=np_, args=[impl, prefix], timeout=300)
            assert job.stdout.count("devices match local training") == np_
            results[np_, impl] = _load(prefix, np_)
    return results


@pytest.mark.parametrize("np_", [2, 4])
def test_twins_are_bit_identical_with_identical_traces(runs, np_):
    reference, core = runs[np_, "reference"], runs[np_, "core"]
    for rank in range(np_):
        for config in reference[rank]:
            ref, cor = reference[rank][config], core[rank][config]
            for a, b in zip(ref["params"], cor["params"]):
                assert np.array_equal(a, b), (rank, config)
            assert ref["trace"] == cor["trace"], (rank, config)
            assert ref["trace"] == reference[0][config]["trace"], "every rank issues the same collectives"


@pytest.mark.parametrize("np_", [2, 4])
def test_mixed_world_matches_either_twin(runs, np_):
    reference, mixed = runs[np_, "reference"], runs[np_, "mixed"]
    for rank in range(np_):
        for config in reference[rank]:
            for a, b in zip(reference[rank][config]["params"], mixed[rank][config]["params"]):
                assert np.array_equal(a, b), (rank, config)
            assert reference[rank][config]["trace"] == mixed[rank][config]["trace"]


@pytest.mark.parametrize("np_", [2, 4])
def test_buckets_reduced_in_shared_memory_train_as_through_mpi(runs, tmp_path, np_):
    # Every bucket through the shared-memory arena (its size threshold lifted): the same collectives, and the
    # same parameters as through MPI (bit for bit on 2 ranks, where every order of two addends is one sum; on 4
    # the orders differ, by float16 rounding in the mixed-precision configuration).
    from _mpi import run_scenario

    prefix = str(tmp_path / "shared")
    job = run_scenario("ddp_train.py", np=np_, args=["core", prefix], timeout=300,
                       env={"DISTLAB_SHARED_MIN_BYTES": "0"})
    assert job.stdout.count("devices match local training") == np_
    shared, through_mpi = _load(prefix, np_), runs[np_, "core"]
    for rank in range(np_):
        for config in through_mpi[rank]:
            assert shared[rank][config]["trace"] == through_mpi[rank][config]["trace"], (rank, config)
            for a, b in zip(shared[rank][config]["params"], through_mpi[rank][config]["params"]):
                assert np.array_equal(a, b) if np_ == 2 else np.allclose(a, b, rtol=1e-3, atol=1e-4), (rank, config)


def test_shared_memory_buckets_are_averaged_by_their_reduction(runs, tmp_path):
    # On one node the buckets live in a shared-memory arena, whose reduction divides each piece it sums: with
    # gradient_as_bucket_view (gradients computed in the bucket) the bucket allreduces are "avg" and gradients
    # stay undivided. Copied in (no view) or in private memory (arenas off), they are divided on the way in and
    # summed, with the same bits on 2 ranks; a comm hook always gets the plain sum to divide.
    from _mpi import run_scenario

    prefix = str(tmp_path / "private")
    job = run_scenario("ddp_train.py", np=2, args=["core", prefix], timeout=300,
                       env={"DISTLAB_SHARED_MEMORY": "0"})
    assert job.stdout.count("devices match local training") == 2
    private, shared = _load(prefix, 2), runs[2, "core"]

    def bucket_ops(trace):
        return {detail for op, name, _, _, detail in trace if op == "allreduce" and name.startswith("bucket")}

    for rank in range(2):
        for config, result in shared[rank].items():
            if "hook" in config:  # the hook's own collectives, named by the hook
                assert bucket_ops(result["trace"]) == bucket_ops(private[rank][config]["trace"]) == set(), config
            else:
                # device buckets stay in device memory (never in the host arena): summed, like private ones
                in_arena = "bucket_view" in config and config.startswith("cpu:")
                assert bucket_ops(result["trace"]) == ({"avg"} if in_arena else {"sum"}), config
                assert bucket_ops(private[rank][config]["trace"]) == {"sum"}, config
            for a, b in zip(result["params"], private[rank][config]["params"]):
                assert np.array_equal(a, b), (rank, config)


def _arena_blind(trace):
    """The trace with the bucket allreduces' "avg" read as "sum": host buckets in a shared-memory arena are
    averaged by their reduction, device buckets (never in a host arena) are divided on the way in and summed."""
    return [(op, name, shape, dtype, "sum" if op == "allreduce" and str(name).startswith("bucket") and
             detail == "avg" else detail) for op, name, shape, dtype, detail in trace]


@pytest.mark.parametrize("np_", [2, 4])
def test_the_device_stand_in_trains_the_numpy_bits_with_the_numpy_trace(runs, np_):
    """Every configuration (every option, hook, sparse gradients) ran a second time in the same launch on the strict
    device stand-in, with no host conversion outside the comm layer (checked in the scenario): the same bits and
    the same collectives as on numpy, for both twins and the mixed world."""
    for (n, impl), ranks in runs.items():
        if n != np_:
            continue
        for rank, result in enumerate(ranks):
            configs = [key[len("cpu:"):] for key in result if key.startswith("cpu:")]
            assert configs and len(result) == 2 * len(configs)
            for config in configs:
                cpu, cuda = result[f"cpu:{config}"], result[f"cuda:{config}"]
                for a, b in zip(cpu["params"], cuda["params"]):
                    assert a.dtype == b.dtype and np.array_equal(a, b), (impl, rank, config)
                assert _arena_blind(cpu["trace"]) == _arena_blind(cuda["trace"]), (impl, rank, config)


def test_trace_shows_buckets_in_order_then_the_used_map(runs):
    trace = runs[2, "core"][0]["cpu:find_unused"]["trace"]
    names = [name for op, name, *_ in trace if op == "allreduce"]
    step = names[: names.index("local_used_map") + 1]
    buckets = [n for n in step if n.startswith("bucket")]
    assert buckets == sorted(buckets, key=lambda n: int(n[6:])) and step[-1] == "local_used_map"


@pytest.mark.parametrize("impl", ["reference", "core"])
def test_model_or_argument_mismatch_is_refused_on_every_rank(mpirun, impl):
    job = mpirun("ddp_errors.py", np=4, args=[impl])
    assert job.stdout.count("model checks OK") == 4
    assert job.stdout.count("model checks on cuda OK") == 4  # the same on the device stand-in


def test_training_example_reaches_its_accuracy_and_writes_a_timeline(mpirun, tmp_path):
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "train_ddp.py"
    trace = tmp_path / "ddp.json"
    job = mpirun(str(example), np=2, args=["--epochs", "8"], timeline=str(trace))
    assert "accuracy" in job.stdout
    events = json.load(open(trace))["traceEvents"]
    lanes = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"reducer grads", "reducer buckets", "comm world"} <= lanes
    spans = [e for e in events if e["ph"] == "X" and e["name"].startswith("bucket")]
    assert spans and all(e["args"]["bytes"] > 0 for e in spans)


def test_buffers_are_broadcast_from_rank_0_before_each_forward_only_when_asked(mpirun):
    job = mpirun("ddp_buffers.py", np=2)
    assert job.stdout.count("DDP buffer checks OK") == 2


@pytest.mark.parametrize("np_, impl, shared", [(2, "reference", "1"), (2, "core", "1"), (3, "core", "0"),
                                               (4, "mixed", "1"), (4, "mixed", "0")])
def test_auto_bucket_caps_agree_on_every_rank_and_under_join(mpirun, np_, impl, shared):
    job = mpirun("ddp_auto.py", np=np_, args=[impl], timeout=300, env={"DISTLAB_SHARED_MEMORY": shared})
    runs = 2 * np_  # on numpy, then on the device stand-in
    assert job.stdout.count("agreed") == runs and job.stdout.count("uneven inputs with auto caps OK") == runs
    assert job.stdout.count("train the same bits") == (runs if shared == "0" else 0)


@pytest.mark.parametrize("np_, impl", [(2, "core"), (3, "mixed")])
def test_fused_optimizer_equals_stepping_after_backward_and_follows_join(mpirun, np_, impl):
    job = mpirun("ddp_fused_optim.py", np=np_, args=[impl], timeout=300)
    # on numpy, then on the device stand-in
    assert job.stdout.count("fused optimizer equals local training") == 2 * np_
    assert job.stdout.count("fused optimizer under Join OK") == 2 * np_
