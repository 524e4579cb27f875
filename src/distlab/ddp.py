"""``distlab.ddp``: data-parallel training of a distlab module over MPI (``DistributedDataParallel``).

Mirrors torch/nn/parallel/distributed.py. The wrapper checks that every rank holds the same model, copies rank
0's parameters and buffers to every rank, buckets the parameters, and hands them to the active twin's
:class:`~distlab.reference.reducer.Reducer`, whose hooks reduce gradients during backward::

    model = DistributedDataParallel(MLP())
    loss = loss_fn(model(x), y)
    loss.backward()          # gradients are averaged over ranks when backward returns
    opt.step()

This module is the one public home of DDP: ``DistributedDataParallel``, the active twin's ``Reducer`` (chosen by
``DISTLAB_IMPL``), :class:`GradBucket` (what a communication hook receives) and
:func:`compute_bucket_assignment_by_size`. The hooks themselves are in :mod:`distlab.ddp_comm_hooks`, as
PyTorch keeps them in ``torch.distributed.algorithms.ddp_comm_hooks``. Shared by both twins (it is plumbing around
the reducer, not a twinned protocol).
"""
from __future__ import annotations

import contextlib
import inspect

import numpy as np

from . import _backend, comm
from ._common.join import HostJoinable, JoinConfig
from ._common.reducer import (
    AUTO,
    DEFAULT_FIRST_BUCKET_BYTES,
    MiB,
    GradBucket,
    bucket_cap,
    compute_bucket_assignment_by_size,
)
from .autograd import SparseGrad, Tensor, is_grad_enabled
from .nn import Module

# Reducer comes from __getattr__ (PEP 562)
__all__ = ["DistributedDataParallel", "Reducer", "GradBucket", "compute_bucket_assignment_by_size"]  # noqa: F822


def __getattr__(name):
    """``distlab.ddp.Reducer``: the active twin's reducer, loaded on first use (PEP 562)."""
    if name == "Reducer":
        return _backend.load("reducer").Reducer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _find_tensors(obj):
    """Every Tensor inside a forward output (tensors, lists, tuples, dicts), like torch's ``_find_tensors``."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _find_tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _find_tensors(item)]
    return []


def _array_of(tensor):
    """The array behind a parameter or buffer (a buffer may be a Tensor or a plain array)."""
    return tensor.data if isinstance(tensor, Tensor) else tensor


class DistributedDataParallel(HostJoinable, Module):
    """Wrap ``module`` so that ``backward`` averages its gradients over the ranks of ``process_group``.

    Parameters
    ----------
    module : distlab.nn.Module
        The model; every rank must build the same one and pass the same arguments (both checked; ``impl`` may
        differ).
    process_group : distlab.comm.ProcessGroup, optional
        Default: :func:`distlab.comm.world`.
    bucket_cap_mb : float, "auto" or None
        Bucket size in MiB. The default, ``"auto"`` (``None`` too, torch's spelling of "the default"), measures
        the first iteration's backward pass and the group's allreduce and chooses the size at the bucket rebuild
        after it: the whole model on one host (in its shared-memory arena), small buckets across a slow link (the
        reducer's docs page); rank 0 logs the choice (logger ``distlab.ddp``, INFO). A number fixes the size and
        measures nothing; 25 is PyTorch's default layout.
    find_unused_parameters : bool
        Find parameters that get no gradient in an iteration (costs a graph walk per iteration).
    gradient_as_bucket_view : bool
        ``.grad`` becomes a view into the bucket, and backward computes each gradient of a ``linear`` or
        ``embedding`` straight into it (:func:`distlab.autograd.set_grad_buffer`): saves the copies in and out
        and the memory of one gradient set. As in torch, a ``.grad`` kept from an earlier step is overwritten.
    static_graph : bool
        Promise that every iteration uses the same parameters, the same number of times.
    broadcast_buffers : bool
        Copy rank 0's buffers to every rank at each forward.
    reduce_dtype : numpy dtype, optional
        Reduce gradients in this dtype (mixed precision, e.g. ``np.float16``).
    impl : {"reference", "core"}, optional
        Which reducer twin to use (default: ``distlab.IMPL``).
    """

    def __init__(self, module, process_group=None, bucket_cap_mb=AUTO, find_unused_parameters=False,
                 gradient_as_bucket_view=False, static_graph=False, broadcast_buffers=True, reduce_dtype=None,
                 impl=None):
        super().__init__()
        self._arguments = dict(bucket_cap_mb=bucket_cap_mb, find_unused_parameters=find_unused_parameters,
                               gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph,
                               broadcast_buffers=broadcast_buffers, reduce_dtype=reduce_dtype, impl=impl)
        self.module = module
        self.process_group = process_group if process_group is not None else comm.world()
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = False
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        # "auto" starts from 25 MiB buckets; the reducer chooses the caps when it rebuilds the buckets.
        auto, self.bucket_bytes_cap = bucket_cap(bucket_cap_mb, "bucket_cap_mb", MiB, "MiB")
        bucket_cap_mb = AUTO if auto else bucket_cap_mb
        self._join_config = JoinConfig.disabled()  # DDP is a Joinable (through HostJoinable)
        self._fused_optimizer = None  # set by _register_fused_optim
        self._divide_by_initial_world_size = True
        self._join_uneven_inputs = False  # set once a Join uses this module (torch's logger: join_uneven_inputs)
        self._join_module = _backend.load("join", impl)
        named = self._parameters_to_reduce()
        self._module_buffers = list(self.module.named_buffers())  # re-read at every sync (_sync_buffers)
        # Arguments that change which collectives a rank issues must agree (the twin, ``impl``, need not).
        options = dict(bucket_cap_mb=bucket_cap_mb, find_unused_parameters=find_unused_parameters,
                       gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph,
                       broadcast_buffers=broadcast_buffers,
                       reduce_dtype=None if reduce_dtype is None else np.dtype(reduce_dtype).name)
        self._verify_model_across_ranks(named, options)
        self._sync_module_states()
        names = [name for name, _ in named]
        params = [p for _, p in named]
        expect_sparse = self._sparse_flags(params)
        reducer_module = _backend.load("reducer", impl)
        self.impl = impl or _backend.active_impl()
        bucket_indices, _limits = compute_bucket_assignment_by_size(params, [self.bucket_bytes_cap], expect_sparse)
        # Reverse: parameters registered last are used last in forward, so their gradients come first.
        self.reducer = reducer_module.Reducer(
            params, list(reversed(bucket_indices)), self.process_group, expect_sparse,
            AUTO if auto else self.bucket_bytes_cap,
            find_unused_parameters, gradient_as_bucket_view, names,
            min(DEFAULT_FIRST_BUCKET_BYTES, self.bucket_bytes_cap),  # a small bucket_cap_mb stays small on rebuild
            reduce_dtype)
        if static_graph:
            self._set_static_graph()

    def rebuilt_on(self, process_group) -> "DistributedDataParallel":
        """A fresh DDP of the same module, with the same arguments, over ``process_group``; this one lets go of the
        parameters (its reducer's hooks are removed) and must not be used again.

        What the survivors of a failure do once they shrank the world (:mod:`distlab.collectives.elastic`): the
        reducer, its buckets and their collectives start anew on the new group; the bucket layout comes back with
        the state they roll back to (:meth:`load_bucket_state_dict`). A communication hook whose state is None or
        this DDP's process group (``allreduce_hook``, ``fp16_compress_hook``, ...) is registered again, with the new
        group; one with a state of its own (PowerSGD's, a fused optimizer's) is not: register it again in a reset
        callback.
        """
        hook, state = self.reducer.comm_hook, self.reducer.comm_hook_state
        self.reducer.remove_hooks()
        rebuilt = DistributedDataParallel(self.module, process_group=process_group, **self._arguments)
        if hook is not None and self._fused_optimizer is None and (state is None or state is self.process_group):
            rebuilt.register_comm_hook(None if state is None else process_group, hook)
        return rebuilt

    # -- construction ---------------------------------------------------------------------------------------
    def _parameters_to_reduce(self):
        named, seen = [], set()
        for name, param in self.module.named_parameters():
            if param.requires_grad and id(param) not in seen:  # a shared parameter is reduced once
                seen.add(id(param))
                named.append((name, param))
        if not named:
            raise ValueError("DistributedDataParallel is not needed when a module has no parameter that "
                             "requires a gradient")
        return named

    def _verify_model_across_ranks(self, named, options):
        """Same arguments, same number of parameters and same shapes on every rank, else an error naming the rank
        (every rank raises). PyTorch checks the shapes only; ranks given different arguments issue different
        collectives, which fail only later, as a timeout that does not say why."""
        mine = [(name, tuple(p.data.shape), str(p.data.dtype)) for name, p in named]
        everyone = self.process_group.allgather_object((options, mine), name="verify model")
        for rank, (theirs, _) in enumerate(everyone[1:], 1):
            differ = [f"{key}={theirs[key]!r} on rank {rank} but {value!r} on rank 0"
                      for key, value in everyone[0][0].items() if theirs[key] != value]
            if differ:
                raise ValueError("DistributedDataParallel expects the same arguments on every rank: "
                                 + "; ".join(differ))
        reference = everyone[0][1]
        for rank, (_, theirs) in enumerate(everyone[1:], 1):
            if len(theirs) != len(reference):
                raise ValueError(f"DistributedDataParallel expects the same model on every rank, but rank {rank} "
                                 f"has {len(theirs)} parameters that require grad while rank 0 has "
                                 f"{len(reference)}")
            for (name0, shape0, dtype0), (name, shape, dtype) in zip(reference, theirs):
                if shape != shape0 or dtype != dtype0:
                    raise ValueError(f"DistributedDataParallel expects the same model on every rank, but "
                                     f"parameter {name!r} is {dtype}{list(shape)} on rank {rank} while rank 0's "
                                     f"{name0!r} is {dtype0}{list(shape0)}")

    def _sync_module_states(self):
        """Every rank starts from rank 0's parameters and buffers (``_sync_module_states``)."""
        for name, tensor in list(self.module.named_parameters()) + list(self.module.named_buffers()):
            self.process_group.broadcast(_array_of(tensor), src=0, name=f"init {name}")

    def _sparse_flags(self, params):
        sparse_ids = {id(m.weight) for m in self.module.modules() if getattr(m, "sparse", False)
                      and getattr(m, "weight", None) is not None}
        return [id(p) in sparse_ids for p in params]

    def _set_static_graph(self):
        self.static_graph = True
        self.reducer.set_static_graph()

    # -- training ---------------------------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        """Run the module, around it the reducer's per-iteration steps (``_pre_forward``/``_post_forward``)."""
        grad_enabled = is_grad_enabled()
        sync = grad_enabled and self.require_backward_grad_sync
        if sync:
            self.reducer.prepare_for_forward()
        join_work = self._join_module.Join.notify_join_context(self)  # None outside an enabled Join
        if join_work is not None:
            self.reducer.set_forward_pass_work_handle(join_work, self._divide_by_initial_world_size)
        if grad_enabled:
            self.reducer.rebuild_buckets()
        if self._will_sync_buffers():
            self._sync_buffers(self._find_common_rank(self.process_group.rank, True)
                               if self._join_config.enable else 0)
        if self._join_config.enable:
            self._wait_grad_sync_flag()
            self._grad_sync_flag = self._check_global_requires_backward_grad_sync(is_joined_rank=False)
        output = self.module(*inputs, **kwargs)
        if sync:
            self.require_forward_param_sync = True
            if self.find_unused_parameters and not self.static_graph:
                self.reducer.prepare_for_backward(_find_tensors(output))
            else:
                self.reducer.prepare_for_backward([])
        else:
            self.require_forward_param_sync = False
        return output

    def _will_sync_buffers(self) -> bool:
        """A model with no buffer at construction never walks its modules for them (torch: ``modules_buffers``)."""
        return self.require_forward_param_sync and self.broadcast_buffers and bool(self._module_buffers)

    def _sync_buffers(self, src: int = 0):
        """Broadcast ``src``'s buffers, read afresh: a module may have reassigned one since the last forward
        (``self.buf = self.buf + 1``), and the old object would be broadcast in vain (torch re-reads them too,
        ``_assign_modules_buffers``)."""
        self._module_buffers = list(self.module.named_buffers())
        for name, buffer in self._module_buffers:
            self.process_group.broadcast(_array_of(buffer), src=src, name=f"buffer {name}")

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally inside the block; the first backward after it synchronises them all."""
        if self._fused_optimizer is not None:
            raise RuntimeError("no_sync() cannot be used with an optimizer registered by _register_fused_optim: "
                               "it updates the parameters as each bucket is reduced, so gradients cannot "
                               "accumulate over several backward passes (torch does not support it either)")
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state, hook):
        """Reduce buckets with ``hook(state, bucket) -> Future`` (see :mod:`distlab.ddp_comm_hooks`); once only."""
        if not callable(hook):
            raise TypeError(f"the communication hook must be callable, got {type(hook).__name__}")
        params = list(inspect.signature(hook).parameters)
        if len(params) != 2:
            raise TypeError(f"a communication hook takes (state, bucket); {getattr(hook, '__name__', hook)!r} "
                            f"takes {params}")
        self.reducer.register_comm_hook(state, hook)

    def _register_fused_optim(self, optim, *args, optim_params=None, **kwargs):
        """Update each parameter as soon as its bucket is reduced, with ``optim(params, *args, **kwargs)``.

        Mirrors torch's ``DistributedDataParallel._register_fused_optim``: the optimizer's update runs inside the
        communication hook (:func:`~distlab.ddp_comm_hooks.hook_then_optimizer` around ``allreduce_hook``), while
        later buckets are still being reduced, instead of after the last one; ``backward()`` returns with the
        parameters updated, and the training loop calls no ``step()``. ``optim_params`` (default: every
        parameter) limits it to some parameters. As in torch it is called once, does not compose with
        :meth:`register_comm_hook`, and refuses :meth:`no_sync`. Returns the optimizer.
        """
        from .ddp_comm_hooks import OptimizerHookState, allreduce_hook, hook_then_optimizer

        if self._fused_optimizer is not None:
            raise RuntimeError("_register_fused_optim can only be called once on a DistributedDataParallel "
                               f"(a {type(self._fused_optimizer).__name__} is registered)")
        if self.reducer.comm_hook is not None:
            raise RuntimeError("_register_fused_optim does not compose with register_comm_hook: a communication "
                               "hook is already registered")
        params = list(self.module.parameters() if optim_params is None else optim_params)
        optimizer = optim(params, *args, **kwargs)
        self.register_comm_hook(None, hook_then_optimizer(allreduce_hook, OptimizerHookState(
            optimizer, None if optim_params is None else params)))
        self._fused_optimizer = optimizer
        return optimizer

    def _get_ddp_logging_data(self):
        """What torch's DDP logger reports: the reducer's configuration and stats, and ``join_uneven_inputs``
        (whether a Join has used this module, i.e. iterations ran under Join)."""
        return {**self.reducer.get_logging_data(), "join_uneven_inputs": self._join_uneven_inputs}

    # -- Join (mirrors DistributedDataParallel.join and _DDPJoinHook) ------------------------------------------
    def join(self, divide_by_initial_world_size=True, enable=True, throw_on_early_termination=False):
        """``with model.join(): ...``: train on uneven inputs (Join with this model as the only joinable).

        ``divide_by_initial_world_size=True`` keeps dividing gradients by the world size after ranks have
        joined (joined ranks contribute zeros, so later steps are smaller); False divides by the number of
        ranks still training.
        """
        return self._join_module.Join([self], enable, throw_on_early_termination,
                                      divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs):
        """DDP's join hook: shadows one iteration's collectives; the post hook syncs the final model."""
        return _DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    def _check_global_requires_backward_grad_sync(self, is_joined_rank: bool):
        """Tell joined ranks whether this iteration syncs gradients (no_sync does not)."""
        flag = np.array([0 if is_joined_rank or not self.require_backward_grad_sync else 1], dtype=np.int64)
        work = self.process_group.allreduce(flag, async_op=True, name="join: gradient sync this iteration")
        if not is_joined_rank:
            return work
        work.wait()
        return bool(flag[0])

    def _wait_grad_sync_flag(self):
        """Complete the previous iteration's flag allreduce (nobody reads it here; it must not stay pending)."""
        work = getattr(self, "_grad_sync_flag", None)
        if work is not None:
            work.wait()
            self._grad_sync_flag = None

    def _find_common_rank(self, rank: int, candidate: bool) -> int:
        """The highest rank among candidates (ties broken by the larger rank), agreed by every rank."""
        chosen = np.array([rank if candidate else -1], dtype=np.int64)
        self.process_group.allreduce(chosen, op="max", name="join: common rank")
        if chosen[0] < 0:
            raise RuntimeError("no rank was a candidate for the authoritative model copy (a distlab bug)")
        return int(chosen[0])

    def _match_all_reduce_for_bwd_pass(self):
        """Allreduce zeros for every bucket, in the reducer's order, as the training ranks' backward does.

        The reduced buckets then go into ``.grad``, as a training rank's ``finalize_backward`` puts them: a
        joined rank ends the shadowed iteration with the gradients every other rank has, so a joinable listed
        after DDP that steps with them (ZeroRedundancyOptimizer, owner of a shard) stays correct. (The anchor
        discards them.)
        """
        buckets = self.reducer._get_zeros_like_grad_buckets()
        futures = [self.reducer._run_comm_hook(b) for b in buckets]
        for bucket, future in zip(buckets, futures):
            _set_reduced_grads(bucket, future.wait())

    def _match_unused_params_allreduce(self):
        self.process_group.allreduce(self.reducer._get_local_used_map(), name="local_used_map")

    def _sync_final_model(self, is_last_joiner: bool):
        """Every rank ends with the model of the highest rank among the last joiners."""
        self._wait_grad_sync_flag()
        self._authoritative_rank = self._find_common_rank(self.process_group.rank, is_last_joiner)
        for name, tensor in list(self.module.named_parameters()) + list(self.module.named_buffers()):
            self.process_group.broadcast(_array_of(tensor), src=self._authoritative_rank, name=f"final {name}")

    def state_dict(self, prefix: str = "") -> dict:
        return self.module.state_dict(prefix)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict)

    # -- the bucket layout, for a resumed run -------------------------------------------------------------------
    def bucket_state_dict(self) -> dict:
        """The reducer's bucket layout: which parameters each bucket holds, in reduction order, and whether it is
        the layout rebuilt after the first iteration (in gradient arrival order; with ``bucket_cap_mb="auto"``,
        with the sizes chosen then). The same on every rank (rank 0's layout is broadcast at the rebuild).

        A resumed run loads it with :meth:`load_bucket_state_dict`, so that it reduces the same buckets as the run
        it continues from its first step (the rebuild would otherwise happen again after that step, from its own
        arrival order and measurements) and a restarted run's results stay bit for bit those of the first.
        """
        reducer = self.reducer
        return {"rebuilt": bool(reducer.has_rebuilt_bucket),
                "buckets": [[int(i) for i in bucket.variable_indices] for bucket in reducer.buckets],
                "names": list(reducer.param_names),
                "first_bucket_bytes_cap": int(reducer.first_bucket_bytes_cap),
                "bucket_bytes_cap": int(reducer.bucket_bytes_cap), "auto_choice": reducer.auto_choice}

    def load_bucket_state_dict(self, state: dict) -> None:
        """Reduce in the buckets of ``state`` (from :meth:`bucket_state_dict`); call it before the first forward.

        A layout that was not rebuilt yet changes nothing (this run rebuilds after its first iteration, as the saved
        one would have). Raises ValueError when the layout is for other parameters.
        """
        reducer = self.reducer
        if list(state["names"]) != list(reducer.param_names):
            raise ValueError("load_bucket_state_dict: the saved bucket layout is for the parameters "
                             f"{state['names']}, this model reduces {list(reducer.param_names)}")
        if not state["rebuilt"]:
            return
        if reducer.num_iterations and reducer.require_finalize:
            raise RuntimeError("load_bucket_state_dict: a backward pass is in flight; call it between iterations")
        reducer.first_bucket_bytes_cap = int(state["first_bucket_bytes_cap"])
        reducer.bucket_bytes_cap = int(state["bucket_bytes_cap"])
        reducer.auto_choice = state["auto_choice"]
        reducer.initialize_buckets([list(bucket) for bucket in state["buckets"]])
        reducer.has_rebuilt_bucket = True
        reducer.rebuilt_param_indices = []

    def extra_repr(self) -> str:
        return f"impl={self.impl!r}, buckets={len(self.reducer.get_grad_buckets())}"


def _set_reduced_grads(bucket, reduced) -> None:
    """Point each parameter of a shadowed bucket at (a copy of) its slice of the reduced bucket."""
    params = bucket.parameters()
    if isinstance(reduced, SparseGrad):
        params[0].grad = reduced
        return
    for param, offset, length, size in zip(params, bucket.offsets(), bucket.lengths(), bucket.sizes()):
        param.grad = Tensor(reduced[offset:offset + length].reshape(size).astype(param.data.dtype, copy=True))


class _DDPJoinHook:
    """Shadows one DDP iteration on a rank that ran out of inputs (mirrors distributed.py ``_DDPJoinHook``)."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size
        ddp._join_uneven_inputs = True  # mirrors ddp.logger._set_uneven_input_join()

    def main_hook(self) -> None:
        """The collectives of one iteration, in order: rebuild once, buffers, grad-sync flag, buckets, used map."""
        ddp = self.ddp
        ddp.reducer.rebuild_buckets()
        if ddp._will_sync_buffers():
            ddp._sync_buffers(ddp._find_common_rank(ddp.process_group.rank, False))
        should_sync = ddp._check_global_requires_backward_grad_sync(is_joined_rank=True)
        ddp.require_forward_param_sync = should_sync  # no_sync on the others: no buffer sync next time either
        if not should_sync:
            return
        ddp.reducer.forward_work_static_world = ddp._divide_by_initial_world_size  # as the others' forward set it
        ddp._match_all_reduce_for_bwd_pass()
        if ddp.find_unused_parameters and not ddp.static_graph:
            ddp._match_unused_params_allreduce()
        ddp.reducer._push_all_rebuilt_params()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._sync_final_model(is_last_joiner)

