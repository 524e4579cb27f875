"""Contexts and container access: ``with context() as context_id``, ``get_gradients``, ``init``,
``get_container`` and ``debug_info`` (mirrors torch/distributed/autograd/__init__.py and init.cpp)."""
from __future__ import annotations

from distlab.errors import AutogradContextNotFoundError
from distlab.timeline import get_timeline, now_us

from . import _state, cleanup

__all__ = ["context", "get_gradients", "init", "get_container", "debug_info"]

_timeline = get_timeline()  # spans on the "dist_autograd" lane when DISTLAB_TIMELINE is set


def init(worker_id: int):
    """Initialise this worker's container with ``worker_id`` (done on first use with the RPC rank)."""
    return _state.twin().init(worker_id)


def get_container():
    """This worker's container (initialised with the RPC rank on first use)."""
    _state.attach()
    return _state.twin().get_container()


class context:
    """``with context() as context_id:`` wraps one distributed forward and backward pass.

    Entering opens a context on this worker (an error if this thread already has one). Leaving releases it here
    and on every worker it reached: normally it waits for their answers (bounded by the RPC timeout, the
    attempts included) so that no context outlives its pass, and names a worker that could not be reached in a
    ``RuntimeWarning``. When the block raised (a failed backward, say) the error propagates at once and the
    release goes on in the background, bounded the same way; a failure is then logged.
    """

    def __enter__(self) -> int:
        self._ctx = get_container().new_context()
        return self._ctx.context_id

    def __exit__(self, exc_type, exc, tb):
        context_id = self._ctx.context_id
        start = now_us() if _timeline.enabled else 0.0
        failures = cleanup.release(context_id, background=exc_type is not None)
        if _timeline.enabled:
            _timeline.complete("release context", start, lane="dist_autograd",
                               args={"context": context_id, "background": exc_type is not None})
        cleanup.warn_failures(context_id, failures)
        return False


def get_gradients(context_id: int) -> dict:
    """``{Tensor: gradient}`` accumulated on this worker in context ``context_id`` (mirrors get_gradients)."""
    return get_container().retrieve_context(context_id).get_gradients()


def debug_info() -> dict:
    """Counts on this worker (mirrors torch's ``_get_debug_info``): contexts alive, backward passes whose part
    here is not over, the send and recv functions recorded in all contexts, and the releases still running in
    the background (after failed passes)."""
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
            "num_recv_functions": sum(len(ctx.recv_functions()) for ctx in contexts),
            "num_releases_in_flight": cleanup.releases_in_flight()}
