"""Distributed autograd over distlab.rpc (mirrors torch.distributed.autograd).

::

    from distlab import distributed_autograd as dist_autograd
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker1", f, args=(x, w)).sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)   # {tensor: gradient}, .grad untouched

RPCs made inside a context (``rpc_sync``, ``rpc_async``, ``remote``, ``RRef.to_here`` and the RRef proxies)
carry autograd metadata ``(context id, message id, sender)``: the sender records a ``SendRpcBackward`` for the
tensors that require grad and the receiver a ``RecvRpcBackward`` per such tensor (and the reply the same way
back); every RPC records its destination as a known worker of the context (utils.cpp getMessageWithAutograd,
forced grad recording). The containers are twinned (``distlab._backend.load("autograd_container")``); the
engine is :mod:`distlab._dist_engine`. Leaving the context releases it here and, with retries and a timeout, on every
known worker, which forwards the release to the workers it knows (nested RPC chains).

Tensors travel as their data and ``requires_grad`` (arriving as leaves, then given a recv function); importing
this module registers that pickling for :class:`~distlab.autograd.Tensor`.
"""
from __future__ import annotations

import collections
import copyreg
import logging
import threading
import time
import warnings

from distlab import _backend
from distlab import _dist_engine as engine
from distlab._wire import DIST_AUTOGRAD_KIND_CODES
from distlab.autograd import array_module, grad_mode
from distlab.autograd.tensor import Tensor
from distlab.errors import (
    AutogradContextNotFoundError,
    DistAutogradError,
    DistBackwardError,
    DistTimeoutError,
    RemoteError,
)
from distlab.futures import Future, collect_all
from distlab.nn.parameter import Parameter
from distlab.rpc import api as _rpc_api
from distlab.rpc import framing
from distlab.timeline import get_timeline, now_us

__all__ = ["context", "backward", "get_gradients", "init", "get_container", "cleanup_timeout", "debug_info"]

log = logging.getLogger("distlab.distributed_autograd")
K_BACKWARD = DIST_AUTOGRAD_KIND_CODES["dist_autograd_backward"]
K_PREPARE = DIST_AUTOGRAD_KIND_CODES["dist_autograd_prepare"]
K_CLEANUP = DIST_AUTOGRAD_KIND_CODES["dist_autograd_cleanup"]

#: Seconds each attempt to release a context on a known worker may take, and how many attempts are made.
cleanup_timeout = 10.0
CLEANUP_ATTEMPTS = 3
#: Run the backward part a gradient message triggers on the receiver's RPC listener thread (no thread-pool hop:
#: a chain of workers then passes gradients listener to listener). Backward never waits for a message, so this
#: cannot deadlock unless a tensor hook itself makes a blocking RPC; set it False on every worker for such hooks
#: (the part then runs on the RPC thread pool, as in PyTorch).
inline_backward = True
#: How many released context ids each worker remembers (to refuse RPCs that outlive their context).
RELEASED_MEMORY = 4096

_impl = _backend.load("autograd_container")
_timeline = get_timeline()  # spans on the "dist_autograd" lane when DISTLAB_TIMELINE is set
_attach_lock = threading.Lock()
_attached_agent = None


# -- tensors over the wire -------------------------------------------------------------------------------------
def _rebuild_tensor(cls, data, requires_grad):
    t = cls.__new__(cls)
    Tensor.__init__(t, data, requires_grad=requires_grad)
    return t


def _reduce_tensor(t):
    return _rebuild_tensor, (type(t), t.data, bool(t.requires_grad))


copyreg.pickle(Tensor, _reduce_tensor)
copyreg.pickle(Parameter, _reduce_tensor)


def _tensors(obj, out):
    """Collect the Tensors inside ``obj`` (nested tuples, lists and dict values), in order."""
    if isinstance(obj, Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            _tensors(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _tensors(item, out)
    return out


def _needing_grad(obj):
    if not grad_mode.is_grad_enabled():
        return []
    return [t for t in _tensors(obj, []) if t.requires_grad]


# -- setup ----------------------------------------------------------------------------------------------------
def init(worker_id: int):
    """Initialise this worker's container with ``worker_id`` (done on first use with the RPC rank)."""
    return _impl.init(worker_id)


def get_container():
    """This worker's container (initialised with the RPC rank on first use)."""
    _attach()
    return _impl.get_container()


def _attach():
    """Register the distributed autograd handlers on the running agent (once per agent) and init the container."""
    global _attached_agent
    agent = _rpc_api.get_agent()
    if agent is _attached_agent:
        return agent
    with _attach_lock:
        if agent is not _attached_agent:
            if _impl.is_initialized() and _impl.get_container().worker_id != agent.rank:
                _impl.shutdown()  # a new RPC session with another rank: a new container
            _impl.init(agent.rank)
            _forget_released()
            agent.register_handler(K_BACKWARD, _handle_backward)
            agent.register_handler(K_PREPARE, _handle_prepare)
            agent.register_handler(K_CLEANUP, _handle_cleanup)
            _attached_agent = agent
    return agent


# -- forward: wrapping RPCs (utils.cpp addSendRpcBackward / addRecvRpcBackward) ------------------------------
def _add_send(ctx, tensors, message_id, to_worker):
    if tensors:
        fn = engine.SendRpcBackward(tuple(t._grad_node() for t in tensors), message_id, to_worker)
        ctx.add_send_function(fn, message_id)


def _add_recv(ctx, tensors, message_id, from_worker):
    tensors = [t for t in tensors if t.requires_grad]
    if tensors:
        group = engine.RecvRpcGroup(message_id, from_worker, len(tensors))
        for i, t in enumerate(tensors):
            t.grad_fn = engine.RecvRpcBackward(group, i)  # set_history: the received tensor is now a non-leaf
        ctx.add_recv_function(group, message_id)


def _rpc_hook(dst, func, args, kwargs, remote=False):
    """Called by distlab.rpc for every call: inside a context, rewrite it to carry autograd metadata."""
    if _attached_agent is None and not _impl.is_initialized():
        return None
    container = _impl.get_container() if _impl.is_initialized() else None
    if container is None or not container.has_valid_context():
        return None
    agent = _attach()
    ctx = container.current_context()
    message_id = container.new_autograd_message_id()
    _add_send(ctx, _needing_grad((args, kwargs)), message_id, dst)
    ctx.add_known_worker_id(dst)
    # the wire form of AutogradMetadata, plus the sender (RpcWithAutograd's fromWorkerId)
    meta = _impl.AutogradMetadata(ctx.context_id, message_id).to_tuple() + (agent.rank,)
    call = (_autograd_remote if remote else _autograd_call, (meta, framing.by_value(func), args, kwargs), None)

    def unwrap(reply):
        response_meta, value = reply
        if response_meta is not None:
            _add_recv(ctx, _tensors(value, []), response_meta[1], response_meta[2])
        return value

    return call + (unwrap,)


#: Ids of contexts released on this worker (bounded memory): an RPC of a context that arrives after the release
#: is refused instead of re-creating a context nobody will ever release again.
_released_ids = collections.deque(maxlen=RELEASED_MEMORY)
_released_set = set()
_released_lock = threading.Lock()


def _remember_released(context_id):
    with _released_lock:
        if context_id in _released_set:
            return
        if len(_released_ids) == _released_ids.maxlen:
            _released_set.discard(_released_ids[0])
        _released_ids.append(context_id)
        _released_set.add(context_id)


def _forget_released():
    """Forget the released ids (a new RPC session, or a new container whose ids start again)."""
    with _released_lock:
        _released_ids.clear()
        _released_set.clear()


def _enter(meta, args, kwargs):
    context_id, message_id, from_worker = meta
    agent = _attach()
    container = _impl.get_container()
    if context_id in _released_set:
        raise DistAutogradError(
            f"an RPC of distributed autograd context {context_id} from worker {from_worker} reached worker "
            f"{agent.rank} after the context was released there (the RPC outlived its context); refused, so that "
            "no context is re-created and leaked")
    ctx = container.get_or_create_context(context_id)
    _add_recv(ctx, _tensors((args, kwargs), []), message_id, from_worker)
    return agent, container, ctx


def _autograd_call(meta, func, args, kwargs):
    """Callee side (processForwardAutogradReq): recv functions, run in the caller's context, send functions."""
    agent, container, ctx = _enter(meta, args, kwargs)
    previous = container.force_current_context_id(ctx.context_id)  # DistAutogradContextGuard
    try:
        value = func(*args, **kwargs) if kwargs else func(*args)
        ctx.add_known_worker_id(meta[2])
        tensors = _needing_grad(value)
        if not tensors:
            return None, value
        message_id = container.new_autograd_message_id()
        _add_send(ctx, tensors, message_id, meta[2])
        return (ctx.context_id, message_id, agent.rank), value
    finally:
        container.force_current_context_id(previous)


def _autograd_remote(meta, func, args, kwargs):
    """Owner side of ``remote`` inside a context: recv functions for the arguments, run in the context."""
    _agent, container, ctx = _enter(meta, args, kwargs)
    previous = container.force_current_context_id(ctx.context_id)
    try:
        ctx.add_known_worker_id(meta[2])
        return func(*args, **kwargs) if kwargs else func(*args)
    finally:
        container.force_current_context_id(previous)


_rpc_api.autograd_hook = _rpc_hook


# -- the context manager and cleanup ----------------------------------------------------------------------------
class context:
    """``with context() as context_id:`` wraps one distributed forward and backward pass.

    Entering opens a context on this worker (an error if this thread already has one); leaving releases it here
    and on every worker it reached, waiting (bounded by ``cleanup_timeout`` per attempt, ``CLEANUP_ATTEMPTS``
    attempts) so that no context outlives its pass; a worker that cannot be reached is reported as a warning.
    """

    def __enter__(self) -> int:
        self._ctx = get_container().new_context()
        return self._ctx.context_id

    def __exit__(self, exc_type, exc, tb):
        container = _impl.get_container()
        start = now_us() if _timeline.enabled else 0.0
        _remember_released(self._ctx.context_id)
        known = container.release_context_if_present(self._ctx.context_id)
        container.clear_current_context_id()
        failures = _release_on(known, self._ctx.context_id, exclude=None)
        if _timeline.enabled:
            _timeline.complete("release context", start, lane="dist_autograd",
                               args={"context": self._ctx.context_id, "workers": sorted(known)})
        if failures:
            warnings.warn(f"distributed autograd context {self._ctx.context_id} could not be released on "
                          f"{failures}", RuntimeWarning, stacklevel=2)
        return False


def _send_with_retries(agent, dst, payload, attempts):
    """Send a cleanup request; retry on failure; return a Future of None or of the last error."""
    result = Future(description=f"release autograd context on worker {dst}")

    def attempt(left):
        fut = agent.send(dst, K_CLEANUP, payload, timeout=cleanup_timeout, inline=True)

        def done(f):
            exc = f.exception()
            if exc is None:
                result.set_result(None)
            elif left > 1 and agent.running:
                attempt(left - 1)
            else:
                result.set_exception(exc)

        fut.add_done_callback(done)

    try:
        attempt(attempts)
    except Exception as exc:  # noqa: BLE001 - agent stopped: report, never raise from cleanup
        result.set_exception(exc)
    return result


def _release_futures(known, context_id, exclude):
    agent = _rpc_api.get_agent()
    return {w: _send_with_retries(agent, w, context_id, CLEANUP_ATTEMPTS)
            for w in sorted(known) if w != exclude and w != agent.rank}


def _release_on(known, context_id, exclude):
    """Tell ``known`` workers to release ``context_id``; wait (bounded); return ``{worker: error}`` failures."""
    if not known or not _rpc_api.is_initialized():
        return {}
    futures = _release_futures(known, context_id, exclude)
    deadline = time.monotonic() + cleanup_timeout * CLEANUP_ATTEMPTS + 1.0
    failures = {}
    for worker, fut in futures.items():
        try:
            fut.wait(max(deadline - time.monotonic(), 1e-3))
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            failures[worker] = exc
    return failures


def _handle_cleanup(src, context_id, meta):
    """A known worker left the context: release it here and forward to the workers this one knows."""
    _remember_released(context_id)
    known = _impl.get_container().release_context_if_present(context_id)
    futures = list(_release_futures(known, context_id, exclude=src).values())
    if not futures:
        return None
    return collect_all(futures).then(lambda f: None)


# -- backward --------------------------------------------------------------------------------------------------
def _validate_roots(roots):
    """DistEngine::validateRootsAndRetrieveEdges."""
    if isinstance(roots, Tensor):
        roots = [roots]
    roots = list(roots)
    if not roots:
        raise RuntimeError("No tensors provided for gradient computation.")
    entries = []
    for root in roots:
        if not isinstance(root, Tensor):
            raise TypeError(f"backward roots must be Tensors, got {type(root).__name__}")
        if not root.requires_grad:
            raise RuntimeError("requires_grad not set on root")
        if root.data.size != 1:
            raise RuntimeError(f"root of shape {tuple(root.data.shape)} is not a scalar, all roots need to be scalar")
        if root.grad_fn is None:
            raise RuntimeError("root does not have a valid gradient function (it is a leaf)")
        entries.append((root.grad_fn, array_module(root.data).ones_like(root.data)))
    return entries


def backward(context_id: int, roots, retain_graph: bool = False) -> None:
    """Run the distributed backward pass of context ``context_id`` from scalar ``roots``.

    Gradients accumulate in the context on each worker (read them with :func:`get_gradients`), never in
    ``.grad``. Returns when every worker has finished its part. Errors: the roots' checks, an unknown context,
    and DistBackwardError naming the worker where the pass failed (or the one that did not answer in time).
    """
    container = get_container()
    ctx = container.retrieve_context(context_id)
    entries = _validate_roots(roots)
    agent = _attach()
    pass_id = container.new_autograd_message_id()  # unique across the world: names this pass everywhere
    start = now_us() if _timeline.enabled else 0.0
    task, _created, silent = engine.task_for(ctx, pass_id, retain_graph, [node for node, _ in entries])
    try:
        ctx.clear_outstanding_rpcs()
        _join_tree(agent, ctx, task, (context_id, pass_id, retain_graph), parent=None)  # the root of the tree
        _answer_silent(agent, ctx, task, silent)
        _run(agent, ctx, task, entries)
        _finish(agent, ctx, task).wait(_pass_timeout(agent) * 2)
    except DistTimeoutError as exc:
        raise DistBackwardError(
            f"distributed backward of context {context_id} on worker {agent.rank}: not finished within "
            f"{_pass_timeout(agent):g} s (send functions still without gradients: messages "
            f"{sorted(task.sends_left)}): {exc}", worker_id=agent.rank, context_id=context_id) from exc
    except (DistBackwardError, RemoteError) as exc:
        err = _as_backward_error(exc, context_id)
        if err is exc:
            raise
        raise err from exc
    finally:
        ctx.reset_graph_task()
        if _timeline.enabled:
            _timeline.complete("dist backward", start, lane="dist_autograd",
                               args={"context": context_id, "pass": pass_id})


def _pass_timeout(agent):
    return agent.rpc_timeout if agent.rpc_timeout and agent.rpc_timeout > 0 else 300.0


def _answer_silent(agent, ctx, task, silent):
    """A task was created here: the recv groups nothing here can reach answer "no gradient" now."""
    _send_grads(agent, ctx, task, [(g.from_worker, g.message_id, [None] * len(g.nodes)) for g in silent])
    task.check_finished()


def _join_tree(agent, ctx, task, prepare, parent):
    """This worker joins the pass's tree of prepare messages (once): forward the prepare to every known worker
    but the parent; the parent's answer then waits for this worker's part and for those forwards' answers.
    Returns False if it had joined already (a second prepare is answered at once: the tree has no cycles)."""
    with _tree_lock:
        if task.in_tree:
            return False
        task.in_tree = True
    for w in sorted(ctx.known_worker_ids()):
        if w != parent and w != agent.rank:
            _track(ctx, task, agent.send(w, K_PREPARE, prepare, inline=True))
    return True


_tree_lock = threading.Lock()


def _finish(agent, ctx, task):
    """Future of this worker's part of the pass and its subtree's: every send function here ran, then every
    prepare it forwarded was answered (the context's outstanding RPCs, first error wins).

    A failed forward fails the pass here at once (see :func:`_track`), so a failed worker never leaves this
    waiting for send functions that will not run; the root bounds its wait by the RPC timeout.
    """
    result = Future(description=f"backward of autograd context {ctx.context_id} on worker {agent.rank}")

    def sends_ran(f):
        exc = f.exception()
        if exc is not None:
            result.set_exception(exc)
            return
        ctx.clear_and_wait_for_outstanding_rpcs_async().add_done_callback(
            lambda g: result.set_exception(g.exception()) if g.exception() is not None else result.set_result(None))

    task.finished.add_done_callback(sends_ran)
    return result


def _track(ctx, task, fut):
    """Add a gradient/prepare RPC to the context's outstanding RPCs; its failure fails the pass here at once."""
    ctx.add_outstanding_rpc(fut)
    fut.add_done_callback(lambda f: task.fail(f.exception()) if f.exception() is not None else None)


def _run(agent, ctx, task, entries):
    start = now_us() if _timeline.enabled else 0.0
    try:
        sends = engine.execute(task, ctx, entries)
    except DistBackwardError:
        raise
    except Exception as exc:
        err = DistBackwardError(f"Error on worker {agent.rank} ({agent.info.name!r}) in the backward pass of "
                                f"autograd context {ctx.context_id}: {type(exc).__name__}: {exc}",
                                worker_id=agent.rank, context_id=ctx.context_id)
        task.fail(err)
        raise err from exc
    _send_grads(agent, ctx, task, sends)
    if _timeline.enabled:
        what = "gradients in" if isinstance(entries[0][0], engine.SendRpcBackward) else "roots"
        _timeline.complete(f"backward part ({what})", start, lane="dist_autograd",
                           args={"context": ctx.context_id, "pass": task.pass_id, "grads_sent_to":
                                 [w for w, _m, _g in sends]})
    task.check_finished()


def _send_grads(agent, ctx, task, sends):
    """Send each completed recv group's gradients to the worker holding the matching send function (one-way:
    one message per send/recv pair; the receiver's part, reported through the prepare tree, covers it)."""
    for worker, message_id, grads in sends:
        payload = (ctx.context_id, message_id, task.pass_id, task.retain_graph, grads)
        agent.send(worker, K_BACKWARD, payload, noreply=True, inline=inline_backward)


def _as_backward_error(exc, context_id):
    if isinstance(exc, DistBackwardError):
        return exc
    if isinstance(exc, RemoteError) and isinstance(exc.remote_exception, DistBackwardError):
        return exc.remote_exception
    worker = getattr(exc, "worker_name", None) or getattr(exc, "missing_ranks", None)
    return DistBackwardError(f"distributed backward of context {context_id} failed on worker {worker}: {exc}",
                             context_id=context_id)


def _handle_prepare(src, payload, meta):
    """A pass starts (sent by the root, forwarded by each worker once it joins the tree): count dependencies here
    if this worker has no task for the pass yet, answer silent recv groups, and if this is the first prepare
    here, answer it once this worker's part and its subtree's are over (the pass's completion, bottom up)."""
    context_id, pass_id, retain_graph = payload
    agent = _attach()
    try:
        ctx = _impl.get_container().retrieve_context(context_id)
    except AutogradContextNotFoundError:
        return None  # the RPC that made us a known worker never arrived: nothing of this pass lives here
    task, created, silent = engine.task_for(ctx, pass_id, retain_graph)
    if created:
        _answer_silent(agent, ctx, task, silent)
    if not _join_tree(agent, ctx, task, payload, parent=src):
        return None
    return _finish(agent, ctx, task)


def _handle_backward(src, payload, meta):
    """Gradients for one of our send functions, one-way (processBackwardAutogradReq -> executeSendFunctionAsync).

    Nobody waits for an answer: this worker's part is over when all its send functions have run, which the
    answer to its first prepare reports; an error here fails that answer.
    """
    context_id, message_id, pass_id, retain_graph, grads = payload
    agent = _attach()
    ctx = _impl.get_container().retrieve_context(context_id)
    task, created, silent = engine.task_for(ctx, pass_id, retain_graph)
    if created:
        _answer_silent(agent, ctx, task, silent)
    try:
        send_fn = ctx.retrieve_send_function(message_id)
        send_fn.set_grads(grads)
    except Exception as exc:
        task.fail(DistBackwardError(f"Error on worker {agent.rank} ({agent.info.name!r}) in the backward pass of "
                                    f"autograd context {context_id}: {exc}", worker_id=agent.rank,
                                    context_id=context_id))
        raise
    try:
        _run(agent, ctx, task, [(send_fn, None)])
    except DistBackwardError:
        pass  # recorded by task.fail: it reaches the root through this worker's answer to its prepare


def get_gradients(context_id: int) -> dict:
    """``{Tensor: gradient}`` accumulated on this worker in context ``context_id`` (mirrors get_gradients)."""
    return get_container().retrieve_context(context_id).get_gradients()


def debug_info() -> dict:
    """Counts on this worker (mirrors torch's ``_get_debug_info``): contexts alive, backward passes whose part
    here is not over, and the send and recv functions recorded in all contexts."""
    container = get_container()
    contexts = []
    for context_id in container.context_ids():
        try:
            contexts.append(container.retrieve_context(context_id))
        except AutogradContextNotFoundError:
            pass  # released meanwhile
    tasks = [ctx.retrieve_graph_task() for ctx in contexts]
    return {"num_autograd_contexts": len(contexts),
            "num_current_backward_passes": sum(1 for t in tasks if t is not None and not t.finished.done()),
            "num_send_functions": sum(len(ctx.send_functions()) for ctx in contexts),
            "num_recv_functions": sum(len(ctx.recv_functions()) for ctx in contexts)}
