"""Kernel launches and host round trips of a training step, counted on the device stand-in (distlab.fakegpu).

At a small model's size a GPU step is bound by kernel launches (cupy starts one in about 8 us) and stalled by
every read back to the host, so these counts are what the stand-in can show of a GPU step's time. Nothing here
is timed: the counts are exact and deterministic.
"""
from __future__ import annotations

import numpy as np
import pytest

import distlab
from distlab import fakegpu as xp
from distlab import nn, optim
from distlab.autograd._kernels import HostElementwiseKernel


@pytest.fixture
def dev():
    a = xp.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    xp.reset()
    return a


def test_every_kernel_counts_one_launch_by_kind_and_module_and_views_none(dev):
    assert (dev.T, dev.reshape(3, 2), dev[0], dev[:, 1:], xp.broadcast_to(dev[0], (4, 3)),
            xp.swapaxes(dev, 0, 1), dev.astype(np.float32, copy=False)) and xp.launches() == {}
    dev + 1
    np.exp(dev)
    dev += 1  # in place: still a kernel
    dev.sum()
    dev.max(axis=0)
    dev @ dev.T
    xp.matmul(dev, dev.T)
    xp.zeros((3,))
    xp.empty_like(dev)
    dev.copy()
    dev.astype(np.float64)
    dev[xp.asarray(np.array([1, 0]))]  # advanced indexing gathers
    dev[0] = 2
    dev.fill(0)
    here = __name__
    assert xp.launches() == {("elementwise", here): 3, ("reduction", here): 2, ("matmul", here): 2,
                             ("alloc", here): 2, ("copy", here): 3, ("fill", here): 2}
    assert xp.launch_total() == 14 and xp.launch_total("matmul") == 2 and xp.launch_total(prefix="distlab.") == 0
    xp.reset()
    assert xp.launches() == {} and xp.transfers() == {}


def test_host_round_trips_are_every_read_back_and_synchronize(dev):
    dev.get()
    float(dev[0, 0])
    dev[0, 1].item()
    bool(dev[0, 2])
    xp.asnumpy(dev)
    xp.cuda.get_current_stream().synchronize()
    xp.asarray(np.ones(2))  # host to device: a transfer, not a round trip
    assert xp.round_trips() == 6 and xp.round_trips(prefix="distlab.") == 0 and xp.total("from_host") == 1


def test_an_elementwise_kernel_is_one_launch_and_computes_what_numpy_computes(dev):
    kernel = xp.ElementwiseKernel("T g, T lr", "T p, T buf", "T d = -g; buf = buf * lr + d; p -= lr * buf;", "k")
    g = xp.asarray(np.array([[1.5, -2.0, 0.25]] * 2, np.float32))
    p, buf = dev.copy(), xp.ones((2, 3), np.float32)
    xp.reset()
    assert kernel(g, 0.1, p, buf) == (p, buf)
    assert xp.launches() == {("elementwise", __name__): 1}
    host_g, host_buf = g.get(), np.ones((2, 3), np.float32)
    host_buf = host_buf * np.float32(0.1) + -host_g
    assert np.array_equal(buf.get(), host_buf) and np.array_equal(p.get(), dev.get() - 0.1 * host_buf)
    fresh = xp.ElementwiseKernel("T x, T y", "T z", "z = x * (y > 0)", "relu")(g, dev)  # outputs allocated
    assert isinstance(fresh, xp.ndarray) and np.array_equal(fresh.get(), g.get() * (dev.get() > 0))


@pytest.mark.parametrize("make, call, error, words", [
    (("T x", "T y", "y = 1.5 * x", "k"), None, ValueError, "no float literals"),
    (("T x", "T y", "x = y", "k"), None, ValueError, "input parameter"),
    (("T x", "T y", "z = x; y = z", "k"), None, ValueError, "assigned before it is declared"),
    (("T x", "T y", "y = pow(x, 2)", "k"), None, ValueError, "unknown name 'pow'"),
    (("T x", "T y", "y = x ? 1 : 0", "k"), None, ValueError, "cannot read"),
    (("raw T x", "T y", "y = x", "k"), None, ValueError, "no raw"),
    (("T x, T z", "T y", "y = x + z", "k"), "mixed dtypes", TypeError, "type is mismatched"),
    (("T x", "T y", "y = x", "k"), "host array", TypeError, "numpy array cannot be mixed"),
    (("T x", "T y", "y = x", "k"), "three arguments", TypeError, "Wrong number of arguments"),
])
def test_elementwise_kernels_refuse_what_they_cannot_run_faithfully(make, call, error, words):
    a32, a64 = xp.ones(3, np.float32), xp.ones(3, np.float64)
    calls = {"mixed dtypes": lambda k: k(a32, a64), "host array": lambda k: k(np.ones(3), a32),
             "three arguments": lambda k: k(a32, a32, a32)}
    with pytest.raises(error, match=words):
        calls[call](xp.ElementwiseKernel(*make)) if call else xp.ElementwiseKernel(*make)
    if call is None:  # the numpy twin reads the body with the same rules
        with pytest.raises(error, match=words):
            HostElementwiseKernel(*make)


def test_relu_backward_is_one_kernel_with_numpys_bits():
    """``g * (out > 0)``: negative zeros where the gradient is negative and the output is not positive, NaN kept
    where it flows through, exactly as the two numpy operations give them."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    g = rng.standard_normal((4, 5)).astype(np.float32)
    g[0, 0] = np.nan
    grads = []
    for module in (np, xp):
        t = distlab.tensor(module.asarray(x), requires_grad=True)
        out = t.relu()
        xp.reset()
        out.backward(module.asarray(g))
        grads.append(distlab.autograd.to_numpy(t.grad.data))
    assert xp.launch_total(prefix="distlab.autograd.ops") == 1
    assert grads[0].tobytes() == grads[1].tobytes() and np.signbit(grads[1]).any()


LAYERS = 20
#: per training step of LAYERS x (Linear + ReLU) with an MSE loss, on the stand-in (40 parameters: 2 launches)
AFTER = {"zero_grad": 0, "forward": 3 * LAYERS + 3, "backward": 4 * LAYERS + 4, "optimizer": 2}


@pytest.mark.parametrize("make_optimizer", [
    lambda ps: optim.SGD(ps, lr=1e-3),
    lambda ps: optim.SGD(ps, lr=1e-3, momentum=0.9, weight_decay=1e-4, nesterov=True),
    lambda ps: optim.Adam(ps, lr=1e-3, amsgrad=True),
    lambda ps: optim.AdamW(ps, lr=1e-3),
    lambda ps: optim.RMSprop(ps, lr=1e-3, momentum=0.9, centered=True),
], ids=["sgd", "sgd-momentum-nesterov-wd", "adam-amsgrad", "adamw", "rmsprop"])
def test_a_training_step_launches_a_fixed_few_kernels_per_layer_and_never_waits_for_the_device(make_optimizer):
    """Kernel launches per step of LAYERS x (Linear + ReLU), MSE loss, counted by phase after two warm-up steps.

    Per layer: forward 3 (matmul, bias, ReLU), backward 4 (ReLU's backward as one fused kernel, two matmuls,
    the bias gradient's sum; the first layer's input needs no gradient); 7 for the loss and the seed gradient;
    and the optimizer's update, one fused body run by multi-tensor launches of 32 parameters each. For 100
    layers, before (one H100 then took 1.44x torch's step): 1207 launches per step with SGD, 2407 with SGD +
    momentum, weight decay and Nesterov, 3407 with Adam (ReLU's backward 2 a layer; each parameter's update 2,
    8 and 13 launches); now 714 with each of them (303 forward, 404 backward, 7 optimizer). And no host round
    trip anywhere in distlab during the step (no ``float(loss)``, no ``.item()``, no synchronize), nor any
    other transfer.
    """
    xp.use_as_cuda()
    try:
        distlab.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(16, 16), nn.ReLU())]).to("cuda")
        opt = make_optimizer(model.parameters())
        rng = np.random.default_rng(0)
        x, y = (distlab.tensor(xp.asarray(rng.standard_normal((4, 16), dtype=np.float32))) for _ in range(2))
        loss_fn = nn.MSELoss()
        for _ in range(2):
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        counts = {}
        xp.reset()
        opt.zero_grad()
        counts["zero_grad"] = xp.launch_total()
        loss = loss_fn(model(x), y)
        counts["forward"] = xp.launch_total() - sum(counts.values())
        loss.backward()
        counts["backward"] = xp.launch_total() - sum(counts.values())
        opt.step()
        counts["optimizer"] = xp.launch_total() - sum(counts.values())
    finally:
        xp.use_as_cuda(False)
    assert counts == AFTER, counts
    assert sum(counts.values()) == 7 * LAYERS + 9 < 12 * LAYERS  # before: 12 a layer with plain SGD, 24 and 34
    assert xp.launch_total(prefix="distlab.") == xp.launch_total()
    assert xp.round_trips(prefix="distlab.") == 0 and xp.transfers() == {}


def test_the_gpu_benchmarks_local_step_reports_the_stand_ins_launches():
    """``bench_gpu.py --device fake``'s local-step row carries the launches of one step of the library's path."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_gpu.py"
    spec = importlib.util.spec_from_file_location("_bench_gpu_for_launches", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    module, _ = bench.gpu_or_reason("fake")
    try:
        row = bench.local_step(module, layers=3, width=8, batch=2, steps=1, warmup=1)
    finally:
        xp.use_as_cuda(False)
    assert row["launches_per_step"] == 7 * 3 + 7 + 1 and row["torch_ms"] is None
