"""Whole (unsharded) state dicts of a sharded model, on request (torch's
``torch.distributed.checkpoint.state_dict.get_model_state_dict`` / ``set_model_state_dict`` with
``StateDictOptions``).

``model.state_dict()`` gives each rank its shards without communication (what distributed checkpoints save);
these functions gather the whole arrays, one parameter at a time (so a rank holds at most one whole parameter
beyond its shards while gathering), or load whole arrays, optionally sent from rank 0.
"""
from __future__ import annotations

import dataclasses

from ..autograd._array import array_module, to_numpy
from ..autograd.tensor import Tensor
from ._state import fsdp_state

__all__ = ["StateDictOptions", "get_model_state_dict", "set_model_state_dict"]


@dataclasses.dataclass(frozen=True)
class StateDictOptions:
    """How to give or take a sharded model's state (torch's ``StateDictOptions``).

    Parameters
    ----------
    full_state_dict : bool
        Whole arrays instead of :class:`distlab.ShardedArray` shards.
    cpu_offload : bool
        Whole arrays as numpy arrays, kept on rank 0 only (other ranks get an empty dict), as torch keeps them.
    broadcast_from_rank0 : bool
        ``set_model_state_dict``: only rank 0 holds the whole state dict; every rank receives its arrays from it.
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    broadcast_from_rank0: bool = False


def get_model_state_dict(model, *, options: StateDictOptions | None = None) -> dict:
    """``model``'s state dict: its shards (the default), or whole arrays (``full_state_dict=True``) gathered with one
    all-gather per parameter over its shard group, kept on rank 0 only with ``cpu_offload=True``."""
    options = options or StateDictOptions()
    state = model.state_dict()
    if not options.full_state_dict:
        return state
    group = fsdp_state(model).mesh_info.full_group
    keep = not options.cpu_offload or group.rank == 0
    full = {}
    slots = dict(model.named_parameters(remove_duplicate=False))
    for key, value in state.items():
        if hasattr(value, "global_shape"):
            value = _gather(slots[key].__dict__["_fsdp_param"], key)
        elif isinstance(value, Tensor):
            value = value.data
        if keep:
            full[key] = to_numpy(value).copy() if options.cpu_offload else value
    return full


def set_model_state_dict(model, model_state_dict: dict, *, options: StateDictOptions | None = None):
    """Load ``model_state_dict`` (shards or whole arrays); with ``broadcast_from_rank0`` rank 0's whole arrays are
    broadcast to every rank first (the others may pass an empty dict)."""
    options = options or StateDictOptions()
    if options.broadcast_from_rank0:
        group = fsdp_state(model).mesh_info.full_group
        own = model.state_dict()
        problem = _whole_state_problem(own, model_state_dict) if group.rank == 0 else None
        problem = group.broadcast_object(problem, src=0, name="fsdp: check rank 0's state dict")
        if problem is not None:  # every rank raises it, before any array is sent or changed
            raise RuntimeError(f"set_model_state_dict(broadcast_from_rank0=True): rank 0's state dict {problem}")
        received = {}
        for key, value in own.items():
            shape = value.global_shape if hasattr(value, "global_shape") else tuple(value.shape)
            like = value.local if hasattr(value, "global_shape") else (value.data if isinstance(value, Tensor)
                                                                         else value)
            xp = array_module(like)
            buf = xp.empty(shape, dtype=like.dtype)
            if group.rank == 0:
                source = model_state_dict[key]
                source = source.data if isinstance(source, Tensor) else source
                buf[...] = source if array_module(source) is xp else xp.asarray(source)
            group.broadcast(buf, src=0, name=f"fsdp: load {key}")
            received[key] = buf
        model_state_dict = received
    return model.load_state_dict(model_state_dict)


def _whole_state_problem(own: dict, given: dict) -> str | None:
    """What is wrong with the whole state dict ``given`` for a model whose own state dict is ``own`` (None when it
    fits): a missing key, another shape, a key the model lacks (``load_state_dict``'s strict check)."""
    for key, value in own.items():
        if key not in given:
            return f"lacks {key!r}"
        shape = tuple(value.global_shape) if hasattr(value, "global_shape") else tuple(value.shape)
        theirs = given[key]
        theirs = tuple(getattr(theirs, "shape", ()))
        if theirs != shape:
            return f"has {key!r} of shape {theirs}, the model's is {shape}"
    extra = sorted(set(given) - set(own))
    if extra:
        return f"has keys the model lacks: {extra}"
    return None


def _gather(fsdp_param, key: str):
    """The whole parameter: the padded shards of its shard group, all-gathered, without the padding rows."""
    group = fsdp_param.shard_group
    padded = fsdp_param.sharded_param_data
    out = group.allgather(padded, name=f"fsdp: full state dict {key}")
    rows = out.reshape((-1,) + fsdp_param.orig_size[1:])
    return rows[:fsdp_param.rows].copy()
