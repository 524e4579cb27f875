"""Graph nodes: the backward functions the engine runs (mirrors torch/csrc/autograd/function.h ``Node``).

Every differentiable operation creates one :class:`Node` for its output. A node knows the nodes that produced
its inputs (``next_nodes``, torch's ``next_edges``), and ``apply(grad)`` maps the gradient of its output to one
gradient per input. Leaves end in an ``AccumulateGrad`` node (accumulate_grad.py) that writes ``tensor.grad``.

Gradients travel through the engine as raw arrays (numpy/cupy ndarrays or :class:`SparseGrad`), never as
Tensors: wrapping every intermediate gradient would double the per-node cost. Hooks see Tensors.
"""
from __future__ import annotations

import itertools

__all__ = ["Node", "RemovableHandle", "add_hook", "FREED_GRAPH_MESSAGE"]

#: Creation order of nodes. The engine runs ready nodes newest first, like torch's ``sequence_nr``.
_sequence = itertools.count()
_handle_ids = itertools.count()

FREED_GRAPH_MESSAGE = (
    "Trying to backward through the graph a second time (or to use saved values after they were freed) at {name}. "
    "Saved intermediate values of the graph are freed when you call .backward(); "
    "specify retain_graph=True if you need to backward through the graph a second time."
)


class RemovableHandle:
    """Returned by every ``register_*hook``; ``handle.remove()`` unregisters the hook (torch's RemovableHandle)."""

    __slots__ = ("_hooks", "id")

    def __init__(self, hooks: dict):
        self._hooks = hooks
        self.id = next(_handle_ids)

    def remove(self) -> None:
        """Unregister the hook (idempotent)."""
        self._hooks.pop(self.id, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def add_hook(hooks: dict | None, fn, prepend: bool = False) -> tuple[dict, RemovableHandle]:
    """Add ``fn`` to ``hooks`` (created if None); return the dict and a handle. Dicts keep registration order;
    ``prepend`` puts ``fn`` first (the dict stays the same object, so earlier handles still remove theirs)."""
    if hooks is None:
        hooks = {}
    handle = RemovableHandle(hooks)
    if prepend and hooks:
        rest = dict(hooks)
        hooks.clear()
        hooks[handle.id] = fn
        hooks.update(rest)
    else:
        hooks[handle.id] = fn
    return hooks, handle


class Node:
    """A backward function in the graph.

    Attributes
    ----------
    next_nodes : tuple of (Node or None)
        One entry per input of the forward op: the node that receives that input's gradient, or None when the
        input needs no gradient.
    seq : int or float
        Creation order; among ready nodes the engine runs the highest first (torch's ``sequence_nr``).
    saved : object or None
        What ``apply`` needs from the forward pass (arrays); set to None by :meth:`release` after backward.
    pre_hooks : dict or None
        ``fn(grad) -> grad or None`` run on the incoming gradient before ``apply`` (tensor hooks of non-leaves).

    Subclasses implement :meth:`apply`. A distributed engine can subclass Node for send/recv functions.
    """

    __slots__ = ("next_nodes", "seq", "saved", "pre_hooks", "freed", "__weakref__")

    def __init__(self, next_nodes=(), saved=None):
        self.next_nodes = next_nodes if type(next_nodes) is tuple else tuple(next_nodes)
        self.seq = next(_sequence)
        self.saved = saved
        self.pre_hooks = None
        self.freed = False

    def name(self) -> str:
        """The node's name, e.g. ``"MulBackward"`` (torch's ``Node::name``)."""
        return type(self).__name__

    @property
    def next_functions(self) -> tuple:
        """``((node, input_nr), ...)`` as in PyTorch; ``input_nr`` is always 0 (every node has one output)."""
        return tuple((n, 0) for n in self.next_nodes)

    def apply(self, grad):
        """Return a tuple with one gradient (array, SparseGrad or None) per entry of ``next_nodes``."""
        raise NotImplementedError(f"{self.name()} does not implement apply")

    def needs(self, i: int) -> bool:
        """True when input ``i`` wants a gradient (so ``apply`` may skip computing the others)."""
        return self.next_nodes[i] is not None

    def release(self) -> None:
        """Free the saved values (called by the engine after ``apply`` unless ``retain_graph``)."""
        if self.saved is not None:
            self.saved = None
            self.freed = True

    def register_prehook(self, fn) -> RemovableHandle:
        """Register ``fn(grad) -> grad or None`` to run on this node's incoming gradient."""
        self.pre_hooks, handle = add_hook(self.pre_hooks, fn)
        return handle

    def __repr__(self):
        return f"<{self.name()} seq={self.seq}>"
