"""Distributed autograd contexts, reference twin: what one worker keeps about one pass (part of the
``autograd_container`` component; read :mod:`distlab.reference.autograd_container` first).

Twinned with ``core/_autograd_context.pxi`` (included by ``core/_autograd_container.pyx``).

Mirrors torch/csrc/distributed/autograd/context/context.cpp (``DistAutogradContext``) and
rpc_messages/autograd_metadata.h (``AutogradMetadata``).
"""
from __future__ import annotations

import threading

from distlab._common.autograd_container import (
    backward_already_running,
    check_id,
    describe_context,
    first_error_future,
    function_error,
    gradients_as_tensors,
    private_copy,
    send_function_not_found,
)
from distlab.autograd.sparse import add_grads

__all__ = ["AutogradMetadata", "DistAutogradContext"]

class AutogradMetadata:
    """What an RPC carries for distributed autograd: ``(context_id, message_id)`` (mirrors autograd_metadata.h).

    Parameters
    ----------
    context_id : int
        The distributed autograd pass the RPC belongs to.
    message_id : int
        Names the send/recv function pair this RPC creates (unique across the world).
    """

    __slots__ = ("context_id", "message_id")

    def __init__(self, context_id: int, message_id: int):
        self.context_id = check_id(context_id)
        self.message_id = check_id(message_id, "message id")

    def to_tuple(self) -> tuple:
        """The wire form ``(context_id, message_id)``."""
        return (self.context_id, self.message_id)

    def __eq__(self, other):
        return isinstance(other, AutogradMetadata) and self.to_tuple() == other.to_tuple()

    def __hash__(self):
        return hash(self.to_tuple())

    def __repr__(self):
        return f"AutogradMetadata(context_id={self.context_id}, message_id={self.message_id})"


class DistAutogradContext:
    """Everything one worker knows about one distributed autograd pass (mirrors context.cpp).

    Parameters
    ----------
    context_id : int
        The pass's id (minted by the worker that opened it).

    Notes
    -----
    Keeping the send/recv functions here keeps them (and so the graph behind them) alive until the context is
    released, and lets backward find them by message id.
    """

    def __init__(self, context_id: int):
        self._context_id = check_id(context_id)
        self._lock = threading.Lock()  # mirrors context.h lock_
        self._known_workers = set()  # knownWorkerIds_
        self._send = {}  # message id -> SendRpcBackward (sendAutogradFunctions_)
        self._recv = {}  # message id -> RecvRpcBackward (recvAutogradFunctions_)
        self._grads = {}  # id(tensor) -> [tensor, gradient] (accumulatedGrads_, keyed by identity)
        self._outstanding = []  # futures of gradient RPCs this worker sent (outStandingRpcs_)
        self._graph_task = None  # the distributed engine's state for this pass on this worker

    @property
    def context_id(self) -> int:
        """The pass's id."""
        return self._context_id

    # -- known workers (mirrors DistAutogradContext::addKnownWorkerId / getKnownWorkerIds) ------------------
    def add_known_worker_id(self, worker_id: int) -> None:
        """Record that an RPC of this pass went to ``worker_id`` (so the context is released there too)."""
        with self._lock:
            self._known_workers.add(int(worker_id))

    def known_worker_ids(self) -> set:
        """The workers this pass sent RPCs to, as a set of ids."""
        with self._lock:
            return set(self._known_workers)

    # -- send / recv functions (mirrors addSendFunction, addRecvFunction, retrieveSendFunction) --------------
    def add_send_function(self, func, message_id: int) -> None:
        """Record the ``SendRpcBackward`` of the RPC ``message_id`` (error if the id is already used)."""
        self._add_function(self._send, "send", func, message_id)

    def add_recv_function(self, func, message_id: int) -> None:
        """Record the ``RecvRpcBackward`` of the RPC ``message_id`` (error if the id is already used)."""
        self._add_function(self._recv, "recv", func, message_id)

    def _add_function(self, table, what, func, message_id):
        if func is None:
            raise function_error(self._context_id, what, None)
        message_id = check_id(message_id, "message id")
        with self._lock:
            if message_id in table:  # one RPC records one function on each side
                raise function_error(self._context_id, what, message_id)
            table[message_id] = func

    def send_functions(self) -> dict:
        """``{message id: SendRpcBackward}`` (a copy, in insertion order)."""
        with self._lock:
            return dict(self._send)

    def recv_functions(self) -> dict:
        """``{message id: RecvRpcBackward}`` (a copy, in insertion order)."""
        with self._lock:
            return dict(self._recv)

    def retrieve_send_function(self, message_id: int):
        """The send function of RPC ``message_id``; DistAutogradError if this context has none."""
        with self._lock:
            func = self._send.get(int(message_id))
        if func is None:
            raise send_function_not_found(self._context_id, message_id)
        return func

    # -- gradients (mirrors DistAutogradContext::accumulateGrad / getGradients) ------------------------------
    def accumulate_grad(self, variable, grad) -> None:
        """Add ``grad`` (an array or SparseGrad) to the gradient this pass holds for leaf ``variable``.

        The first gradient is stored as a private copy; later ones are added out of place, so a dict returned by
        :meth:`get_gradients` earlier never changes under its holder. ``variable.grad`` is never touched.
        """
        with self._lock:
            entry = self._grads.get(id(variable))
            if entry is None:
                self._grads[id(variable)] = [variable, private_copy(variable, grad)]
            else:
                entry[1] = add_grads(entry[1], grad)  # out of place: earlier results stay as they were

    def get_gradients(self) -> dict:
        """``{leaf Tensor: gradient Tensor}`` accumulated in this context (SparseGrad stays sparse)."""
        with self._lock:
            entries = list(self._grads.values())
        return gradients_as_tensors(entries)

    # -- outstanding RPCs (mirrors addOutstandingRpc / clearAndWaitForOutstandingRpcsAsync) ------------------
    def add_outstanding_rpc(self, future) -> None:
        """Track the future of a gradient RPC this worker sent during backward."""
        with self._lock:
            self._outstanding.append(future)

    def num_outstanding_rpcs(self) -> int:
        """Gradient RPCs tracked and not yet cleared."""
        with self._lock:
            return len(self._outstanding)

    def clear_outstanding_rpcs(self) -> None:
        """Forget the tracked futures (a new backward pass in this context starts clean)."""
        with self._lock:
            self._outstanding = []

    def clear_and_wait_for_outstanding_rpcs_async(self):
        """Take the tracked futures; return a Future that completes when all succeeded, or with the first error.

        First error wins: the result fails as soon as one RPC fails (with that RPC's error), without waiting for
        the others, so a failed worker cannot stall the pass behind RPCs that will never be answered.
        """
        with self._lock:
            futures, self._outstanding = self._outstanding, []
        return first_error_future(futures, self._context_id)

    # -- engine state (mirrors setGraphTask / retrieveGraphTask / resetGraphTask) ----------------------------
    def set_graph_task(self, task) -> None:
        """Attach the distributed engine's state of this pass (error if one is attached already)."""
        with self._lock:
            if self._graph_task is not None:
                raise backward_already_running(self._context_id)
            self._graph_task = task

    def retrieve_graph_task(self):
        """The attached engine state, or None."""
        return self._graph_task

    def reset_graph_task(self) -> None:
        """Detach the engine state once the pass is over."""
        with self._lock:
            self._graph_task = None

    def __repr__(self):
        with self._lock:
            return describe_context(self._context_id, self._known_workers, self._send, self._recv, len(self._grads))
