"""What both FSDP twins share about one parameter: its construction (the chunk rule, the padded shard, the sharded
``Parameter`` with its global shape and offsets), its dtypes, and its state-dict forms.

Mirrors the construction half of torch/distributed/fsdp/_fully_shard/_fsdp_param.py: ``FSDPParam.__init__``,
``_init_sharded_param``, ``_init_sharded_post_forward_param_metadata``, ``init_dtype_attrs``,
``reset_sharded_param``. The per-step half (the all-gather input, the unsharded parameter's views, the state
changes) is twinned: ``reference/fsdp_param.py`` and ``core/_fsdp_param.pxi``, which bind these methods.
"""
from __future__ import annotations

import math

import numpy as np

from ..autograd._array import array_module
from ..autograd.tensor import Tensor
from .._types import ShardedArray
from .fsdp import ShardedState, chunk_rows, shard_rows

__all__ = ["FSDPParamBase", "ParamModuleInfo"]


class ParamModuleInfo:
    """Where a parameter is registered: ``(module, name)`` pairs, the first the one it was found on, the others
    modules of the same group sharing it (``_fsdp_param.py ParamModuleInfo``)."""

    __slots__ = ("places",)

    def __init__(self, module, name: str):
        self.places = [(module, name)]

    def add(self, module, name: str) -> None:
        self.places.append((module, name))


class FSDPParamBase:
    """Construction and state dicts of :class:`~distlab.reference.fsdp_param.FSDPParam` (bound by the core)."""

    def _init_sharded_param(self, param, module_info, shard_size: int, shard_rank: int, post_forward_size: int,
                            mp_policy, fqn: str) -> None:
        """Shard ``param`` on dimension 0 by torch's chunk rule (``_init_sharded_param``).

        Every rank keeps ``ceil(d0 / W)`` rows, zero-padded (ranks past the end hold only padding): the padded
        shard is ``_sharded_param_data`` (1-D), and the sharded ``Parameter`` the optimizer steps is a view of
        its unpadded rows, registered on the modules in place of ``param``. Its ``global_shape`` and
        ``offsets`` say where the rows sit in the whole parameter (``distlab.ShardedArray``'s fields).
        The twin's constructor then registers it on the modules (``_setattr_on_modules``).
        """
        data = param.data
        self.xp = array_module(data)
        self.module_info = module_info
        self.fqn = fqn
        self.orig_size = tuple(int(d) for d in data.shape)
        self.orig_dtype = data.dtype
        self.rows = self.orig_size[0]
        self.row_numel = int(math.prod(self.orig_size[1:]))
        self.shard_size, self.shard_rank = int(shard_size), int(shard_rank)
        self.chunk = chunk_rows(self.rows, shard_size)
        self.shard_offset, self.shard_length = shard_rows(self.rows, shard_size, shard_rank)
        self.padded_sharded_numel = self.chunk * self.row_numel
        self.sharded_numel = self.shard_length * self.row_numel
        self.unsharded_numel = self.padded_sharded_numel * self.shard_size
        padded = self.xp.zeros(self.padded_sharded_numel, dtype=self.orig_dtype)
        first = self.shard_offset * self.row_numel
        padded[:self.sharded_numel] = data.reshape(-1)[first:first + self.sharded_numel]
        self._sharded_param_data = padded
        self.param_class = type(param)  # Parameter (distlab.nn, which a shared module does not import)
        self.sharded_param = self.param_class(self._sharded_view(padded), requires_grad=param.requires_grad)
        self.sharded_param.global_shape = self.orig_size
        self.sharded_param.offsets = (self.shard_offset,) + (0,) * (len(self.orig_size) - 1)
        self.sharded_param._fsdp_param = self
        self._unsharded_param = None
        self.all_gather_output = None
        self._storage_generation = -1
        self._unsharded_generation = -2
        self._sharded_post_forward_param_data = None
        self.unsharded_accumulated_grad = None
        self.init_post_forward(post_forward_size)
        self.init_dtype_attrs(mp_policy)
        self.sharded_state = ShardedState.SHARDED  # the twin's constructor registers the shard on the modules

    def _sharded_view(self, padded):
        """The unpadded rows of the padded shard, shaped ``(rows here,) + orig_size[1:]``."""
        return padded[:self.sharded_numel].reshape((self.shard_length,) + self.orig_size[1:])

    def init_post_forward(self, post_forward_size: int) -> None:
        """Keep a ``1/k`` piece of the unsharded data after forward (``reshard_after_forward=k``), or nothing (0)
        (``_init_sharded_post_forward_param_metadata``)."""
        self.post_forward_size = int(post_forward_size)
        self.post_forward_rank = self.shard_rank % self.post_forward_size if self.post_forward_size else 0
        self.post_forward_numel = self.unsharded_numel // self.post_forward_size if self.post_forward_size else 0

    def init_dtype_attrs(self, mp_policy) -> None:
        """``param_dtype`` and ``reduce_dtype``, clamped to None where no cast is needed (``init_dtype_attrs``)."""
        self.param_dtype, self.reduce_dtype = mp_policy.clamped(self.orig_dtype)
        self.unsharded_dtype = self.param_dtype if self.param_dtype is not None else self.orig_dtype

    @property
    def sharded_size(self) -> tuple:
        return (self.shard_length,) + self.orig_size[1:]

    @property
    def padded_sharded_size(self) -> tuple:
        return (self.chunk,) + self.orig_size[1:]

    # -- state dicts (``to_sharded_dtensor`` / ``reset_sharded_param``) ------------------------------------------
    def sharded_array(self) -> ShardedArray:
        """This rank's unpadded shard with its global shape and offsets (no communication)."""
        param = self.sharded_param
        return ShardedArray(param.data, self.orig_size, param.offsets)

    def check_load(self, value, key: str) -> None:
        """Raise if ``value`` (a whole parameter, or a ShardedArray block) cannot be loaded into this shard; a
        state dict is checked whole before any parameter is loaded."""
        if hasattr(value, "global_shape"):
            self._check_sharded(value, key)
            return
        value = value.data if isinstance(value, Tensor) else value
        if tuple(value.shape) != self.orig_size:
            raise RuntimeError(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, the "
                               f"shape in current model is {self.orig_size}")

    def load(self, value, key: str) -> None:
        """Copy this rank's rows of a whole parameter, or its own block (a ShardedArray), into the shard."""
        self.check_load(value, key)
        if hasattr(value, "global_shape"):
            self._copy_into_shard(value.local)
            return
        value = value.data if isinstance(value, Tensor) else value
        self._copy_into_shard(value[self.shard_offset:self.shard_offset + self.shard_length])

    def _check_sharded(self, value: ShardedArray, key: str) -> None:
        """``value``'s block must be this rank's block (resharding is the checkpoint's)."""
        if tuple(value.global_shape) != self.orig_size:
            raise RuntimeError(f"size mismatch for {key}: copying a param with shape {tuple(value.global_shape)}, "
                               f"the shape in current model is {self.orig_size}")
        mine = self.sharded_param.offsets, self.sharded_size
        if (tuple(value.offsets), tuple(value.sizes)) != mine:
            raise RuntimeError(f"{key}: the saved block at offsets {tuple(value.offsets)} of shape "
                               f"{tuple(value.sizes)} is not this rank's block (offsets {mine[0]}, shape "
                               f"{mine[1]}); load a checkpoint saved on another number of ranks with "
                               "distlab.checkpoint, which reshards")

    def _copy_into_shard(self, rows) -> None:
        xp = self.xp
        rows = rows if array_module(rows) is xp else xp.asarray(rows)
        self.sharded_param.data[...] = rows
        self._sharded_param_data[self.sharded_numel:] = 0  # the padding stays zero (reset_sharded_param)

    def describe(self) -> tuple:
        """What must agree across ranks about this parameter: name, shape, dtype (checked before the first
        all-gather)."""
        return (self.fqn, self.orig_size, str(np.dtype(self.orig_dtype)))
