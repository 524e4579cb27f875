"""The Tensor: an ndarray (numpy or cupy) plus what autograd needs (mirrors torch's ``Variable``/``AutogradMeta``).

A tensor is a *leaf* when ``grad_fn`` is None (created by the user, e.g. a Parameter); otherwise ``grad_fn`` is
the :class:`~distlab.autograd.node.Node` that computes its inputs' gradients. Operators delegate to
:mod:`distlab.autograd.ops`.
"""
from __future__ import annotations

import weakref

import numpy as np

from ._array import array_module, is_cupy, to_numpy
from .node import add_hook

__all__ = ["Tensor", "tensor"]


def _as_array(value):
    """Unwrap a Tensor to its array; arrays and SparseGrad pass through; anything else goes through np.asarray."""
    if isinstance(value, Tensor):
        return value.data
    if isinstance(value, np.ndarray) or is_cupy(value) or getattr(value, "is_sparse", False):
        return value
    return np.asarray(value)


class Tensor:
    """An n-dimensional array that records the operations applied to it.

    Parameters
    ----------
    data : array_like
        Wrapped as is when it is already a numpy/cupy array (no copy), else converted with ``np.asarray``.
    requires_grad : bool
        Whether gradients should be computed for this tensor.
    """

    __slots__ = ("data", "grad", "requires_grad", "grad_fn", "_accumulator", "_hooks", "_post_acc_hooks",
                 "_retains_grad", "__weakref__", "__dict__")
    __array_priority__ = 1000  # ndarray <op> Tensor defers to Tensor's reflected operator
    __hash__ = object.__hash__  # identity hash (== is element-wise), so tensors can key optimizer state
    is_sparse = False

    def __init__(self, data, requires_grad: bool = False):
        if isinstance(data, Tensor):
            data = data.data
        elif not (isinstance(data, np.ndarray) or is_cupy(data)):
            data = np.asarray(data)
        self.data = data
        self.grad = None
        self.requires_grad = bool(requires_grad)
        self.grad_fn = None
        self._accumulator = None
        self._hooks = None
        self._post_acc_hooks = None
        self._retains_grad = False

    @classmethod
    def _wrap(cls, data, grad_fn=None):
        """Fast constructor for op outputs and gradients (no conversion, no checks)."""
        t = object.__new__(Tensor)
        t.data = data
        t.grad = None
        t.requires_grad = grad_fn is not None
        t.grad_fn = grad_fn
        t._accumulator = None
        t._hooks = None
        t._post_acc_hooks = None
        t._retains_grad = False
        return t

    # -- metadata -------------------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple:
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def is_leaf(self) -> bool:
        """True for tensors not produced by a recorded operation (user-created tensors, parameters)."""
        return self.grad_fn is None

    @property
    def device(self) -> str:
        return "cuda" if is_cupy(self.data) else "cpu"

    @property
    def T(self) -> "Tensor":
        return self.transpose()

    def size(self, dim=None):
        """The shape (``size()``) or the length of one dimension (``size(dim)``), as torch's."""
        return self.data.shape if dim is None else self.data.shape[dim]

    def numel(self) -> int:
        return int(self.data.size)

    def dim(self) -> int:
        return self.data.ndim

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        extra = f", grad_fn=<{self.grad_fn.name()}>" if self.grad_fn is not None else (
            ", requires_grad=True" if self.requires_grad else "")
        return f"tensor({self.data!r}{extra})"

    # -- conversion -----------------------------------------------------------------------------------------
    def numpy(self) -> np.ndarray:
        """The data as a numpy array (copied to the host for cupy)."""
        return to_numpy(self.data)

    def item(self):
        return self.data.item()

    def tolist(self):
        return to_numpy(self.data).tolist()

    def detach(self) -> "Tensor":
        """A new leaf tensor sharing the same data, outside the graph."""
        return Tensor._wrap(self.data)

    def detach_(self) -> "Tensor":
        """Detach in place: make this tensor a leaf that does not require grad."""
        self.grad_fn = None
        self.requires_grad = False
        return self

    def requires_grad_(self, requires_grad: bool = True) -> "Tensor":
        if self.grad_fn is not None and not requires_grad:
            raise RuntimeError("you can only change requires_grad flags of leaf variables")
        self.requires_grad = requires_grad
        return self

    def to(self, device) -> "Tensor":
        """Copy to ``"cpu"`` (numpy) or ``"cuda"`` (cupy); not recorded in the graph. Returns self if already there."""
        if device == self.device:
            return self
        if device == "cpu":
            data = to_numpy(self.data)
        else:
            import cupy

            data = cupy.asarray(self.data)
        return Tensor(data, requires_grad=self.requires_grad and self.is_leaf)

    # -- autograd -------------------------------------------------------------------------------------------
    def _grad_node(self):
        """The node that receives this tensor's gradient: grad_fn, the leaf's AccumulateGrad, or None."""
        if self.grad_fn is not None:
            return self.grad_fn
        if not self.requires_grad:
            return None
        node = self._accumulator() if self._accumulator is not None else None
        if node is None:
            node = _accumulate_grad.AccumulateGrad(self)
            self._accumulator = weakref.ref(node)
        return node

    def backward(self, gradient=None, retain_graph: bool = False) -> None:
        """Compute the gradient of this tensor with respect to the graph's leaves (see torch.Tensor.backward).

        Parameters
        ----------
        gradient : Tensor or array, optional
            d(loss)/d(self); may be omitted only for single-element tensors (it is then 1).
        retain_graph : bool
            Keep the saved values so backward can run through this graph again.
        """
        _engine.run_backward([self], [_check_gradient(self, gradient)], retain_graph=retain_graph)

    def register_hook(self, hook) -> "RemovableHandle":  # noqa: F821
        """Register ``hook(grad) -> Tensor or None``, called with this tensor's gradient before it is used.

        A returned value replaces the gradient. On a leaf the hook runs before accumulation into ``.grad``.
        """
        if not self.requires_grad:
            raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
        if self.grad_fn is not None:
            return self.grad_fn.register_prehook(hook)
        self._hooks, handle = add_hook(self._hooks, hook)
        return handle

    def register_post_accumulate_grad_hook(self, hook) -> "RemovableHandle":  # noqa: F821
        """Register ``hook(tensor)``, called after this leaf's ``.grad`` has been updated in a backward pass.

        Mirrors ``torch.Tensor.register_post_accumulate_grad_hook``; DDP's reducer uses it as its
        ``autograd_hook``. It fires once per backward pass, when this leaf's gradient is complete.
        """
        if self.grad_fn is not None:
            raise RuntimeError("post accumulate grad hooks cannot be registered on non-leaf tensors")
        if not self.requires_grad:
            raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
        self._post_acc_hooks, handle = add_hook(self._post_acc_hooks, hook)
        return handle

    def retain_grad(self) -> None:
        """Make a non-leaf tensor keep its ``.grad`` after backward (leaves always do)."""
        if self.grad_fn is None or self._retains_grad:
            return
        self._retains_grad = True
        ref = weakref.ref(self)

        def _retain(grad):
            t = ref()
            if t is not None:
                t.grad = Tensor._wrap(grad.data.copy()) if t.grad is None else Tensor._wrap(t.grad.data + grad.data)

        self.grad_fn.register_prehook(_retain)

    # -- operators (all recorded by distlab.autograd.ops) ---------------------------------------------------
    def __add__(self, other): return _ops.add(self, other)
    def __radd__(self, other): return _ops.add(other, self)
    def __sub__(self, other): return _ops.sub(self, other)
    def __rsub__(self, other): return _ops.sub(other, self)
    def __mul__(self, other): return _ops.mul(self, other)
    def __rmul__(self, other): return _ops.mul(other, self)
    def __truediv__(self, other): return _ops.div(self, other)
    def __rtruediv__(self, other): return _ops.div(other, self)
    def __matmul__(self, other): return _ops.matmul(self, other)
    def __rmatmul__(self, other): return _ops.matmul(other, self)
    def __pow__(self, exponent): return _ops.pow(self, exponent)
    def __rpow__(self, base): return _ops.pow(base, self)
    def __neg__(self): return _ops.neg(self)
    def __pos__(self): return self
    def __getitem__(self, index): return _shape_ops.getitem(self, index)

    # Comparisons are not differentiable: they return plain boolean arrays.
    def __lt__(self, other): return self.data < _as_array(other)
    def __le__(self, other): return self.data <= _as_array(other)
    def __gt__(self, other): return self.data > _as_array(other)
    def __ge__(self, other): return self.data >= _as_array(other)
    def __eq__(self, other): return self.data == _as_array(other)
    def __ne__(self, other): return self.data != _as_array(other)

    def exp(self): return _ops.exp(self)
    def log(self): return _ops.log(self)
    def sqrt(self): return _ops.sqrt(self)
    def relu(self): return _ops.relu(self)
    def tanh(self): return _ops.tanh(self)
    def sigmoid(self): return _ops.sigmoid(self)
    def abs(self): return _ops.abs(self)
    def sum(self, axis=None, keepdims=False): return _shape_ops.sum(self, axis, keepdims)
    def mean(self, axis=None, keepdims=False): return _shape_ops.mean(self, axis, keepdims)
    def reshape(self, *shape): return _shape_ops.reshape(self, *shape)
    def view(self, *shape): return _shape_ops.reshape(self, *shape)
    def flatten(self): return _shape_ops.reshape(self, -1)
    def transpose(self, *axes): return _shape_ops.transpose(self, *axes)
    def log_softmax(self, axis=-1): return _shape_ops.log_softmax(self, axis)
    def softmax(self, axis=-1): return _shape_ops.softmax(self, axis)


def _check_gradient(out: Tensor, gradient):
    """Validate ``backward``'s gradient argument and return it as an array (torch's ``_make_grads``)."""
    if not out.requires_grad:
        raise RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn; "
                           "call backward on a tensor computed from tensors with requires_grad=True")
    if gradient is None:
        if out.data.size != 1:
            raise RuntimeError(f"grad can be implicitly created only for scalar outputs; this tensor has shape "
                               f"{tuple(out.shape)}: pass gradient= of that shape")
        return array_module(out.data).ones_like(out.data)
    grad = _as_array(gradient)
    if tuple(grad.shape) != tuple(out.shape):
        raise RuntimeError(f"Mismatch in shape: grad_output[0] has a shape of {tuple(grad.shape)} and "
                           f"output[0] has a shape of {tuple(out.shape)}")
    return grad


def zero_grads(params, set_to_none: bool = True) -> None:
    """Reset the gradients of ``params``: to None (the default, as torch 2.x) or to zeros in place.

    What ``Module.zero_grad`` and ``Optimizer.zero_grad`` both do; a sparse gradient is always dropped (it has no
    dense storage to zero).
    """
    for p in params:
        if p.grad is None:
            continue
        if set_to_none or getattr(p.grad, "is_sparse", False):
            p.grad = None
        else:
            p.grad.data[...] = 0


def tensor(data, requires_grad: bool = False, dtype=None) -> Tensor:
    """Create a leaf tensor from ``data`` (copied, as ``torch.tensor`` does).

    ``dtype`` defaults to the array's own dtype (numpy's inference: Python floats become float64).
    """
    if isinstance(data, Tensor):
        data = data.data
    xp = array_module(data)
    return Tensor(xp.array(data, dtype=dtype), requires_grad=requires_grad)


# These modules import Tensor back; bound here, looked up at call time.
from . import accumulate_grad as _accumulate_grad  # noqa: E402
from . import engine as _engine  # noqa: E402
from . import ops as _ops  # noqa: E402
from . import shape_ops as _shape_ops  # noqa: E402
