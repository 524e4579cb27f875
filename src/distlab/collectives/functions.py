"""Horovod's helpers: broadcast parameters, optimizer state and objects; allgather objects (horovod/torch/functions.py).

Every helper is made of negotiated collectives (:mod:`distlab.collectives.ops`), so it goes through the same
coordinator and response cache as the training's allreduces, and every rank must call it.
"""
from __future__ import annotations

import pickle

import numpy as np

from ..autograd._array import is_cupy
from ..autograd.tensor import Tensor
from .ops import allgather, broadcast, broadcast_async, global_process_set, rank, synchronize

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]


def _array_of(value):
    return value.data if isinstance(value, Tensor) else value


def broadcast_parameters(params, root_rank=0, process_set=global_process_set) -> None:
    """Overwrite every parameter, in place, with ``root_rank``'s (as ``hvd.broadcast_parameters``).

    Parameters
    ----------
    params : dict or list
        A dict of arrays or tensors, a list of ``(name, tensor)`` pairs, or a list of tensors: typically
        ``model.state_dict()``, ``model.named_parameters()`` or ``model.parameters()``; a dict is
        broadcast in sorted name order, so every rank submits the same names. Tensors and numpy arrays are
        written in place.
    root_rank : int
        The rank whose values everyone gets.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in list(params)]
    handles = []
    for index, (name, param) in enumerate(items):
        key = f"broadcast_parameters.{name if name is not None else index}"
        handles.append((param, broadcast_async(_array_of(param), root_rank, key, process_set)))
    for param, handle in handles:
        _array_of(param)[...] = synchronize(handle)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Return ``root_rank``'s ``obj`` on every rank (pickled, then broadcast as bytes, as ``hvd.broadcast_object``).

    ``name`` defaults to the object's type name; the size travels first, then the bytes.
    """
    name = type(obj).__name__ if name is None else str(name)
    payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8) \
        if rank() == root_rank else np.zeros(0, dtype=np.uint8)
    size = broadcast(np.array([payload.size], dtype=np.int64), root_rank, f"{name}.sz", process_set)
    data = payload if rank() == root_rank else np.zeros(int(size[0]), dtype=np.uint8)
    data = broadcast(data, root_rank, f"{name}.t", process_set)
    return obj if rank() == root_rank else pickle.loads(data.tobytes())


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Every rank's ``obj``, in rank order (pickled and allgathered, as ``hvd.allgather_object``)."""
    name = type(obj).__name__ if name is None else str(name)
    payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    sizes = allgather(np.array([payload.size], dtype=np.int64), f"{name}.sz", process_set)
    data = allgather(payload, f"{name}.t", process_set)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    return [pickle.loads(data[offsets[i]:offsets[i + 1]].tobytes()) for i in range(len(sizes))]


def broadcast_optimizer_state(optimizer, root_rank=0, process_set=global_process_set) -> None:
    """Give every rank ``root_rank``'s optimizer state: per-parameter arrays and scalars, and the group options.

    As ``hvd.broadcast_optimizer_state``: an optimizer without state yet gets it first (a step with zero
    gradients on the wrapped optimizer, which leaves the parameters unchanged); arrays are broadcast in place,
    scalars (and tuples of numbers, such as Adam's betas) are wrapped in float64 arrays and cast back to their
    type; other values (None, strings) travel as objects. Works with a :class:`DistributedOptimizer` too.
    """
    base = getattr(optimizer, "optimizer", optimizer)      # a DistributedOptimizer wraps the real one
    params = [p for group in base.param_groups for p in group["params"]]
    if not base.state:
        for p in params:
            if p.requires_grad and p.grad is None:
                p.grad = Tensor(np.zeros_like(p.data))
        base.step()
    arrays, scalars, objects = [], [], {}
    for index, group in enumerate(base.param_groups):
        for key in sorted(k for k in group if k != "params"):
            _classify(f"option.{index}.{key}", group, key, arrays, scalars, objects)
    for position, p in enumerate(params):
        state = base.state.get(p)
        if state is None:
            continue
        for key in sorted(state):
            _classify(f"state.{position}.{key}", state, key, arrays, scalars, objects)
    handles = [(array, broadcast_async(array, root_rank, f"optimizer.{label}", process_set))
               for label, array in arrays]
    for array, handle in handles:
        array[...] = synchronize(handle)
    if scalars:
        values = np.array([float(v) for _label, _owner, _key, kind, flat in scalars for v in flat], dtype=np.float64)
        values = broadcast(values, root_rank, "optimizer.scalars", process_set)
        offset = 0
        for _label, owner, key, kind, flat in scalars:
            owner[key] = _cast(kind, values[offset:offset + len(flat)])
            offset += len(flat)
    if objects:
        received = broadcast_object(objects if rank() == root_rank else None, root_rank, "optimizer.objects",
                                    process_set)
        for label, (owner, key) in _object_owners(base, params).items():
            if label in received:
                owner[key] = received[label]


def _classify(label, owner, key, arrays, scalars, objects):
    value = owner[key]
    if isinstance(value, np.ndarray) or is_cupy(value):  # broadcast in place, on its device
        arrays.append((label, value))
    elif isinstance(value, (bool, int, float, np.number)):
        scalars.append((label, owner, key, type(value), [value]))
    elif isinstance(value, tuple) and value and all(isinstance(v, (bool, int, float, np.number)) for v in value):
        scalars.append((label, owner, key, tuple(type(v) for v in value), list(value)))
    else:
        objects[label] = value


def _cast(kind, values):
    if isinstance(kind, tuple):
        return tuple(t(v) for t, v in zip(kind, values))
    return kind(values[0])


def _object_owners(base, params):
    owners = {}
    for index, group in enumerate(base.param_groups):
        for key in group:
            if key != "params":
                owners[f"option.{index}.{key}"] = (group, key)
    for position, p in enumerate(params):
        for key in base.state.get(p, {}):
            owners[f"state.{position}.{key}"] = (base.state[p], key)
    return owners
