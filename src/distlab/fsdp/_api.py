"""``fully_shard`` and ``FSDPModule`` (mirrors torch/distributed/fsdp/_fully_shard/_fully_shard.py and
``_fsdp_init.py``).

``fully_shard(module)`` shards, in place, the parameters of ``module`` that no earlier call took, makes them one
parameter group (one all-gather and one reduce-scatter per step), hooks the module's forward, and changes its class
to ``FSDP<Orig>``, a subclass of :class:`FSDPModule` and of its own class. Apply it bottom-up: the blocks, then the
root.
"""
from __future__ import annotations

import warnings

import numpy as np

from .. import _backend, comm
from .._common.fsdp import MixedPrecisionPolicy
from .._common.fsdp_param import ParamModuleInfo
from .._common.fsdp_param_group import MeshInfo, describe_group
from .._common.join import JoinConfig
from ..autograd._array import array_module
from ..nn import Module
from ._mesh import DeviceMesh
from ._state import FSDPState, fsdp_state

__all__ = ["fully_shard", "check_same_model"]

_FSDP_CLASSES: dict = {}
_SUBGROUPS: dict = {}  # (id(shard group), k) -> the rank's k-rank subgroup (reshard_after_forward=k)


def fully_shard(module, *, group=None, reshard_after_forward=None, mp_policy=MixedPrecisionPolicy(),
                ignored_params=None, impl=None):
    """Shard ``module``'s parameters over the ranks of ``group`` (torch's ``fully_shard``; read ``distlab.fsdp``).

    Parameters
    ----------
    module : Module or list of Module
        The module to shard, in place; a list makes one group of several modules (tied parameters).
    group : ProcessGroup or DeviceMesh, optional
        The ranks to shard over (default: the world); a 2-D :class:`DeviceMesh` ``(replicate, shard)`` is hybrid
        sharding. Every rank of the world must take part.
    reshard_after_forward : bool, int or None
        True frees the unsharded parameters after forward and gathers them again in backward (ZeRO-3); False
        keeps them until backward ends (ZeRO-2); an int k keeps a 1/k piece so that backward gathers over k
        ranks; None (default) is True except for the root, which keeps them.
    mp_policy : MixedPrecisionPolicy
        Mixed precision (all-gather and compute dtype, reduction dtype).
    ignored_params : set of Parameter, optional
        Parameters to leave alone: not sharded, not reduced.
    impl : {"reference", "core"}, optional
        Which twin runs the group (default: ``distlab.IMPL``).

    Returns
    -------
    FSDPModule
        ``module``, now an instance of ``FSDP<its class>``.

    Notes
    -----
    The parameters the module then holds (``parameters()``, what the optimizer steps, so what its state is
    shaped like) are each rank's unpadded rows of the originals, ``Parameter``s with two more attributes:
    ``global_shape``, the whole parameter's shape, and ``offsets``, where the rows start in it (``(rank * chunk,
    0, ...)``, clipped to the end): ``distlab.ShardedArray(p.data, p.global_shape, p.offsets)`` describes a shard,
    or an optimizer state of its shape, without recomputing the chunk rule.
    """
    from ._module import FSDPModule

    modules = tuple(module) if isinstance(module, (list, tuple)) else (module,)
    for m in modules:
        _validate_module(m)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard: mp_policy must be a distlab.fsdp.MixedPrecisionPolicy, got {mp_policy!r}")
    mesh_info = _mesh_info(group)
    auto = reshard_after_forward is None
    post_forward_group = _post_forward_group(True if auto else reshard_after_forward, mesh_info)
    places = _managed_params(modules, ignored_params)
    twin = _backend.load("fsdp", impl)
    info = mesh_info
    k = 0 if post_forward_group is None else post_forward_group.size
    fsdp_params = [twin.FSDPParam(param, module_info, info.shard_size, info.shard_rank, k, mp_policy, fqn)
                   for fqn, param, module_info in places]
    _check_devices(fsdp_params)
    for fsdp_param in fsdp_params:
        fsdp_param.shard_group = info.shard_group  # the whole parameter is gathered over it (full state dicts)
    param_group = twin.FSDPParamGroup(fsdp_params, modules, info, post_forward_group, mp_policy) \
        if fsdp_params else None
    FSDPState(modules, param_group, mp_policy, auto, mesh_info, impl, check_same_model)  # sets itself on the modules
    for m in modules:
        object.__setattr__(m, "_join_config", JoinConfig.disabled())  # an FSDPModule is a Joinable
        cls = type(m)
        fsdp_cls = _FSDP_CLASSES.get(cls)
        if fsdp_cls is None:
            fsdp_cls = _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        m.__class__ = fsdp_cls
    return module


def _validate_module(module) -> None:
    if not isinstance(module, Module):
        raise ValueError(f"fully_shard expects a distlab.nn.Module, got {type(module).__name__}")
    if fsdp_state(module) is not None:
        raise RuntimeError("Each distinct composable distributed API can only be applied to a module once. "
                           f"fully_shard has already been applied to the following module.\n{module}")
    if type(module).forward is Module.forward:
        raise ValueError(f"fully_shard does not support containers that do not implement forward: {module}")


def _mesh_info(group) -> MeshInfo:
    if group is None:
        return MeshInfo(comm.world())
    if isinstance(group, DeviceMesh):
        if group.ndim not in (1, 2):
            raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {group}")
        if group.ndim == 1:
            return MeshInfo(group.get_group(0))
        return MeshInfo(group.get_group(1), group.get_group(0), group.group)
    if not all(hasattr(group, name) for name in ("allgather", "reduce_scatter", "size", "rank")):
        raise TypeError(f"fully_shard: group must be a distlab.comm.ProcessGroup or a DeviceMesh, got "
                        f"{type(group).__name__}")
    return MeshInfo(group)


def _post_forward_group(reshard_after_forward, mesh_info):
    """The group parameters stay sharded over after forward (``_get_post_forward_mesh_info``)."""
    if not isinstance(reshard_after_forward, (bool, int, np.integer)):
        raise ValueError("reshard_after_forward should be a bool or an int representing the group size to "
                         f"reshard to, not {reshard_after_forward!r}")
    if isinstance(reshard_after_forward, bool):
        return mesh_info.shard_group if reshard_after_forward else None
    k, size = int(reshard_after_forward), mesh_info.shard_size
    if k < 1 or k > size or size % k:
        raise ValueError(f"If passing reshard_after_forward as an int, it should be a factor of {size}, not {k}")
    if k == 1:
        warnings.warn("reshard_after_forward=1 keeps every rank's whole parameters after forward, as False does; "
                      "use False (or True for full sharding)", stacklevel=3)
        return None
    if k == size:
        return mesh_info.shard_group
    shard = mesh_info.shard_group
    key = (id(shard), k)
    if key not in _SUBGROUPS:
        for start in range(0, size, k):  # consecutive ranks; every rank of the shard group takes part
            made = shard.new_group(list(range(start, start + k)), name=f"fsdp post-forward {start}..{start + k - 1}")
            if made is not None:
                _SUBGROUPS[key] = made
    return _SUBGROUPS[key]


def _managed_params(modules, ignored_params) -> list:
    """``(name, param, ParamModuleInfo)`` of the parameters this call shards (``_get_managed_states``): those of the
    modules' subtrees not under an earlier call, not ignored, each once with every place it is registered at."""
    ignored = {id(p) for p in (ignored_params or ())}
    found: dict = {}
    order = []
    for root in modules:
        for prefix, module in _unmanaged_modules(root):
            for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
                if id(param) in ignored:
                    continue
                fqn = f"{prefix}.{name}" if prefix else name
                if "_fsdp_param" in param.__dict__ or param.__dict__.get("_fsdp_sharded"):
                    raise ValueError(f"Parameter '{fqn}' is shared with a parameter already managed by another "
                                     "FSDP group. For shared/tied parameters, use fully_shard([module_a, "
                                     "module_b]) to place them in the same FSDP group.")
                if id(param) in found:
                    found[id(param)][2].add(module, name)
                    continue
                _check_param(param, fqn)
                found[id(param)] = (fqn, param, ParamModuleInfo(module, name))
                order.append(id(param))
    for key in order:
        found[key][1].__dict__["_fsdp_sharded"] = True  # the original: any later group finding it refuses
    return [found[key] for key in order]


def _unmanaged_modules(root):
    """``(name, module)`` of ``root``'s subtree, leaving out subtrees an earlier ``fully_shard`` call took."""
    stack = [("", root)]
    seen = set()
    while stack:
        prefix, module = stack.pop(0)
        if id(module) in seen:
            continue
        seen.add(id(module))
        if module is not root and fsdp_state(module) is not None:
            continue
        yield prefix, module
        for name, child in module.named_children():
            stack.append((f"{prefix}.{name}" if prefix else name, child))


def _check_param(param, fqn: str) -> None:
    data = param.data
    if data.ndim == 0:
        raise ValueError(f"FSDP does not support scalar (0-dimensional) parameters: {fqn!r}; give it shape (1,)")
    if not data.flags.c_contiguous:
        raise NotImplementedError(f"FSDP does not support non-contiguous parameters yet: {fqn!r} "
                                  f"param.shape={tuple(data.shape)} param.strides={tuple(data.strides)}")


def _check_devices(fsdp_params) -> None:
    modules = {array_module(p.sharded_param.data).__name__ for p in fsdp_params}
    if len(modules) > 1:
        raise AssertionError(f"FSDP expects the parameters of one group on one device, but they are on "
                             f"{sorted(modules)}: move the module first (module.to(...)) and then apply fully_shard")


def check_same_model(root_state) -> None:
    """Before the root's first all-gather: every rank of the world built the same model with the same groups, and
    the groups cover the world. Every rank raises the same error naming the ranks that differ."""
    world = comm.world()
    groups = root_state.groups()
    mine = [describe_group(group) for group in groups]
    sizes = sorted({group.mesh_info.full_group.size for group in groups})
    everyone = world.allgather_object((mine, sizes), name="fsdp: check the sharded model")
    for rank, (_, their_sizes) in enumerate(everyone):
        if any(size != world.size for size in their_sizes):
            raise ValueError(f"fully_shard: the group of rank {rank} has {their_sizes[0]} ranks, but the world has "
                             f"{world.size}: FSDP shards over every rank of the world (group=None), or a 2-D "
                             "DeviceMesh covering it for hybrid sharding")
    differ = [rank for rank, (theirs, _) in enumerate(everyone) if theirs != everyone[0][0]]
    if differ:
        raise ValueError("fully_shard: the sharded modules differ across ranks (found before the first "
                         f"all-gather): ranks {differ} differ from rank 0. "
                         + _first_difference(everyone[0][0], everyone[differ[0]][0], differ[0]))


def _first_difference(ours, theirs, rank: int) -> str:
    if len(ours) != len(theirs):
        return f"Rank 0 has {len(ours)} parameter groups, rank {rank} has {len(theirs)}."
    for mine, other in zip(ours, theirs):
        if mine != other:
            if mine[1] != other[1]:
                return (f"In group {mine[0] or '<root>'!r}, rank 0 has parameters {list(mine[1])} and rank {rank} "
                        f"{list(other[1])}.")
            return f"Group {mine[0] or '<root>'!r} is configured differently: rank 0 {mine}, rank {rank} {other}."
    return ""
