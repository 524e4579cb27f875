"""``distlab.rpc.functions``: mirrors ``torch.distributed.rpc.functions``.

A function run through RPC normally answers with the value it returns. One decorated with
:func:`async_execution` returns a :class:`~distlab.futures.Future` instead, and the callee answers when that
future completes (with its value or its error), without holding a thread meanwhile: the pattern for functions
that wait on other RPCs, or on work queued elsewhere (a batch being filled, a parameter-server round).

Without the decorator, a function that returns a Future is an error (a ``TypeError`` raised on the callee, so a
:class:`~distlab.errors.RemoteError` for the caller), as in PyTorch, where the Future could not be sent. The
decorator states the intent where the function is defined, not at each call site.
"""
from __future__ import annotations

import functools

__all__ = ["async_execution", "is_async_execution"]


def async_execution(fn):
    """Mark ``fn`` as returning a :class:`~distlab.futures.Future` whose result is the RPC's answer.

    Works for ``rpc_sync``, ``rpc_async``, ``remote`` (the OwnerRRef takes the future's value) and the RRef
    proxies (a method decorated this way). Combine with ``@staticmethod`` / ``@classmethod`` by putting those
    outside (``@staticmethod`` then ``@async_execution``), as in PyTorch.

    Examples
    --------
    >>> @async_execution
    ... def add_later(to, x, y):
    ...     return rpc.rpc_async(to, operator.add, (x, y)).then(lambda f: f.value() * 2)
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    wrapper._wrapped_async_rpc_function = fn  # torch's attribute name
    return wrapper


def is_async_execution(fn) -> bool:
    """True when ``fn`` (a function, or a bound or unbound method) was decorated with :func:`async_execution`."""
    return hasattr(fn, "_wrapped_async_rpc_function")


def check_result(fn, result, future_type):
    """The answer of ``fn``'s call: ``result`` itself. TypeError when a Future comes from an undecorated function,
    or anything else from a decorated one (both are mistakes that would otherwise surface far away)."""
    decorated = is_async_execution(fn)
    if isinstance(result, future_type):
        if not decorated:
            raise TypeError(
                f"rpc: {getattr(fn, '__qualname__', fn)!r} returned a distlab.futures.Future; decorate it with "
                "@distlab.rpc.functions.async_execution to answer when that future completes")
    elif decorated:
        raise TypeError(f"rpc: {getattr(fn, '__qualname__', fn)!r} is decorated with @async_execution but returned "
                        f"{type(result).__name__}, not a distlab.futures.Future")
    return result
