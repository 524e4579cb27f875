"""One distributed backward pass across the workers (mirrors dist_engine.cpp ``execute`` and
``executeSendFunctionAsync``, request_callback_no_python.cpp processBackwardAutogradReq).

The graph work of each worker's part is :mod:`.engine`; this module moves the pass between workers:

- ``backward`` on the root validates the roots, makes the pass's task here, sends a *prepare* to every known
  worker, runs its part from the roots and sends the gradients its recv groups produced;
- a gradient message (one-way, one per send/recv pair) runs the receiver's part from that send function;
- completion travels through the tree of prepares: each worker forwards the first prepare it gets to the workers
  it knows and answers it once all its send functions have run and its own forwards are answered; a later
  prepare is answered at once, so the waits form a tree. When the root's prepares are answered and its own send
  functions have run, the pass is over on every worker.

Every wait is bounded by the RPC timeout (``DISTLAB_TIMEOUT`` when it is disabled); a failure anywhere reaches the
root as :class:`~distlab.errors.DistBackwardError` naming the worker and the context.
"""
from __future__ import annotations

import logging
import threading

from distlab._wire import DIST_AUTOGRAD_KIND_CODES
from distlab.autograd import array_module
from distlab.autograd.tensor import Tensor
from distlab.errors import AutogradContextNotFoundError, DistBackwardError, DistTimeoutError, RemoteError
from distlab.futures import Future
from distlab.timeline import get_timeline, now_us

from . import _state, config, engine

__all__ = ["backward", "handle_prepare", "handle_backward"]

K_BACKWARD = DIST_AUTOGRAD_KIND_CODES["dist_autograd_backward"]
K_PREPARE = DIST_AUTOGRAD_KIND_CODES["dist_autograd_prepare"]
log = logging.getLogger("distlab.distributed_autograd")
_timeline = get_timeline()  # spans on the "dist_autograd" lane when DISTLAB_TIMELINE is set
_tree_lock = threading.Lock()


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

    Gradients accumulate in the context on each worker (read them with
    :func:`~distlab.distributed_autograd.get_gradients`), never in ``.grad``. Returns when every worker has finished
    its part.

    Raises
    ------
    RuntimeError, TypeError
        Invalid roots (none, not requiring grad, not scalar, leaves).
    AutogradContextNotFoundError
        No context ``context_id`` on this worker.
    DistBackwardError
        The pass failed on a worker (named, with the context id), or a worker did not answer within the timeout.
    """
    agent = _state.attach()
    container = _state.twin().get_container()
    ctx = container.retrieve_context(context_id)
    entries = _validate_roots(roots)
    pass_id = container.new_autograd_message_id()  # unique across the world: names this pass everywhere
    start = now_us() if _timeline.enabled else 0.0
    task, _created, silent = engine.task_for(ctx, pass_id, retain_graph, [node for node, _ in entries])
    limit = _state.timeout(agent)
    try:
        ctx.clear_outstanding_rpcs()
        _join_tree(agent, ctx, task, (context_id, pass_id, retain_graph), parent=None)  # the root of the tree
        _answer_silent(agent, ctx, task, silent)
        _run(agent, ctx, task, entries)
        # + 1 s: a prepare's own RPC timeout (which names the worker that did not answer) fires first
        _finish(agent, ctx, task).wait(limit + 1.0)
    except DistTimeoutError as exc:
        raise DistBackwardError(
            f"distributed backward of autograd context {context_id} on worker {agent.rank}: not finished within "
            f"{limit:g} s: {_waiting_for(task)}: {exc}", worker_id=agent.rank, context_id=context_id) from exc
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


def _waiting_for(task) -> str:
    """What the pass still waits for: workers that have not answered its prepare, gradients of send functions."""
    silent_workers = sorted(w for w, f in task.prepares.items() if not f.done() or f.exception() is not None)
    return (f"no answer from workers {silent_workers} to the start of the pass, "
            f"send functions still without gradients: messages {sorted(task.sends_left)}")


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
            fut = agent.send(w, K_PREPARE, prepare, inline=True, timeout=_state.timeout(agent))
            task.prepares[w] = fut
            _track(ctx, task, fut)
    return True


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
    """Add a prepare RPC to the context's outstanding RPCs; its failure fails the pass here at once."""
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
        # gradients go back the way their tensors came: the own device map to `worker`, else the inverse of its map
        agent.send(worker, K_BACKWARD, payload, noreply=True, inline=config.inline_backward, device_map="either")


def _as_backward_error(exc, context_id):
    if isinstance(exc, DistBackwardError):
        return exc
    if isinstance(exc, RemoteError) and isinstance(exc.remote_exception, DistBackwardError):
        return exc.remote_exception
    worker = getattr(exc, "worker_name", None) or getattr(exc, "missing_ranks", None)
    return DistBackwardError(f"distributed backward of autograd context {context_id} failed on worker {worker}: "
                             f"{exc}", context_id=context_id)


@_state.handles(K_PREPARE)
def handle_prepare(src, payload, meta):
    """A pass starts (sent by the root, forwarded by each worker once it joins the tree): count dependencies here
    if this worker has no task for the pass yet, answer silent recv groups, and if this is the first prepare
    here, answer it once this worker's part and its subtree's are over (the pass's completion, bottom up)."""
    context_id, pass_id, retain_graph = payload
    agent = _state.attach()
    try:
        ctx = _state.twin().get_container().retrieve_context(context_id)
    except AutogradContextNotFoundError:
        return None  # the RPC that made us a known worker never arrived: nothing of this pass lives here
    task, created, silent = engine.task_for(ctx, pass_id, retain_graph)
    if created:
        _answer_silent(agent, ctx, task, silent)
    if not _join_tree(agent, ctx, task, payload, parent=src):
        return None
    return _finish(agent, ctx, task)


@_state.handles(K_BACKWARD)
def handle_backward(src, payload, meta):
    """Gradients for one of our send functions, one-way (processBackwardAutogradReq -> executeSendFunctionAsync).

    Nobody waits for an answer: this worker's part is over when all its send functions have run, which the
    answer to its first prepare reports; an error here fails that answer.
    """
    context_id, message_id, pass_id, retain_graph, grads = payload
    agent = _state.attach()
    try:
        ctx = _state.twin().get_container().retrieve_context(context_id)
    except AutogradContextNotFoundError:
        if _state.is_released(context_id):  # a stalled worker's gradients, after the failed pass's release
            log.info("dropped gradients of released autograd context %s from worker %s", context_id, src)
            return None
        raise
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
