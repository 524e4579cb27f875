"""What both FSDP twins share about one parameter: its construction (the chunk rule, the padded shard, the sharded
``Parameter`` with its global shape and offsets), its dtypes, and its state-dict forms, as functions.

Mirrors the construction half of torch/distributed/fsdp/_fully_shard/_fsdp_param.py: ``FSDPParam.__init__``,
``_init_sharded_param``, ``_init_sharded_post_forward_param_metadata``, ``init_dtype_attrs``,
``to_sharded_dtensor``, ``reset_sharded_param``.

There is no base class. As the reducer's twins take a ``ReducerSetup``, each ``FSDPParam`` twin's ``__init__``
takes a :class:`ParamSetup` from :func:`prepare_param` and keeps its fields under the names of
:data:`PARAM_STATE`; the functions here read a parameter's state by those names only, and none calls a twin's
method, so calls go one way: twin (or ``distlab.fsdp``) -> these functions. The per-step half (the all-gather
input, the unsharded parameter's views, the state changes) is twinned: ``reference/fsdp_param.py`` and
``core/_fsdp_param.pxi``.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from ..autograd._array import array_module
from ..autograd.tensor import Tensor
from .._types import ShardedArray
from .fsdp import ShardedState, chunk_rows, shard_rows

__all__ = ["ParamModuleInfo", "ParamSetup", "PARAM_STATE", "prepare_param", "sharded_array", "check_load", "load",
           "describe_param"]


class ParamModuleInfo:
    """Where a parameter is registered: ``(module, name)`` pairs, the first the one it was found on, the others
    modules of the same group sharing it (``_fsdp_param.py ParamModuleInfo``)."""

    __slots__ = ("places",)

    def __init__(self, module, name: str):
        self.places = [(module, name)]

    def add(self, module, name: str) -> None:
        self.places.append((module, name))


class ParamSetup(NamedTuple):
    """What a new ``FSDPParam`` starts from (:func:`prepare_param`); a twin keeps every field under its name."""

    xp: Any  # the array module of the parameter (numpy, cupy, the device stand-in)
    module_info: ParamModuleInfo
    fqn: str
    orig_size: tuple
    orig_dtype: Any
    param_class: type  # Parameter (distlab.nn, which a shared module does not import)
    rows: int  # d0
    row_numel: int  # elements of one row
    shard_size: int
    shard_rank: int
    chunk: int  # rows every rank holds, ceil(d0 / W)
    shard_offset: int  # the first row of this rank's shard
    shard_length: int  # the rows of the shard that are not padding
    padded_sharded_numel: int
    sharded_numel: int
    unsharded_numel: int  # the padded rows of every rank: what the group's all-gather gives this parameter
    sharded_size: tuple  # (shard_length,) + orig_size[1:], the sharded parameter's shape
    post_forward_size: int  # k of reshard_after_forward=k, or 0
    post_forward_rank: int
    post_forward_numel: int
    param_dtype: Any  # all-gather and compute dtype, None when no cast
    reduce_dtype: Any  # reduce-scatter dtype, None when no cast
    unsharded_dtype: Any
    sharded_param_data: Any  # the padded shard, 1-D
    sharded_param: Any  # the Parameter the optimizer steps: a view of the shard's unpadded rows
    sharded_state: int = ShardedState.SHARDED


#: The state every ``FSDPParam`` twin keeps, by name: :class:`ParamSetup`'s fields, then ``all_gather_output``
#: (its slice of the group's storage), ``unsharded_accumulated_grad`` and ``shard_group`` (set by
#: ``fully_shard``). The one list of what the functions here and ``distlab.fsdp`` may read of a parameter
#: (tests/test_fsdp.py checks that both twins have it all).
PARAM_STATE = ParamSetup._fields + ("all_gather_output", "unsharded_accumulated_grad", "shard_group")


def prepare_param(param, module_info, shard_size: int, shard_rank: int, post_forward_size: int, mp_policy,
                  fqn: str) -> ParamSetup:
    """Shard ``param`` on dimension 0 by torch's chunk rule (``_init_sharded_param``).

    Every rank keeps ``ceil(d0 / W)`` rows, zero-padded (ranks past the end hold only padding): the padded
    shard is ``sharded_param_data`` (1-D), and the sharded ``Parameter`` the optimizer steps is a view of its
    unpadded rows; its ``global_shape`` and ``offsets`` say where the rows sit in the whole parameter
    (``distlab.ShardedArray``'s fields). The twin's constructor registers it on the modules.
    ``post_forward_size`` is ``k`` of ``reshard_after_forward=k``: keep a ``1/k`` piece of the unsharded data
    after forward (``_init_sharded_post_forward_param_metadata``), or 0 for nothing.
    """
    data = param.data
    xp = array_module(data)
    orig_size = tuple(int(d) for d in data.shape)
    rows, row_numel = orig_size[0], int(math.prod(orig_size[1:]))
    shard_size, shard_rank, post_forward_size = int(shard_size), int(shard_rank), int(post_forward_size)
    chunk = chunk_rows(rows, shard_size)
    shard_offset, shard_length = shard_rows(rows, shard_size, shard_rank)
    padded_numel, sharded_numel = chunk * row_numel, shard_length * row_numel
    unsharded_numel = padded_numel * shard_size
    padded = xp.zeros(padded_numel, dtype=data.dtype)
    first = shard_offset * row_numel
    padded[:sharded_numel] = data.reshape(-1)[first:first + sharded_numel]
    sharded_size = (shard_length,) + orig_size[1:]
    sharded = type(param)(padded[:sharded_numel].reshape(sharded_size), requires_grad=param.requires_grad)
    sharded.global_shape = orig_size
    sharded.offsets = (shard_offset,) + (0,) * (len(orig_size) - 1)
    post_rank = shard_rank % post_forward_size if post_forward_size else 0
    post_numel = unsharded_numel // post_forward_size if post_forward_size else 0
    param_dtype, reduce_dtype = mp_policy.clamped(data.dtype)  # init_dtype_attrs
    unsharded_dtype = param_dtype if param_dtype is not None else data.dtype
    return ParamSetup(xp, module_info, fqn, orig_size, data.dtype, type(param), rows, row_numel, shard_size,
                      shard_rank, chunk, shard_offset, shard_length, padded_numel, sharded_numel, unsharded_numel,
                      sharded_size, post_forward_size, post_rank, post_numel, param_dtype, reduce_dtype,
                      unsharded_dtype, padded, sharded)


# -- state dicts (``to_sharded_dtensor`` / ``reset_sharded_param``) -----------------------------------------------
def sharded_array(fsdp_param) -> ShardedArray:
    """This rank's unpadded shard with its global shape and offsets (no communication)."""
    param = fsdp_param.sharded_param
    return ShardedArray(param.data, fsdp_param.orig_size, param.offsets)


def check_load(fsdp_param, value, key: str) -> None:
    """Raise if ``value`` (a whole parameter, or a ShardedArray block) cannot be loaded into this shard; a state
    dict is checked whole before any parameter is loaded."""
    orig_size = fsdp_param.orig_size
    if hasattr(value, "global_shape"):
        if tuple(value.global_shape) != orig_size:
            raise RuntimeError(f"size mismatch for {key}: copying a param with shape {tuple(value.global_shape)}, "
                               f"the shape in current model is {orig_size}")
        mine = fsdp_param.sharded_param.offsets, fsdp_param.sharded_size
        if (tuple(value.offsets), tuple(value.sizes)) != mine:  # resharding is the checkpoint's
            raise RuntimeError(f"{key}: the saved block at offsets {tuple(value.offsets)} of shape "
                               f"{tuple(value.sizes)} is not this rank's block (offsets {mine[0]}, shape "
                               f"{mine[1]}); load a checkpoint saved on another number of ranks with "
                               "distlab.checkpoint, which reshards")
        return
    value = value.data if isinstance(value, Tensor) else value
    if tuple(value.shape) != orig_size:
        raise RuntimeError(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, the "
                           f"shape in current model is {orig_size}")


def load(fsdp_param, value, key: str) -> None:
    """Copy this rank's rows of a whole parameter, or its own block (a ShardedArray), into the shard; the padding
    stays zero (``reset_sharded_param``)."""
    check_load(fsdp_param, value, key)
    if hasattr(value, "global_shape"):
        rows = value.local
    else:
        value = value.data if isinstance(value, Tensor) else value
        rows = value[fsdp_param.shard_offset:fsdp_param.shard_offset + fsdp_param.shard_length]
    xp = fsdp_param.xp
    fsdp_param.sharded_param.data[...] = rows if array_module(rows) is xp else xp.asarray(rows)
    fsdp_param.sharded_param_data[fsdp_param.sharded_numel:] = 0


def describe_param(fsdp_param) -> tuple:
    """What must agree across ranks about this parameter: name, shape, dtype (checked before the first
    all-gather)."""
    return (fsdp_param.fqn, fsdp_param.orig_size, str(np.dtype(fsdp_param.orig_dtype)))
