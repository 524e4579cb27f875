"""The engine: dependency order, AccumulateGrad, hooks, queue_callback, errors, graph walks, run_backward."""
from __future__ import annotations

import sys

import numpy as np
import pytest

import distlab
from distlab import autograd as ag
from distlab import nn


def leaf(*shape, seed=0):
    return distlab.tensor(np.random.default_rng(seed).standard_normal(shape), requires_grad=True)


def mlp(depth=3, width=4):
    distlab.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width, dtype=np.float64) for _ in range(depth)])


def test_leaf_used_twice_gets_one_summed_gradient_and_one_hook_call():
    x = leaf(3)
    calls = []
    x.register_post_accumulate_grad_hook(lambda t: calls.append(t.grad.data.copy()))
    (x * x + x).sum().backward()
    np.testing.assert_allclose(x.grad.data, 2 * x.data + 1)
    assert len(calls) == 1
    np.testing.assert_allclose(calls[0], 2 * x.data + 1)


def test_a_gradient_delivered_by_hand_runs_the_post_accumulate_grad_hooks_in_order():
    x = leaf(3)
    seen = []
    x.register_post_accumulate_grad_hook(lambda t: seen.append(("first", t)))
    handle = x.register_post_accumulate_grad_hook(lambda t: seen.append(("second", t)))
    ag.run_post_accumulate_grad_hooks(x)
    assert seen == [("first", x), ("second", x)]
    handle.remove()
    ag.run_post_accumulate_grad_hooks(x)
    ag.run_post_accumulate_grad_hooks(leaf(2))  # no hooks: nothing to run
    assert seen == [("first", x), ("second", x), ("first", x)]


def test_gradients_accumulate_across_backward_calls():
    x = leaf(3)
    (x * 2).sum().backward()
    (x * 3).sum().backward()
    np.testing.assert_allclose(x.grad.data, 5.0)


def test_first_gradient_is_a_private_copy():
    a, b = leaf(3), leaf(3, seed=1)
    (a + b).backward(np.ones(3))  # AddBackward hands the same array to both leaves
    assert not np.shares_memory(a.grad.data, b.grad.data)
    a.grad.data[...] = 7.0
    np.testing.assert_allclose(b.grad.data, 1.0)
    g = np.full(3, 2.0)
    c = leaf(3)
    (c + 0.0).backward(g)
    assert not np.shares_memory(c.grad.data, g)


def test_gradient_seen_by_a_hook_is_never_stored_as_grad():
    x = leaf(3)
    kept = []
    y = x + 0.0  # AddBackward passes the gradient array through unchanged
    y.register_hook(lambda g: kept.append(g))
    (y * 2).sum().backward()
    assert not np.shares_memory(x.grad.data, kept[0].data)
    w = leaf(2, 2)
    w.register_hook(lambda g: kept.append(g))
    (w @ np.ones((2, 1))).sum().backward()
    assert not np.shares_memory(w.grad.data, kept[-1].data)


def test_fresh_gradient_is_stored_without_a_copy_as_torch_steals_it():
    distlab.manual_seed(0)
    lin = nn.Linear(3, 2)
    seen = []
    lin.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.data))
    lin(distlab.tensor(np.ones((4, 3), dtype=np.float32))).sum().backward()
    assert lin.weight.grad.data is seen[0] and lin.weight.grad.data.flags.c_contiguous
    assert lin.weight.grad.dtype == np.float32


def test_a_second_gradient_is_added_in_place_into_an_array_only_the_engine_holds(xp, monkeypatch):
    """``a`` receives two fresh gradients: the second is added into the first (no new array, as torch's
    InputBuffer steals it); one shared with another edge (``x + x`` passes the same array twice) is not."""
    from distlab.autograd import engine

    adds = []
    monkeypatch.setattr(engine, "add_grads", lambda p, g: adds.append(1) or p + g)
    data = np.array([[0.5, -1.25], [2.0, 0.75]], np.float32)
    x = distlab.tensor(xp.asarray(data), requires_grad=True)
    a = x * 3.0
    ((a * 2.0 + a * 5.0) * 1.0).sum().backward()
    assert adds == [] and ag.to_numpy(x.grad.data).tolist() == [[21.0, 21.0], [21.0, 21.0]]  # (2 + 5) * 3
    y = distlab.tensor(xp.asarray(data), requires_grad=True)
    (y + y).sum().backward()
    assert adds == [1] and ag.to_numpy(y.grad.data).tolist() == [[2.0, 2.0], [2.0, 2.0]]


def test_post_accumulate_hooks_fire_once_per_leaf_in_ready_order():
    model = mlp(depth=3)
    order = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda t, name=name: order.append(name))
    x = distlab.tensor(np.ones((2, 4)))
    for _ in range(2):
        order.clear()
        model(x).sum().backward()
        # the last layer's gradients are ready first; every parameter exactly once
        assert order == ["2.weight", "2.bias", "1.weight", "1.bias", "0.weight", "0.bias"]


def test_accumulate_grad_runs_as_soon_as_ready():
    w1, w2 = leaf(4, 4), leaf(4, 4, seed=1)
    events = []
    w2.register_post_accumulate_grad_hook(lambda t: events.append("w2 ready"))
    h = distlab.tensor(np.ones((1, 4))) @ w1
    h.register_hook(lambda g: events.append("backward reached h"))
    (h @ w2).sum().backward()
    assert events == ["w2 ready", "backward reached h"]


def test_register_hook_can_replace_gradient_and_be_removed():
    x = leaf(3)
    handle = x.register_hook(lambda g: g * 10)
    (x * 2).sum().backward()
    np.testing.assert_allclose(x.grad.data, 20.0)
    handle.remove()
    x.grad = None
    (x * 2).sum().backward()
    np.testing.assert_allclose(x.grad.data, 2.0)


def test_hook_on_non_leaf_changes_upstream_gradient():
    x = leaf(3)
    y = x * 3
    seen = []
    y.register_hook(lambda g: seen.append(g.data.copy()) or g * 0.5)
    y.sum().backward()
    np.testing.assert_allclose(seen[0], 1.0)
    np.testing.assert_allclose(x.grad.data, 1.5)


def test_retain_grad_on_non_leaf():
    x = leaf(3)
    y = x * 3
    y.retain_grad()
    (y * 2).sum().backward()
    np.testing.assert_allclose(y.grad.data, 2.0)


def test_queue_callback_runs_after_all_hooks_once():
    model = mlp(depth=2)
    log = []

    def hook(p):
        log.append("hook")
        if log.count("hook") == 1:
            ag.queue_callback(lambda: log.append("final"))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    model(distlab.tensor(np.ones((2, 4)))).sum().backward()
    assert log == ["hook"] * 4 + ["final"]


def test_queue_callback_from_a_callback_and_outside_backward():
    x = leaf(2)
    log = []
    x.register_post_accumulate_grad_hook(
        lambda t: ag.queue_callback(lambda: (log.append(1), ag.queue_callback(lambda: log.append(2)))))
    x.sum().backward()
    assert log == [1, 2]
    assert not ag.is_backward_running()
    with pytest.raises(RuntimeError, match="only be called during a backward pass"):
        ag.queue_callback(lambda: None)


def test_backward_twice_through_freed_graph():
    x = leaf(3)
    y = (x * x).sum()
    y.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time.*retain_graph=True"):
        y.backward()
    z = (x * x).sum()
    z.backward(retain_graph=True)
    z.backward()
    np.testing.assert_allclose(x.grad.data, 3 * 2 * x.data)


def test_backward_errors_are_clear():
    x = leaf(2, 3)
    with pytest.raises(RuntimeError, match="implicitly created only for scalar outputs"):
        (x * 2).backward()
    with pytest.raises(RuntimeError, match="Mismatch in shape"):
        (x * 2).backward(np.ones((3, 2)))
    with pytest.raises(RuntimeError, match="does not require grad"):
        distlab.tensor([1.0, 2.0]).sum().backward()


def test_sparse_gradient_accumulates_in_place_into_a_dense_grad():
    w = leaf(4, 2)
    w.grad = distlab.Tensor(np.zeros((4, 2)))
    bucket_view = w.grad.data
    ag.run_backward([w], [ag.SparseGrad(np.array([1, 1]), np.ones((2, 2)), (4, 2))])
    assert w.grad.data is bucket_view
    np.testing.assert_allclose(bucket_view[1], 2.0)


def test_backward_runs_with_grad_mode_off():
    x = leaf(2)
    modes = []
    x.register_post_accumulate_grad_hook(lambda t: modes.append(ag.is_grad_enabled()))
    (x * 2).sum().backward()
    assert modes == [False] and ag.is_grad_enabled()


def test_deep_chain_does_not_recurse():
    x = leaf(4)
    y = x
    for _ in range(3 * sys.getrecursionlimit()):
        y = y * 1.0
    y.sum().backward()
    np.testing.assert_allclose(x.grad.data, 1.0)


def test_no_grad_records_nothing():
    x = leaf(3)
    with distlab.no_grad():
        y = x * 2
    assert y.grad_fn is None and not y.requires_grad and y.is_leaf

    @distlab.no_grad()
    def f(t):
        return t + 1

    assert f(x).grad_fn is None
    with distlab.no_grad():
        with distlab.enable_grad():
            assert (x * 2).requires_grad


def test_detach_and_leaf_flags():
    x = leaf(3)
    y = x * 2
    assert x.is_leaf and not y.is_leaf and y.grad_fn.name() == "MulBackward"
    d = y.detach()
    assert d.is_leaf and not d.requires_grad and np.shares_memory(d.data, y.data)
    assert x.numel() == 3 and x.size() == (3,) and x.size(0) == 3 and x.numpy() is x.data


def test_graph_walk_and_leaves_find_unused_parameters():
    distlab.manual_seed(0)
    used, unused = nn.Linear(4, 4), nn.Linear(4, 4)
    out = used(distlab.tensor(np.ones((1, 4), dtype=np.float32))).sum()
    leaves = ag.graph_leaves([out])
    assert leaves == {used.weight, used.bias} == ag.graph_leaves(out)
    assert not ({unused.weight, unused.bias} & leaves)
    names = [n.name() for n in ag.walk_graph([out])]
    assert names[:2] == ["SumBackward", "LinearBackward"] and names.count("AccumulateGrad") == 2
    nexts = out.grad_fn.next_functions
    assert nexts[0][0] is out.grad_fn.next_nodes[0] and nexts[0][1] == 0


def test_run_backward_from_a_node_with_a_sink():
    x, w = leaf(2, 3), leaf(3, 3, seed=1)
    h = x @ w
    out = h.tanh()
    got = {}
    fired = []
    w.register_post_accumulate_grad_hook(lambda t: fired.append(t))
    ag.run_backward([out.grad_fn], [np.ones((2, 3))], retain_graph=True,
                    accumulate=lambda t, g: got.__setitem__(id(t), g))
    assert x.grad is None and w.grad is None and not fired
    out.backward(np.ones((2, 3)))
    np.testing.assert_allclose(got[id(x)], x.grad.data)
    np.testing.assert_allclose(got[id(w)], w.grad.data)


def test_run_backward_with_several_roots():
    x = leaf(3)
    a = x * 2
    b = a * 3  # b depends on a: a must wait for b's contribution
    ag.run_backward([a, b], [np.ones(3), np.ones(3)])
    np.testing.assert_allclose(x.grad.data, 2 + 6)


def test_autograd_grad_leaves_dot_grad_alone():
    x, y = leaf(3), leaf(3, seed=1)
    gx, gy = ag.grad((x * y).sum(), [x, y])
    np.testing.assert_allclose(gx.data, y.data)
    np.testing.assert_allclose(gy.data, x.data)
    assert x.grad is None
    with pytest.raises(RuntimeError, match="not have been used"):
        ag.grad((x * 2).sum(), [x, y])


def test_custom_nodes_as_send_and_recv_functions():
    """A distributed engine's send/recv functions are Nodes at the edges of the local graph."""
    received = []

    class RecvBackward(ag.Node):  # stands for "a tensor that came from another worker"
        __slots__ = ()

        def apply(self, grad):
            received.append(grad)  # a real one would send this gradient back to the sender
            return ()

    class SendBackward(ag.Node):  # a root: the engine starts here with a gradient that arrived from afar
        __slots__ = ()

        def apply(self, grad):
            return (grad,)

    z = distlab.Tensor._wrap(np.ones(3), RecvBackward(()))
    (z * 5).sum().backward()
    np.testing.assert_allclose(received[0], 5.0)

    x = leaf(3)
    y = x * 2
    send = SendBackward((y.grad_fn,))
    ag.run_backward([send], [np.full(3, 0.5)])
    np.testing.assert_allclose(x.grad.data, 1.0)


def test_grad_mode_and_backward_state_are_per_thread():
    import threading

    x = leaf(2)
    seen = {}

    def worker():
        seen["grad_enabled"] = ag.is_grad_enabled()
        y = (x * 3).sum()
        y.backward()
        seen["backward_running"] = ag.is_backward_running()

    with distlab.no_grad():
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert seen == {"grad_enabled": True, "backward_running": False}
    np.testing.assert_allclose(x.grad.data, 3.0)


# -- gradient buffers: a leaf's first gradient computed in place (what DDP's bucket views use) ---------------------
def _buffered(model):
    """Give every parameter a buffer full of NaN; return them in parameter order."""
    buffers = [np.full(p.data.shape, np.nan, p.data.dtype) for p in model.parameters()]
    for p, buffer in zip(model.parameters(), buffers):
        ag.accumulate_grad.set_grad_buffer(p, buffer)
    return buffers


def _plain_grads(model, run):
    for p in model.parameters():
        p.grad = None
    run()
    grads = [p.grad.data.copy() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return grads


def test_linear_computes_the_first_gradient_into_the_buffer_bit_for_bit():
    model = mlp()
    x = distlab.tensor(np.random.default_rng(1).standard_normal((5, 4)))
    expected = _plain_grads(model, lambda: model(x).tanh().sum().backward())
    buffers = _buffered(model)
    delivered = {}
    for p in model.parameters():  # what the reducer's hook sees: the buffer itself, already holding the gradient
        p.register_post_accumulate_grad_hook(lambda t: delivered.__setitem__(id(t), t.grad.data))
    model(x).tanh().sum().backward()
    for p, buffer, grad in zip(model.parameters(), buffers, expected):
        assert p.grad.data is buffer and delivered[id(p)] is buffer
        assert np.array_equal(buffer, grad)


def test_a_second_gradient_accumulates_as_usual():
    model = mlp()
    x = distlab.tensor(np.ones((2, 4)))
    once = _plain_grads(model, lambda: model(x).sum().backward())
    buffers = _buffered(model)
    model(x).sum().backward()
    model(x).sum().backward()  # .grad is the buffer now: the second gradient is added into it
    for p, buffer, grad in zip(model.parameters(), buffers, once):
        assert p.grad.data is buffer
        np.testing.assert_allclose(buffer, 2 * grad)


def test_a_leaf_used_twice_gets_the_sum_whichever_producer_took_the_buffer():
    distlab.manual_seed(0)
    layer = nn.Linear(4, 4, dtype=np.float64)
    x = distlab.tensor(np.random.default_rng(2).standard_normal((3, 4)))
    expected = _plain_grads(layer, lambda: layer(layer(x).tanh()).sum().backward())
    _buffered(layer)
    layer(layer(x).tanh()).sum().backward()
    for p, grad in zip(layer.parameters(), expected):
        np.testing.assert_allclose(p.grad.data, grad, rtol=1e-12)
    layer.weight.grad = layer.bias.grad = None
    layer(layer(x).tanh()).sum().backward()  # the claim did not outlive the pass
    for p, grad in zip(layer.parameters(), expected):
        np.testing.assert_allclose(p.grad.data, grad, rtol=1e-12)


def test_a_tensor_hook_or_a_sink_keeps_the_gradient_out_of_the_buffer():
    model = mlp(depth=1)
    x = distlab.tensor(np.ones((2, 4)))
    expected = _plain_grads(model, lambda: model(x).sum().backward())
    buffers = _buffered(model)
    shown = []
    model[0].weight.register_hook(lambda g: shown.append(g))  # a hook may keep what it was shown
    model(x).sum().backward()
    assert model[0].weight.grad.data is not buffers[0] and np.isnan(buffers[0]).all()
    assert shown[0].data is not buffers[0]
    assert model[0].bias.grad.data is buffers[1]
    np.testing.assert_allclose(model[0].weight.grad.data, expected[0])
    model[0].bias.grad = None
    got = {}
    out = model(x).sum()
    ag.run_backward([out], [np.ones(())], accumulate=lambda t, g: got.__setitem__(id(t), g))
    assert got[id(model[0].bias)] is not buffers[1]  # a distributed autograd context keeps its own arrays
    assert model[0].bias.grad is None


def test_embedding_and_mismatched_dtypes():
    distlab.manual_seed(0)
    emb = nn.Embedding(6, 3)
    tokens = np.array([[1, 2, 2], [5, 0, 1]])
    expected = _plain_grads(emb, lambda: emb(tokens).sum().backward())
    (buffer,) = _buffered(emb)
    emb(tokens).sum().backward()
    assert emb.weight.grad.data is buffer and np.array_equal(buffer, expected[0])
    layer = nn.Linear(4, 2, dtype=np.float32)
    buffers = _buffered(layer)
    layer(distlab.tensor(np.ones((2, 4)))).sum().backward()  # float64 input: the weight's gradient is float64
    assert layer.weight.grad.data is not buffers[0] and layer.weight.grad.dtype == np.float32


def test_set_grad_buffer_checks_the_buffer():
    p = nn.Parameter(np.zeros((2, 3), np.float32))
    for bad in (np.zeros((3, 2), np.float32), np.zeros((2, 3)), np.zeros((3, 2), np.float32).T, [[0.0] * 3] * 2):
        with pytest.raises(ValueError, match=r"set_grad_buffer: the buffer must be .* shape \(2, 3\) and dtype float32"):
            ag.accumulate_grad.set_grad_buffer(p, bad)
    ag.accumulate_grad.set_grad_buffer(p, None)


# -- pickling and deepcopy: data and requires_grad travel, this process's autograd state does not ---------------
def test_a_trained_module_pickles_without_its_graph_gradients_or_buffers():
    import pickle

    model = mlp(depth=2)
    model[0].weight.note = "kept"  # the instance's own attributes travel, as torch's
    _buffered(model)
    out = model(distlab.tensor(np.ones((2, 4)))).sum()  # a graph is alive: accumulators are set
    out.backward(retain_graph=True)
    copy = pickle.loads(pickle.dumps(model))
    for p, q in zip(model.parameters(), copy.parameters()):
        assert type(q) is nn.Parameter and q.requires_grad and q.is_leaf
        assert np.array_equal(p.data, q.data) and not np.shares_memory(p.data, q.data)
        assert q.grad is None and q._grad_buffer is None and q._accumulator is None
    assert copy[0].weight.note == "kept"
    restored = pickle.loads(pickle.dumps(out))  # a non-leaf arrives as a leaf that requires grad
    assert restored.is_leaf and restored.requires_grad and restored.item() == out.item()


def test_deepcopy_of_a_module_is_independent_of_the_original_graph():
    import copy

    model = mlp(depth=2)
    x = distlab.tensor(np.ones((2, 4)))
    model(x).sum().backward()
    grads = [p.grad.data.copy() for p in model.parameters()]
    alive = model(x).sum()  # the original's AccumulateGrad nodes are alive now
    twin = copy.deepcopy(model)
    for p, q, g in zip(model.parameters(), twin.parameters(), grads):
        assert np.array_equal(q.grad.data, g) and not np.shares_memory(q.grad.data, p.grad.data)
    for q in twin.parameters():
        q.grad = None
    twin(x).sum().backward()  # accumulates into the copy, never into the original's parameters
    for p, q, g in zip(model.parameters(), twin.parameters(), grads):
        assert np.array_equal(p.grad.data, g) and np.array_equal(q.grad.data, g)
    with pytest.raises(RuntimeError, match="Only Tensors created explicitly by the user"):
        copy.deepcopy(alive)


def test_a_node_prehook_or_a_node_applied_by_hand_gets_no_buffer():
    model = mlp(depth=1)
    x = distlab.tensor(np.ones((2, 4)))
    buffers = _buffered(model)
    out = model(x).sum()
    out.grad_fn.next_nodes[0].apply(np.ones((2, 4)))  # by hand, outside any backward pass
    assert np.isnan(buffers[0]).all() and model[0].weight.grad is None
    out = model(x).sum()
    model[0].weight._grad_node().register_prehook(lambda g: None)  # a pre-hook is shown the gradient
    out.backward()
    assert model[0].weight.grad.data is not buffers[0] and model[0].bias.grad.data is buffers[1]
