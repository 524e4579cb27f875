"""``ZeroRedundancyOptimizer``: optimizer state sharded across ranks (mirrors
torch/distributed/optim/zero_redundancy_optimizer.py, the ZeRO stage-1 idea of arXiv:1910.02054).

Data-parallel training keeps a full copy of the optimizer state on every rank: for Adam, two arrays the size of
the model. ZeRO gives each parameter one *owner* rank. Only the owner keeps the parameter's optimizer state and
updates it; after every step each owner broadcasts its parameters, so every rank again holds the whole updated
model. Gradients must already be the same on every rank (DDP's allreduce makes them so).

The partition (torch's ``_partition_parameters``), per parameter group, with one running total per rank that
carries over from one group to the next::

    for each parameter group, in order:
        for each parameter, largest first (stable: equal sizes keep their order):
            owner = the rank with the smallest total so far (the lowest such rank on ties)
            total[owner] += number of elements

Greedy on sorted sizes balances the element counts within a few percent when there are many more parameters
than ranks, so each rank keeps about ``1/world_size`` of the state.

A ZeroRedundancyOptimizer is a Joinable: on a rank that ran out of inputs, its join hook runs this rank's share of
the step with the gradients its parameters hold and takes part in every broadcast, so the ranks still training
receive this rank's shard. List DDP before it in the same Join: DDP's join hook leaves the reduced gradients
of the shadowed iteration in ``.grad``.
"""
from __future__ import annotations

import copy
import logging

from .. import _backend
from .._common.join import HostJoinable, Joinable, JoinHook
from ..autograd._array import array_module
from ..autograd.tensor import Tensor
from .optimizer import Optimizer

__all__ = ["ZeroRedundancyOptimizer"]

log = logging.getLogger("distlab.optim.zero")


class _ZeROJoinHook(JoinHook):
    """A joined rank still owns its shard: it steps it and broadcasts it with the others (torch's ``_ZeROJoinHook``).

    Unlike :meth:`ZeroRedundancyOptimizer.step`, the hook does not notify Join (this rank has joined, and its
    count allreduce already stood for the notification).
    """

    def __init__(self, zero: "ZeroRedundancyOptimizer"):
        self.zero = zero

    def main_hook(self) -> None:
        self.zero._local_step()
        self.zero._sync_params()


class ZeroRedundancyOptimizer(Optimizer, HostJoinable):
    """Wrap ``optimizer_class`` so that each rank keeps the optimizer state of its shard of the parameters only.

    Parameters
    ----------
    params : iterable of Tensor
        Every parameter of the model (the same ones, in the same order, on every rank).
    optimizer_class : type
        The local optimizer, a :class:`distlab.optim.Optimizer` subclass (``Adam``, ``SGD``, ``Adagrad``, ...),
        built on each rank over that rank's shard.
    process_group : distlab.comm.ProcessGroup, optional
        Default: :func:`distlab.comm.world`.
    parameters_as_bucket_view : bool
        Pack each rank's shard into one contiguous array, with the parameters' ``data`` as views into it: one
        broadcast per rank per step instead of one per parameter.
    overlap_with_ddp : bool
        Not supported: raises NotImplementedError (see the message).
    **defaults
        Hyper-parameters of ``optimizer_class`` (``lr=...``).

    Examples
    --------
    >>> opt = ZeroRedundancyOptimizer(ddp_model.parameters(), optimizer_class=optim.Adam, lr=1e-3)  # doctest: +SKIP
    >>> loss.backward(); opt.step()    # each rank updates its shard, then every shard is broadcast  # doctest: +SKIP
    """

    def __init__(self, params, optimizer_class, process_group=None, parameters_as_bucket_view: bool = False,
                 overlap_with_ddp: bool = False, **defaults):
        if overlap_with_ddp:
            raise NotImplementedError(
                "ZeroRedundancyOptimizer(overlap_with_ddp=True) is not supported: in torch it runs the optimizer "
                "step inside a DDP communication hook built by ddp_zero_hook (and needs NCCL to avoid hangs). Use "
                "overlap_with_ddp=False and call step() after backward; DDP already overlaps its gradient "
                "allreduces with the backward pass, and parameters_as_bucket_view=True makes the step's "
                "broadcasts one per rank")
        self._all_params = _verified_params(params)
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(f"optimizer_class must be a distlab.optim.Optimizer subclass (Adam, SGD, ...), got "
                            f"{optimizer_class!r}")
        from .. import comm  # here, not at the top: importing distlab.optim starts no MPI

        self.initialized = False  # add_param_group partitions only once the constructor is done
        Optimizer.__init__(self, self._all_params, defaults)
        Joinable.__init__(self)
        self.process_group = process_group if process_group is not None else comm.world()
        self.world_size = self.process_group.size
        self.rank = self.process_group.rank
        self._join = _backend.load("join").Join
        self._optim_constructor = optimizer_class
        self._optim_defaults = defaults
        self._partition_cache: list[list[dict]] = []
        self._is_trainable_mask = self._get_is_trainable_mask()
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._buckets: list = []  # parameters_as_bucket_view: one flat array per rank
        self._all_state_dicts: list[dict] = []  # filled by consolidate_state_dict on its target rank
        self._init_local_optimizer()
        self._build_param_buckets()
        self.initialized = True

    # -- the partition ------------------------------------------------------------------------------------------
    def _partition_parameters(self) -> list[list[dict]]:
        """Per rank, its param groups (copies of ours holding only its parameters); computed once, cached."""
        if not self._partition_cache:
            sizes = [0] * self.world_size  # carried across groups, as torch does
            partition: list[list[dict]] = [[] for _ in range(self.world_size)]
            for group in self.param_groups:
                params_per_rank: list[list] = [[] for _ in range(self.world_size)]
                for param in sorted(group["params"], key=lambda p: p.data.size, reverse=True):
                    owner = sizes.index(min(sizes))  # the first rank with the smallest total
                    params_per_rank[owner].append(param)
                    sizes[owner] += param.data.size
                for rank, params in enumerate(params_per_rank):
                    partition[rank].append({**group, "params": params})
            self._partition_cache = partition
        return self._partition_cache

    @property
    def _param_to_rank(self) -> dict:
        """``id(param)`` -> the rank that owns it."""
        return {id(p): rank for rank, groups in enumerate(self._partition_parameters())
                for group in groups for p in group["params"]}

    def _index_to_param(self) -> list:
        """The parameters in the global (state_dict) order: group after group."""
        return [p for group in self.param_groups for p in group["params"]]

    def _init_local_optimizer(self) -> None:
        """This rank's optimizer over its shard (a group with no parameter here is kept, empty: indices line up)."""
        self.optim = self._optim_constructor(self._partition_parameters()[self.rank], **self._optim_defaults)
        self._sync_param_groups(self.optim.param_groups, self.param_groups)

    @staticmethod
    def _sync_param_groups(src_groups, dst_groups) -> None:
        """Copy every hyper-parameter (not the parameters) from ``src_groups`` to ``dst_groups``."""
        for src, dst in zip(src_groups, dst_groups):
            dst.update({key: value for key, value in src.items() if key != "params"})

    # -- parameters_as_bucket_view ------------------------------------------------------------------------------
    def _build_param_buckets(self) -> None:
        """One flat array per rank holding its trainable parameters; their ``data`` become views into it.

        A rank that owns nothing gets a one-element dummy, so every rank still issues one broadcast per rank.
        """
        if not self.parameters_as_bucket_view:
            return
        self._buckets = []
        for groups in self._partition_parameters():
            params = [p for group in groups for p in group["params"]]
            trainable = [p for p in params if p.requires_grad]
            for p in params:
                if not p.requires_grad:
                    p.data = p.data.copy()  # out of a bucket it may have been in: frozen data stays put
            if not trainable:
                self._buckets.append(array_module(self._all_params[0].data).zeros(1, self._all_params[0].data.dtype))
                continue
            xp = array_module(trainable[0].data)
            bucket = xp.empty(sum(p.data.size for p in trainable), dtype=trainable[0].data.dtype)
            offset = 0
            for p in trainable:
                n = p.data.size
                bucket[offset:offset + n] = p.data.reshape(-1)
                p.data = bucket[offset:offset + n].reshape(p.data.shape)
                offset += n
            self._buckets.append(bucket)

    # -- the step -----------------------------------------------------------------------------------------------
    def step(self, closure=None):
        """Update this rank's shard, then broadcast every shard from its owner; returns ``closure()`` if given."""
        self._join.notify_join_context(self)
        loss = self._local_step(closure)
        self._sync_params()
        return loss

    def _local_step(self, closure=None):
        """Step the local optimizer, hyper-parameters synced both ways (an LR scheduler edits ours)."""
        mask = self._get_is_trainable_mask()
        if mask != self._is_trainable_mask:
            log.warning("ZeroRedundancyOptimizer: the trainable parameters changed; rebuilding the buckets")
            self._build_param_buckets()
            self._is_trainable_mask = mask
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        loss = self.optim.step(closure)
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        return loss

    def _sync_params(self) -> None:
        """Every rank broadcasts its shard; every other rank receives it (all asynchronous, then waited)."""
        works = []
        index = {id(p): i for i, p in enumerate(self._index_to_param())}  # names the broadcasts
        for rank in range(self.world_size):
            works.extend(self._broadcast_params_from_rank(rank, index))
        for work in works:
            work.wait()

    def _broadcast_params_from_rank(self, rank: int, index: dict) -> list:
        """One broadcast of ``rank``'s bucket, or one per parameter it owns (in partition order)."""
        group = self.process_group
        if self.parameters_as_bucket_view:
            return [group.broadcast(self._buckets[rank], src=rank, async_op=True, name=f"zero: shard of rank {rank}")]
        return [group.broadcast(p.data, src=rank, async_op=True, name=f"zero: param {index[id(p)]}")
                for param_group in self._partition_parameters()[rank] for p in param_group["params"]]

    def _get_is_trainable_mask(self) -> list:
        return [p.requires_grad for p in self._all_params]

    # -- param groups and state ---------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """Add a group and partition its parameters (on every rank: the partition must be the same everywhere).

        The parameters already partitioned keep their owners (the greedy pass sees the old groups first), so the
        local optimizer only gains this rank's share of the new group.
        """
        super().add_param_group(param_group)
        if not self.initialized:
            return
        self._all_params = self._index_to_param()
        self._is_trainable_mask = self._get_is_trainable_mask()
        self._partition_cache = []
        self.optim.add_param_group(self._partition_parameters()[self.rank][-1])
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        self._build_param_buckets()

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's optimizer state on rank ``to`` (call on every rank; one broadcast per rank, as torch)."""
        from ..comm.steps import check_rank  # here: importing distlab.optim starts no MPI

        check_rank(to, self.process_group.size, self.process_group.name, "consolidate_state_dict(to=...)")
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        states = []
        for rank in range(self.world_size):
            mine = self.optim.state_dict() if rank == self.rank else None
            received = self.process_group.broadcast_object(mine, src=rank, name=f"zero: state of rank {rank}")
            if self.rank == to:
                states.append(copy.deepcopy(received) if rank == self.rank else received)
        self._all_state_dicts = states

    def state_dict(self) -> dict:
        """The whole optimizer state, with torch's global indexing; only on the ``to`` rank of the last consolidate.

        Raises
        ------
        RuntimeError
            On a rank that did not receive a consolidated state (call ``consolidate_state_dict(to=rank)`` on every
            rank first). The state is as of that call.
        """
        if not self._all_state_dicts:
            raise RuntimeError(f"ZeroRedundancyOptimizer.state_dict() on rank {self.rank}: the optimizer state has "
                               f"not been consolidated on this rank. Call consolidate_state_dict(to={self.rank}) on "
                               "every rank first (each rank keeps only its shard of the state)")
        state_dict = Optimizer.state_dict(self)  # our groups, with global indices; our own state is empty
        global_index = {id(p): i for i, p in enumerate(self._index_to_param())}
        for rank, local in enumerate(self._all_state_dicts):
            for local_group, global_group in zip(local["param_groups"], self._partition_parameters()[rank]):
                for local_index, param in zip(local_group["params"], global_group["params"]):
                    if local_index in local["state"]:
                        state_dict["state"][global_index[id(param)]] = local["state"][local_index]
        state_dict["state"] = dict(sorted(state_dict["state"].items()))
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a :meth:`state_dict`: each rank keeps only the state of the parameters it owns."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(g["params"]) != len(own["params"]) for g, own in zip(groups, self.param_groups)):
            raise ValueError("loaded state dict has a different number of parameter groups or parameters")
        params, owner = self._index_to_param(), self._param_to_rank
        for index, value in state_dict["state"].items():
            param = params[int(index)]
            if owner[id(param)] == self.rank:
                self.optim.state[param] = {k: (v.copy() if hasattr(v, "copy") else v) for k, v in value.items()}
        for own, saved in zip(self.param_groups, groups):
            own.update({k: copy.deepcopy(v) for k, v in saved.items() if k != "params"})
        self._sync_param_groups(self.param_groups, self.optim.param_groups)

    # -- Joinable -----------------------------------------------------------------------------------------------
    def join_hook(self, **kwargs) -> _ZeROJoinHook:
        """The hook that steps this rank's shard and takes part in the broadcasts after it joined."""
        return _ZeROJoinHook(self)


def _verified_params(params) -> list:
    """torch's ``_verify_and_init_params`` and ``_verify_same_dense_param_type``: Tensors, one dtype, not empty."""
    if isinstance(params, Tensor):
        raise TypeError("params argument should be an iterable of Tensors, but got a Tensor")
    try:
        params = list(params)
    except TypeError:
        raise TypeError(f"params argument should be an iterable of Tensors, but got {type(params).__name__}") from None
    if not params:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
    for p in params:
        if not isinstance(p, Tensor):
            raise TypeError(f"params argument should be an iterable of Tensors, but it holds a {type(p).__name__} "
                            "(parameter groups as dicts are added with add_param_group)")
    dtypes = sorted({str(p.data.dtype) for p in params})
    if len(dtypes) > 1:
        raise ValueError(f"ZeroRedundancyOptimizer needs every parameter of one dtype, got {', '.join(dtypes)}")
    return params
