"""Call wrappers: how another subsystem rewrites the calls of ``rpc_sync``, ``rpc_async``, ``remote`` and
``RRef.to_here`` without distlab.rpc knowing it.

Distributed autograd is the user: inside a context, a call must carry autograd metadata and its reply must pass
through the receiving side's bookkeeping (torch does this inside its agent, in utils.cpp getMessageWithAutograd).
Rather than importing distributed autograd, distlab.rpc consults the wrappers registered here, so the dependency
runs one way (distributed autograd imports rpc, never the reverse)::

    def wrapper(dst_id, func, args, kwargs, remote):
        if nothing_to_do:
            return None                       # the call goes out as it is
        return new_func, new_args, new_kwargs, unwrap   # unwrap(reply) -> the value the caller sees

    remove = register_call_wrapper(wrapper)

Wrappers apply in registration order; the ``unwrap`` functions of a call run in the reverse order on its reply.
For ``remote`` the reply is an RRef and ``unwrap`` is not applied.
"""
from __future__ import annotations

import threading
from typing import Callable

__all__ = ["register_call_wrapper", "unregister_call_wrapper", "is_registered", "wrap_call", "wrap_for", "registered"]

_lock = threading.Lock()
#: The registered wrappers, replaced (never mutated) on change so that readers need no lock. The per-call paths
#: test it before calling :func:`wrap_for` (no call at all when none is registered); only this module assigns it.
registered: tuple = ()


def register_call_wrapper(fn: Callable) -> Callable[[], None]:
    """Register ``fn(dst_id, func, args, kwargs, remote)``; return a function that unregisters it.

    Raises
    ------
    TypeError
        ``fn`` is not callable.
    ValueError
        ``fn`` is registered already.
    """
    global registered
    if not callable(fn):
        raise TypeError(f"register_call_wrapper: the wrapper must be callable, got {type(fn).__name__}")
    with _lock:
        if fn in registered:
            raise ValueError(f"register_call_wrapper: {fn!r} is registered already")
        registered = registered + (fn,)
    return lambda: unregister_call_wrapper(fn)


def unregister_call_wrapper(fn: Callable) -> None:
    """Remove ``fn`` (nothing happens if it is not registered)."""
    global registered
    with _lock:
        registered = tuple(w for w in registered if w is not fn)


def is_registered(fn: Callable) -> bool:
    """True if ``fn`` is a registered call wrapper."""
    return fn in registered


def wrap_call(dst_id: int, func, args, kwargs, remote: bool = False):
    """Pass a call through every wrapper; return None (no wrapper changed it) or ``(func, args, kwargs, unwrap)``."""
    unwraps = []
    for wrapper in registered:
        wrapped = wrapper(dst_id, func, args, kwargs, remote)
        if wrapped is not None:
            func, args, kwargs, unwrap = wrapped
            unwraps.append(unwrap)
    if not unwraps:
        return None
    if len(unwraps) == 1:
        return func, args, kwargs, unwraps[0]

    def unwrap_all(reply):
        for unwrap in reversed(unwraps):
            reply = unwrap(reply)
        return reply

    return func, args, kwargs, unwrap_all


def wrap_for(agent, to, func, args, kwargs, remote: bool = False):
    """:func:`wrap_call` for a call to worker ``to`` (a name, id or WorkerInfo) of ``agent``; None when no wrapper
    is registered or none changed the call."""
    return registered and wrap_call(agent.worker_info(to).id, func, args, kwargs, remote)
