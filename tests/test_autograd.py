"""Every differentiable op's gradient against central finite differences (float64)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import distlab
from distlab import autograd as ag
from distlab.autograd import gradcheck
from distlab.nn import functional as F

RNG = np.random.default_rng(1234)


def leaf(*shape, low=-2.0, high=2.0, positive=False, away_from_zero=False, xp=np):
    """A float64 leaf of ``shape`` on ``xp``'s device (numpy, or the device stand-in)."""
    data = RNG.uniform(low, high, shape)
    if positive:
        data = RNG.uniform(0.5, 2.0, shape)
    if away_from_zero:
        data = np.where(np.abs(data) < 0.1, 0.5, data)
    return distlab.tensor(xp.asarray(data), requires_grad=True)


shapes = st.sampled_from([(), (1,), (3,), (2, 3), (1, 3), (2, 1), (2, 1, 3)])


@settings(max_examples=25, deadline=None, derandomize=True)
@given(shapes=hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=3),
       op=st.sampled_from(["add", "sub", "mul", "div", "pow"]))
def test_binary_ops_broadcast(shapes, op):
    sa, sb = shapes.input_shapes
    a = leaf(*sa, positive=op in ("div", "pow"))
    b = leaf(*sb, positive=op in ("div", "pow"))
    fn = {"add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y,
          "div": lambda x, y: x / y, "pow": lambda x, y: x ** y}[op]
    gradcheck(fn, [a, b])
    assert a.grad.shape == a.shape and b.grad.shape == b.shape


@settings(max_examples=10, deadline=None, derandomize=True)
@given(shape=shapes)
def test_binary_ops_with_one_tensor_side(shape):
    x = leaf(*shape, positive=True)
    gradcheck(lambda x: 2.0 - x, [x])
    gradcheck(lambda x: 3.0 / x, [x])
    gradcheck(lambda x: 2.0 ** x, [x])
    gradcheck(lambda x: x ** 3 + x * 0.5 - 1.0, [x])
    gradcheck(lambda x: np.full(shape, 2.0) * x, [x])


@pytest.mark.parametrize("name", ["neg", "exp", "log", "sqrt", "tanh", "sigmoid", "relu", "abs"])
def test_unary_ops(name, xp):
    positive = name in ("log", "sqrt")
    x = leaf(3, 4, positive=positive, away_from_zero=True, xp=xp)
    fn = {"neg": lambda t: -t, "exp": ag.exp, "log": ag.log, "sqrt": ag.sqrt, "tanh": ag.tanh,
          "sigmoid": ag.sigmoid, "relu": ag.relu, "abs": ag.abs}[name]
    gradcheck(fn, [x])


@pytest.mark.parametrize("sa,sb", [((3, 4), (4, 2)), ((4,), (4, 2)), ((3, 4), (4,)), ((4,), (4,)),
                                   ((2, 3, 4), (4, 5)), ((2, 3, 4), (1, 4, 5)), ((3, 4), (2, 4, 5))])
def test_matmul(sa, sb, xp):
    gradcheck(lambda a, b: a @ b, [leaf(*sa, xp=xp), leaf(*sb, xp=xp)])


@pytest.mark.parametrize("axis", [None, 0, 1, -1, (0, 2)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_sum_mean(axis, keepdims, xp):
    x = leaf(2, 3, 4, xp=xp)
    gradcheck(lambda t: t.sum(axis=axis, keepdims=keepdims), [x])
    gradcheck(lambda t: t.mean(axis=axis, keepdims=keepdims), [x])


def test_reshape_transpose(xp):
    x = leaf(2, 3, 4, xp=xp)
    gradcheck(lambda t: t.reshape(4, 6) * 2, [x])
    gradcheck(lambda t: t.reshape((-1,)), [x])
    gradcheck(lambda t: t.transpose(), [x])
    gradcheck(lambda t: t.transpose(1, 2, 0), [x])
    gradcheck(lambda t: t.T, [leaf(3, 5, xp=xp)])


@pytest.mark.parametrize("index", [1, (slice(None), 2), (Ellipsis, slice(1, 3)), (None, 0),
                                   np.array([0, 2, 0, 0]), (np.array([0, 1, 1]), np.array([2, 2, 0]))])
def test_getitem(index, xp):
    gradcheck(lambda t: t[index], [leaf(3, 4, xp=xp)])


def test_getitem_boolean_mask_and_repeats_accumulate():
    x = leaf(5)
    mask = np.array([True, False, True, True, False])
    gradcheck(lambda t: t[mask], [x])
    x.grad = None
    x[np.array([1, 1, 1])].sum().backward()
    assert x.grad.data[1] == 3.0 and x.grad.data.sum() == 3.0


def test_concatenate_stack(xp):
    a, b, c = leaf(2, 3, xp=xp), leaf(1, 3, xp=xp), leaf(4, 3, xp=xp)
    gradcheck(lambda *ts: ag.concatenate(ts, axis=0), [a, b, c])
    d, e = leaf(2, 3, xp=xp), leaf(2, 2, xp=xp)
    gradcheck(lambda x, y: ag.concatenate([x, y], axis=1), [d, e])
    gradcheck(lambda x, y: ag.stack([x, y], axis=1), [leaf(2, 3, xp=xp), leaf(2, 3, xp=xp)])


@pytest.mark.parametrize("axis", [-1, 0])
def test_log_softmax_softmax(axis, xp):
    x = leaf(3, 5, xp=xp)
    gradcheck(lambda t: ag.log_softmax(t, axis=axis), [x])
    gradcheck(lambda t: t.softmax(axis), [x])
    big = distlab.tensor(np.array([[1000.0, 0.0]]))
    assert np.isfinite(ag.log_softmax(big).data).all()  # shifted by the max: no overflow


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("xshape", [(4, 3), (2, 4, 3)])
def test_linear(bias, xshape, xp):
    x, w = leaf(*xshape, xp=xp), leaf(5, 3, xp=xp)
    args = [x, w, leaf(5, xp=xp)] if bias else [x, w]
    gradcheck(lambda *a: F.linear(*a), args)


def test_embedding_dense_gradient(xp):
    w = leaf(6, 3, xp=xp)
    idx = np.array([[0, 2, 2], [5, 0, 1]])
    gradcheck(lambda t: F.embedding(idx, t), [w])


def test_layer_norm_cross_entropy_mse(xp):
    x, g, b = leaf(4, 5, xp=xp), leaf(5, xp=xp), leaf(5, xp=xp)
    gradcheck(lambda x, g, b: F.layer_norm(x, (5,), g, b), [x, g, b], atol=1e-4)
    target = np.array([0, 4, 2, 2])
    gradcheck(lambda t: F.cross_entropy(t, target), [x])
    y = RNG.standard_normal((4, 5))
    gradcheck(lambda t: F.mse_loss(t, xp.asarray(y)), [x])


def test_dropout_gradient_is_the_mask():
    x = leaf(50, 40)
    out = F.dropout(x, p=0.5, training=True, rng=np.random.default_rng(0))
    out.sum().backward()
    kept = out.data != 0
    np.testing.assert_allclose(x.grad.data[kept], 2.0)
    np.testing.assert_allclose(x.grad.data[~kept], 0.0)
    assert 0.4 < kept.mean() < 0.6


def test_composite_expression():
    a, b = leaf(3, 4), leaf(4)
    gradcheck(lambda a, b: ((a * b).tanh() @ b).exp().sum() / (1.0 + (a ** 2).mean()), [a, b])


def test_custom_function():
    class Cube(ag.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x.data)
            return x.data ** 3

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return grad.data * 3 * x ** 2

    x = leaf(3, 2)
    gradcheck(lambda t: Cube.apply(t) * 2, [x])
    assert Cube.apply(x).grad_fn.name() == "CubeBackward"


def test_float32_stays_float32():
    x = distlab.tensor(np.ones(3, dtype=np.float32), requires_grad=True)
    y = (x * 2.0 + 1.0) / 3.0 - 0.5
    assert y.dtype == np.float32
    y.sum().backward()
    assert x.grad.dtype == np.float32


def test_comparisons_return_arrays():
    x = distlab.tensor([1.0, 2.0, 3.0])
    assert isinstance(x > 1.5, np.ndarray)
    assert (x == distlab.tensor([1.0, 0.0, 3.0])).tolist() == [True, False, True]
    assert {x: 1}[x] == 1  # identity hash despite element-wise ==


def test_imports_run_one_way():
    """tensor.py imports no module that imports it back; the methods those modules install are in place."""
    import _architecture

    cycles = [c for c in _architecture.import_cycles() if any(m.startswith("distlab.autograd") for m in c)]
    assert cycles == []
    for name in ("__add__", "__rsub__", "__matmul__", "__neg__", "__getitem__", "exp", "sum", "reshape", "view",
                 "flatten", "transpose", "softmax", "backward", "_grad_node"):
        assert name in vars(ag.Tensor), name
    x = distlab.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    y = (2.0 - x).flatten() @ distlab.tensor([1.0, 1.0, 1.0, 1.0])
    y.backward()
    assert x.grad.tolist() == [[-1.0, -1.0], [-1.0, -1.0]]
