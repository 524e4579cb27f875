"""The distributed backward engine and its graph nodes (mirrors torch/csrc/distributed/autograd/engine/
dist_engine.cpp and functions/sendrpc_backward.cpp, recvrpc_backward.cpp). Shared plumbing, not twinned: it
works with whichever container twin is active (``distlab._backend.load("autograd_container")``). This module
does no communication: :mod:`.backward_pass` moves a pass between workers.

Forward: an RPC made inside a context records a :class:`SendRpcBackward` on the sender (its next nodes are the
sent tensors' grad nodes) and, on the receiver, one :class:`RecvRpcBackward` per received tensor that requires
grad (each becomes that tensor's ``grad_fn``), grouped by the RPC's message id in a :class:`RecvRpcGroup`.
The reply does the same in the other direction.

Backward, on each worker, per context and pass (:class:`GraphTask`):

1. Dependencies are counted from the roots (on the worker that called ``backward``) *and every send function of
   the context* (dist_engine.cpp computeDependencies), so a node fed both by the local loss and by gradients
   arriving from another worker runs once, with the sum.
2. Entry points: the root (seeded with ones), or a send function whose gradients arrived from the worker that
   holds the matching recv functions (processBackwardAutogradReq -> executeSendFunctionAsync).
3. Nodes run newest first when their count reaches zero. AccumulateGrad delivers into the *context*
   (DistAccumulateGradCaptureHook), never ``.grad``. A RecvRpcBackward always runs, even without a gradient,
   and when the last reachable one of its group has run the group sends the gradients (None where nothing
   flowed: no zero tensors are made or sent) to the sending worker, whose send function then runs.
4. Gradient messages are one-way (one message per send/recv pair). Completion travels through a tree of
   "prepare" messages: the root sends one to every worker it knows, each worker forwards the first it receives
   to the workers it knows and answers it once all its send functions have run and its own forwards are
   answered; so when the root's prepares are answered (and its own send functions have run), the pass is over
   on every worker. A later prepare is answered at once, so the tree has no cycles.

Unlike torch (whose "smart mode" never landed and which hangs when a send function never gets gradients),
a recv group that no root or send function on its worker can reach answers with "no gradient" when the pass
starts there, and ``backward`` first tells every known worker (recursively) that a pass starts, so every send
function of the pass runs exactly once and no node waits for a gradient that will never come.
"""
from __future__ import annotations

import heapq
import threading

from distlab.autograd import grad_mode
from distlab.autograd.accumulate_grad import AccumulateGrad, run_tensor_hooks
from distlab.autograd.engine import GraphTask as _LocalGraphTask
from distlab.autograd.engine import _tasks as _local_tasks  # the local engine's per-thread graph-task stack
from distlab.autograd.engine import compute_dependencies, evaluate_node, propagate
from distlab.autograd.node import Node
from distlab.autograd.sparse import add_grads
from distlab.futures import Future

__all__ = ["SendRpcBackward", "RecvRpcBackward", "RecvRpcGroup", "GraphTask", "task_for", "execute"]


class SendRpcBackward(Node):
    """Recorded on the sender of an RPC: its next nodes are the grad nodes of the tensors sent that require grad.

    In backward its input is not a local gradient: the receiver's recv functions send the gradients of those
    tensors back, :meth:`set_grads` stores them and the engine runs this node as an entry point
    (mirrors sendrpc_backward.cpp: ``apply`` returns the gradients it was given).
    """

    __slots__ = ("message_id", "to_worker", "_grads")

    def __init__(self, next_nodes, message_id: int, to_worker: int):
        super().__init__(next_nodes)
        self.message_id = message_id
        self.to_worker = to_worker
        self._grads = None

    def set_grads(self, grads) -> None:
        """Store the gradients received for this RPC's tensors (one per next node; None where none flowed)."""
        if len(grads) != len(self.next_nodes):
            raise ValueError(f"SendRpcBackward of message {self.message_id}: got {len(grads)} gradients for "
                             f"{len(self.next_nodes)} tensors")
        self._grads = tuple(grads)

    def apply(self, grad):
        grads, self._grads = self._grads, None
        return grads if grads is not None else ()


class RecvRpcGroup:
    """The recv side of one RPC: the RecvRpcBackward nodes of its tensors, by position (recvrpc_backward.cpp).

    It collects each node's gradient during a pass; when every node reachable in this pass has run it hands
    back the message to send to ``from_worker``: ``(message_id, [grad or None per tensor])``.
    """

    def __init__(self, message_id: int, from_worker: int, n: int):
        self.message_id = message_id
        self.from_worker = from_worker
        self.nodes = [None] * n
        self._lock = threading.Lock()
        self._pass = None
        self._grads = [None] * n
        self._pending = 0

    def begin_pass(self, pass_id, reachable) -> bool:
        """Reset for pass ``pass_id``; return True when no node of this group is reachable (send "none" now)."""
        with self._lock:
            self._pass = pass_id
            self._grads = [None] * len(self.nodes)
            self._pending = sum(1 for node in self.nodes if node in reachable)
            return self._pending == 0

    def deliver(self, index: int, grad):
        """Record node ``index``'s gradient; return the gradient list once the group is complete, else None."""
        with self._lock:
            self._grads[index] = grad
            self._pending -= 1
            if self._pending != 0:
                return None
            grads, self._grads = self._grads, [None] * len(self.nodes)
            return grads


class RecvRpcBackward(Node):
    """The grad_fn of one tensor received through an RPC: a leaf of the local graph that, when run, passes its
    gradient to its :class:`RecvRpcGroup` (which sends the group's gradients to the sending worker)."""

    __slots__ = ("group", "index")

    def __init__(self, group: RecvRpcGroup, index: int):
        super().__init__(())
        self.group = group
        self.index = index
        group.nodes[index] = self

    def apply(self, grad):
        return ()


class GraphTask:
    """One worker's state of one backward pass of one context (torch's GraphTask owned by the context)."""

    __slots__ = ("pass_id", "retain_graph", "deps", "buffers", "lock", "order", "sends_left", "finished",
                 "in_tree", "prepares", "callbacks", "_closing")

    def __init__(self, pass_id, retain_graph: bool):
        self.pass_id = pass_id
        self.retain_graph = retain_graph
        self.deps = {}
        self.buffers = {}
        self.lock = threading.Lock()
        self.order = 0
        self.sends_left = set()  # message ids of send functions not yet run in this pass (outstanding_tasks_)
        #: completed when every send function of the context has run here (or with the first local error)
        self.finished = Future(description=f"backward pass {pass_id}")
        self.in_tree = False  # joined the pass's tree of prepare messages (see backward_pass)
        self.prepares = {}  # worker -> Future of the prepare this worker forwarded to it (names who is late)
        self.callbacks = []  # queued with distlab.autograd.queue_callback during this worker's part
        self._closing = False

    def fail(self, exc) -> None:
        """Record a local error: the pass is over here (first error wins)."""
        if not self.finished.done():
            try:
                self.finished.set_exception(exc)
            except RuntimeError:
                pass

    def check_finished(self) -> None:
        """Complete :attr:`finished` once every send function has run (call after sending their gradients),
        after running the callbacks queued during this worker's part (engine.cpp exec_post_processing)."""
        with _task_lock:
            if self.sends_left or self.finished.done() or self._closing:
                return
            self._closing = True
        try:
            with _engine_task(self):
                i = 0
                while i < len(self.callbacks):  # a callback may queue more
                    self.callbacks[i]()
                    i += 1
        except BaseException as exc:  # noqa: BLE001 - a failed callback fails this worker's part
            self.fail(exc)
            return
        try:
            self.finished.set_result(None)
        except RuntimeError:
            pass


def task_for(context, pass_id, retain_graph: bool, roots=()):
    """Return ``(task, created, silent_groups)`` for pass ``pass_id`` of ``context`` on this worker.

    A new pass gets a new task: dependencies counted from ``roots`` and every send function, the recv groups
    told which of their nodes can run. ``silent_groups`` are the recv groups no root or send function here
    can reach; the caller sends them "no gradient" at once (nothing else ever would).
    """
    task = context.retrieve_graph_task()
    if task is not None and task.pass_id == pass_id:
        return task, False, []
    task = GraphTask(pass_id, retain_graph)
    sends = context.send_functions()
    starts = list(roots) + list(sends.values())
    # mirrors computeDependencies: BFS from the graph root and every send function of the context
    task.deps = compute_dependencies(starts)
    task.sends_left = set(sends)
    reachable = set(task.deps)
    reachable.update(starts)
    with _task_lock:  # two messages of a new pass may race to create its task
        current = context.retrieve_graph_task()
        if current is not None and current.pass_id == pass_id:
            return current, False, []
        context.reset_graph_task()  # a new pass in this context: forget the previous one (cleanupBackwardPass)
        silent = [group for group in context.recv_functions().values() if group.begin_pass(pass_id, reachable)]
        context.set_graph_task(task)
    return task, True, silent


_task_lock = threading.Lock()


class _engine_task:
    """Make ``queue_callback`` work in this thread during a distributed part: the local engine's stack of graph
    tasks gets one whose callbacks list is the distributed task's (distlab.autograd.engine keeps that stack)."""

    def __init__(self, task):
        self.local = _LocalGraphTask(task.retain_graph, True)
        self.local.callbacks = task.callbacks

    def __enter__(self):
        _local_tasks.stack.append(self.local)

    def __exit__(self, *exc):
        _local_tasks.stack.pop()


def execute(task: GraphTask, context, entries) -> list:
    """Run the graph from ``entries`` (``[(node, grad or None)]``) until no node is ready.

    Returns the gradient messages to send: ``[(worker, message_id, grads)]`` of the recv groups completed.
    Serialised per task (gradients for two send functions may arrive at once on two handler threads).
    """
    sends = []
    with task.lock:
        was_enabled = grad_mode._state.enabled
        grad_mode._state.enabled = False  # backward records nothing
        try:
            ready = []
            for node, grad in entries:
                if grad is not None:
                    prev = task.buffers.get(node)
                    task.buffers[node] = grad if prev is None else add_grads(prev, grad)
                heapq.heappush(ready, (-node.seq, task.order, node))
                task.order += 1
            with _engine_task(task):
                _loop(task, context, ready, sends)
        finally:
            grad_mode._state.enabled = was_enabled
    return sends


def _loop(task, context, ready, sends) -> None:
    """The engine loop (the local engine's, plus send/recv functions and the context as gradient sink)."""
    heappop = heapq.heappop
    buffers, deps, retain = task.buffers, task.deps, task.retain_graph
    sink = context.accumulate_grad
    while ready:
        node = heappop(ready)[2]
        grad = buffers.pop(node, None)
        if isinstance(node, AccumulateGrad):
            if grad is not None:
                node.accumulate(grad, sink)  # DistAccumulateGradCaptureHook: into the context, not .grad
            continue
        if isinstance(node, RecvRpcBackward):
            if grad is not None and node.pre_hooks:
                grad = run_tensor_hooks(node.pre_hooks, grad)
            grads = node.group.deliver(node.index, grad)  # recv functions always run
            if grads is not None:
                sends.append((node.group.from_worker, node.group.message_id, grads))
            continue
        if isinstance(node, SendRpcBackward):
            task.sends_left.discard(node.message_id)
            outputs = node.apply(None)
        elif grad is None:
            outputs = ()  # nothing flowed in: dependents still need their counts decremented
        else:
            outputs = evaluate_node(node, grad, retain)
        task.order = propagate(node, outputs, buffers, deps, ready, task.order)
