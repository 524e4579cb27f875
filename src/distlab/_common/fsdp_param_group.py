"""What both FSDP twins share about a parameter group: its construction, the process groups it talks over, the
context shared by every group of one root, and the record a joined rank replays, as functions.

Mirrors the construction and bookkeeping half of torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py
(``FSDPParamGroup.__init__``, ``lazy_init``'s layout, ``FSDPCommContext``) and ``_fsdp_common.py``'s mesh infos.

There is no base class. Each ``FSDPParamGroup`` twin's ``__init__`` takes a :class:`GroupSetup` from
:func:`prepare_group` and keeps its fields under the names of :data:`GROUP_STATE`; the functions here take what
they need as arguments or read a group's state by those names, and none calls a twin's method. The per-step half
(unshard, reshard, the forward and backward hooks) is twinned: ``reference/fsdp_param_group.py`` and
``core/_fsdp_param_group.pyx``.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..timeline import get_timeline, now_us
from .fsdp import FSDP_LANE, BufferPool, ShardedState, TrainingState
from .fsdp_param import describe_param

__all__ = ["MeshInfo", "FSDPCommContext", "GroupSetup", "GROUP_STATE", "prepare_group", "pack_shards", "storage_layout",
           "record_call", "compute_begins", "compute_ends", "describe_group"]

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


class GroupSetup(NamedTuple):
    """What a new ``FSDPParamGroup`` starts from (:func:`prepare_group`); a twin keeps every field under its name."""

    fsdp_params: list
    modules: tuple
    mesh_info: MeshInfo
    post_forward_group: Any  # None (ZeRO-2), the shard group (ZeRO-3) or a k-rank subgroup (reshard_after_forward=k)
    mp_policy: Any
    module_fqn: str
    comm_ctx: FSDPCommContext  # this group's until the root's lazy init gives every group the root's
    orig_dtype: Any
    reduce_dtype: Any
    xp: Any
    sharded_flat: Any  # the padded shards one after the other (pack_shards), what the all-gather sends; or None
    training_state: int = TrainingState.IDLE
    sharded_state: int = ShardedState.SHARDED
    reduce_grads: bool = True  # set_requires_gradient_sync
    all_reduce_grads: bool = True  # set_requires_all_reduce (hybrid sharding)
    reshard_after_backward: bool = True
    gradient_divide_factor: Any = None
    user_divide_factor: Any = None  # the factor set_gradient_divide_factor set (Join may override the other)
    unshard_async_op: bool = False
    join_mask: Any = None  # set while a joined rank replays a post_backward (zero gradients)
    storage: Any = None  # the UnshardedStorage, made by the twin's lazy_init


#: The state every ``FSDPParamGroup`` twin keeps, by name: :class:`GroupSetup`'s fields. The one list of what the
#: functions here and ``distlab.fsdp`` may read or set of a group (tests/test_fsdp.py checks both twins have it).
GROUP_STATE = GroupSetup._fields


def prepare_group(fsdp_params, modules, mesh_info, post_forward_group, mp_policy, module_fqn) -> GroupSetup:
    """Check the group's parameters (one original dtype, as torch's ``FSDPParamGroup`` asserts) and give its
    initial state."""
    fsdp_params = list(fsdp_params)
    dtypes = {np.dtype(p.orig_dtype) for p in fsdp_params}
    if len(dtypes) > 1:
        raise AssertionError(f"FSDP expects uniform original parameter dtype but got "
                             f"{sorted(str(d) for d in dtypes)} in the group of {module_fqn or '<root>'!r}")
    first = fsdp_params[0] if fsdp_params else None
    return GroupSetup(fsdp_params, tuple(modules), mesh_info, post_forward_group, mp_policy, module_fqn,
                      FSDPCommContext(), dtypes.pop() if dtypes else None,
                      first.reduce_dtype if first is not None else None, first.xp if first is not None else np,
                      pack_shards(fsdp_params))


def pack_shards(fsdp_params):
    """Move the group's padded shards into one flat buffer, one after the other in the order of the all-gather's
    copy-in, and return it (None for a group whose all-gather casts: mixed precision).

    Each parameter's padded shard (``sharded_param_data``) and its sharded ``Parameter``'s data become views of the
    buffer, so the optimizer steps the buffer in place and the group's all-gather sends it as it is: no copy-in,
    and no flat input buffer (a distlab addition: torch's FSDP2 copies the shards in before each all-gather). The
    copy-in remains for a cast (``param_dtype``) and for the piece kept after forward (``reshard_after_forward=k``).
    """
    if not fsdp_params or any(p.unsharded_dtype != p.orig_dtype for p in fsdp_params):
        return None
    flat = fsdp_params[0].xp.empty(sum(p.padded_sharded_numel for p in fsdp_params), dtype=fsdp_params[0].orig_dtype)
    offset = 0
    for fsdp_param in fsdp_params:
        padded = flat[offset:offset + fsdp_param.padded_sharded_numel]
        padded[...] = fsdp_param.sharded_param_data
        fsdp_param.sharded_param_data = padded
        fsdp_param.sharded_param.data = padded[:fsdp_param.sharded_numel].reshape(fsdp_param.sharded_size)
        offset += fsdp_param.padded_sharded_numel
    return flat


def storage_layout(fsdp_params) -> tuple:
    """``(dtype, offsets, total)`` of a group's unsharded storage (``lazy_init``'s all-gather outputs): each
    parameter's all-gather output starts at its offset, aligned to :data:`ALIGN_BYTES`."""
    dtype = fsdp_params[0].unsharded_dtype
    step = max(1, ALIGN_BYTES // np.dtype(dtype).itemsize)
    offsets, total = [], 0
    for fsdp_param in fsdp_params:
        offsets.append(total)
        total += -(-fsdp_param.unsharded_numel // step) * step
    return dtype, offsets, total


# -- records --------------------------------------------------------------------------------------------------------
def record_call(group, event: str, argument=None) -> None:
    """Note a per-step call of ``group`` for a joined rank to replay (``FSDPCommContext.program``)."""
    ctx = group.comm_ctx
    if ctx.recording:
        ctx.program.append((group, event, argument))


def compute_begins() -> float:
    """The start of a module's forward or backward computation (0.0 when no timeline records it)."""
    return now_us() if get_timeline().enabled else 0.0


def compute_ends(start: float, what: str, group) -> None:
    """Put a module's forward or backward computation that began at ``start`` on the timeline (lane ``fsdp``)."""
    if start:
        get_timeline().complete(f"{what} {group.module_fqn or '<root>'}", start, now_us(), lane=FSDP_LANE,
                                args={"params": len(group.fsdp_params)})


def describe_group(group) -> tuple:
    """What must agree across ranks about a group (checked before the first all-gather)."""
    info, post = group.mesh_info, group.post_forward_group
    return (group.module_fqn, tuple(describe_param(p) for p in group.fsdp_params), info.shard_size,
            info.replicate_size, 0 if post is None else post.size, str(group.mp_policy.param_dtype),
            str(group.mp_policy.reduce_dtype))
