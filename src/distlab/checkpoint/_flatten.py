"""A nested state dict as flat entries keyed by their fully qualified name (torch's ``flatten_state_dict``).

``{"model": {"fc.weight": w}, "optim": {"state": {...}}, "step": 7}`` becomes ``model.fc.weight``,
``optim.state.fc.weight.exp_avg``, ``step``... Dicts are walked; a list is walked by index when it holds an array
somewhere inside (else the list is one value); everything else is a leaf:

- an *array*: a numpy or device array (a :class:`~distlab.autograd.Tensor` stands for its ``data``), the same on
  every rank that has the key (replicated: DDP's parameters);
- a :class:`~distlab.ShardedArray`: this rank's block of a larger array (sharded modules, sharded optimizer state);
- an *object*: anything else (ints, floats, strings, tuples), pickled, replicated like an array.

A *stateful* value (an object with ``state_dict()`` and ``load_state_dict()``, not a dict: a module, an optimizer,
a sampler, :class:`~distlab.checkpoint.RNGState`) is replaced by its ``state_dict()`` and walked. An empty dict in a
template for :func:`~distlab.checkpoint.load` is a *slot*: it asks for everything the checkpoint holds under its key
(an optimizer whose state is not made yet; :class:`ShardedSlot` reads the saved arrays as blocks).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .._types import ShardedArray
from ..autograd import Tensor
from ..autograd._array import device_module
from ..errors import CheckpointException

__all__ = ["Entry", "ShardedSlot", "flatten", "fqn_of", "is_array", "is_stateful"]


class ShardedSlot(dict):
    """An empty dict that asks :func:`~distlab.checkpoint.load` for every saved value under its key, reading each
    array of global shape ``global_shape`` as the block at ``offsets`` of shape ``sizes`` (a
    :class:`~distlab.ShardedArray`); other values are read whole.

    What :func:`~distlab.checkpoint.get_state_dict` gives for the optimizer state of a sharded parameter that has no
    state yet.
    """

    def __init__(self, global_shape, offsets, sizes):
        super().__init__()
        self.global_shape = tuple(int(d) for d in global_shape)
        self.offsets = tuple(int(o) for o in offsets)
        self.sizes = tuple(int(s) for s in sizes)

    def __repr__(self) -> str:
        return f"ShardedSlot(global_shape={self.global_shape}, offsets={self.offsets}, sizes={self.sizes})"


@dataclass
class Entry:
    """One flat entry: its key, the dict or list that holds it (``container[key]``), and what it holds.

    ``kind`` is ``"array"``, ``"sharded"``, ``"object"`` or ``"slot"`` (an empty dict of a load template).
    """

    fqn: str
    path: tuple
    container: object = field(repr=False)
    key: object
    kind: str
    value: object = field(repr=False)

    def replace(self, value) -> None:
        """Put ``value`` where this entry was (a loaded object, or a slot's contents)."""
        self.container[self.key] = value
        self.value = value


def is_array(value) -> bool:
    """A numpy array or a device array (cupy, or a registered stand-in)."""
    return isinstance(value, np.ndarray) or device_module(value) is not None


def is_stateful(value) -> bool:
    """Has ``state_dict()`` and ``load_state_dict()`` (torch's ``Stateful`` protocol) and is not a plain dict."""
    return (not isinstance(value, dict) and callable(getattr(value, "state_dict", None))
            and callable(getattr(value, "load_state_dict", None)))


def _holds_array(value) -> bool:
    if is_array(value) or isinstance(value, (ShardedArray, Tensor)):
        return True
    if isinstance(value, dict):
        return any(_holds_array(v) for v in value.values())
    if isinstance(value, list):
        return any(_holds_array(v) for v in value)
    return False


def flatten(state_dict: dict, *, template: bool = False) -> tuple[dict, list]:
    """``({fqn: Entry}, statefuls)`` of ``state_dict``; ``statefuls`` lists ``(object, its state dict)``.

    ``state_dict`` itself is not changed: a stateful value is walked through the dict its ``state_dict()`` returns
    (a load fills that one, and the caller hands it back with ``load_state_dict``). ``template`` (for a load) turns
    empty dicts into slots.
    """
    if not isinstance(state_dict, dict):
        raise CheckpointException(f"a state dict must be a dict, got {type(state_dict).__name__}")
    entries: dict = {}
    statefuls: list = []
    _walk(state_dict, (), entries, statefuls, template)
    return entries, statefuls


def fqn_of(path: tuple) -> str:
    """The flat key of ``path``: its keys joined with dots (``("model", "fc.weight")`` -> ``model.fc.weight``)."""
    return ".".join(str(key) for key in path)


def _walk(node, prefix: tuple, entries: dict, statefuls: list, template: bool) -> None:
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in list(items):
        if not isinstance(key, (str, int, np.integer)):
            raise CheckpointException(f"state dict keys must be strings or integers, got {key!r} under "
                                      f"{fqn_of(prefix) or 'the top level'}")
        path = prefix + (key if isinstance(key, str) else int(key),)
        fqn = fqn_of(path)
        if is_stateful(value) and not is_array(value):
            inner = value.state_dict()
            if not isinstance(inner, dict):
                raise CheckpointException(f"{fqn}: {type(value).__name__}.state_dict() returned a "
                                          f"{type(inner).__name__}, not a dict")
            statefuls.append((value, inner))
            if template and not inner:
                _add(entries, Entry(fqn, path, inner, None, "slot", inner))
            else:
                _walk(inner, path, entries, statefuls, template)
            continue
        if isinstance(value, Tensor):
            value = value.data
        if isinstance(value, dict):
            if template and not value:
                _add(entries, Entry(fqn, path, node, key, "slot", value))
            else:
                _walk(value, path, entries, statefuls, template)
        elif isinstance(value, list) and _holds_array(value):
            _walk(value, path, entries, statefuls, template)
        else:
            kind = "sharded" if isinstance(value, ShardedArray) else "array" if is_array(value) else "object"
            _add(entries, Entry(fqn, path, node, key, kind, value))


def _add(entries: dict, entry: Entry) -> None:
    if entry.fqn in entries:
        raise CheckpointException(f"two values of the state dict have the same key {entry.fqn!r} once flattened "
                                  "(a key with a dot in it, and a nested dict spelling the same path): rename one")
    entries[entry.fqn] = entry
