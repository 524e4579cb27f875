"""Distributed autograd on N workers (2-4): ids, context errors, known workers, cleanup everywhere, backward
across workers equal to the same graph run locally, remote engine errors, DistributedOptimizer.

``mixed`` as first argument: even ranks use the reference twin of the containers, odd ranks the core.
"""
import os
import sys
import threading

import numpy as np

if len(sys.argv) > 1 and sys.argv[1] == "mixed":
    os.environ["DISTLAB_IMPL"] = "reference" if int(os.environ["RANK"]) % 2 == 0 else "core"

import distlab.rpc as rpc
from distlab import distributed_autograd as dist_autograd
from distlab import nn, optim
from distlab.autograd import Tensor
from distlab.distributed_autograd import DistributedOptimizer, config, forward
from distlab._wire import RPC_KIND_CODES
from distlab.rpc.framing import call_payload as _call_payload
from distlab.errors import AutogradContextNotFoundError, DistAutogradError, DistBackwardError, RemoteError

from autograd_checks import Boom

K_CALL = RPC_KIND_CODES["call"]
rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
_done = threading.Event()
rng = np.random.default_rng(1234)  # same on every rank: every rank knows every weight
WEIGHTS = [rng.standard_normal((4, 4)) for _ in range(world)]
X0 = rng.standard_normal((3, 4))
W = Tensor(WEIGHTS[rank].copy(), requires_grad=True)  # this worker's own parameter
PARAM = nn.Parameter(np.arange(4.0))


def finish():
    _done.set()


def num_contexts():
    return dist_autograd.get_container().num_autograd_contexts()


def layer(x):
    """One stage: tanh(x @ W_rank)."""
    return (x @ W).tanh()


def chain(x, hops):
    """Apply this worker's layer, then forward to the next worker for ``hops`` more stages (nested RPC)."""
    y = layer(x)
    if hops == 0:
        return y
    return rpc.rpc_sync((rank + 1) % world, chain, (y, hops - 1))


def combine(x, a):
    """tanh((x + a) @ W): two received tensors feeding one graph."""
    return ((x + a) @ W).tanh()


def relay_combine(x, dst):
    """Stage here, then combine on worker dst (a second sender into dst's context)."""
    y = layer(x)
    return rpc.rpc_sync(dst, combine, (x, y))


@rpc.cheap
def cheap_layer(x):
    """Runs on the callee's listener thread (no pool hop), inside the caller's context."""
    return layer(x)


def set_inline_backward(flag):
    config.inline_backward = flag


def total(t):
    return float(t.data.sum())


def my_grad(context_id):
    return dist_autograd.get_gradients(context_id).get(W)


def context_state(context_id):
    ctx = dist_autograd.get_container().retrieve_context(context_id)
    return sorted(ctx.known_worker_ids()), len(ctx.send_functions()), len(ctx.recv_functions())


def ignore_and_return_constant(x):
    return Tensor(np.ones(2))  # does not require grad: the sender's send function gets no gradient path back


def boom_stage(x):
    return Boom.apply(x)


class FailingSGD(optim.SGD):
    def step(self, closure=None):
        raise ArithmeticError(f"step failed on worker {rank}")


def param_rref():
    return rpc.RRef(PARAM)


def local_chain_grads(hops):
    """The same chain computed in one process: gradients of every worker's weight."""
    ws = [Tensor(WEIGHTS[r].copy(), requires_grad=True) for r in range(world)]
    x = Tensor(X0.copy(), requires_grad=True)
    y = x
    for i in range(hops + 1):
        y = (y @ ws[i % world]).tanh()
    loss = (y * y).sum()
    loss.backward()
    return x.grad.data, [w.grad.data if w.grad is not None else None for w in ws]


info = rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_timeout=30)
container = dist_autograd.get_container()
assert container.worker_id == rank
impl = type(container).__module__
print(f"rank {rank} container {impl}")

if rank == 0:
    others = list(range(1, world))
    # -- ids, nesting, no context --------------------------------------------------------------------------
    with dist_autograd.context() as cid:
        assert cid >> 48 == 0 and container.current_context().context_id == cid
        try:
            with dist_autograd.context():
                raise AssertionError("nested context accepted")
        except DistAutogradError as exc:
            assert "Already have an autograd context id" in str(exc)
    assert container.current_context_id() == -1
    try:
        container.current_context()
        raise AssertionError("no-context accepted")
    except DistAutogradError as exc:
        assert "with distlab.distributed_autograd.context()" in str(exc)
    try:
        dist_autograd.get_gradients(cid)
        raise AssertionError("released context still found")
    except AutogradContextNotFoundError as exc:
        assert "Could not find autograd context" in str(exc)

    # -- invalid roots ----------------------------------------------------------------------------------------
    with dist_autograd.context() as cid:
        leaf = Tensor(np.ones(1), requires_grad=True)
        for roots, text in (([], "No tensors provided"), ([Tensor(np.ones(1))], "requires_grad not set"),
                            ([leaf * np.ones(2)], "not a scalar"), ([leaf], "valid gradient function")):
            try:
                dist_autograd.backward(cid, roots)
                raise AssertionError(f"bad roots accepted: {text}")
            except RuntimeError as exc:
                assert text in str(exc), exc
    try:
        dist_autograd.backward(cid, [leaf.sum()])
        raise AssertionError("backward on a released context")
    except AutogradContextNotFoundError:
        pass

    # -- backward without RPC equals local autograd; .grad untouched ----------------------------------------
    with dist_autograd.context() as cid:
        x = Tensor(X0.copy(), requires_grad=True)
        loss = ((x @ W).tanh() ** 2).sum()
        dist_autograd.backward(cid, [loss])
        grads = dist_autograd.get_gradients(cid)
        assert W.grad is None and x.grad is None
        xr, wr = Tensor(X0.copy(), requires_grad=True), Tensor(WEIGHTS[0].copy(), requires_grad=True)
        ((xr @ wr).tanh() ** 2).sum().backward()
        np.testing.assert_allclose(grads[W].data, wr.grad.data, rtol=1e-12)
        np.testing.assert_allclose(grads[x].data, xr.grad.data, rtol=1e-12)

    # -- known workers, with and without grad tensors; cleanup on every rank ---------------------------------
    with dist_autograd.context() as cid:
        for dst in others:
            rpc.rpc_sync(dst, np.add, (np.ones(2), 1))                       # no tensors at all
            rpc.rpc_sync(dst, total, (Tensor(X0),))                          # tensors without grad
        ctx = container.retrieve_context(cid)
        assert ctx.known_worker_ids() == set(others) and not ctx.send_functions()
        for dst in others:
            assert rpc.rpc_sync(dst, context_state, (cid,)) == ([0], 0, 0)
    assert [rpc.rpc_sync(dst, num_contexts) for dst in range(world)] == [0] * world

    assert dist_autograd.debug_info() == {"num_autograd_contexts": 0, "num_current_backward_passes": 0,
                                          "num_send_functions": 0, "num_recv_functions": 0,
                                          "num_releases_in_flight": 0}
    with dist_autograd.context() as cid:
        x = Tensor(X0.copy(), requires_grad=True)
        outs = [rpc.rpc_sync(dst, layer, (x,)) for dst in others]
        assert dist_autograd.debug_info() == {"num_autograd_contexts": 1, "num_current_backward_passes": 0,
                                              "num_send_functions": world - 1, "num_recv_functions": world - 1,
                                              "num_releases_in_flight": 0}
        ctx = container.retrieve_context(cid)
        assert ctx.known_worker_ids() == set(others)
        assert len(ctx.send_functions()) == world - 1 and len(ctx.recv_functions()) == world - 1
        for dst in others:
            assert rpc.rpc_sync(dst, context_state, (cid,)) == ([0], 1, 1)
        # sum of every worker's stage, backward across all of them
        loss = outs[0].sum()
        for out in outs[1:]:
            loss = loss + out.sum()
        dist_autograd.backward(cid, [loss])
        gx = dist_autograd.get_gradients(cid)[x].data
        xl = Tensor(X0.copy(), requires_grad=True)
        total = None
        wls = {}
        for dst in others:
            wls[dst] = Tensor(WEIGHTS[dst].copy(), requires_grad=True)
            s = (xl @ wls[dst]).tanh().sum()
            total = s if total is None else total + s
        total.backward()
        np.testing.assert_allclose(gx, xl.grad.data, rtol=1e-10)
        for dst in others:
            np.testing.assert_allclose(rpc.rpc_sync(dst, my_grad, (cid,)).data, wls[dst].grad.data, rtol=1e-10)
    assert [rpc.rpc_sync(dst, num_contexts) for dst in range(world)] == [0] * world

    # -- a chain of nested RPCs through every worker (and back to 0 on the last hop) equals local -------------
    hops = world  # 0 -> 1 -> ... -> world-1 -> 0: worker 0's weight used twice
    with dist_autograd.context() as cid:
        x = Tensor(X0.copy(), requires_grad=True)
        y = layer(x)
        y = rpc.rpc_sync(1 % world, chain, (y, hops - 1))
        loss = (y * y).sum()
        dist_autograd.backward(cid, [loss])
        gx_local, gw_local = local_chain_grads(hops)
        np.testing.assert_allclose(dist_autograd.get_gradients(cid)[x].data, gx_local, rtol=1e-10)
        np.testing.assert_allclose(my_grad(cid).data, gw_local[0], rtol=1e-10)
        for dst in others:
            np.testing.assert_allclose(rpc.rpc_sync(dst, my_grad, (cid,)).data, gw_local[dst], rtol=1e-10)
    assert [rpc.rpc_sync(dst, num_contexts) for dst in range(world)] == [0] * world, "nested chain leaked"

    # -- a diamond: x goes to 1 and (with 1's output) to the last worker, which 1 also calls -----------------
    last = world - 1
    with dist_autograd.context() as cid:
        x = Tensor(X0.copy(), requires_grad=True)
        a = rpc.rpc_sync(1, layer, (x,))
        b = rpc.rpc_sync(last, combine, (x, a))
        c = rpc.rpc_sync(1, relay_combine, (x, last)) if last != 1 else a
        loss = (b * b).sum() + a.sum() + (c * c).sum()
        dist_autograd.backward(cid, [loss])
        ws = {r: Tensor(WEIGHTS[r].copy(), requires_grad=True) for r in {1, last}}
        xl = Tensor(X0.copy(), requires_grad=True)
        al = (xl @ ws[1]).tanh()
        bl = ((xl + al) @ ws[last]).tanh()
        cl = ((xl + (xl @ ws[1]).tanh()) @ ws[last]).tanh() if last != 1 else al
        ((bl * bl).sum() + al.sum() + (cl * cl).sum()).backward()
        np.testing.assert_allclose(dist_autograd.get_gradients(cid)[x].data, xl.grad.data, rtol=1e-10)
        for r in sorted({1, last}):
            np.testing.assert_allclose(rpc.rpc_sync(r, my_grad, (cid,)).data, ws[r].grad.data, rtol=1e-10)
    assert [rpc.rpc_sync(dst, num_contexts) for dst in range(world)] == [0] * world

    # -- remote() and to_here() inside a context carry autograd metadata ----------------------------------------
    with dist_autograd.context() as cid:
        x = Tensor(X0.copy(), requires_grad=True)
        r = rpc.remote(1, layer, (x,))
        y = r.to_here()
        assert y.grad_fn is not None and container.retrieve_context(cid).known_worker_ids() == {1}
        dist_autograd.backward(cid, [(y * y).sum()])
        xl, wl = Tensor(X0.copy(), requires_grad=True), Tensor(WEIGHTS[1].copy(), requires_grad=True)
        yl = (xl @ wl).tanh()
        (yl * yl).sum().backward()
        np.testing.assert_allclose(dist_autograd.get_gradients(cid)[x].data, xl.grad.data, rtol=1e-10)
        np.testing.assert_allclose(rpc.rpc_sync(1, my_grad, (cid,)).data, wl.grad.data, rtol=1e-10)
        del r
    assert [rpc.rpc_sync(dst, num_contexts) for dst in range(world)] == [0] * world

    # -- a cheap (inline) function inside a context -------------------------------------------------------------
    with dist_autograd.context() as cid:
        x = Tensor(X0.copy(), requires_grad=True)
        y = rpc.rpc_sync(1, cheap_layer, (x,))
        dist_autograd.backward(cid, [y.sum()])
        xl, wl = Tensor(X0.copy(), requires_grad=True), Tensor(WEIGHTS[1].copy(), requires_grad=True)
        (xl @ wl).tanh().sum().backward()
        np.testing.assert_allclose(dist_autograd.get_gradients(cid)[x].data, xl.grad.data, rtol=1e-10)

    # -- self RPC inside a context ----------------------------------------------------------------------------
    with dist_autograd.context() as cid:
        x = Tensor(X0.copy(), requires_grad=True)
        y = rpc.rpc_sync(0, layer, (x,))
        dist_autograd.backward(cid, [(y * y).sum()])
        xl, wl = Tensor(X0.copy(), requires_grad=True), Tensor(WEIGHTS[0].copy(), requires_grad=True)
        yl = (xl @ wl).tanh()
        (yl * yl).sum().backward()
        np.testing.assert_allclose(dist_autograd.get_gradients(cid)[x].data, xl.grad.data, rtol=1e-10)
        np.testing.assert_allclose(my_grad(cid).data, wl.grad.data, rtol=1e-10)

    # -- the same chain with backward parts on the RPC thread pools (inline_backward off on every worker) -------
    for dst in range(world):
        rpc.rpc_sync(dst, set_inline_backward, (False,))
    with dist_autograd.context() as cid:
        x = Tensor(X0.copy(), requires_grad=True)
        y = rpc.rpc_sync(1 % world, chain, (layer(x), hops - 1))
        dist_autograd.backward(cid, [(y * y).sum()])
        np.testing.assert_allclose(dist_autograd.get_gradients(cid)[x].data, gx_local, rtol=1e-10)
        for dst in others:
            np.testing.assert_allclose(rpc.rpc_sync(dst, my_grad, (cid,)).data, gw_local[dst], rtol=1e-10)
    for dst in range(world):
        rpc.rpc_sync(dst, set_inline_backward, (True,))

    # -- retain_graph: two passes in one context accumulate; rpc_async inside a context -----------------------
    with dist_autograd.context() as cid:
        x = Tensor(X0.copy(), requires_grad=True)
        y = rpc.rpc_async(1, layer, (x,)).wait(30)
        loss = y.sum()
        dist_autograd.backward(cid, [loss], retain_graph=True)
        once = rpc.rpc_sync(1, my_grad, (cid,)).data.copy()
        dist_autograd.backward(cid, [loss])
        np.testing.assert_allclose(rpc.rpc_sync(1, my_grad, (cid,)).data, 2 * once, rtol=1e-12)

    # -- an unused send function (its receiver returns a constant) must neither hang nor drop gradients -------
    with dist_autograd.context() as cid:
        w = Tensor(np.full((3, 4), 0.5), requires_grad=True)
        h = w * 2.0                      # shared by the local loss and the RPC below
        rpc.rpc_sync(1, ignore_and_return_constant, (h,))
        loss = (h * h).sum()
        dist_autograd.backward(cid, [loss])
        np.testing.assert_allclose(dist_autograd.get_gradients(cid)[w].data, 8 * w.data, rtol=1e-12)

    # -- a remote engine error comes back naming the worker ---------------------------------------------------
    with dist_autograd.context() as cid:
        x = Tensor(X0.copy(), requires_grad=True)
        y = rpc.rpc_sync(world - 1, boom_stage, (x,))
        try:
            dist_autograd.backward(cid, [y.sum()])
            raise AssertionError("remote backward error swallowed")
        except DistBackwardError as exc:
            assert exc.worker_id == world - 1 and f"worker {world - 1}" in str(exc) and "boom in backward" in str(exc)
    assert [rpc.rpc_sync(dst, num_contexts) for dst in range(world)] == [0] * world, "failed pass leaked"

    # -- an RPC that outlives its context is refused, never re-creates (and leaks) the context ------------------
    with dist_autograd.context() as cid:
        rpc.rpc_sync(1, layer, (Tensor(X0, requires_grad=True),))
        late_meta = (cid, container.new_autograd_message_id(), 0)
    late = rpc.get_agent().send(1, K_CALL, _call_payload(forward.autograd_call,
                                                         (late_meta, layer, (Tensor(X0, requires_grad=True),), None),
                                                         None))
    try:
        late.wait(30)
        raise AssertionError("late RPC re-created its context")
    except RemoteError as exc:
        assert "outlived its context" in str(exc), exc
    assert rpc.rpc_sync(1, num_contexts) == 0

    # -- DistributedOptimizer: the update equals the local one ------------------------------------------------
    rrefs = [rpc.rpc_sync(dst, param_rref) for dst in range(world)]
    opt = DistributedOptimizer(optim.SGD, rrefs, lr=0.5)
    with dist_autograd.context() as cid:
        x = Tensor(np.ones(4), requires_grad=True)
        loss = None
        for r in rrefs:
            out = r.rpc_sync().__mul__(x)    # PARAM * x on the owner
            s = (out * out).sum()
            loss = s if loss is None else loss + s
        dist_autograd.backward(cid, [loss])
        opt.step(cid)
    for dst, r in enumerate(rrefs):
        # d/dp sum((p*x)^2) = 2 p x^2 = 2p: p - 0.5*2p = 0
        np.testing.assert_allclose(r.to_here().data, np.zeros(4), atol=1e-12)
    try:
        opt.step(cid)
        raise AssertionError("step on a released context accepted")
    except AutogradContextNotFoundError:
        pass
    try:
        DistributedOptimizer(optim.SGD, rrefs, lr=-1.0)
        raise AssertionError("bad optimizer arguments accepted")
    except RemoteError as exc:
        assert "Invalid learning rate" in str(exc)
    bad = DistributedOptimizer(FailingSGD, rrefs, lr=0.1)
    with dist_autograd.context() as cid:
        out = rrefs[-1].rpc_sync().__mul__(Tensor(np.ones(4), requires_grad=True))
        dist_autograd.backward(cid, [out.sum()])
        try:
            bad.step(cid)
            raise AssertionError("remote optimizer error swallowed")
        except RemoteError as exc:
            assert "step failed on worker" in str(exc) and exc.exc_type.endswith("ArithmeticError")
    del rrefs, opt, r, bad

    # -- concurrent contexts on two threads share worker 1; each gets its own gradients -------------------------
    results = {}

    def trainer(scale):
        with dist_autograd.context() as cid:
            x = Tensor(X0 * scale, requires_grad=True)
            y = rpc.rpc_sync(1, layer, (x,))
            dist_autograd.backward(cid, [(y * y).sum()])
            results[scale] = (dist_autograd.get_gradients(cid)[x].data, rpc.rpc_sync(1, my_grad, (cid,)).data)

    threads = [threading.Thread(target=trainer, args=(s,)) for s in (1.0, 2.0, 3.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for scale in (1.0, 2.0, 3.0):
        xl, wl = Tensor(X0 * scale, requires_grad=True), Tensor(WEIGHTS[1].copy(), requires_grad=True)
        yl = (xl @ wl).tanh()
        (yl * yl).sum().backward()
        np.testing.assert_allclose(results[scale][0], xl.grad.data, rtol=1e-10)
        np.testing.assert_allclose(results[scale][1], wl.grad.data, rtol=1e-10)
    assert [rpc.rpc_sync(dst, num_contexts) for dst in range(world)] == [0] * world
    for dst in others:
        rpc.rpc_sync(dst, finish)
    print(f"dist autograd OK on {world} workers")
else:
    assert _done.wait(90), "rank 0 never finished"
    assert num_contexts() == 0

rpc.shutdown()
print(f"rank {rank} done")
