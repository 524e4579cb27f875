"""PowerSGD (distlab.ddp_comm_hooks.powerSGD_hook and batched_powerSGD_hook): torch's documented behaviour on one
rank, its errors, and on 2 ranks (tests/mpi/powersgd_checks.py) equality with torch's own hooks on recorded
gradients, DDP training on both twins and a mixed world, and Join on uneven inputs."""
import importlib
import pickle

import numpy as np
import pytest

from distlab import comm
from distlab.autograd import to_numpy as host
from distlab.ddp import GradBucket
from distlab.ddp_comm_hooks import PowerSGDState, batched_powerSGD_hook, powerSGD_hook

matrices = importlib.import_module("distlab.ddp_comm_hooks._powersgd_matrices")
SHAPES = [(32, 16), (32,), (32, 16), (32,), (16, 32), (16,), (4, 4)]


def bucket_of(flat, shapes=SHAPES, index=0, count=1):
    lengths = [int(np.prod(s)) for s in shapes]
    offsets = list(np.cumsum([0] + lengths[:-1]))
    return GradBucket(index, count, flat, offsets, lengths, shapes, [])


def grads(seed, shapes=SHAPES, xp=np):
    """A flat float32 gradient for ``shapes`` in the array module ``xp`` (the same numbers on numpy and the
    device stand-in)."""
    rng = np.random.default_rng(seed)
    return xp.asarray(rng.standard_normal(sum(int(np.prod(s)) for s in shapes)).astype(np.float32))


# -- PowerSGDState ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(start_powerSGD_iter=1), "start_powerSGD_iter"),  # torch's check: error feedback and warm start need 2
    (dict(start_powerSGD_iter=0, use_error_feedback=False), "start_powerSGD_iter"),
    (dict(matrix_approximation_rank=0), "matrix_approximation_rank"),
    (dict(matrix_approximation_rank=1.5), "matrix_approximation_rank"),
    (dict(min_compression_rate=-1), "min_compression_rate"),
    (dict(orthogonalization_epsilon=-1e-8), "orthogonalization_epsilon"),
])
def test_state_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PowerSGDState(None, **kwargs)


def test_start_iter_1_is_allowed_without_error_feedback_and_warm_start():
    state = PowerSGDState(None, start_powerSGD_iter=1, use_error_feedback=False, warm_start=False)
    assert state.start_powerSGD_iter == 1


def test_state_pickles_without_its_process_group(xp):
    state = PowerSGDState(comm.world(), matrix_approximation_rank=2, start_powerSGD_iter=2)
    for _ in range(3):
        powerSGD_hook(state, bucket_of(grads(0, xp=xp))).wait()
    restored = pickle.loads(pickle.dumps(state))
    assert restored.process_group is None and restored.iter == 3
    assert np.array_equal(host(restored.error_dict[0]), host(state.error_dict[0]))
    # the restored state goes on where the saved one was: warm-started Q, same error, same draws
    a = powerSGD_hook(state, bucket_of(grads(1, xp=xp))).wait()
    b = powerSGD_hook(restored, bucket_of(grads(1, xp=xp))).wait()
    assert np.array_equal(host(a), host(b))


# -- one rank: what torch's tests check -------------------------------------------------------------------------
def test_plain_allreduce_before_start_then_compression(xp):
    state = PowerSGDState(comm.world(), matrix_approximation_rank=1, start_powerSGD_iter=3)
    g = grads(0, xp=xp)
    for it in range(3):
        out = powerSGD_hook(state, bucket_of(g.copy())).wait()
        assert np.array_equal(host(out), host(g)) if it < 3 else True  # averaging over one rank: unchanged
        assert state.iter == it + 1
    assert not state.error_dict and state.compression_stats() == (0, 0, 0)
    out = powerSGD_hook(state, bucket_of(g.copy())).wait()
    assert not np.allclose(host(out), host(g))  # rank 1 loses most of a random matrix ...
    vectors = [(32 * 16, 32), (2 * 32 * 16 + 32, 32), (3 * 32 * 16 + 64, 16)]
    for offset, n in vectors:  # ... but vectors (rank-1 tensors) are allreduced uncompressed
        assert np.array_equal(host(out[offset:offset + n]), host(g[offset:offset + n]))
    tail = slice(g.size - 16, g.size)  # and the 4 x 4 matrix does not compress enough at min rate 2
    assert np.array_equal(host(out[tail]), host(g[tail]))


def test_error_feedback_keeps_what_compression_lost(xp):
    state = PowerSGDState(comm.world(), matrix_approximation_rank=1, start_powerSGD_iter=2)
    for _ in range(2):
        powerSGD_hook(state, bucket_of(grads(0, xp=xp))).wait()
    g = grads(1, xp=xp)
    out = powerSGD_hook(state, bucket_of(g.copy())).wait()
    np.testing.assert_allclose(host(state.error_dict[0]), host(g - out), atol=1e-6)
    g2 = grads(2, xp=xp)
    out2 = powerSGD_hook(state, bucket_of(g2.copy())).wait()
    np.testing.assert_allclose(host(state.error_dict[0]), host(g2 + (g - out) - out2), atol=1e-5)


def test_compressing_a_low_rank_gradient_is_exact(xp):
    rng = np.random.default_rng(3)
    shapes = [(64, 48)]
    low = (rng.standard_normal((64, 2)) @ rng.standard_normal((2, 48))).astype(np.float32).ravel()
    state = PowerSGDState(comm.world(), matrix_approximation_rank=2, start_powerSGD_iter=2)
    for _ in range(4):  # warm start: the power iteration converges on the 2-dimensional row space
        out = powerSGD_hook(state, bucket_of(xp.asarray(low), shapes)).wait()
    np.testing.assert_allclose(host(out), low, atol=1e-4)


def test_compression_stats_and_layout(xp):
    state = PowerSGDState(comm.world(), matrix_approximation_rank=2, start_powerSGD_iter=2)
    for _ in range(3):
        powerSGD_hook(state, bucket_of(grads(0, xp=xp))).wait()
    before = 2 * 32 * 16 + 2 * 32 + 16 * 32 + 16 + 16
    after = 2 * (32 + 16) * 2 + 2 * 32 + (16 + 32) * 2 + 16 + 16
    assert state.compression_stats() == (before / after, before, after)
    layout = state._layouts[0]
    assert [run[2] for run in layout.runs] == [2, 1]  # the two 32 x 16 at a constant stride: one batch
    assert state.p_memory_dict[0].size == layout.p_total == (2 * 32 + 16) * 2
    assert state.q_memory_dict[0].size == layout.q_total == (2 * 16 + 32) * 2


def test_min_compression_rate_zero_compresses_every_tensor(xp):
    state = PowerSGDState(comm.world(), matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=0)
    for _ in range(3):
        powerSGD_hook(state, bucket_of(grads(0, xp=xp))).wait()
    # as torch: a vector is an n x 1 matrix, which rate 0 compresses too (to n x 1 and 1 x 1)
    assert sum(run[2] for run in state._layouts[0].runs) == len(SHAPES) and state._layouts[0].u_total == 0


def test_without_warm_start_q_is_drawn_anew_from_the_seed(xp):
    def run(seed):
        state = PowerSGDState(comm.world(), matrix_approximation_rank=1, start_powerSGD_iter=2,
                              warm_start=False, random_seed=seed)
        return [powerSGD_hook(state, bucket_of(grads(0, xp=xp))).wait().copy() for _ in range(4)], state

    (outs, state), (again, _), (other, _) = run(0), run(0), run(1)
    # the same seed, the same draws (every rank agrees)
    assert all(np.array_equal(host(a), host(b)) for a, b in zip(outs, again))
    assert not np.array_equal(host(outs[2]), host(other[2]))
    assert not state.p_memory_dict and not state.q_memory_dict  # nothing kept between steps


def test_orthogonalization_gram_schmidt_and_qr(xp):
    rng = np.random.default_rng(4)
    for rank in (1, 2, 4):
        m = xp.asarray(rng.standard_normal((3, 20, rank)).astype(np.float32))
        matrices._orthogonalize(m)
        for matrix in host(m):
            np.testing.assert_allclose(matrix.T @ matrix, np.eye(rank), atol=1e-5)


def test_zero_column_stays_zero_with_epsilon_0(xp, caplog):
    m = xp.zeros((1, 8, 2), dtype=np.float32)
    m[0, :, 1] = 1
    matrices._orthogonalize_gram_schmidt(m, 0)
    m = host(m)
    assert np.all(m[0, :, 0] == 0) and np.isfinite(m).all()
    with_eps = xp.zeros((1, 8, 1), dtype=np.float32)
    matrices._orthogonalize_gram_schmidt(with_eps, 1e-8)
    assert np.all(host(with_eps) == 0)


def test_batched_hook_on_one_rank(xp):
    state = PowerSGDState(comm.world(), matrix_approximation_rank=1, start_powerSGD_iter=2)
    g = grads(5, xp=xp)
    for _ in range(3):
        bucket = bucket_of(g.copy())
        out = batched_powerSGD_hook(state, bucket).wait()
    assert out is bucket.buffer() and out.size == g.size
    side = int(np.ceil(np.sqrt(g.size)))
    assert state.error_dict[0].size == side * side
    assert state.compression_stats()[1:] == (g.size, 2 * side)


def test_a_non_float_bucket_is_refused(xp):
    state = PowerSGDState(comm.world(), start_powerSGD_iter=2)
    state.iter = 2
    with pytest.raises(TypeError, match="floating-point"):
        powerSGD_hook(state, bucket_of(xp.zeros(sum(int(np.prod(s)) for s in SHAPES), dtype=np.int32)))
    with pytest.raises(TypeError, match="floating-point"):
        batched_powerSGD_hook(state, bucket_of(xp.zeros(10, dtype=np.int64), [(10,)]))


def test_rebuilt_buckets_drop_the_old_memory(xp):
    state = PowerSGDState(comm.world(), matrix_approximation_rank=1, start_powerSGD_iter=2)
    for _ in range(3):
        powerSGD_hook(state, bucket_of(grads(0, xp=xp))).wait()
    shapes = SHAPES[:3]
    out = powerSGD_hook(state, bucket_of(grads(0, shapes, xp), shapes)).wait()
    assert out.size == state.error_dict[0].size == grads(0, shapes, xp).size


# -- 2 ranks ----------------------------------------------------------------------------------------------------

@pytest.mark.mpi
def test_equals_torchs_hooks_on_recorded_gradients(mpirun):
    job = mpirun("powersgd_checks.py", np=2, args=["parity"], timeout=240)
    assert job.stdout.count("parity with torch") == 2


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from _mpi import run_scenario

    out = tmp_path_factory.mktemp("powersgd")
    results = {}
    for impl in ("reference", "core", "mixed"):
        run_scenario("powersgd_checks.py", np=2, args=["train", impl, str(out / impl)], timeout=240)
        results[impl] = [pickle.load(open(out / f"{impl}.{r}.pkl", "rb")) for r in range(2)]
    return results


@pytest.mark.mpi
def test_training_on_both_twins_and_a_mixed_world_is_bit_identical_with_identical_traces(trained):
    for impl in ("core", "mixed"):
        for rank in range(2):
            ref, other = trained["reference"][rank], trained[impl][rank]
            assert all(np.array_equal(a, b) for a, b in zip(ref["params"], other["params"])), (impl, rank)
            assert ref["trace"] == other["trace"] == trained["reference"][0]["trace"]
    losses = trained["core"][0]["losses"]
    assert losses[-1] < losses[0]


@pytest.mark.mpi
def test_every_collective_matches_across_ranks_under_detail_checks(mpirun, tmp_path):
    """DISTLAB_DEBUG=DETAIL checks each collective's fingerprint across ranks before running it."""
    mpirun("powersgd_checks.py", np=2, args=["train", "core", str(tmp_path / "detail")], timeout=240,
           env={"DISTLAB_DEBUG": "DETAIL"})


@pytest.mark.mpi
def test_join_on_uneven_inputs_shadows_with_zeros(mpirun, impl, tmp_path):
    mpirun("powersgd_checks.py", np=2, args=["join", impl, str(tmp_path / "join")], timeout=240)


@pytest.mark.mpi
def test_training_example_with_powersgd_reaches_its_accuracy(mpirun):
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "train_ddp.py"
    job = mpirun(str(example), np=2, args=["--epochs", "8", "--powersgd", "1", "--target", "0.9"], timeout=240)
    assert "accuracy" in job.stdout and "; loss " in job.stdout


@pytest.mark.mpi
def test_a_missing_rank_times_out_naming_the_bucket_and_the_rank(mpirun):
    job = mpirun("powersgd_checks.py", np=2, args=["timeout"], timeout=120)
    assert "timeout named the bucket and the rank" in job.stdout


def test_batch_tensors_with_same_shape_gives_the_same_results(xp):
    """torch's option stacks same-shape matrices; distlab always batches them (strided, without a copy)."""
    outs = []
    for batch in (False, True):
        state = PowerSGDState(comm.world(), matrix_approximation_rank=2, start_powerSGD_iter=2,
                              batch_tensors_with_same_shape=batch)
        outs.append([powerSGD_hook(state, bucket_of(grads(i, xp=xp))).wait().copy() for i in range(4)])
    assert all(np.array_equal(host(a), host(b)) for a, b in zip(*outs))


def test_compression_stats_are_logged_at_their_frequency(xp, caplog):
    state = PowerSGDState(comm.world(), start_powerSGD_iter=2, compression_stats_logging_frequency=2)
    with caplog.at_level("INFO", logger="distlab.ddp_comm_hooks"):
        for _ in range(6):
            powerSGD_hook(state, bucket_of(grads(0, xp=xp))).wait()
    reports = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compression stats")]
    assert [m.split(",")[0] for m in reports] == ["Compression stats: iter 2", "Compression stats: iter 4"]


@pytest.mark.parametrize("hook", [powerSGD_hook, batched_powerSGD_hook])
def test_on_the_device_stand_in_equal_to_numpy_without_host_copies(hook):
    """Every step on device buckets is bit-equal to numpy's; nothing but the comm layer's staging and the Qs drawn
    on the host (as the anchor draws them on the CPU) crosses to or from the host."""
    from distlab import fakegpu

    def run(xp):
        state = PowerSGDState(comm.world(), matrix_approximation_rank=2, start_powerSGD_iter=2, warm_start=False)
        return [host(hook(state, bucket_of(grads(i, xp=xp))).wait()) for i in range(4)]

    want = run(np)
    fakegpu.reset()
    got = run(fakegpu)
    assert all(np.array_equal(a, b) for a, b in zip(want, got))
    moved = {key for key in fakegpu.transfers() if key[1].startswith("distlab.") and key[0] != "synchronize"}
    outside_comm = {key for key in moved if not key[1].startswith("distlab.comm.")}
    assert outside_comm == {("from_host", "distlab.ddp_comm_hooks.powersgd")}, moved     # the Qs drawn on the host
    assert {kind for kind, _module in moved - outside_comm} == {"to_host", "from_host"}, moved   # comm's staging
