"""Grad mode: whether operations record the graph (mirrors torch's thread-local ``GradMode``).

Grad mode is per thread, as in PyTorch: an RPC worker thread running a function is not affected by a
``no_grad()`` block in the main thread.
"""
from __future__ import annotations

import functools
import threading

__all__ = ["no_grad", "enable_grad", "set_grad_enabled", "is_grad_enabled"]


class _GradState(threading.local):
    enabled = True  # class attribute: the default every new thread sees


_state = _GradState()


def is_grad_enabled() -> bool:
    """Return True if operations on tensors that require grad currently record a graph."""
    return _state.enabled


class set_grad_enabled:
    """Context manager (and decorator) that sets grad mode to ``mode`` and restores the previous mode on exit."""

    def __init__(self, mode: bool = True):
        self.mode = bool(mode)
        self.prev = None

    def __enter__(self):
        self.prev = _state.enabled
        _state.enabled = self.mode
        return self

    def __exit__(self, *exc):
        _state.enabled = self.prev
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self.__class__(self.mode):
                return fn(*args, **kwargs)

        return wrapper


class no_grad(set_grad_enabled):
    """Disable graph recording: ``with distlab.no_grad(): ...`` or ``@distlab.no_grad()``."""

    def __init__(self):
        super().__init__(False)

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with no_grad():
                return fn(*args, **kwargs)

        return wrapper


class enable_grad(set_grad_enabled):
    """Enable graph recording inside a ``no_grad`` block."""

    def __init__(self):
        super().__init__(True)

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with enable_grad():
                return fn(*args, **kwargs)

        return wrapper
