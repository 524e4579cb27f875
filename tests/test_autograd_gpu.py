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
