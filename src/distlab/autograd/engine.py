"""The backward engine: runs the graph's nodes in dependency order (mirrors torch/csrc/autograd/engine.cpp).

One backward pass is a *graph task*:

1. ``compute_dependencies``: walk the graph once from the roots and count, for every node, how many edges point
   at it (engine.cpp ``compute_dependencies``).
2. Seed the input buffers of the root nodes with the supplied gradients and put the roots whose count is zero on
   the ready queue.
3. Pop the ready node with the highest sequence number (the most recently created, so backward visits the graph
   in reverse creation order; AccumulateGrad nodes have an infinite number and run the moment they are ready),
   run its pre-hooks and ``apply``, add each output gradient into the input buffer of the next node, decrement
   that node's count and queue it when the count reaches zero (engine.cpp ``evaluate_function``).
4. When the queue is empty, run the callbacks queued with :func:`queue_callback` (``exec_post_processing``).

The loop is iterative, so a 1000-layer chain does not touch Python's recursion limit.
"""
from __future__ import annotations

import heapq
import sys
import threading
from collections import deque

import numpy as np

from . import grad_mode
from ._array import is_cupy
from .accumulate_grad import AccumulateGrad, run_tensor_hooks
from .node import FREED_GRAPH_MESSAGE, Node
from .sparse import add_grads
from .tensor import Tensor, _check_gradient

__all__ = ["run_backward", "queue_callback", "compute_dependencies", "walk_graph", "graph_leaves",
           "is_backward_running", "evaluate_node", "propagate", "leaf_grad_buffer"]


class _Tasks(threading.local):
    def __init__(self):
        self.stack = []  # graph tasks of this thread, innermost last (reentrant backward nests them)


_tasks = _Tasks()


def _owned_refcount() -> int:
    """What ``sys.getrefcount`` reports for an array held by one local variable only (see ``_execute``)."""
    grad = bytearray(1)
    return sys.getrefcount(grad)


_OWNED_REFS = _owned_refcount()


class GraphTask:
    """State of one backward pass: options and the final callbacks (torch's ``GraphTask``)."""

    __slots__ = ("retain_graph", "sink", "callbacks")

    def __init__(self, retain_graph: bool, sink):
        self.retain_graph = retain_graph
        self.sink = sink
        self.callbacks = []


def is_backward_running() -> bool:
    """True while this thread is inside a backward pass (in a node, a hook or a final callback)."""
    return bool(_tasks.stack)


def queue_callback(fn) -> None:
    """Run ``fn()`` once the current backward pass has finished, after every node and hook.

    Mirrors ``Variable._execution_engine.queue_callback``: DDP's reducer queues ``finalize_backward`` this way
    from its first autograd hook. Callbacks run in the order queued; a callback may queue further callbacks.

    Raises
    ------
    RuntimeError
        When called outside a backward pass.
    """
    if not _tasks.stack:
        raise RuntimeError(
            "queue_callback() can only be called during a backward pass (from a hook or a node's apply); "
            "no backward pass is running in this thread")
    _tasks.stack[-1].callbacks.append(fn)


def leaf_grad_buffer(node, i: int, shape: tuple, *operands):
    """The array ``node`` may compute its gradient for input ``i`` into, or None to allocate one as usual.

    That is the input's gradient buffer (:func:`~distlab.autograd.accumulate_grad.set_grad_buffer`) when the input
    is a leaf whose ``.grad`` is None, with no hook that may keep what it is shown, reached by a backward pass
    (not a node applied by hand) that accumulates into ``.grad`` (not a distributed autograd context), and when
    the gradient, of ``shape`` and of the result dtype of the ``operands`` (arrays of the buffer's kind: numpy,
    or the same device), fits it. The first producer
    claims the buffer; a leaf used twice gets its second gradient in a fresh array, and the engine adds the two
    into another (``add_grads`` never writes in place).
    """
    leaf = node.next_nodes[i]
    if type(leaf) is not AccumulateGrad or leaf.buffer_claimed or leaf.pre_hooks:
        return None
    var = leaf.variable
    buffer = var._grad_buffer
    if buffer is None or var.grad is not None or var._hooks or not _tasks.stack or _tasks.stack[-1].sink is not True:
        return None
    if buffer.shape != shape or any(type(a) is not type(buffer) for a in operands) \
            or np.result_type(*(a.dtype for a in operands)) != buffer.dtype:
        return None
    leaf.buffer_claimed = True
    return buffer


def compute_dependencies(roots) -> dict:
    """Return ``{node: number of edges pointing at it}`` for every node reachable from ``roots``."""
    deps = {}
    seen = set(roots)
    stack = list(roots)
    while stack:
        node = stack.pop()
        for nxt in node.next_nodes:
            if nxt is None:
                continue
            deps[nxt] = deps.get(nxt, 0) + 1
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return deps


def walk_graph(outputs):
    """Yield every node reachable from ``outputs`` (a Tensor or Node, or a sequence of them) once, breadth first."""
    if isinstance(outputs, (Tensor, Node)):
        outputs = [outputs]
    frontier = deque()
    for out in outputs:
        node = out._grad_node() if isinstance(out, Tensor) else out
        if node is not None:
            frontier.append(node)
    seen = set(frontier)
    while frontier:
        node = frontier.popleft()
        yield node
        for nxt in node.next_nodes:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)


def graph_leaves(outputs) -> set:
    """Return the set of leaf tensors (requiring grad) reachable from ``outputs``.

    This is how DDP's ``find_unused_parameters`` works: parameters not in this set get no gradient this step.
    """
    return {node.variable for node in walk_graph(outputs) if isinstance(node, AccumulateGrad)}


def _root_node(root):
    if isinstance(root, Node):
        return root
    node = root._grad_node()
    if node is None:
        raise RuntimeError("element of tensors does not require grad and does not have a grad_fn")
    return node


def run_backward(roots, grad_roots, retain_graph: bool = False, accumulate=True) -> None:
    """Run one backward pass from ``roots`` seeded with ``grad_roots``.

    Parameters
    ----------
    roots : sequence of Tensor or Node
        Where backward starts. A Tensor starts at its ``grad_fn`` (or its AccumulateGrad for a leaf); a Node
        starts there directly (a distributed engine starts at the send functions it received gradients for).
    grad_roots : sequence of arrays
        One gradient per root (numpy/cupy arrays, already checked against the roots' shapes).
    retain_graph : bool
        Keep saved values so the graph can be run again.
    accumulate : True or callable
        True: leaves accumulate into ``.grad`` and fire their post-accumulate-grad hooks. A callable
        ``accumulate(tensor, grad)`` instead receives each leaf's gradient (after the leaf's tensor hooks) and
        ``.grad`` is untouched (how distributed autograd accumulates into its context). ``grad`` is an ndarray
        or a :class:`SparseGrad` that may be shared with other consumers: copy it before modifying it in place.

    Notes
    -----
    Runs in the calling thread with grad mode off. Nodes run newest first among those ready, leaves' gradients
    are delivered the moment they are complete, and callbacks queued with :func:`queue_callback` run after the
    last node, before this function returns. Unless ``retain_graph``, each node's saved values are freed after it
    runs; running it again raises the "backward through the graph a second time" error.
    """
    task = GraphTask(retain_graph, accumulate)
    _tasks.stack.append(task)
    grad_was_enabled = grad_mode._state.enabled
    grad_mode._state.enabled = False  # backward records nothing (torch: grad mode = create_graph = False)
    try:
        buffers = {}
        for root, grad in zip(roots, grad_roots):
            node = _root_node(root)
            buffers[node] = grad if node not in buffers else add_grads(buffers[node], grad)
        deps = compute_dependencies(buffers)
        ready = []
        order = 0  # tie-breaker: equal priorities run in the order they became ready
        for node in buffers:
            if node not in deps:
                heapq.heappush(ready, (-node.seq, order, node))
                order += 1
        _execute(task, ready, buffers, deps, order)
        _run_callbacks(task)
    finally:
        grad_mode._state.enabled = grad_was_enabled
        _tasks.stack.pop()


def _execute(task, ready, buffers, deps, order) -> None:
    """The engine loop (engine.cpp ``thread_main`` + ``evaluate_function``) over one graph task."""
    heappop = heapq.heappop
    retain, sink = task.retain_graph, task.sink
    while ready:
        node = heappop(ready)[2]
        grad = buffers.pop(node, None)
        if grad is None:
            outputs = ()  # nothing flowed in: dependents still need their counts decremented
        elif isinstance(node, AccumulateGrad):
            outputs = None  # drop our other reference (the previous node's outputs) so the count below is exact
            owned = sys.getrefcount(grad) <= _OWNED_REFS  # only `grad` refers to it: no one else can alias it
            node.accumulate(grad, sink, owned)
            continue
        else:
            outputs = evaluate_node(node, grad, retain)
        order = propagate(node, outputs, buffers, deps, ready, order)


def evaluate_node(node, grad, retain_graph: bool):
    """Run one non-leaf node on its summed gradient: pre-hooks, ``apply``, then free its saved values.

    Mirrors engine.cpp ``call_function``; shared with the distributed engine.
    """
    if node.freed:
        raise RuntimeError(FREED_GRAPH_MESSAGE.format(name=node.name()))
    if node.pre_hooks:
        grad = run_tensor_hooks(node.pre_hooks, grad)
    outputs = node.apply(grad)
    if not retain_graph:
        node.release()
    return outputs


def propagate(node, outputs, buffers, deps, ready, order: int) -> int:
    """Add ``outputs`` into the next nodes' input buffers and queue each whose dependencies are all met.

    Mirrors the tail of engine.cpp ``evaluate_function``; shared with the distributed engine. A next node missing
    from ``deps`` counts as having one dependency (the distributed engine adds send functions' targets late).
    A gradient added to one already waiting is added in place when the waiting array is the engine's alone (no
    other reference, not a view, same shape and dtype; torch's ``InputBuffer::accumulate`` steals it alike), else
    into a new array.
    Returns the tie-breaking counter for the next node queued.
    """
    for i, nxt in enumerate(node.next_nodes):
        if nxt is None:
            continue
        g = outputs[i] if outputs else None
        if g is not None:
            prev = buffers.get(nxt)
            if prev is None:
                buffers[nxt] = g
            elif (type(prev) is type(g) and (type(prev) is np.ndarray or is_cupy(prev))
                  and prev.base is None and prev.shape == g.shape
                  and prev.dtype == g.dtype and getattr(prev.flags, "writeable", True)
                  and sys.getrefcount(prev) <= _OWNED_REFS + 1):
                prev += g  # only this buffer refers to it (+1: the dict): add in place, allocate nothing
            else:
                buffers[nxt] = add_grads(prev, g)
        remaining = deps.get(nxt, 1) - 1
        deps[nxt] = remaining
        if remaining == 0:
            heapq.heappush(ready, (-nxt.seq, order, nxt))
            order += 1
    return order


def _tensor_backward(self, gradient=None, retain_graph: bool = False) -> None:
    """Compute the gradient of this tensor with respect to the graph's leaves (see torch.Tensor.backward).

    Parameters
    ----------
    gradient : Tensor or array, optional
        d(loss)/d(self); may be omitted only for single-element tensors (it is then 1).
    retain_graph : bool
        Keep the saved values so backward can run through this graph again.
    """
    run_backward([self], [_check_gradient(self, gradient)], retain_graph=retain_graph)


_tensor_backward.__name__, _tensor_backward.__qualname__ = "backward", "Tensor.backward"
Tensor.backward = _tensor_backward  # a Tensor method; defined here so that tensor.py need not import the engine


def _run_callbacks(task) -> None:
    """Run the final callbacks in order; ones queued by a callback run too (engine.cpp exec_post_processing)."""
    i = 0
    while i < len(task.callbacks):
        task.callbacks[i]()
        i += 1
