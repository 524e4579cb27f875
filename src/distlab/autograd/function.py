"""Custom differentiable operations (mirrors ``torch.autograd.Function``).

Subclass :class:`Function`, write ``forward(ctx, *args)`` over arrays or Tensors and ``backward(ctx, grad)``
returning one gradient per forward argument, and call ``MyFn.apply(*args)``. Distributed autograd can use this
(or subclass :class:`~distlab.autograd.node.Node` directly) for its send/recv functions.
"""
from __future__ import annotations

from . import grad_mode
from .node import Node
from .ops import edge, needs_grad
from .tensor import Tensor, _as_array

__all__ = ["Function", "FunctionCtx"]


class FunctionCtx:
    """The ``ctx`` object passed to forward and backward: save what backward needs on it."""

    def __init__(self, needs_input_grad):
        self.needs_input_grad = needs_input_grad
        self.saved_tensors = ()

    def save_for_backward(self, *values) -> None:
        """Keep ``values`` for backward (read them back as ``ctx.saved_tensors``)."""
        self.saved_tensors = values


class FunctionBackward(Node):
    """The node recorded for a custom Function: calls ``cls.backward(ctx, grad)`` (torch's ``BackwardCFunction``)."""

    __slots__ = ("fn_cls",)

    def __init__(self, next_nodes, saved, fn_cls):
        super().__init__(next_nodes, saved)
        self.fn_cls = fn_cls

    def name(self) -> str:
        return f"{self.fn_cls.__name__}Backward"

    def apply(self, g):
        grads = self.fn_cls.backward(self.saved, Tensor._wrap(g))
        if not isinstance(grads, tuple):
            grads = (grads,)
        if len(grads) != len(self.next_nodes):
            raise RuntimeError(f"{self.fn_cls.__name__}.backward returned {len(grads)} gradients, "
                               f"expected {len(self.next_nodes)} (one per forward argument)")
        return tuple(None if gr is None else _as_array(gr) for gr in grads)


class Function:
    """Base class for custom ops: implement static ``forward(ctx, *args)`` and ``backward(ctx, grad)``."""

    @staticmethod
    def forward(ctx, *args):
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError

    @classmethod
    def apply(cls, *args) -> Tensor:
        """Run forward without recording inner ops and record one node for the whole function."""
        ctx = FunctionCtx(tuple(isinstance(a, Tensor) and a.requires_grad for a in args))
        with grad_mode.no_grad():
            out = cls.forward(ctx, *args)
        data = _as_array(out)
        if not needs_grad(*args):
            return Tensor._wrap(data)
        return Tensor._wrap(data, FunctionBackward(tuple(edge(a) for a in args), ctx, cls))
