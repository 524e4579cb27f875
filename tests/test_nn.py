"""distlab.nn: module bookkeeping, initialisation, layers, sparse embeddings, and a small MLP that learns."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import distlab
from distlab import autograd as ag
from distlab import nn, optim
from distlab.autograd import SparseGrad, to_numpy


class Block(nn.Module):
    def __init__(self, n_in):
        super().__init__()
        self.fc = nn.Linear(n_in, 4, seed=1)
        self.norm = nn.LayerNorm(4)
        self.register_buffer("steps", np.zeros(1))
        self.register_buffer("scratch", np.zeros(2), persistent=False)

    def forward(self, x):
        return self.norm(self.fc(x)).relu()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(3), Block(4)])
        self.head = nn.Linear(4, 2, bias=False, seed=2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_named_parameters_gives_a_shared_parameter_under_each_name_when_asked():
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    net[1].weight = net[0].weight
    assert [n for n, _ in net.named_parameters()] == ["0.weight", "0.bias", "1.bias"]
    every = list(net.named_parameters(remove_duplicate=False))
    assert [n for n, _ in every] == ["0.weight", "0.bias", "1.weight", "1.bias"] and every[2][1] is every[0][1]
    assert [n for n, _ in net[1].named_parameters("b", recurse=False, remove_duplicate=False)] == ["b.weight",
                                                                                                    "b.bias"]


def test_named_parameters_buffers_children():
    net = Net()
    names = [n for n, _ in net.named_parameters()]
    assert names == ["blocks.0.fc.weight", "blocks.0.fc.bias", "blocks.0.norm.weight", "blocks.0.norm.bias",
                     "blocks.1.fc.weight", "blocks.1.fc.bias", "blocks.1.norm.weight", "blocks.1.norm.bias",
                     "head.weight"]
    assert all(isinstance(p, nn.Parameter) and p.requires_grad and p.is_leaf for p in net.parameters())
    assert [n for n, _ in net.named_buffers()] == ["blocks.0.steps", "blocks.0.scratch",
                                                   "blocks.1.steps", "blocks.1.scratch"]
    assert [n for n, _ in net.named_children()] == ["blocks", "head"]
    assert len(list(net.modules())) == 1 + 1 + 2 * 3 + 1
    assert net.head.bias is None


def test_shared_parameter_listed_once():
    a = nn.Linear(2, 2)
    seq = nn.Sequential(a, nn.Tanh(), a)
    assert len(list(seq.parameters())) == 2


def test_state_dict_round_trip_and_errors():
    net, other = Net(), Net()
    for p in other.parameters():
        p.data += 1.0
    state = {k: v.copy() for k, v in net.state_dict().items()}
    assert "blocks.0.steps" in state and "blocks.0.scratch" not in state
    result = other.load_state_dict(state)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for (n, p), (_, q) in zip(net.named_parameters(), other.named_parameters()):
        np.testing.assert_array_equal(p.data, q.data)
    with pytest.raises(RuntimeError, match="missing keys"):
        other.load_state_dict({"head.weight": state["head.weight"]})
    with pytest.raises(RuntimeError, match="size mismatch for head.weight"):
        other.load_state_dict({**state, "head.weight": np.zeros((3, 3))})


def test_zero_grad_train_eval_and_forward_hooks():
    net = Net()
    x = distlab.tensor(np.ones((2, 3), dtype=np.float32))
    net(x).sum().backward()
    assert all(p.grad is not None for p in net.parameters())
    net.zero_grad(set_to_none=False)
    assert all(np.all(p.grad.data == 0) for p in net.parameters())
    net.zero_grad()
    assert all(p.grad is None for p in net.parameters())
    net.eval()
    assert not any(m.training for m in net.modules())
    net.train()
    assert all(m.training for m in net.modules())
    seen = []
    handle = net.head.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    net(x)
    handle.remove()
    net(x)
    assert seen == [(2, 2)]


def test_deterministic_init_and_bounds():
    a, b = nn.Linear(64, 8, seed=5), nn.Linear(64, 8, seed=5)
    np.testing.assert_array_equal(a.weight.data, b.weight.data)
    distlab.manual_seed(3)
    c = nn.Linear(64, 8)
    distlab.manual_seed(3)
    d = nn.Linear(64, 8)
    np.testing.assert_array_equal(c.weight.data, d.weight.data)
    assert not np.array_equal(a.weight.data, c.weight.data)
    bound = 1 / math.sqrt(64)  # kaiming_uniform(a=sqrt(5)) as torch
    assert np.abs(c.weight.data).max() <= bound and np.abs(c.bias.data).max() <= bound
    assert np.abs(c.weight.data).max() > 0.8 * bound
    assert c.weight.dtype == np.float32


def test_dropout_train_and_eval():
    drop = nn.Dropout(0.5, seed=0)
    x = distlab.tensor(np.ones((100, 100), dtype=np.float32))
    y = drop(x)
    assert 0.45 < (y.data == 0).mean() < 0.55 and set(np.unique(y.data)) <= {0.0, 2.0}
    assert drop.eval()(x) is x


def test_layer_norm_normalises():
    ln = nn.LayerNorm(8)
    x = distlab.tensor(np.random.default_rng(0).normal(3, 5, (4, 8)))
    y = ln(x).data
    np.testing.assert_allclose(y.mean(-1), 0, atol=1e-6)
    np.testing.assert_allclose(y.var(-1), 1, atol=1e-3)


def test_losses_match_formulas():
    logits = np.random.default_rng(0).standard_normal((5, 3))
    target = np.array([0, 2, 1, 1, 0])
    loss = nn.CrossEntropyLoss()(distlab.tensor(logits), target).item()
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    assert loss == pytest.approx(-logp[np.arange(5), target].mean())
    y = np.ones((5, 3))
    assert nn.MSELoss()(distlab.tensor(logits), y).item() == pytest.approx(((logits - 1) ** 2).mean())
    assert nn.MSELoss(reduction="sum")(distlab.tensor(logits), y).item() == pytest.approx(((logits - 1) ** 2).sum())


def embedding_grads(sparse, indices_list, xp=np):
    emb = nn.Embedding(10, 4, sparse=sparse, dtype=np.float64, seed=0)
    if xp is not np:
        emb.to("cuda")  # the xp fixture made "cuda" mean the stand-in
    for idx in indices_list:
        (emb(xp.asarray(idx)) * xp.arange(4.0)).sum().backward()
    return emb.weight.grad


def test_sparse_and_dense_embedding_gradients_agree(xp):
    batches = [np.array([[1, 3, 3], [0, 9, 1]]), np.array([3, 3, 7])]
    dense = embedding_grads(False, batches, xp)
    sparse = embedding_grads(True, batches, xp)
    assert isinstance(sparse, SparseGrad) and not isinstance(dense, SparseGrad)
    assert type(sparse.values) is type(dense.data) is type(xp.zeros(1))  # on the device they came from
    assert sparse.nnz() == 9 and not sparse.coalesced  # accumulation concatenates, as torch
    np.testing.assert_allclose(to_numpy(sparse.to_dense()), to_numpy(dense.data))
    co = sparse.coalesce()
    assert co.indices.tolist() == [0, 1, 3, 7, 9] and co.coalesced
    np.testing.assert_allclose(to_numpy(co.to_dense()), to_numpy(dense.data))
    np.testing.assert_allclose(to_numpy(co.values[co.indices.tolist().index(3)]), 4 * np.arange(4.0))


def test_sparse_embedding_hooks_and_padding():
    emb = nn.Embedding(5, 2, padding_idx=0, sparse=True, seed=0)
    assert np.all(emb.weight.data[0] == 0)
    fired = []
    emb.weight.register_post_accumulate_grad_hook(lambda p: fired.append(type(p.grad).__name__))
    emb(np.array([0, 2, 0])).sum().backward()
    assert fired == ["SparseGrad"]
    np.testing.assert_allclose(emb.weight.grad.to_dense()[0], 0)
    np.testing.assert_allclose(emb.weight.grad.to_dense()[2], 1)
    assert ag.grad(emb(np.array([4])).sum(), emb.weight).to_dense()[4].tolist() == [1.0, 1.0]


def spiral(n_per_class=100, classes=3, seed=0):
    """Three interleaved spirals in 2-D: not linearly separable, learnable by a small MLP."""
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for c in range(classes):
        r = np.linspace(0.05, 1.0, n_per_class)
        t = np.linspace(c * 4.0, (c + 1) * 4.0, n_per_class) + rng.normal(0, 0.15, n_per_class)
        xs.append(np.c_[r * np.sin(t), r * np.cos(t)])
        ys.append(np.full(n_per_class, c))
    return np.concatenate(xs).astype(np.float32), np.concatenate(ys)


def test_mlp_learns_spirals():
    x, y = spiral()
    distlab.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    opt = optim.Adam(model.parameters(), lr=0.02)
    loss_fn = nn.CrossEntropyLoss()
    order = np.random.default_rng(0)
    for epoch in range(60):
        perm = order.permutation(len(x))
        for i in range(0, len(x), 50):  # batches of 50 keep BLAS single-threaded (fast on a loaded machine)
            b = perm[i:i + 50]
            opt.zero_grad()
            loss_fn(model(distlab.tensor(x[b])), y[b]).backward()
            opt.step()
    with distlab.no_grad():
        accuracy = (model(distlab.tensor(x)).data.argmax(1) == y).mean()
    assert accuracy >= 0.95


# -- BatchNorm1d and SyncBatchNorm (one process) --------------------------------------------------------------------
def bn_reference(x, weight, bias, eps=1e-5):
    """torch.nn.functional.batch_norm in training mode, written out in float64 numpy (biased variance)."""
    axes = (0,) + tuple(range(2, x.ndim))
    shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    x = x.astype(np.float64)
    mean, var = x.mean(axis=axes), x.var(axis=axes)
    y = (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps)
    return y * weight.reshape(shape) + bias.reshape(shape), mean, var


@pytest.mark.parametrize("shape", [(8, 3), (5, 3, 7)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_batchnorm1d_training_forward_and_running_stats(shape, dtype, xp):
    rng = np.random.default_rng(1)
    bn = nn.BatchNorm1d(3, momentum=0.2, dtype=dtype)
    bn.weight.data[...] = [1.5, -0.5, 2.0]
    bn.bias.data[...] = [0.1, 0.2, -0.3]
    if xp is not np:
        bn.to("cuda")  # the xp fixture made "cuda" mean the stand-in
    running_mean, running_var = np.zeros(3), np.ones(3)
    for step in range(1, 4):
        x = (rng.standard_normal(shape) * 3 + 2).astype(dtype)
        out = bn(distlab.tensor(xp.asarray(x)))
        expected, mean, var = bn_reference(x, to_numpy(bn.weight.data), to_numpy(bn.bias.data))
        assert out.dtype == dtype and type(out.data) is type(xp.asarray(x))
        np.testing.assert_allclose(to_numpy(out.data), expected, rtol=1e-5 if dtype == np.float32 else 1e-12,
                                   atol=1e-5)
        n = x.size // 3
        running_mean = 0.8 * running_mean + 0.2 * mean
        running_var = 0.8 * running_var + 0.2 * var * n / (n - 1)  # unbiased for the running estimate
        np.testing.assert_allclose(to_numpy(bn.running_mean.data), running_mean, rtol=1e-5)
        np.testing.assert_allclose(to_numpy(bn.running_var.data), running_var, rtol=1e-5)
        assert int(bn.num_batches_tracked.data) == step


def test_batchnorm1d_eval_uses_running_stats_and_momentum_none_averages():
    bn = nn.BatchNorm1d(2, momentum=None, dtype=np.float64)
    batches = [np.array([[1.0, 2.0], [3.0, 6.0]]), np.array([[5.0, 0.0], [7.0, 4.0]])]
    for x in batches:
        bn(distlab.tensor(x))
    # cumulative average of the batch means (2, 4) and (6, 2), and of the unbiased variances (2, 8) and (2, 8)
    np.testing.assert_allclose(bn.running_mean.data, [4.0, 3.0])
    np.testing.assert_allclose(bn.running_var.data, [2.0, 8.0])
    bn.eval()
    x = np.array([[4.0, 3.0], [6.0, 3.0 + np.sqrt(8.0 + 1e-5)]])
    np.testing.assert_allclose(bn(distlab.tensor(x)).data, [[0.0, 0.0], [2.0 / np.sqrt(2.0 + 1e-5), 1.0]])
    assert int(bn.num_batches_tracked.data) == 2  # eval does not count


def test_batchnorm1d_without_running_stats_or_affine():
    bn = nn.BatchNorm1d(2, affine=False, track_running_stats=False)
    assert bn.weight is None and bn.running_mean is None and list(bn.parameters()) == []
    x = np.array([[1.0, 2.0], [3.0, 6.0]], dtype=np.float32)
    bn.eval()  # no running statistics: batch statistics in eval mode too (as torch)
    np.testing.assert_allclose(bn(distlab.tensor(x)).data, [[-1, -1], [1, 1]], atol=1e-4)
    assert set(nn.BatchNorm1d(2).state_dict()) == {"weight", "bias", "running_mean", "running_var",
                                                    "num_batches_tracked"}


@pytest.mark.parametrize("shape", [(6, 3), (4, 3, 5)])
@pytest.mark.parametrize("training", [True, False])
def test_batchnorm1d_gradients_match_finite_differences(shape, training):
    rng = np.random.default_rng(2)
    bn = nn.BatchNorm1d(3, dtype=np.float64)
    bn.weight.data[...] = rng.standard_normal(3)
    bn.bias.data[...] = rng.standard_normal(3)
    bn.running_mean.data[...] = rng.standard_normal(3)
    bn.running_var.data[...] = rng.uniform(0.5, 2.0, 3)
    bn.train(training)
    x = distlab.tensor(rng.standard_normal(shape) * 2 + 1, requires_grad=True)
    assert ag.gradcheck(lambda x, w, b: bn(x), [x, bn.weight, bn.bias])


def test_batchnorm1d_gradients_equal_the_composed_ops():
    """The fused node against the same formula built from autograd ops (mean, sub, mul, sqrt, div)."""
    rng = np.random.default_rng(3)
    x0, w0, b0 = rng.standard_normal((7, 4, 3)), rng.standard_normal(4), rng.standard_normal(4)
    bn = nn.BatchNorm1d(4, dtype=np.float64)
    bn.weight.data[...], bn.bias.data[...] = w0, b0
    x = distlab.tensor(x0, requires_grad=True)
    (bn(x) * distlab.tensor(np.cos(x0))).sum().backward()
    xc = distlab.tensor(x0, requires_grad=True)
    w, b = distlab.tensor(w0.reshape(1, 4, 1), requires_grad=True), distlab.tensor(b0.reshape(1, 4, 1),
                                                                                     requires_grad=True)
    centred = xc - xc.mean(axis=(0, 2), keepdims=True)
    y = centred / ((centred * centred).mean(axis=(0, 2), keepdims=True) + 1e-5).sqrt() * w + b
    (y * distlab.tensor(np.cos(x0))).sum().backward()
    np.testing.assert_allclose(x.grad.data, xc.grad.data, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(bn.weight.grad.data, w.grad.data.ravel(), rtol=1e-9)
    np.testing.assert_allclose(bn.bias.grad.data, b.grad.data.ravel(), rtol=1e-9)


def test_batchnorm_errors():
    bn = nn.BatchNorm1d(3)
    with pytest.raises(ValueError, match=r"expected 2D or 3D input \(got 4D input\)"):
        bn(distlab.tensor(np.zeros((2, 3, 4, 5), np.float32)))
    with pytest.raises(ValueError, match=r"expects input of shape \(N, 3, ...\), got \(2, 4\)"):
        bn(distlab.tensor(np.zeros((2, 4), np.float32)))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        bn(distlab.tensor(np.zeros((1, 3), np.float32)))
    with pytest.raises(ValueError, match="num_features must be positive"):
        nn.BatchNorm1d(0)
    bn.eval()
    assert bn(distlab.tensor(np.zeros((1, 3), np.float32))).shape == (1, 3)  # eval: one sample is fine


def test_sync_batchnorm_on_one_rank_is_batchnorm1d_and_converts_in_place():
    rng = np.random.default_rng(4)
    distlab.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4, seed=1), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2, seed=2),
                        nn.BatchNorm1d(2, momentum=None))
    twin = nn.Sequential(nn.Linear(3, 4, seed=1), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2, seed=2),
                         nn.BatchNorm1d(2, momentum=None))
    weight = net[1].weight
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    assert converted is net and [type(m).__name__ for m in net] == [
        "Linear", "SyncBatchNorm", "Tanh", "Linear", "SyncBatchNorm"]  # replaced in place, order kept
    assert net[1].weight is weight and net[4].momentum is None
    assert nn.SyncBatchNorm.layers_in(net) == [net[1], net[4]]
    for _ in range(2):
        x = rng.standard_normal((6, 3)).astype(np.float32)
        a, b = net(distlab.tensor(x)), twin(distlab.tensor(x))
        np.testing.assert_array_equal(a.data, b.data)
        a.sum().backward()
        b.sum().backward()
    for (name, p), q in zip(net.named_parameters(), twin.parameters()):
        np.testing.assert_array_equal(p.grad.data, q.grad.data, err_msg=name)
    for key, value in twin.state_dict().items():
        np.testing.assert_array_equal(net.state_dict()[key], value, err_msg=key)
    single = nn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm1d(5))
    assert isinstance(single, nn.SyncBatchNorm) and single.join_device == "cpu"
    from distlab.join import Joinable

    assert isinstance(single, Joinable) and single.join_process_group is distlab.comm.world()


def test_replacing_a_submodule_or_parameter_keeps_its_place():
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    seq.add_module("1", nn.Tanh())
    assert [type(m).__name__ for m in seq] == ["Linear", "Tanh", "Linear"]
    lin = nn.Linear(2, 3)
    lin.weight = nn.Parameter(np.zeros((3, 2), np.float32))
    assert [name for name, _ in lin.named_parameters()] == ["weight", "bias"]


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 9), st.integers(1, 5), st.one_of(st.none(), st.integers(1, 4)), st.booleans(),
       st.floats(0.0, 1.0), st.integers(0, 2**31 - 1))
def test_batchnorm1d_matches_torchs_formula_for_any_shape(n, channels, length, affine, momentum, seed):
    rng = np.random.default_rng(seed)
    shape = (n, channels) if length is None else (n, channels, length)
    x = rng.standard_normal(shape) * rng.uniform(0.1, 10) + rng.uniform(-5, 5)
    bn = nn.BatchNorm1d(channels, momentum=momentum, affine=affine, dtype=np.float64)
    if affine:
        bn.weight.data[...], bn.bias.data[...] = rng.standard_normal(channels), rng.standard_normal(channels)
    expected, mean, var = bn_reference(x, bn.weight.data if affine else np.ones(channels),
                                       bn.bias.data if affine else np.zeros(channels))
    np.testing.assert_allclose(bn(distlab.tensor(x)).data, expected, rtol=1e-9, atol=1e-9)
    count = x.size // channels
    np.testing.assert_allclose(bn.running_mean.data, momentum * mean, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(bn.running_var.data, (1 - momentum) + momentum * var * count / (count - 1),
                               rtol=1e-9)


def test_importing_nn_and_optim_starts_no_mpi():
    """SyncBatchNorm and ZeroRedundancyOptimizer reach MPI only when one is built (a local model needs no MPI)."""
    import subprocess
    import sys

    code = "import sys, distlab.nn, distlab.optim; print('mpi4py.MPI' in sys.modules)"
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
