"""AccumulateGrad: the sink node of a leaf tensor (mirrors torch/csrc/autograd/functions/accumulate_grad.h)."""
from __future__ import annotations

from .node import Node
from .sparse import SparseGrad, add_grads
from .tensor import Tensor, _as_array

__all__ = ["AccumulateGrad", "accumulate_into", "run_tensor_hooks"]


class AccumulateGrad(Node):
    """The sink node of a leaf tensor: accumulates the incoming gradient into ``variable.grad``.

    Mirrors torch/csrc/autograd/functions/accumulate_grad.h. Its ``seq`` is infinite so the engine runs it as
    soon as it is ready: a parameter's gradient is published (and its post-accumulate hooks fire) the moment it
    is complete, which is what lets DDP start a bucket's allreduce during backward.

    One AccumulateGrad exists per leaf while a graph uses it (the tensor keeps a weak reference and the graph
    keeps it alive), so a leaf used twice still gets one summed gradient and one hook call per backward.
    """

    __slots__ = ("variable",)

    def __init__(self, variable):
        super().__init__(())
        self.seq = float("inf")
        self.variable = variable

    def apply(self, grad):
        self.accumulate(grad, True)
        return ()

    def accumulate(self, grad, sink=True) -> None:
        """Run the leaf's tensor hooks, then deliver ``grad``.

        ``sink`` is True to accumulate into ``.grad`` and fire the post-accumulate-grad hooks, or a callable
        ``sink(tensor, grad)`` that receives the gradient instead (distributed autograd's context).
        """
        var = self.variable
        if var._hooks:
            grad = run_tensor_hooks(var._hooks, grad)
        if sink is not True:
            sink(var, grad)
            return
        accumulate_into(var, grad)
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


def accumulate_into(var, grad) -> None:
    """AccumulateGrad semantics: the first gradient is stored as a private copy, later ones are added.

    The copy matters: a gradient array may be shared (``a + b`` passes the same array to both inputs), and the
    DDP reducer later writes bucket results into ``.grad`` in place, which must not leak into other tensors.
    Later gradients are added in place, as torch does when grad mode is off.
    """
    old = var.grad
    if old is None:
        var.grad = grad.clone() if isinstance(grad, SparseGrad) else Tensor._wrap(grad.copy())
    elif isinstance(old, SparseGrad) or isinstance(grad, SparseGrad):
        new = add_grads(old if isinstance(old, SparseGrad) else old.data, grad)
        var.grad = new if isinstance(new, SparseGrad) else Tensor._wrap(new)
    else:
        old.data += grad
