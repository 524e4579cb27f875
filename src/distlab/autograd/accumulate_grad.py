"""AccumulateGrad: the sink node of a leaf tensor (mirrors torch/csrc/autograd/functions/accumulate_grad.h)."""
from __future__ import annotations

import weakref

import numpy as np

from ._array import index_add, is_cupy
from .node import Node
from .sparse import SparseGrad, add_grads
from .tensor import Tensor, _as_array

__all__ = ["AccumulateGrad", "accumulate_into", "run_tensor_hooks", "set_grad_buffer", "run_post_accumulate_grad_hooks"]

_INF = float("inf")


class AccumulateGrad(Node):
    """The sink node of a leaf tensor: accumulates the incoming gradient into ``variable.grad``.

    Mirrors torch/csrc/autograd/functions/accumulate_grad.h. Its ``seq`` is infinite so the engine runs it as
    soon as it is ready: a parameter's gradient is published (and its post-accumulate hooks fire) the moment it
    is complete, which is what lets DDP start a bucket's allreduce during backward.

    One AccumulateGrad exists per leaf while a graph uses it (the tensor keeps a weak reference and the graph
    keeps it alive), so a leaf used twice still gets one summed gradient and one hook call per backward.
    ``buffer_claimed`` is set while a node's output computed into the leaf's gradient buffer is on its way here
    (see ``leaf_grad_buffer`` in engine.py), so a second producer computes its own array.
    """

    __slots__ = ("variable", "buffer_claimed")

    def __init__(self, variable):
        # Node.__init__ inlined: one is created per parameter per forward pass
        self.next_nodes = ()
        self.seq = _INF
        self.saved = None
        self.pre_hooks = None
        self.freed = False
        self.variable = variable
        self.buffer_claimed = False

    def apply(self, grad):
        self.accumulate(grad, True)
        return ()

    def accumulate(self, grad, sink=True, owned: bool = False) -> None:
        """Run the leaf's tensor hooks, then deliver ``grad``.

        ``sink`` is True to accumulate into ``.grad`` and fire the post-accumulate-grad hooks, or a callable
        ``sink(tensor, grad)`` that receives the gradient instead (distributed autograd's context).
        ``owned`` says the engine holds the only reference to ``grad``, so it may be stored without a copy.
        """
        var = self.variable
        self.buffer_claimed = False
        if var._hooks:
            owned = False  # a hook may keep the gradient it was shown
            grad = run_tensor_hooks(var._hooks, grad)
        if sink is not True:
            sink(var, grad)
            return
        accumulate_into(var, grad, owned)
        if var._post_acc_hooks:
            for hook in tuple(var._post_acc_hooks.values()):
                hook(var)


def run_tensor_hooks(hooks: dict, grad):
    """Call each ``hook(grad_tensor)`` in registration order; a non-None return value replaces the gradient."""
    for hook in tuple(hooks.values()):
        arg = grad if getattr(grad, "is_sparse", False) else Tensor._wrap(grad)
        result = hook(arg)
        if result is not None:
            grad = _as_array(result)
    return grad


def accumulate_into(var, grad, owned: bool = False) -> None:
    """AccumulateGrad semantics: the first gradient is stored as a private array, later ones are added.

    Privacy matters: a gradient array may be shared (``a + b`` passes the same array to both inputs), and the
    DDP reducer later writes bucket results into ``.grad`` in place, which must not leak into other tensors.
    So the first gradient is copied, unless nothing else can see it: ``owned`` (the engine held the only
    reference), not a view of another array, C-contiguous and of the parameter's dtype. That is torch's
    "steal the gradient if its use_count is 1" in accumulate_grad.h, and it saves a 26 MB copy per step on the
    big benchmark model. Later gradients are added in place, as torch does when grad mode is off.
    """
    old = var.grad
    if old is None:
        if grad is var._grad_buffer:  # computed in place by the node that produced it: it is the gradient
            var.grad = Tensor._wrap(grad)
        elif isinstance(grad, SparseGrad):
            var.grad = grad.clone()
        elif owned and grad.base is None and grad.flags.c_contiguous and grad.dtype == var.data.dtype:
            var.grad = Tensor._wrap(grad)
        else:
            var.grad = Tensor._wrap(grad.astype(var.data.dtype, order="C", copy=True))
    elif isinstance(old, SparseGrad):
        new = add_grads(old, grad)  # sparse + sparse stays sparse (concatenated); + dense becomes dense
        var.grad = new if isinstance(new, SparseGrad) else Tensor._wrap(new)
    elif isinstance(grad, SparseGrad):
        index_add(old.data, grad.indices, grad.values)  # in place: .grad may be a view into a DDP bucket
    else:
        old.data += grad


def run_post_accumulate_grad_hooks(tensor) -> None:
    """Call ``tensor``'s post-accumulate-grad hooks, in registration order, as :class:`AccumulateGrad` does after
    accumulating: for components that deliver a leaf's gradient themselves (FSDP sets each sharded parameter's
    gradient after its reduce-scatter, as torch's ``foreach_reduce`` runs the hooks then)."""
    hooks = tensor._post_acc_hooks
    if hooks:
        for hook in tuple(hooks.values()):
            hook(tensor)


def set_grad_buffer(tensor, buffer) -> None:
    """Give a leaf an array its first gradient of a backward pass may be computed in, or None to take it away.

    When ``tensor.grad`` is None and the node producing its gradient can write its result in place (``linear``
    and ``embedding`` can), it computes the gradient into ``buffer``, and ``buffer`` becomes ``.grad``; no
    gradient array is allocated and none is copied. Any other gradient arrives as usual. DDP with
    ``gradient_as_bucket_view=True`` gives each parameter its bucket view, so that backward writes the gradients
    straight into the buckets (the anchor copies each gradient into its view, see ``mark_variable_ready_dense``).
    A hook registered on the tensor, or a distributed autograd context, turns this off: they may keep the
    gradient they are shown.

    Raises
    ------
    ValueError
        When ``buffer`` is not a C-contiguous array of the tensor's kind (numpy, or its device), shape and dtype.
    """
    if buffer is not None:
        data = tensor.data
        host = type(buffer) is np.ndarray
        if (type(buffer) is not type(data) or not (host or is_cupy(buffer)) or not buffer.flags.c_contiguous
                or (host and not buffer.flags.writeable) or buffer.shape != data.shape or buffer.dtype != data.dtype):
            raise ValueError(f"set_grad_buffer: the buffer must be a writeable C-contiguous array of the tensor's "
                             f"kind ({type(data).__name__}), shape {tuple(data.shape)} and dtype {data.dtype}, "
                             f"got {type(buffer).__name__} "
                             f"{getattr(buffer, 'dtype', '')}{list(getattr(buffer, 'shape', ()))}")
    tensor._grad_buffer = buffer


def _grad_node(self):
    """The node that receives this tensor's gradient: grad_fn, the leaf's AccumulateGrad, or None."""
    if self.grad_fn is not None:
        return self.grad_fn
    if not self.requires_grad:
        return None
    node = self._accumulator() if self._accumulator is not None else None
    if node is None:
        node = AccumulateGrad(self)
        self._accumulator = weakref.ref(node)  # the graph keeps the node alive, the tensor only finds it
    return node


Tensor._grad_node = _grad_node  # a Tensor method; defined here so that tensor.py need not import this module
