"""distlab.autograd: a small, real reverse-mode autograd engine over numpy (and cupy).

Pieces and the PyTorch code they mirror:

- :class:`Tensor` (tensor.py): ndarray + ``grad``/``grad_fn``/hooks (``Variable``, ``AutogradMeta``).
- :class:`Node` (node.py), :class:`AccumulateGrad` (accumulate_grad.py): backward functions (function.h,
  accumulate_grad.h); :func:`set_grad_buffer`, where a leaf's first gradient may be computed in place;
  :func:`run_post_accumulate_grad_hooks`, for a gradient delivered by hand.
- :func:`run_backward`, :func:`queue_callback`, :func:`graph_leaves` (engine.py): the engine (engine.cpp).
- ops.py, shape_ops.py: differentiable operations (derivatives.yaml).
- :class:`SparseGrad` (sparse.py): row-sparse gradients of sparse embeddings.
- :class:`Function` (function.py): custom differentiable operations.

Imports run one way: tensor.py imports none of the modules that use Tensor. The Tensor methods that need them
are installed on the class by the module that implements them (``_grad_node`` by accumulate_grad.py,
``backward`` by engine.py, the operators by ops.py and shape_ops.py), all of which this package imports.
"""
from __future__ import annotations

# Tensor is defined in tensor.py, which imports none of the modules below; accumulate_grad, engine, ops and
# shape_ops install its autograd methods and operators when imported (importing this package imports them all).
from ._array import array_module, is_cupy, register_device_array, to_numpy
from .tensor import Tensor, _check_gradient, tensor
from .engine import compute_dependencies, graph_leaves, is_backward_running, queue_callback, run_backward, walk_graph
from .function import Function, FunctionCtx
from .grad_mode import enable_grad, is_grad_enabled, no_grad, set_grad_enabled
from .gradcheck import gradcheck, numerical_grad
from .accumulate_grad import AccumulateGrad, run_post_accumulate_grad_hooks, set_grad_buffer
from .node import Node, RemovableHandle
from .ops import abs, add, div, exp, log, matmul, mul, neg, pow, relu, sigmoid, sqrt, sub, tanh
from .shape_ops import concatenate, getitem, log_softmax, mean, reshape, softmax, stack, sum, transpose
from .sparse import SparseGrad

__all__ = [
    "Tensor", "tensor", "no_grad", "enable_grad", "set_grad_enabled", "is_grad_enabled",
    "Node", "AccumulateGrad", "RemovableHandle", "Function", "FunctionCtx", "SparseGrad",
    "backward", "grad", "run_backward", "queue_callback", "is_backward_running",
    "compute_dependencies", "walk_graph", "graph_leaves", "set_grad_buffer", "run_post_accumulate_grad_hooks",
    "gradcheck", "numerical_grad",
    "array_module", "is_cupy", "register_device_array", "to_numpy",
    "add", "sub", "mul", "div", "neg", "pow", "exp", "log", "sqrt", "relu", "tanh", "sigmoid", "abs", "matmul",
    "sum", "mean", "reshape", "transpose", "getitem", "concatenate", "stack", "log_softmax", "softmax",
]


def backward(tensors, grad_tensors=None, retain_graph: bool = False) -> None:
    """Accumulate into the leaves' ``.grad`` the gradient of ``tensors`` (``torch.autograd.backward``)."""
    if isinstance(tensors, Tensor):
        tensors = [tensors]
    if grad_tensors is None or isinstance(grad_tensors, Tensor):
        grad_tensors = [grad_tensors] * len(tensors) if grad_tensors is None else [grad_tensors]
    grads = [_check_gradient(t, g) for t, g in zip(tensors, grad_tensors)]
    run_backward(list(tensors), grads, retain_graph=retain_graph)


def grad(outputs, inputs, grad_outputs=None, retain_graph: bool = False, allow_unused: bool = False):
    """Return the gradients of ``outputs`` with respect to the leaf tensors ``inputs`` without touching ``.grad``.

    A subset of ``torch.autograd.grad``: ``inputs`` must be leaves. Post-accumulate-grad hooks do not fire.
    """
    if isinstance(outputs, Tensor):
        outputs = [outputs]
    single = isinstance(inputs, Tensor)
    inputs = [inputs] if single else list(inputs)
    if grad_outputs is None or isinstance(grad_outputs, Tensor):
        grad_outputs = [grad_outputs] * len(outputs) if grad_outputs is None else [grad_outputs]
    wanted = {id(x): i for i, x in enumerate(inputs)}
    results = [None] * len(inputs)

    def sink(leaf, g):
        i = wanted.get(id(leaf))
        if i is not None:
            results[i] = g if results[i] is None else results[i] + g

    grads = [_check_gradient(t, g) for t, g in zip(outputs, grad_outputs)]
    run_backward(list(outputs), grads, retain_graph=retain_graph, accumulate=sink)
    if not allow_unused and any(r is None for r in results):
        raise RuntimeError("one of the differentiated tensors appears to not have been used in the graph; "
                           "set allow_unused=True if this is the desired behaviour")
    out = [None if r is None else (r if getattr(r, "is_sparse", False) else Tensor._wrap(r)) for r in results]
    return out[0] if single else tuple(out)
