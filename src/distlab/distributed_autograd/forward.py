"""Forward: RPCs made inside a context carry autograd metadata and record send/recv functions (mirrors
torch/csrc/distributed/autograd/utils.cpp getMessageWithAutograd, addSendRpcBackward, addRecvRpcBackward, and
rpc/request_callback_no_python.cpp processForwardAutogradReq).

:func:`wrap_call` is this package's call wrapper (:mod:`distlab.rpc.wrappers`), registered when distributed
autograd attaches to the agent. Inside a context it rewrites ``rpc_sync(dst, f, args)`` into a call of
:func:`autograd_call` carrying ``(context id, message id, sender)``: the sender records a ``SendRpcBackward`` for
the tensors that require grad, the callee a ``RecvRpcBackward`` per such tensor, runs ``f`` in the caller's
context, and does the same for the reply. Every RPC records its destination as a known worker of the context,
even without tensors (forced grad recording), so that the release reaches it.

Tensors travel as their data and ``requires_grad`` (``Tensor.__reduce_ex__``), arriving as leaves, then given a
recv function.
"""
from __future__ import annotations

from distlab.autograd import grad_mode
from distlab.autograd.tensor import Tensor
from distlab.errors import DistAutogradError
from distlab.rpc import framing

from . import _state
from .engine import RecvRpcBackward, RecvRpcGroup, SendRpcBackward

__all__ = ["wrap_call", "autograd_call", "autograd_remote"]


# -- tensors over the wire --------------------------------------------------------------------------------------
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


# -- send and recv functions (utils.cpp addSendRpcBackward / addRecvRpcBackward) ------------------------------------
def _add_send(ctx, tensors, message_id, to_worker):
    if tensors:
        fn = SendRpcBackward(tuple(t._grad_node() for t in tensors), message_id, to_worker)
        ctx.add_send_function(fn, message_id)


def _add_recv(ctx, tensors, message_id, from_worker):
    tensors = [t for t in tensors if t.requires_grad]
    if tensors:
        group = RecvRpcGroup(message_id, from_worker, len(tensors))
        for i, t in enumerate(tensors):
            t.grad_fn = RecvRpcBackward(group, i)  # set_history: the received tensor is now a non-leaf
        ctx.add_recv_function(group, message_id)


# -- the caller's side ------------------------------------------------------------------------------------------
def wrap_call(dst, func, args, kwargs, remote=False):
    """The call wrapper: None outside a context, else the call rewritten to carry autograd metadata.

    Returns ``(autograd_call or autograd_remote, (meta, func, args, kwargs), None, unwrap)``; ``unwrap`` gives the
    reply's tensors recv functions (the reply's metadata names the callee's send function).
    """
    twin = _state.twin()
    if not twin.is_initialized():
        return None
    container = twin.get_container()
    if not container.has_valid_context():
        return None
    agent = _state.attach()
    ctx = container.current_context()
    message_id = container.new_autograd_message_id()
    _add_send(ctx, _needing_grad((args, kwargs)), message_id, dst)
    ctx.add_known_worker_id(dst)
    # the wire form of AutogradMetadata plus the sender (RpcWithAutograd's fromWorkerId): AUTOGRAD_METADATA_FIELDS
    meta = twin.AutogradMetadata(ctx.context_id, message_id).to_tuple() + (agent.rank,)
    call = (autograd_remote if remote else autograd_call, (meta, framing.by_value(func), args, kwargs), None)

    def unwrap(reply):
        response_meta, value = reply
        if response_meta is not None:
            _add_recv(ctx, _tensors(value, []), response_meta[1], response_meta[2])
        return value

    return call + (unwrap,)


# -- the callee's side (processForwardAutogradReq) -----------------------------------------------------------------
def _enter(meta, args, kwargs):
    context_id, message_id, from_worker = meta
    agent = _state.attach()
    container = _state.twin().get_container()
    if _state.is_released(context_id):
        raise DistAutogradError(
            f"an RPC of distributed autograd context {context_id} from worker {from_worker} reached worker "
            f"{agent.rank} after the context was released there (the RPC outlived its context); refused, so that "
            "no context is re-created and leaked")
    ctx = container.get_or_create_context(context_id)
    _add_recv(ctx, _tensors((args, kwargs), []), message_id, from_worker)
    return agent, container, ctx


def autograd_call(meta, func, args, kwargs):
    """Callee side of ``rpc_sync``/``rpc_async``: recv functions, run in the caller's context, send functions.

    Returns ``(reply metadata or None, value)``: the metadata when the value holds tensors that require grad.
    """
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


def autograd_remote(meta, func, args, kwargs):
    """Owner side of ``remote`` inside a context: recv functions for the arguments, run in the context."""
    _agent, container, ctx = _enter(meta, args, kwargs)
    previous = container.force_current_context_id(ctx.context_id)
    try:
        ctx.add_known_worker_id(meta[2])
        return func(*args, **kwargs) if kwargs else func(*args)
    finally:
        container.force_current_context_id(previous)


_state.provide_call_wrapper(wrap_call)
