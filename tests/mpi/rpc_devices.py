"""RPC and RRefs with device arrays on 2 workers, as PyTorch's CUDA RPC: device maps (init checks, refusals on the
caller), arguments and results rebuilt on the mapped device, ``remote`` / ``to_here``, distributed autograd across
the workers, each compared with the same seeded run on numpy.

Arguments: the twin (``reference``, ``core`` or ``mixed``: even ranks the reference, odd the core) and the device
module (``fake``: the strict stand-in ``distlab.fakegpu``, results bit-equal to numpy; ``cupy``: a real GPU,
float64 results within ``rtol=1e-12`` of numpy: cupy's matmul and reductions round differently).
"""
import os
import sys
import threading

import numpy as np

IMPL = sys.argv[1] if len(sys.argv) > 1 else "core"
DEVICE = sys.argv[2] if len(sys.argv) > 2 else "fake"
rank = int(os.environ["RANK"])
if IMPL == "mixed":
    os.environ["DISTLAB_IMPL"] = "reference" if rank % 2 == 0 else "core"

if DEVICE == "cupy":
    import cupy as xp
else:
    from distlab import fakegpu as xp

import distlab.rpc as rpc  # noqa: E402 - after DISTLAB_IMPL is chosen
from distlab import distributed_autograd as dist_autograd  # noqa: E402 - after DISTLAB_IMPL is chosen
from distlab.autograd import Tensor  # noqa: E402 - after DISTLAB_IMPL is chosen
from distlab.errors import RemoteError, RpcDeviceError  # noqa: E402 - after DISTLAB_IMPL is chosen
from distlab.rpc import RpcBackendOptions  # noqa: E402 - after DISTLAB_IMPL is chosen

from scenario_checks import expect  # noqa: E402 - after DISTLAB_IMPL is chosen

assert int(os.environ["WORLD_SIZE"]) == 2, "rpc_devices runs on 2 workers"
me, peer = f"w{rank}", f"w{1 - rank}"
COUNT = xp.cuda.runtime.getDeviceCount()
_done = threading.Event()
rng = np.random.default_rng(7)  # the same on both workers
X = rng.standard_normal((5, 4))
W1 = rng.standard_normal((4, 3))
BIG = rng.standard_normal(1 << 17)  # 1 MiB: several MPI messages, the Isend path
TOL = {"rtol": 0.0, "atol": 0.0} if DEVICE == "fake" else {"rtol": 1e-12, "atol": 1e-12}


def same(got, want, what):
    assert isinstance(got, xp.ndarray), (what, type(got))
    assert got.device.id == 0, (what, got.device)
    np.testing.assert_allclose(xp.asnumpy(got), want, err_msg=what, **TOL)


def finish():
    _done.set()


def on_device(a):
    assert isinstance(a, xp.ndarray) and a.device.id == 0, type(a)
    return a


def add_and_twice(a, b):
    on_device(a)
    return a + b, a * 2.0, {"n": int(a.shape[0]), "host": np.arange(3)}


def make_device(n):
    return xp.arange(n, dtype=xp.float64) * 0.5


def total(rref):
    return float(on_device(rref.local_value()).sum())


def layer(x):
    """tanh(x @ W1) with W1 on this worker's device when x is a device tensor."""
    w = Tensor(xp.asarray(W1) if isinstance(x.data, xp.ndarray) else W1.copy(), requires_grad=True)
    _weights.append(w)
    return (x @ w).tanh()


_weights = []


def weight_grad(context_id):
    return dist_autograd.get_gradients(context_id)[_weights[-1]]  # a Tensor, as torch's


def autograd_run(x):
    """Forward on w1, backward from w0: the gradients of x (here) and of W1 (on w1)."""
    with dist_autograd.context() as context_id:
        xt = Tensor(x, requires_grad=True)
        y = rpc.rpc_sync("w1", layer, (xt,))
        dist_autograd.backward(context_id, [(y * y).sum()])
        gx = dist_autograd.get_gradients(context_id)[xt]
        gw = rpc.rpc_sync("w1", weight_grad, (context_id,))
    return y.data, gx.data, gw.data


def init(options=None):
    return rpc.init_rpc(me, rpc_timeout=30, rpc_backend_options=options)


# 1. Device maps are checked at init_rpc: every worker raises the same error, naming what is wrong.
bad = {0: RpcBackendOptions(device_maps={"w1": {0: COUNT}})}
expect(RpcDeviceError, lambda: init(bad.get(rank)), f"cuda:{COUNT}", "device map for 'w1'",
       f"worker 'w1' sees {COUNT} device(s)")
expect(RpcDeviceError, lambda: init(RpcBackendOptions(device_maps={"nobody": {0: 0}}) if rank == 1 else None),
       "worker 'w1' has device maps for unknown workers ['nobody']")
expect(RpcDeviceError, lambda: init(RpcBackendOptions(devices=[0, 0]) if rank == 0 else None),
       "worker 'w0' has duplicated devices")
expect(RpcDeviceError, lambda: RpcBackendOptions(device_maps={"w1": {0: 0}}).set_device_map("w1", {0: 1}),
       "only supports 1-to-1 mapping, trying to map cuda:0 to cuda:1 and cuda:0")
assert not rpc.is_initialized()

# 2. No device map: a device array is refused on the sender, saying what to set; host arrays still travel.
init()
x = xp.asarray(X)
if rank == 0:
    expect(RpcDeviceError, lambda: rpc.rpc_sync("w1", on_device, (x,)), "a device array is on device cuda:0",
           "no device map is set for worker 'w1'", "set_device_map('w1'")
    expect(RpcDeviceError, lambda: rpc.rpc_async("w1", on_device, (x,)), "no device map is set for worker 'w1'")
    expect(RpcDeviceError, lambda: rpc.remote("w1", on_device, (x,)), "no device map is set for worker 'w1'")
    assert rpc.rref_debug_info()["num_pending_users"] == 0  # the refused remote left no RRef behind
    # a result on the device goes back through the inverse of the caller's map, which w0 did not set
    expect(RemoteError, lambda: rpc.rpc_sync("w1", make_device, (4,)), "is sent back to worker 'w0'",
           "worker 'w0' set no device map for worker 'w1'")
    held = rpc.remote("w1", make_device, (4,))
    expect(RemoteError, held.to_here, "is sent back to worker 'w0'")
    del held
    assert np.array_equal(rpc.rpc_sync("w1", np.add, (X, 1.0)), X + 1.0)
rpc.shutdown()

# 3. w0 maps its device 0 to w1's device 0 (w1 sets nothing): requests follow w0's map, responses its inverse.
init(RpcBackendOptions(device_maps={"w1": {"cuda:0": 0}}) if rank == 0 else None)
if rank == 0:
    a, twice, info = rpc.rpc_sync("w1", add_and_twice, (x, 1.5))
    same(a, X + 1.5, "rpc_sync result")
    same(twice, X * 2.0, "second result")
    assert info["n"] == 5 and isinstance(info["host"], np.ndarray)  # host arrays stay host arrays
    same(rpc.rpc_async("w1", on_device, (xp.asarray(BIG),)).wait(), BIG, "1 MiB argument and result")
    # remote: the owner builds the value on its device; to_here brings it back through the inverse map
    rref = rpc.remote("w1", make_device, (6,))
    same(rref.to_here(), np.arange(6) * 0.5, "RRef.to_here")
    # an argument of remote lands on the owner's device; an RRef to it travels as an argument
    held = rpc.remote("w1", on_device, (x,))
    np.testing.assert_allclose(rpc.rpc_sync("w1", total, (held,)), X.sum(), rtol=1e-12)
    del rref, held
    # distributed autograd: tensors forward over the map, gradients back along it; as on numpy
    y_dev, gx_dev, gw_dev = autograd_run(x)
    y_host, gx_host, gw_host = autograd_run(X.copy())
    assert all(isinstance(v, np.ndarray) for v in (y_host, gx_host, gw_host)), [type(v) for v in (y_host, gx_host, gw_host)]
    same(y_dev, y_host, "dist autograd forward")
    same(gx_dev, gx_host, "dist autograd gradient of the caller's input")
    same(gw_dev, gw_host, "dist autograd gradient of the callee's weight")
    rpc.rpc_sync("w1", finish)
else:
    # w1 set no map of its own: its requests with device arrays are refused (torch: maps are per direction)
    expect(RpcDeviceError, lambda: rpc.rpc_sync("w0", on_device, (xp.asarray(X),)),
           "no device map is set for worker 'w0'")
    assert _done.wait(120), "w0 never finished"
rpc.shutdown()
print(f"rpc devices OK ({IMPL}, {DEVICE})", flush=True)
