"""The same autograd code over cupy arrays (skipped cleanly without cupy and a CUDA device)."""
from __future__ import annotations

import numpy as np
import pytest

import distlab
from distlab import nn, optim
from distlab.autograd import array_module

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    cupy = pytest.importorskip("cupy")
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - any CUDA failure means "no usable device"
        pytest.skip(f"no usable CUDA device: {exc}")
    return cupy


def test_array_module_without_cupy_is_numpy():
    assert array_module(np.ones(2)) is np


def test_mlp_step_on_gpu_matches_cpu(cp):
    def step(device):
        distlab.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(device)
        emb = nn.Embedding(5, 4, sparse=True).to(device)
        opt = optim.SGD(list(model.parameters()) + list(emb.parameters()), lr=0.1)
        idx = np.array([0, 3, 3, 1])
        if device == "cuda":
            idx = cp.asarray(idx)
        loss = nn.CrossEntropyLoss()(model(emb(idx)), idx % 3)
        loss.backward()
        opt.step()
        return [distlab.tensor(p.data).numpy() for p in model.parameters()] + [emb.weight.numpy()]

    for cpu, gpu in zip(step("cpu"), step("cuda")):
        np.testing.assert_allclose(cpu, gpu, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opt_cls, kw", [
    (optim.SGD, dict(lr=0.1)), (optim.SGD, dict(lr=0.05, momentum=0.8, dampening=0.3)),
    (optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, maximize=True)),
    (optim.Adam, dict(lr=0.01, weight_decay=0.1, amsgrad=True)), (optim.AdamW, dict(lr=0.01, maximize=True)),
])
def test_fused_kernels_compile_and_match_numpy(cp, opt_cls, kw):
    """The fused kernels compiled by cupy (ReLU's backward; each optimizer's update as multi-tensor raw kernels in
    ``step`` and as an ElementwiseKernel per parameter in ``step_param``): a ReLU MLP trained 3 steps on the GPU
    (fused, the default there), then each parameter stepped once more alone, against the unfused numpy code, to
    float32 rounding."""
    def train(device):
        distlab.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).to(device)
        opt = opt_cls(model.parameters(), **kw)
        rng = np.random.default_rng(0)
        x, y = (rng.standard_normal((5, n)).astype(np.float32) for n in (6, 3))
        if device == "cuda":
            x, y = cp.asarray(x), cp.asarray(y)
        for _ in range(3):
            opt.zero_grad()
            nn.MSELoss()(model(distlab.tensor(x)), distlab.tensor(y)).backward()
            opt.step()
        for p in model.parameters():
            opt.step_param(p, p.grad)
        return [p.numpy() for p in model.parameters()]

    for cpu, gpu in zip(train("cpu"), train("cuda")):
        np.testing.assert_allclose(gpu, cpu, rtol=1e-4, atol=1e-5)
