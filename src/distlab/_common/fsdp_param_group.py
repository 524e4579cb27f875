"""What both FSDP twins share about a parameter group: its construction, the process groups it talks over, the
context shared by every group of one root, and the record a joined rank replays.

Mirrors the construction and bookkeeping half of torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py
(``FSDPParamGroup.__init__``, ``lazy_init``, the ``is_sharded``... properties, ``use_training_state``,
``FSDPCommContext``) and ``_fsdp_common.py``'s mesh infos. The per-step half (unshard, reshard, the forward and
backward hooks) is twinned: ``reference/fsdp_param_group.py`` and ``core/_fsdp_param_group.pyx``.
"""
from __future__ import annotations

import contextlib

import numpy as np

from ..timeline import get_timeline, now_us
from .fsdp import FSDP_LANE, BufferPool, ShardedState, TrainingState
from .fsdp_storage import UnshardedStorage

__all__ = ["MeshInfo", "FSDPCommContext", "FSDPParamGroupBase"]

#: Elements between two parameters' all-gather outputs in a group's storage are aligned to this many bytes.
ALIGN_BYTES = 64


class MeshInfo:
    """The process groups of one ``fully_shard`` call (torch's ``FSDPMeshInfo`` / ``HSDPMeshInfo``).

    ``shard_group`` shards the parameters; ``replicate_group`` (hybrid sharding, a 2-D mesh) holds the ranks with
    the same shard on the other hosts, or None; ``full_group`` spans both (the process group Join counts on).
    """

    def __init__(self, shard_group, replicate_group=None, full_group=None):
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        self.full_group = full_group if full_group is not None else shard_group
        self.shard_size, self.shard_rank = shard_group.size, shard_group.rank
        self.replicate_size = replicate_group.size if replicate_group is not None else 1


class FSDPCommContext:
    """What every group of one root shares (torch's ``FSDPCommContext``): the reused all-gather buffers, the
    order groups ran forward in (backward prefetches in reverse), the reduce-scatter in flight, and the record of
    this iteration's group calls that a joined rank replays (:mod:`distlab.fsdp`'s Join support)."""

    def __init__(self):
        self.all_gather_pool = BufferPool()
        self.post_forward_order: list = []
        self.forward_order: list = []  # groups in the order their pre-forward ran, this iteration
        self.forward_successor: dict = {}  # id(group) -> the group whose forward followed it last iteration
        self.reduce_scatter_state = None
        self.program: list = []  # (group, event, argument) of the iteration, in call order
        self.recording = True


class FSDPParamGroupBase:
    """Construction and bookkeeping of :class:`~distlab.reference.fsdp_param_group.FSDPParamGroup`."""

    def _configure(self, fsdp_params, modules, mesh_info, post_forward_group, mp_policy, module_fqn):
        self.fsdp_params = list(fsdp_params)
        self.modules = tuple(modules)
        self.mesh_info = mesh_info
        self.post_forward_group = post_forward_group  # None, the shard group (True) or a k-rank subgroup
        self.mp_policy = mp_policy
        self._module_fqn = module_fqn
        self.comm_ctx = FSDPCommContext()
        self._training_state = TrainingState.IDLE
        self._sharded_state = ShardedState.SHARDED
        self._all_gather_result = None
        self._post_forward_indices: list = []
        self._pending_reduce = None
        self._post_backward_pending = 0
        self._join_mask = None  # set while a joined rank replays a post_backward (zero gradients)
        self.reduce_grads = True  # set_requires_gradient_sync
        self.all_reduce_grads = True  # set_requires_all_reduce (hybrid sharding)
        self.reshard_after_backward = True
        self.gradient_divide_factor = None
        self.unshard_async_op = False
        self.storage = None
        self._compute_start = 0.0
        dtypes = {np.dtype(p.orig_dtype) for p in self.fsdp_params}
        if len(dtypes) > 1:
            raise AssertionError(f"FSDP expects uniform original parameter dtype but got "
                                 f"{sorted(str(d) for d in dtypes)} in the group of {module_fqn or '<root>'!r}")
        self._orig_dtype = dtypes.pop() if dtypes else None
        self._reduce_dtype = self.fsdp_params[0].reduce_dtype if self.fsdp_params else None
        self.xp = self.fsdp_params[0].xp if self.fsdp_params else np

    def lazy_init(self) -> None:
        """Make the group's unsharded storage, each parameter's all-gather output a slice of it (``lazy_init``)."""
        if self.storage is not None:
            return
        dtype = self.fsdp_params[0].unsharded_dtype
        step = max(1, ALIGN_BYTES // np.dtype(dtype).itemsize)
        offsets, total = [], 0
        for fsdp_param in self.fsdp_params:
            offsets.append(total)
            total += -(-fsdp_param.unsharded_numel // step) * step
        self._storage_offsets = offsets
        self.storage = UnshardedStorage(self.xp, dtype, total)
        self._cut_all_gather_outputs()

    def _cut_all_gather_outputs(self) -> None:
        """Point each parameter's all-gather output at its slice of the storage (again after a device storage was
        re-made)."""
        flat, generation = self.storage.flat, self.storage.generation
        for fsdp_param, offset in zip(self.fsdp_params, self._storage_offsets):
            view = None if flat is None else flat[offset:offset + fsdp_param.unsharded_numel]
            fsdp_param.set_all_gather_output(view, generation)

    def alloc_storage(self) -> None:
        """Hold the unsharded storage (``alloc_all_gather_outputs``)."""
        if self.storage.alloc():
            self._cut_all_gather_outputs()

    # -- the process groups ---------------------------------------------------------------------------------------
    @property
    def _reshard_after_forward(self) -> bool:
        return self.post_forward_group is not None

    @property
    def _use_post_forward_mesh(self) -> bool:
        return self.post_forward_group is not None and self.post_forward_group is not self.mesh_info.shard_group

    @property
    def _all_gather_process_group(self):
        """The shard group, or after a forward with ``reshard_after_forward=k``, the rank's k-rank subgroup."""
        if self._sharded_state == ShardedState.SHARDED_POST_FORWARD:
            return self.post_forward_group
        return self.mesh_info.shard_group

    @property
    def _reduce_scatter_process_group(self):
        return self.mesh_info.shard_group

    @property
    def _all_reduce_process_group(self):
        return self.mesh_info.replicate_group

    @property
    def is_sharded(self) -> bool:
        return self._sharded_state == ShardedState.SHARDED

    @property
    def is_sharded_post_forward(self) -> bool:
        return self._sharded_state == ShardedState.SHARDED_POST_FORWARD

    @property
    def is_unsharded(self) -> bool:
        return self._sharded_state == ShardedState.UNSHARDED

    @contextlib.contextmanager
    def use_training_state(self, training_state):
        previous = self._training_state
        self._training_state = training_state
        try:
            yield
        finally:
            self._training_state = previous

    # -- checks and records ---------------------------------------------------------------------------------------
    def _record(self, event: str, argument=None) -> None:
        """Note a per-step call for a joined rank to replay (``FSDPCommContext.program``)."""
        ctx = self.comm_ctx
        if ctx.recording:
            ctx.program.append((self, event, argument))

    def _compute_begins(self) -> None:
        """The module's forward or backward computation starts now (for its span on the timeline)."""
        self._compute_start = now_us() if get_timeline().enabled else 0.0

    def _compute_ends(self, what: str) -> None:
        """Put the module's forward or backward computation on the timeline (lane ``fsdp``)."""
        if self._compute_start:
            get_timeline().complete(f"{what} {self._module_fqn or '<root>'}", self._compute_start, now_us(),
                                    lane=FSDP_LANE, args={"params": len(self.fsdp_params)})
            self._compute_start = 0.0

    def _with_fqn(self, label: str) -> str:
        return f"{label} ({self._module_fqn})" if self._module_fqn else label

    def describe(self) -> tuple:
        """What must agree across ranks about this group (checked before the first all-gather)."""
        info = self.mesh_info
        post = 0 if self.post_forward_group is None else self.post_forward_group.size
        return (self._module_fqn, tuple(p.describe() for p in self.fsdp_params), info.shard_size,
                info.replicate_size, post, str(self.mp_policy.param_dtype), str(self.mp_policy.reduce_dtype))
