"""distlab.optim against PyTorch's update formulas computed by hand in numpy."""
from __future__ import annotations

import numpy as np
import pytest

import distlab
from distlab import nn, optim
from distlab.autograd import SparseGrad

GRADS = [np.array([0.5, -1.0, 2.0]), np.array([-0.25, 0.75, 1.5]), np.array([1.0, 1.0, -3.0])]
P0 = np.array([1.0, -2.0, 0.5])


def run(opt_cls, steps=3, **kw):
    p = nn.Parameter(P0.copy())
    opt = opt_cls([p], **kw)
    for g in GRADS[:steps]:
        p.grad = distlab.Tensor(g.copy())
        opt.step()
    return p.data, opt


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
def test_sgd_matches_torch_formula(kw):
    got, _ = run(optim.SGD, **kw)
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
def test_adam_matches_torch_formula(kw):
    got, opt = run(optim.Adam, **kw)
    np.testing.assert_allclose(got, adam_reference(**kw), rtol=1e-10)
    assert opt.state[opt.param_groups[0]["params"][0]]["step"] == 3


@pytest.mark.parametrize("kw", [dict(lr=0.1), dict(lr=0.1, weight_decay=0.5, amsgrad=True)])
def test_adamw_matches_torch_formula(kw):
    got, _ = run(optim.AdamW, **kw)
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
