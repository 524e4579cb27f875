"""The Tensor: an ndarray (numpy or cupy) plus what autograd needs (mirrors torch's ``Variable``/``AutogradMeta``).

A tensor is a *leaf* when ``grad_fn`` is None (created by the user, e.g. a Parameter); otherwise ``grad_fn`` is
the :class:`~distlab.autograd.node.Node` that computes its inputs' gradients. The differentiable operators and
methods are installed on the class by :mod:`distlab.autograd.ops` and :mod:`distlab.autograd.shape_ops` (which
import this module, never the other way round).
"""
from __future__ import annotations

import copy
import weakref

import numpy as np

from ._array import array_module, is_cupy, to_numpy
from .node import add_hook

__all__ = ["Tensor", "tensor"]


def _rebuild_tensor(cls, data, requires_grad: bool, attributes=None):
    """A leaf of class ``cls`` (Tensor, Parameter or a subclass) around ``data``: what unpickling calls."""
    tensor = object.__new__(cls)
    Tensor.__init__(tensor, data, requires_grad=requires_grad)
    if attributes:
        tensor.__dict__.update(attributes)
    return tensor


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
                 "_retains_grad", "_grad_buffer", "__weakref__", "__dict__")
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
        self._grad_buffer = None  # where a first gradient may be computed in place (see set_grad_buffer)

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
        t._grad_buffer = None
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

    # -- pickling and copying (torch/_tensor.py __reduce_ex__ and __deepcopy__) -----------------------------
    def __reduce_ex__(self, protocol):
        """Pickle the data, ``requires_grad`` and the instance's own attributes, as torch does.

        Not the graph, the gradient, hooks or a gradient buffer: they belong to this process's backward passes
        (a ``grad_fn`` holds the saved arrays of a whole graph). A tensor arrives as a leaf; distributed
        autograd, which sends tensors through RPC this way, then gives it a recv function.
        """
        return _rebuild_tensor, (type(self), self.data, bool(self.requires_grad), self.__dict__ or None)

    def __deepcopy__(self, memo):
        """A leaf with its own copy of the data and of ``.grad`` (torch's ``__deepcopy__``).

        The copy shares nothing with the original's autograd state: a backward pass through the copy accumulates
        into the copy, even while a graph through the original is alive (its ``AccumulateGrad`` nodes are the
        original's), and the copy has no hooks and no gradient buffer (a DDP bucket of the original's).

        Raises
        ------
        RuntimeError
            For a tensor that is not a leaf, as torch.
        """
        if self.grad_fn is not None:
            raise RuntimeError("Only Tensors created explicitly by the user (graph leaves) support the deepcopy "
                               "protocol at the moment")
        attributes = copy.deepcopy(self.__dict__, memo) if self.__dict__ else None
        copied = memo[id(self)] = _rebuild_tensor(type(self), copy.deepcopy(self.data, memo), self.requires_grad,
                                                  attributes)
        if self.grad is not None:
            copied.grad = copy.deepcopy(self.grad, memo)
        return copied

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
    # Installed on the class by the modules that implement them (they import Tensor; tensor.py imports none of
    # them, so the dependency runs one way): ``_grad_node`` by accumulate_grad.py (it makes the leaf's
    # AccumulateGrad), ``backward`` by engine.py, the arithmetic operators and element-wise methods by ops.py,
    # the reductions, shape methods and ``__getitem__`` by shape_ops.py. ``distlab.autograd`` imports them all.

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

    # -- operators: the differentiable ones are installed by ops.py and shape_ops.py (see above) -------------
    def __pos__(self): return self

    # Comparisons are not differentiable: they return plain boolean arrays.
    def __lt__(self, other): return self.data < _as_array(other)
    def __le__(self, other): return self.data <= _as_array(other)
    def __gt__(self, other): return self.data > _as_array(other)
    def __ge__(self, other): return self.data >= _as_array(other)
    def __eq__(self, other): return self.data == _as_array(other)
    def __ne__(self, other): return self.data != _as_array(other)


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
