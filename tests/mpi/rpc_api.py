"""The rest of PyTorch's RPC API on 2 ranks: worker infos, the default timeout, functions.async_execution, RRef
proxies that check the method at the call, confirmed_by_owner/owner_name, RRef.backward (local and distributed).
Run with DISTLAB_TIMEOUT=77 (the default RPC timeout follows it) and DISTLAB_IMPL set to the twin under test."""
import os
import threading
import time

import numpy as np

import distlab.rpc as rpc
from distlab import distributed_autograd as dist_autograd
from distlab.autograd import Tensor
from distlab.errors import DistTimeoutError, RemoteError, RRefError
from distlab.futures import Future
from distlab.rpc import RRef, WorkerInfo, framing
from distlab.rpc.functions import async_execution
from scenario_checks import expect  # noqa: E402

rank = int(os.environ["RANK"])
assert int(os.environ["WORLD_SIZE"]) == 2
_done = threading.Event()


def finish():
    _done.set()


def add(a, b):
    return a + b


@async_execution
def add_later(to, x, y):
    """Answer with 2 * (x + y), computed by another call: no thread waits meanwhile."""
    return rpc.rpc_async(to, add, (x, y)).then(lambda f: 2 * f.value())


@async_execution
def not_a_future():
    return 3


def a_future():
    fut = Future()
    fut.set_result(1)
    return fut


@async_execution
def failing_later():
    fut = Future()
    fut.set_exception(KeyError("late failure"))
    return fut


class Counter:
    def __init__(self):
        self.n = 0

    def incr(self, k=1):
        self.n += k
        return self.n

    @async_execution
    def incr_later(self, k):
        fut = Future()
        fut.set_result(self.incr(k))
        return fut

    @staticmethod
    @async_execution
    def static_later(x):
        fut = Future()
        fut.set_result(x + 100)
        return fut


class Dynamic:
    def __getattr__(self, name):
        if name == "hello":
            return lambda: "hi"
        raise AttributeError(name)


def square_sum(x):
    return (x * x).sum()


def only_on_w0(x):   # worker 1's __main__ loses it below: calls to it carry its by-value copy
    return 2 * x


_copies_loaded = []


def copies_loaded():
    return len(_copies_loaded)


def forget_copies():   # as a restarted worker would have
    framing._received.clear()


if rank == 1:
    del only_on_w0
    _load = framing._load_by_value
    framing._load_by_value = lambda data: (_copies_loaded.append(1), _load(data))[1]

rpc.init_rpc(f"w{rank}")
assert rpc.get_rpc_timeout() == 77.0   # DISTLAB_TIMEOUT
if rank == 0:
    # -- worker infos (torch's get_worker_info(worker_name=None), and the list)
    assert rpc.get_worker_info() == WorkerInfo("w0", 0)
    assert rpc.get_worker_info(worker_name="w1") == WorkerInfo("w1", 1) == rpc.get_worker_info(1)
    assert rpc.get_worker_infos() == [WorkerInfo("w0", 0), WorkerInfo("w1", 1)]
    expect(ValueError, lambda: rpc.get_worker_info("nobody"), "unknown worker name 'nobody'")
    # -- the default timeout, settable
    rpc._set_rpc_timeout(0.3)
    assert rpc.get_rpc_timeout() == 0.3
    t0 = time.monotonic()
    expect(DistTimeoutError, lambda: rpc.rpc_sync(1, time.sleep, (2.0,)), "within 0.3 s")
    assert time.monotonic() - t0 < 1.5
    expect(ValueError, lambda: rpc._set_rpc_timeout(-1), "number of seconds")
    rpc._set_rpc_timeout(77)
    time.sleep(2.0)  # let the slow call end on worker 1
    # -- async_execution
    assert rpc.rpc_sync(1, add_later, (0, 2, 3)) == 10
    assert rpc.rpc_async(1, add_later, (1, 1, 1)).wait(10) == 4
    assert rpc.remote(1, add_later, (0, 4, 4)).to_here() == 16
    assert rpc.rpc_sync(1, Counter.static_later, (1,)) == 101
    exc = expect(RemoteError, lambda: rpc.rpc_sync(1, failing_later), "late failure")
    assert isinstance(exc.remote_exception, KeyError)
    expect(RemoteError, lambda: rpc.rpc_sync(1, not_a_future), "decorated with @async_execution but returned int")
    expect(RemoteError, lambda: rpc.rpc_sync(1, a_future), "decorate it with @distlab.rpc.functions.async_execution")
    expect(RemoteError, lambda: rpc.remote(1, a_future).to_here(), "decorate it with")
    # -- proxies: the method is checked against the value's type at the call
    counter = rpc.remote(1, Counter)
    assert counter.rpc_sync().incr(2) == 2
    assert counter.rpc_async().incr(3).wait(10) == 5
    assert counter.remote().incr().to_here() == 6
    assert counter.rpc_sync().incr_later(10) == 16          # an @async_execution method
    assert counter.rpc_async().incr_later(1).wait(10) == 17
    assert counter.confirmed_by_owner() and counter.owner_name() == "w1" and not counter.is_owner()
    for proxy in (counter.rpc_sync(), counter.rpc_async(), counter.remote()):
        exc = expect(AttributeError, lambda: proxy.nosuch(1), "'Counter' object has no attribute 'nosuch'", "w1")
        assert not isinstance(exc, RemoteError)
    local = RRef(Counter())
    assert local.rpc_sync().incr(5) == 5 and local.owner_name() == "w0" and local.confirmed_by_owner()
    expect(AttributeError, lambda: local.rpc_sync().nosuch(), "no attribute 'nosuch'")
    dynamic = rpc.remote(1, Dynamic)                           # __getattr__: not checked here, asked there
    assert dynamic.rpc_sync().hello() == "hi"
    expect(RemoteError, lambda: dynamic.rpc_sync().nosuch(), "AttributeError")
    # -- backward: local on the owner, distributed through a context, errors
    x = Tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
    RRef(square_sum(x)).backward()
    assert np.array_equal(x.grad.data if hasattr(x.grad, "data") else x.grad, [2.0, 4.0, 6.0]), x.grad
    expect(TypeError, lambda: RRef(3).backward(), "RRef should contain a tensor")
    with dist_autograd.context() as ctx:
        x2 = Tensor(np.array([1.0, -1.0]), requires_grad=True)
        loss = rpc.remote(1, square_sum, (x2,))
        expect(RRefError, lambda: loss.backward(), "require 'dist_autograd_ctx_id'")
        loss.backward(ctx)
        grads = dist_autograd.get_gradients(ctx)
        assert np.array_equal(np.asarray(grads[x2]), [2.0, -2.0]), grads
    expect(RemoteError, lambda: rpc.remote(1, int, (3,)).backward(ctx), "RRef should contain a tensor")
    # -- a __main__ function worker 1 lacks: its by-value copy travels once per worker, until answered
    loaded = rpc.rpc_sync(1, copies_loaded)   # (by-value loads so far there: lambdas' too)
    assert [rpc.rpc_sync(1, only_on_w0, (i,)) for i in range(3)] == [0, 2, 4]
    assert [f.wait(10) for f in [rpc.rpc_async("w1", only_on_w0, (i,)) for i in range(3)]] == [0, 2, 4]
    assert rpc.remote(1, only_on_w0, (5,)).to_here() == 10
    assert rpc.rpc_sync(1, copies_loaded) == loaded + 1
    rpc.rpc_sync(1, forget_copies)   # worker 1 has not seen the copy: a clear error, no hang
    expect(RemoteError, lambda: rpc.rpc_sync(1, only_on_w0, (1,)), "'only_on_w0' is not defined in this worker's "
           "__main__", "has not reached this worker")
    assert rpc.rpc_async(1, only_on_w0, (4,)).wait(10) == 8   # after an error answer, the copy travels again
    assert rpc.rpc_sync(1, only_on_w0, (5,)) == 10 and rpc.rpc_sync(1, copies_loaded) == loaded + 2
    rpc.rpc_sync(1, finish)
else:
    assert _done.wait(90), "rank 0 never finished"
rpc.shutdown()
print(f"rpc api OK rank {rank}", flush=True)
