"""The distributed engine in one process, over each container twin: dependencies from roots and send functions,
gradients into the context, recv groups (always answer, silent when unreachable), errors; the twins give
bit-identical gradients and identical outgoing gradient messages."""
from __future__ import annotations

import os

import numpy as np
import pytest

from distlab.distributed_autograd import engine
from distlab.autograd import Tensor
from distlab.errors import DistAutogradError


def _leaf(seed, shape=(3, 4)):
    return Tensor(np.random.default_rng(seed).standard_normal(shape), requires_grad=True)


def _run(ctx, roots, pass_id=1, retain=False):
    task, created, silent = engine.task_for(ctx, pass_id, retain, [r.grad_fn for r in roots])
    sends = engine.execute(task, ctx, [(r.grad_fn, np.ones_like(r.data)) for r in roots])
    task.check_finished()  # the facade does this after sending the gradients
    return task, created, silent, sends


def test_local_backward_into_the_context(autograd_container):
    ctx = autograd_container.DistAutogradContext(1)
    x, w = _leaf(0), _leaf(1, (4, 2))
    loss = ((x @ w).tanh() * 3.0).sum()
    task, created, silent, sends = _run(ctx, [loss])
    assert created and silent == [] and sends == [] and task.finished.done()
    grads = ctx.get_gradients()
    assert x.grad is None and w.grad is None
    xr, wr = Tensor(x.data.copy(), requires_grad=True), Tensor(w.data.copy(), requires_grad=True)
    ((xr @ wr).tanh() * 3.0).sum().backward()
    np.testing.assert_array_equal(grads[x].data, xr.grad.data)  # same order of operations: bit-identical
    np.testing.assert_array_equal(grads[w].data, wr.grad.data)
    again, created2, _ = engine.task_for(ctx, 1, False)
    assert again is task and not created2


def _simulated_pair(ac):
    """Worker A sends h = 2w to worker B (in this process) which returns tanh(h @ v); A's loss uses both."""
    ctx_a, ctx_b = ac.DistAutogradContext(7), ac.DistAutogradContext(7)
    w, v = _leaf(2), _leaf(3, (4, 4))
    h = w * 2.0
    send_a = engine.SendRpcBackward((h.grad_fn,), 100, 1)
    ctx_a.add_send_function(send_a, 100)
    h_b = Tensor(h.data.copy(), requires_grad=True)  # what B unpickles
    group_b = engine.RecvRpcGroup(100, 0, 1)
    h_b.grad_fn = engine.RecvRpcBackward(group_b, 0)
    ctx_b.add_recv_function(group_b, 100)
    out_b = (h_b @ v).tanh()
    send_b = engine.SendRpcBackward((out_b.grad_fn,), 200, 0)
    ctx_b.add_send_function(send_b, 200)
    out_a = Tensor(out_b.data.copy(), requires_grad=True)
    group_a = engine.RecvRpcGroup(200, 1, 1)
    out_a.grad_fn = engine.RecvRpcBackward(group_a, 0)
    ctx_a.add_recv_function(group_a, 200)
    loss = (out_a * out_a).sum() + (h * h).sum()
    return ctx_a, ctx_b, w, v, loss


def _exchange(ac):
    ctx_a, ctx_b, w, v, loss = _simulated_pair(ac)
    task_a, _, silent_a, sends = _run(ctx_a, [loss], pass_id=9)
    assert silent_a == [] and [(dst, mid) for dst, mid, _g in sends] == [(1, 200)]
    assert not task_a.finished.done()  # h's node waits for the gradient coming back through send 100
    assert sorted(task_a.sends_left) == [100]
    task_b, created, silent_b = engine.task_for(ctx_b, 9, False)
    assert created and silent_b == []
    ctx_b.retrieve_send_function(200).set_grads(sends[0][2])
    sends_b = engine.execute(task_b, ctx_b, [(ctx_b.retrieve_send_function(200), None)])
    task_b.check_finished()
    assert task_b.finished.done() and [(dst, mid) for dst, mid, _g in sends_b] == [(0, 100)]
    ctx_a.retrieve_send_function(100).set_grads(sends_b[0][2])
    assert engine.execute(task_a, ctx_a, [(ctx_a.retrieve_send_function(100), None)]) == []
    task_a.check_finished()
    assert task_a.finished.done()
    return ctx_a, ctx_b, w, v, [sends, sends_b]


def test_send_recv_across_simulated_workers_equals_local(autograd_container):
    ctx_a, ctx_b, w, v, _ = _exchange(autograd_container)
    wl, vl = Tensor(w.data.copy(), requires_grad=True), Tensor(v.data.copy(), requires_grad=True)
    hl = wl * 2.0
    outl = (hl @ vl).tanh()
    ((outl * outl).sum() + (hl * hl).sum()).backward()
    np.testing.assert_allclose(ctx_a.get_gradients()[w].data, wl.grad.data, rtol=1e-13)
    np.testing.assert_allclose(ctx_b.get_gradients()[v].data, vl.grad.data, rtol=1e-13)
    assert w.grad is None and v.grad is None


def test_twins_give_identical_gradients_and_messages():
    from distlab import _backend
    if not _backend.core_available():
        (pytest.fail if os.environ.get("CI", "").lower() in ("1", "true", "yes") else pytest.skip)(
            "the core twin is not compiled")

    results = {}
    for impl, module in _backend.load_twins("autograd_container").items():
        ctx_a, ctx_b, w, v, messages = _exchange(module)
        grads = [ctx_a.get_gradients()[w].data, ctx_b.get_gradients()[v].data]
        trace = [[(dst, mid, [g.tobytes() for g in gs]) for dst, mid, gs in batch] for batch in messages]
        results[impl] = ([g.tobytes() for g in grads], trace)
    assert results["reference"] == results["core"]


def test_unreachable_recv_group_is_silent_and_unused_inputs_answer_none(autograd_container):
    ctx = autograd_container.DistAutogradContext(3)
    a, b = Tensor(np.ones(2), requires_grad=True), Tensor(np.ones(2), requires_grad=True)
    used = engine.RecvRpcGroup(5, 2, 2)
    a.grad_fn, b.grad_fn = engine.RecvRpcBackward(used, 0), engine.RecvRpcBackward(used, 1)
    ctx.add_recv_function(used, 5)
    c = Tensor(np.ones(2), requires_grad=True)
    unused = engine.RecvRpcGroup(6, 1, 1)
    c.grad_fn = engine.RecvRpcBackward(unused, 0)
    ctx.add_recv_function(unused, 6)
    loss = (a * 3.0).sum()  # b and c received but unused
    task, _, silent, sends = _run(ctx, [loss])
    assert silent == [unused]  # no root or send function reaches c: answer "no gradient" at once
    # b is unreachable too, but a's group answers when its reachable nodes ran: None for b, no zeros made
    assert len(sends) == 1 and sends[0][:2] == (2, 5)
    np.testing.assert_array_equal(sends[0][2][0], [3.0, 3.0])
    assert sends[0][2][1] is None


def test_engine_errors(autograd_container):
    from mpi.autograd_checks import Boom  # the scenario scripts' failing Function (tests/mpi)

    ctx = autograd_container.DistAutogradContext(4)
    loss = Boom.apply(_leaf(5)).sum()
    with pytest.raises(ValueError, match="boom"):
        _run(ctx, [loss])
    send = engine.SendRpcBackward((None, None), 1, 0)
    with pytest.raises(ValueError, match="got 1 gradients for 2 tensors"):
        send.set_grads([None])
    with pytest.raises(DistAutogradError, match="Could not find send function for autograd message id 77"):
        ctx.retrieve_send_function(77)
    # a second pass without retain_graph through freed nodes fails like the local engine
    ctx2 = autograd_container.DistAutogradContext(5)
    x = _leaf(6)
    loss = (x * x).sum()
    _run(ctx2, [loss], pass_id=1)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        _run(ctx2, [loss], pass_id=2)


def test_tensors_pickle_as_data_and_requires_grad():
    import pickle

    from distlab.distributed_autograd import forward  # noqa: F401 - registers the pickling
    from distlab.nn import Parameter

    x = _leaf(7)
    y = (x * 2.0).tanh()  # a non-leaf: its graph must not travel
    z = pickle.loads(pickle.dumps(y))
    assert type(z) is Tensor and z.requires_grad and z.grad_fn is None and z.is_leaf
    np.testing.assert_array_equal(z.data, y.data)
    c = pickle.loads(pickle.dumps(Tensor(np.ones(2))))
    assert not c.requires_grad
    p = pickle.loads(pickle.dumps(Parameter(np.ones(3))))
    assert type(p) is Parameter and p.requires_grad


def test_call_wrapper_leaves_calls_outside_a_context_alone(autograd_container):
    from distlab.distributed_autograd import forward

    assert forward.wrap_call(1, print, (), None) is None


def test_queue_callback_runs_when_this_workers_part_is_over(autograd_container):
    from distlab.autograd import queue_callback

    ctx_a, ctx_b, w, v, loss = _simulated_pair(autograd_container)
    ran = []
    w.register_hook(lambda g: queue_callback(lambda: ran.append(len(ran))) and None)
    task_a, _, _, sends = _run(ctx_a, [loss], pass_id=3)
    assert ran == [] and not task_a.finished.done()  # w's first gradient arrived, the send function has not run
    task_b, _, _ = engine.task_for(ctx_b, 3, False)
    ctx_b.retrieve_send_function(200).set_grads(sends[0][2])
    sends_b = engine.execute(task_b, ctx_b, [(ctx_b.retrieve_send_function(200), None)])
    task_b.check_finished()
    ctx_a.retrieve_send_function(100).set_grads(sends_b[0][2])
    engine.execute(task_a, ctx_a, [(ctx_a.retrieve_send_function(100), None)])
    assert ran == []
    task_a.check_finished()
    assert ran == [0] and task_a.finished.done()
    task_a.check_finished()
    assert ran == [0]  # once


def test_failing_callback_fails_the_part(autograd_container):
    from distlab.autograd import queue_callback

    ctx = autograd_container.DistAutogradContext(8)
    x = _leaf(9)

    def boom():
        raise KeyError("callback")

    x.register_hook(lambda g: queue_callback(boom) and None)
    task, _, _, _ = _run(ctx, [(x * 2.0).sum()])
    with pytest.raises(KeyError, match="callback"):
        task.finished.value()
