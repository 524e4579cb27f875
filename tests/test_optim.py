"""distlab.optim against PyTorch's update formulas computed by hand in numpy."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import distlab
from distlab import nn, optim
from distlab.autograd import SparseGrad, to_numpy

GRADS = [np.array([0.5, -1.0, 2.0]), np.array([-0.25, 0.75, 1.5]), np.array([1.0, 1.0, -3.0])]
P0 = np.array([1.0, -2.0, 0.5])


def run(opt_cls, steps=3, xp=np, **kw):
    """``steps`` steps of ``opt_cls`` on arrays of ``xp`` (numpy or the device stand-in); the result on the host."""
    p = nn.Parameter(xp.asarray(P0.copy()))
    opt = opt_cls([p], **kw)
    for g in GRADS[:steps]:
        p.grad = distlab.Tensor(xp.asarray(g.copy()))
        opt.step()
    assert type(p.data) is type(xp.asarray(P0)), type(p.data)  # the update stayed on the parameter's device
    return to_numpy(p.data), opt


def sgd_reference(lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False):
    p, buf = P0.copy(), None
    for g in GRADS:
        g = -g if maximize else g.copy()
        g = g + weight_decay * p
        if momentum:
            buf = g.copy() if buf is None else momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        p = p - lr * g
    return p


@pytest.mark.parametrize("kw", [dict(lr=0.1), dict(lr=0.1, momentum=0.9), dict(lr=0.05, momentum=0.8, dampening=0.3),
                                dict(lr=0.1, momentum=0.9, nesterov=True), dict(lr=0.1, weight_decay=0.01),
                                dict(lr=0.1, momentum=0.5, weight_decay=0.1, nesterov=True),
                                dict(lr=0.1, maximize=True, momentum=0.9)])
def test_sgd_matches_torch_formula(kw, xp):
    got, _ = run(optim.SGD, xp=xp, **kw)
    np.testing.assert_allclose(got, sgd_reference(**kw), rtol=1e-12)


def adam_reference(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, decoupled=False):
    b1, b2 = betas
    p, m, v, vmax = P0.copy(), np.zeros(3), np.zeros(3), np.zeros(3)
    for t, g in enumerate(GRADS, start=1):
        if decoupled:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        vmax = np.maximum(vmax, v)
        denom = np.sqrt(vmax if amsgrad else v) / np.sqrt(1 - b2 ** t) + eps
        p = p - (lr / (1 - b1 ** t)) * m / denom
    return p


@pytest.mark.parametrize("kw", [dict(lr=0.1), dict(lr=0.01, betas=(0.8, 0.99)), dict(lr=0.1, weight_decay=0.1),
                                dict(lr=0.1, amsgrad=True), dict(lr=0.1, eps=1e-3)])
def test_adam_matches_torch_formula(kw, xp):
    got, opt = run(optim.Adam, xp=xp, **kw)
    np.testing.assert_allclose(got, adam_reference(**kw), rtol=1e-10)
    assert opt.state[opt.param_groups[0]["params"][0]]["step"] == 3


@pytest.mark.parametrize("kw", [dict(lr=0.1), dict(lr=0.1, weight_decay=0.5, amsgrad=True)])
def test_adamw_matches_torch_formula(kw, xp):
    got, _ = run(optim.AdamW, xp=xp, **kw)
    np.testing.assert_allclose(got, adam_reference(decoupled=True, **{"weight_decay": 1e-2, **kw}), rtol=1e-10)


def test_sgd_sparse_matches_dense():
    rows, values = np.array([1, 3, 1]), np.arange(6.0).reshape(3, 2)
    sparse = SparseGrad(rows, values, (5, 2))
    for kw in (dict(lr=0.1), dict(lr=0.1, momentum=0.9, weight_decay=0.01)):
        a, b = nn.Parameter(np.ones((5, 2))), nn.Parameter(np.ones((5, 2)))
        oa, ob = optim.SGD([a], **kw), optim.SGD([b], **kw)
        for _ in range(2):
            a.grad, b.grad = sparse, distlab.Tensor(sparse.to_dense())
            oa.step()
            ob.step()
        np.testing.assert_allclose(a.data, b.data, rtol=1e-12)


def test_adam_refuses_sparse_gradients():
    p = nn.Parameter(np.ones((4, 2)))
    p.grad = SparseGrad(np.array([0]), np.ones((1, 2)), (4, 2))
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        optim.Adam([p]).step()


def test_param_groups_zero_grad_and_skipping_params_without_grad():
    a, b = nn.Parameter(np.ones(2)), nn.Parameter(np.ones(2))
    opt = optim.SGD([{"params": [a]}, {"params": [b], "lr": 1.0}], lr=0.1)
    a.grad = distlab.Tensor(np.ones(2))
    opt.step()
    np.testing.assert_allclose(a.data, 0.9)
    np.testing.assert_allclose(b.data, 1.0)  # no grad: untouched
    b.grad = distlab.Tensor(np.ones(2))
    opt.step()
    np.testing.assert_allclose(b.data, 0.0)
    opt.zero_grad(set_to_none=False)
    assert a.grad.data.tolist() == [0.0, 0.0]
    opt.zero_grad()
    assert a.grad is None and b.grad is None
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [a]})
    with pytest.raises(ValueError, match="Nesterov"):
        optim.SGD([a], lr=0.1, nesterov=True)


@pytest.mark.parametrize("opt_cls,kw", [(optim.SGD, dict(lr=0.1, momentum=0.9)), (optim.Adam, dict(lr=0.1)),
                                        (optim.AdamW, dict(lr=0.1, amsgrad=True))])
def test_state_dict_resumes_identically(opt_cls, kw):
    straight, _ = run(opt_cls, steps=3, **kw)
    p = nn.Parameter(P0.copy())
    opt = opt_cls([p], **kw)
    for g in GRADS[:2]:
        p.grad = distlab.Tensor(g.copy())
        opt.step()
    saved = opt.state_dict()
    assert list(saved["state"]) == [0] and saved["param_groups"][0]["params"] == [0]
    q = nn.Parameter(p.data.copy())
    resumed = opt_cls([q], **{**kw, "lr": 123.0})
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["lr"] == kw["lr"]
    q.grad = distlab.Tensor(GRADS[2].copy())
    resumed.step()
    np.testing.assert_allclose(q.data, straight, rtol=1e-12)


def test_float32_parameters_stay_float32():
    p = nn.Parameter(np.ones(3, dtype=np.float32))
    for opt in (optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.1), optim.Adam([p]), optim.AdamW([p])):
        p.grad = distlab.Tensor(np.ones(3, dtype=np.float32))
        opt.step()
        assert p.data.dtype == np.float32


# -- Adagrad, RMSprop, Adadelta, Adamax, Rprop: torch's update, written out by hand from its algorithm box ---------
def adagrad_reference(lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10,
                      maximize=False):
    p, acc = P0.copy(), np.full(3, initial_accumulator_value)
    for t, g in enumerate(GRADS, start=1):
        g = (-g if maximize else g) + weight_decay * p
        clr = lr / (1 + (t - 1) * lr_decay)
        acc = acc + g * g
        p = p - clr * g / (np.sqrt(acc) + eps)
    return p


def rmsprop_reference(lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False,
                      maximize=False):
    p, v, m, buf = P0.copy(), np.zeros(3), np.zeros(3), np.zeros(3)
    for g in GRADS:
        g = (-g if maximize else g) + weight_decay * p
        v = alpha * v + (1 - alpha) * g * g
        if centered:
            m = alpha * m + (1 - alpha) * g
            avg = np.sqrt(v - m * m) + eps
        else:
            avg = np.sqrt(v) + eps
        if momentum > 0:
            buf = momentum * buf + g / avg
            p = p - lr * buf
        else:
            p = p - lr * g / avg
    return p


def adadelta_reference(lr=1.0, rho=0.9, eps=1e-6, weight_decay=0.0, maximize=False):
    p, v, u = P0.copy(), np.zeros(3), np.zeros(3)
    for g in GRADS:
        g = (-g if maximize else g) + weight_decay * p
        v = rho * v + (1 - rho) * g * g
        delta = np.sqrt(u + eps) / np.sqrt(v + eps) * g
        u = rho * u + (1 - rho) * delta * delta
        p = p - lr * delta
    return p


def adamax_reference(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, maximize=False):
    (b1, b2), p, m, u = betas, P0.copy(), np.zeros(3), np.zeros(3)
    for t, g in enumerate(GRADS, start=1):
        g = (-g if maximize else g) + weight_decay * p
        m = b1 * m + (1 - b1) * g
        u = np.maximum(b2 * u, np.abs(g) + eps)
        p = p - lr / (1 - b1 ** t) * m / u
    return p


def rprop_reference(lr=1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 50), maximize=False):
    p, prev, size = P0.copy(), np.zeros(3), np.full(3, lr)
    for g in GRADS:
        g = -g if maximize else g.copy()
        for i in range(3):
            product = g[i] * prev[i]
            size[i] = min(max(size[i] * (etas[1] if product > 0 else etas[0] if product < 0 else 1.0),
                              step_sizes[0]), step_sizes[1])
            if product < 0:
                g[i] = 0.0
            p[i] -= np.sign(g[i]) * size[i]
        prev = g
    return p


ADAPTIVE_CASES = [
    (optim.Adagrad, adagrad_reference, dict()),
    (optim.Adagrad, adagrad_reference, dict(lr=0.1, lr_decay=0.5, weight_decay=0.1, initial_accumulator_value=0.3)),
    (optim.Adagrad, adagrad_reference, dict(lr=0.1, eps=1e-3, maximize=True)),
    (optim.RMSprop, rmsprop_reference, dict()),
    (optim.RMSprop, rmsprop_reference, dict(lr=0.05, alpha=0.9, momentum=0.8)),
    (optim.RMSprop, rmsprop_reference, dict(lr=0.05, alpha=0.9, centered=True, weight_decay=0.1)),
    (optim.RMSprop, rmsprop_reference, dict(lr=0.05, momentum=0.5, centered=True, maximize=True)),
    (optim.Adadelta, adadelta_reference, dict()),
    (optim.Adadelta, adadelta_reference, dict(lr=0.5, rho=0.8, eps=1e-3, weight_decay=0.1, maximize=True)),
    (optim.Adamax, adamax_reference, dict()),
    (optim.Adamax, adamax_reference, dict(lr=0.1, betas=(0.8, 0.9), weight_decay=0.2, maximize=True)),
    (optim.Rprop, rprop_reference, dict()),
    (optim.Rprop, rprop_reference, dict(lr=0.3, etas=(0.3, 1.5), step_sizes=(0.1, 0.4), maximize=True)),
]


@pytest.mark.parametrize("opt_cls,reference,kw", ADAPTIVE_CASES,
                         ids=[f"{c.__name__}-{i}" for i, (c, _, _) in enumerate(ADAPTIVE_CASES)])
def test_adaptive_optimizers_match_torch_formula(opt_cls, reference, kw, xp):
    got, opt = run(opt_cls, xp=xp, **kw)
    np.testing.assert_allclose(got, reference(**kw), rtol=1e-12, atol=1e-15)
    assert opt.state[opt.param_groups[0]["params"][0]]["step"] == 3


def test_adaptive_optimizers_first_step_by_hand():
    """One step from p = 1 with g = 0.5, the numbers worked out on paper (defaults unless stated)."""
    def one_step(opt_cls, **kw):
        p = nn.Parameter(np.array([1.0]))
        p.grad = distlab.Tensor(np.array([0.5]))
        opt_cls([p], **kw).step()
        return float(p.data[0])

    # Adagrad: acc = 0.25, p = 1 - 0.1 * 0.5 / 0.5 = 0.9
    assert one_step(optim.Adagrad, lr=0.1, eps=0.0) == pytest.approx(0.9, abs=1e-15)
    # RMSprop: v = 0.01 * 0.25 = 0.0025, avg = 0.05, p = 1 - 0.01 * 0.5 / 0.05 = 0.9
    assert one_step(optim.RMSprop, eps=0.0) == pytest.approx(0.9, abs=1e-12)
    # RMSprop centered, alpha=0.5: v = 0.125, m = 0.25, avg = sqrt(0.0625) = 0.25, p = 1 - 0.01 * 2 = 0.98
    assert one_step(optim.RMSprop, alpha=0.5, centered=True, eps=0.0) == pytest.approx(0.98, abs=1e-12)
    # Adadelta, eps=0.01, rho=0.5: v = 0.125, delta = sqrt(0.01) / sqrt(0.135) * 0.5, p = 1 - delta
    assert one_step(optim.Adadelta, rho=0.5, eps=0.01) == pytest.approx(1 - 0.1 / np.sqrt(0.135) * 0.5, abs=1e-12)
    # Adamax: m = 0.05, u = 0.5, p = 1 - (0.002 / 0.1) * 0.05 / 0.5 = 0.998
    assert one_step(optim.Adamax, eps=0.0) == pytest.approx(0.998, abs=1e-12)
    # Rprop: prev = 0 so the step size stays lr; p = 1 - sign(0.5) * 0.01 = 0.99
    assert one_step(optim.Rprop) == pytest.approx(0.99, abs=1e-15)


def test_adagrad_sparse_matches_dense_and_others_refuse_sparse():
    rows, values = np.array([1, 3, 1]), np.arange(6.0).reshape(3, 2)
    sparse = SparseGrad(rows, values, (5, 2))
    a, b = nn.Parameter(np.ones((5, 2))), nn.Parameter(np.ones((5, 2)))
    oa, ob = optim.Adagrad([a], lr=0.1, lr_decay=0.1), optim.Adagrad([b], lr=0.1, lr_decay=0.1)
    for _ in range(2):
        a.grad, b.grad = sparse, distlab.Tensor(sparse.to_dense())
        oa.step()
        ob.step()
    np.testing.assert_allclose(a.data[[1, 3]], b.data[[1, 3]], rtol=1e-12)
    np.testing.assert_array_equal(a.data[[0, 2, 4]], 1.0)  # untouched rows stay (the dense update moves by 0 too)
    a.grad = sparse
    with pytest.raises(RuntimeError, match="weight_decay option is not compatible with sparse gradients"):
        optim.Adagrad([a], weight_decay=0.1).step()
    for opt_cls in (optim.RMSprop, optim.Adadelta, optim.Adamax, optim.Rprop):
        with pytest.raises(RuntimeError, match=f"{opt_cls.__name__} does not support sparse gradients"):
            opt_cls([a]).step()


@pytest.mark.parametrize("opt_cls,kw,match", [
    (optim.Adagrad, dict(lr=-1), "Invalid learning_rate value: -1"),
    (optim.Adagrad, dict(lr_decay=-0.1), "Invalid lr_decay value"),
    (optim.Adagrad, dict(initial_accumulator_value=-1), "Invalid initial_accumulator_value value"),
    (optim.RMSprop, dict(alpha=-0.5), "Invalid alpha value"),
    (optim.RMSprop, dict(momentum=-0.5), "Invalid momentum value"),
    (optim.Adadelta, dict(rho=1.5), "Invalid rho value: 1.5"),
    (optim.Adamax, dict(betas=(0.9, 1.0)), "Invalid beta parameter at index 1"),
    (optim.Adamax, dict(eps=-1e-8), "Invalid epsilon value"),
    (optim.Rprop, dict(etas=(1.5, 1.2)), "Invalid eta values: 1.5, 1.2"),
])
def test_adaptive_optimizers_refuse_bad_hyperparameters(opt_cls, kw, match):
    with pytest.raises(ValueError, match=match):
        opt_cls([nn.Parameter(np.ones(2))], **kw)


@pytest.mark.parametrize("opt_cls,kw", [(optim.Adagrad, dict(lr=0.1)),
                                        (optim.RMSprop, dict(lr=0.01, momentum=0.9, centered=True)),
                                        (optim.Adadelta, dict(lr=1.0)), (optim.Adamax, dict(lr=0.1)),
                                        (optim.Rprop, dict(lr=0.01))])
def test_adaptive_optimizers_resume_from_state_dict_and_keep_float32(opt_cls, kw):
    test_state_dict_resumes_identically(opt_cls, kw)
    p = nn.Parameter(np.ones(3, dtype=np.float32))
    opt = opt_cls([p], **kw)
    for _ in range(2):
        p.grad = distlab.Tensor(np.array([1.0, -1.0, 0.5], dtype=np.float32))
        opt.step()
    assert p.data.dtype == np.float32
    assert all(v.dtype == np.float32 for v in opt.state[p].values() if isinstance(v, np.ndarray))


# -- ZeroRedundancyOptimizer in one process (the MPI scenarios are in tests/mpi/join_zero.py) ----------------------
class FakeGroup:
    """Enough of a process group to build a ZeroRedundancyOptimizer of ``size`` ranks (no collective runs)."""

    def __init__(self, size, rank=0):
        self.size, self.rank = size, rank


def params_of(*sizes):
    return [nn.Parameter(np.zeros(n, np.float32)) for n in sizes]


def owners(zero):
    return [[[id(p) for p in group["params"]] for group in groups] for groups in zero._partition_parameters()]


def test_zero_partition_is_torchs_greedy_by_hand():
    first, second = params_of(1, 5, 3, 3, 2), params_of(4)
    zero = optim.ZeroRedundancyOptimizer(first, optim.SGD, process_group=FakeGroup(3), lr=0.1)
    zero.add_param_group({"params": second})
    # largest first, each to the least loaded rank (the lowest on ties); the loads carry over to the next group:
    # 5 -> r0 (5,0,0); 3 -> r1 (5,3,0); 3 -> r2 (5,3,3); 2 -> r1 (5,5,3); 1 -> r2 (5,5,4); then 4 -> r2
    ids = [id(p) for p in first]
    assert owners(zero) == [[[ids[1]], []], [[ids[2], ids[4]], []], [[ids[3], ids[0]], [id(second[0])]]]
    assert [len(g["params"]) for g in zero.optim.param_groups] == [1, 0]  # rank 0's local optimizer


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=12), min_size=1, max_size=3),
       st.integers(1, 5))
def test_zero_partition_properties(group_sizes, world_size):
    groups = [params_of(*sizes) for sizes in group_sizes]
    zero = optim.ZeroRedundancyOptimizer(groups[0], optim.SGD, process_group=FakeGroup(world_size), lr=0.1)
    for group in groups[1:]:
        zero.add_param_group({"params": group})
    partition = zero._partition_parameters()
    loads = [0] * world_size
    for g, group in enumerate(groups):
        assigned = {id(p): rank for rank in range(world_size) for p in partition[rank][g]["params"]}
        assert sorted(assigned) == sorted(id(p) for p in group)  # every parameter exactly once
        for p in sorted(group, key=lambda p: -p.data.size):  # replay: each went to a least-loaded rank
            assert loads[assigned[id(p)]] == min(loads)
            loads[assigned[id(p)]] += p.data.size
    everything = [n for sizes in group_sizes for n in sizes]
    assert max(loads) - min(loads) <= max(everything)  # greedy's balance bound


def test_zero_on_one_rank_equals_the_plain_optimizer_and_refuses_clearly():
    def train(make):
        distlab.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4, seed=1), nn.Tanh(), nn.Linear(4, 1, seed=2))
        opt = make(model.parameters())
        for i in range(3):
            x = np.random.default_rng(i).standard_normal((5, 3)).astype(np.float32)
            opt.zero_grad()
            (model(distlab.tensor(x)) ** 2).mean().backward()
            opt.step()
        return [p.data for p in model.parameters()], opt

    plain, _ = train(lambda ps: optim.Adam(ps, lr=0.1))
    zero_params, zero = train(lambda ps: optim.ZeroRedundancyOptimizer(ps, optim.Adam, lr=0.1,
                                                                      parameters_as_bucket_view=True))
    assert all(np.array_equal(a, b) for a, b in zip(plain, zero_params))
    assert zero.param_groups[0]["betas"] == (0.9, 0.999)  # the local optimizer's defaults, synced back
    with pytest.raises(RuntimeError, match=r"not been consolidated on this rank\. Call consolidate_state_dict\(to=0\)"):
        zero.state_dict()
    zero.consolidate_state_dict()
    assert sorted(zero.state_dict()["state"]) == [0, 1, 2, 3]

    p = params_of(2)
    with pytest.raises(NotImplementedError, match="overlap_with_ddp=True.*is not supported.*call step"):
        optim.ZeroRedundancyOptimizer(p, optim.Adam, overlap_with_ddp=True)
    with pytest.raises(TypeError, match="optimizer_class must be a distlab.optim.Optimizer subclass"):
        optim.ZeroRedundancyOptimizer(p, "Adam")
    with pytest.raises(TypeError, match="iterable of Tensors, but got a Tensor"):
        optim.ZeroRedundancyOptimizer(p[0], optim.Adam)
    with pytest.raises(TypeError, match="parameter groups as dicts are added with add_param_group"):
        optim.ZeroRedundancyOptimizer([{"params": p}], optim.Adam)
    with pytest.raises(ValueError, match="empty parameter list"):
        optim.ZeroRedundancyOptimizer([], optim.Adam)
    with pytest.raises(ValueError, match="every parameter of one dtype, got float32, float64"):
        optim.ZeroRedundancyOptimizer(p + [nn.Parameter(np.zeros(2))], optim.Adam)


def test_zero_rebuilds_its_buckets_when_trainability_changes():
    a, b = params_of(3, 2)
    zero = optim.ZeroRedundancyOptimizer([a, b], optim.SGD, lr=1.0, parameters_as_bucket_view=True)
    assert np.shares_memory(a.data, zero._buckets[0]) and np.shares_memory(b.data, zero._buckets[0])
    b.requires_grad = False
    a.grad = distlab.Tensor(np.ones(3, np.float32))
    zero.step()
    assert not np.shares_memory(b.data, zero._buckets[0]) and zero._buckets[0].size == 3
    np.testing.assert_array_equal(a.data, -1.0)


@pytest.mark.mpi
def test_optimizers_under_distributed_optimizer(mpirun):
    """Adagrad, RMSprop, Adadelta, Adamax, Rprop (and Adam) step remote parameters as they step local ones."""
    job = mpirun("optim_distributed.py", np=2, timeout=180)
    assert job.stdout.count("under DistributedOptimizer OK") == 2
    assert "DistributedOptimizer(Rprop) OK" in job.stdout


FUSED_CASES = [
    (optim.SGD, dict(lr=0.1)), (optim.SGD, dict(lr=0.1, momentum=0.9)),
    (optim.SGD, dict(lr=0.05, momentum=0.8, dampening=0.3)),
    (optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (optim.SGD, dict(lr=0.1, maximize=True, momentum=0.5, weight_decay=0.1)),
    (optim.SGD, dict(lr=0.1, maximize=True, weight_decay=0.1)),
    (optim.Adam, dict(lr=0.01)), (optim.Adam, dict(lr=0.01, weight_decay=0.1, amsgrad=True)),
    (optim.Adam, dict(lr=0.01, maximize=True, betas=(0.8, 0.9), eps=1e-3)),
    (optim.AdamW, dict(lr=0.01)), (optim.AdamW, dict(lr=0.01, amsgrad=True, weight_decay=0.05, maximize=True)),
    (optim.Adagrad, dict(lr=0.1)), (optim.Adagrad, dict(lr=0.1, lr_decay=0.01, weight_decay=0.1, maximize=True,
                                                        initial_accumulator_value=0.5)),
    (optim.RMSprop, dict(lr=0.01)), (optim.RMSprop, dict(lr=0.01, centered=True, momentum=0.9)),
    (optim.RMSprop, dict(lr=0.01, weight_decay=0.1, momentum=0.5, maximize=True)),
    (optim.Adadelta, dict()), (optim.Adadelta, dict(lr=0.5, rho=0.8, weight_decay=0.1, maximize=True)),
    (optim.Adamax, dict()), (optim.Adamax, dict(lr=0.01, betas=(0.8, 0.9), weight_decay=0.1, maximize=True)),
]


def fused_run(opt_cls, kw, module, fused, dtype, steps=4):
    """``steps`` steps on three parameters (a matrix, a vector, a scalar) with seeded gradients (zeros among
    them); the parameters and every state array on the host, and the launches of each step after the first."""
    rng = np.random.default_rng(7)
    params = [nn.Parameter(module.asarray(rng.standard_normal(s).astype(dtype))) for s in ((5, 7), (7,), ())]
    opt = opt_cls(params, fused=fused, **kw)
    launches = []
    for _ in range(steps):
        for p in params:
            g = rng.standard_normal(p.shape).astype(dtype)
            g[g > 1.2] = 0
            p.grad = distlab.Tensor(module.asarray(g))
        if module is not np:
            module.reset()
        opt.step()
        if module is not np:
            launches.append(module.launch_total())
    state = [to_numpy(v) for p in params for v in opt.state.get(p, {}).values() if not isinstance(v, int)]
    return [to_numpy(p.data) for p in params] + state, launches


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("opt_cls, kw", FUSED_CASES)
def test_fused_updates_are_bit_equal_to_the_unfused_numpy_code(opt_cls, kw, dtype):
    """One kernel per parameter (fused=True on numpy, through the kernels' host twin), and one multi-tensor launch
    for all three parameters (the default on the device stand-in) give the unfused numpy code's bits."""
    from distlab import fakegpu

    unfused, _ = fused_run(opt_cls, kw, np, False, dtype)
    host_fused, _ = fused_run(opt_cls, kw, np, True, dtype)
    device, launches = fused_run(opt_cls, kw, fakegpu, None, dtype)
    assert len(unfused) == len(host_fused) == len(device) >= 3  # the parameters, then every state array
    for want, *got in zip(unfused, host_fused, device):
        assert all(g.dtype == want.dtype and g.tobytes() == want.tobytes() for g in got)
    assert launches[1:] == [1] * 3  # after the first step (which makes the state): one launch for the three
    _, per_op = fused_run(opt_cls, kw, fakegpu, False, dtype)
    assert min(per_op[1:]) > 3  # fused=False keeps the operation-by-operation code on the device too


def test_float16_parameters_take_one_fused_kernel_each_with_the_unfused_bits():
    """The multi-tensor kernels take float32 and float64; float16 parameters get one fused kernel each."""
    from distlab import fakegpu

    for opt_cls, kw in ((optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)), (optim.Adam, dict(lr=0.01, eps=1e-3))):
        unfused, _ = fused_run(opt_cls, kw, np, False, np.float16)
        device, launches = fused_run(opt_cls, kw, fakegpu, None, np.float16)
        assert all(d.dtype == u.dtype == np.float16 and d.tobytes() == u.tobytes() for d, u in zip(device, unfused))
        assert launches[1:] == [3] * 3
