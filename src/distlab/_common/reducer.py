"""What both DDP reducer twins share: construction, the one-time bucket rebuild, registration, Join and logging.

:class:`ReducerBase` holds the reducer's methods that run at construction, once per training run or once per
iteration at most (never once per gradient): the reference twin (:class:`distlab.reference.reducer.Reducer`)
inherits them and the core twin (``distlab.core._reducer.Reducer``, a compiled class) binds the same functions, so
both run this one copy. Each twin defines only the per-gradient, per-bucket and per-iteration path.

The error messages are in :mod:`distlab._common.reducer_messages`, bucket assignment and :class:`GradBucket` in
:mod:`distlab._common.reducer_buckets`, the automatic bucket size in :mod:`distlab._common.reducer_autocap`,
runtime statistics in :mod:`distlab._common.reducer_stats`; this module re-exports what the twins import.
"""
from __future__ import annotations

import logging

import numpy as np

from ..autograd import SparseGrad, graph_leaves, queue_callback
from ..autograd.accumulate_grad import set_grad_buffer
from .reducer_autocap import AUTO, choose_bucket_caps, describe_auto_choice, measure_link
from .reducer_buckets import (
    NO_SIZE_LIMIT,
    Bucket,
    GradBucket,
    build_buckets,
    compute_bucket_assignment_by_size,
    empty_sparse_grad,
    sparse_allreduce,
)
from .reducer_messages import (
    check_hook_annotations,
    check_hook_result,
    check_hook_value,
    grad_mismatch,
    grad_shape_mismatch,
    hook_name,
    marked_twice,
    prior_reduction_unfinished,
    static_graph_changed,
)
from .reducer_stats import ReducerStats

log = logging.getLogger("distlab.ddp")

__all__ = ["AUTO", "MiB", "DEFAULT_BUCKET_BYTES", "DEFAULT_FIRST_BUCKET_BYTES", "ReducerBase", "GradBucket", "Bucket",
           "build_buckets", "compute_bucket_assignment_by_size", "empty_sparse_grad", "sparse_allreduce",
           "NO_SIZE_LIMIT", "ReducerStats", "bucket_cap", "marked_twice", "prior_reduction_unfinished", "static_graph_changed",
           "grad_mismatch", "grad_shape_mismatch", "check_hook_result", "check_hook_value"]

MiB = 1024 * 1024
#: The anchor's defaults: buckets of 25 MiB, and a first bucket of 1 MiB after the rebuild.
DEFAULT_BUCKET_BYTES = 25 * MiB
DEFAULT_FIRST_BUCKET_BYTES = 1 * MiB


def bucket_cap(value, what: str, unit: int = 1, unit_name: str = "bytes") -> tuple[bool, int]:
    """``(auto, cap in bytes)`` for a bucket cap: DDP's ``bucket_cap_mb`` (``unit=MiB``) or the reducer's
    ``bucket_bytes_cap``; ``"auto"`` (``None`` too, torch's spelling of "the default") starts from
    :data:`DEFAULT_BUCKET_BYTES` and has the reducer choose the caps at its rebuild. The one check of both."""
    auto = value is None or isinstance(value, str)
    if auto and value not in (None, AUTO):
        raise ValueError(f"{what} must be a number of {unit_name} or {AUTO!r}, got {value!r}")
    if not auto and not value > 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return auto, DEFAULT_BUCKET_BYTES if auto else int(value * unit)


# -- the shared part of the reducer ---------------------------------------------------------------------------
class ReducerBase:
    """The reducer's methods that both twins share (see the module docstring).

    A twin provides the attributes set by :meth:`_configure`, ``rebuilt_param_indices`` (the gradient arrival
    order recorded during the first iteration) and ``hook_counts`` (hooks per parameter in the first static
    iteration), and the methods ``initialize_buckets``, ``mark_variable_ready``, ``mark_variable_ready_dense``,
    ``all_reduce_bucket``, ``finalize_bucket_dense``, ``_should_rebuild_buckets`` and ``_unmarked_parameters``.

    No method takes a lock: the local autograd engine calls the reducer's hooks on the thread that runs backward,
    one backward pass at a time, and the DDP module is driven by one thread (reducer.cpp takes ``mutex_`` because
    the anchor's autograd engine runs hooks on one thread per device).
    """

    #: Which twin this is ("reference" or "core"), reported by :meth:`get_logging_data`.
    IMPL = ""

    def _configure(self, params, bucket_indices, process_group, expect_sparse_gradients, bucket_bytes_cap,
                   find_unused_parameters, gradient_as_bucket_view, param_names, first_bucket_bytes_cap, reduce_dtype):
        """Check the arguments, set the state, build the buckets, hook every parameter (``Reducer::Reducer``).

        The twin's own per-parameter state comes from its ``_init_per_parameter_state``, and each parameter's
        post-accumulate-grad hook from its ``_make_hook(index)``.
        """
        params = list(params)
        if not params:
            raise ValueError("the reducer needs at least one parameter that requires grad")
        n = len(params)
        self.params = params
        self.process_group = process_group
        self.expect_sparse_gradients = [bool(s) for s in (expect_sparse_gradients or [False] * n)]
        if len(self.expect_sparse_gradients) != n:
            raise ValueError(f"expect_sparse_gradients has {len(self.expect_sparse_gradients)} entries for {n} "
                             "parameters")
        self.auto_bucket_cap, self.bucket_bytes_cap = bucket_cap(bucket_bytes_cap, "bucket_bytes_cap")
        self.first_bucket_bytes_cap = int(first_bucket_bytes_cap)
        self.auto_choice = None  # with "auto": what was measured and chosen at the rebuild
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.param_names = list(param_names) if param_names is not None else [f"param{i}" for i in range(n)]
        if len(self.param_names) != n:
            raise ValueError(f"param_names has {len(self.param_names)} names for {n} parameters")
        self.reduce_dtype = None if reduce_dtype is None else np.dtype(reduce_dtype)
        if self.gradient_as_bucket_view and self.reduce_dtype is not None:
            raise ValueError("gradient_as_bucket_view cannot be used with a reduce_dtype: a bucket in another "
                             "dtype cannot be the parameters' .grad")
        self.static_graph = False
        self.comm_hook = None
        self.comm_hook_state = None
        self.num_iterations = 0
        self.expect_autograd_hooks = False
        self.require_finalize = False
        self.has_rebuilt_bucket = False
        self.unused_parameters = []
        self.has_marked_unused_parameters = False
        self.local_used_map = np.zeros(n, dtype=np.int32)
        self.used_during_no_sync = np.zeros(n, dtype=np.int32)
        self.local_used_work = None
        self.local_used_map_reduced = False
        self.div_factor = None
        self.forward_work = None  # Join: the allreduce counting ranks that have not joined
        self.forward_work_static_world = True
        self.stats = ReducerStats(process_group.rank)
        if self.auto_bucket_cap:
            self.stats.record_arrivals(n)
        self._finalize_queued = False
        self._init_per_parameter_state()
        self.initialize_buckets(bucket_indices)
        self.hook_handles = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(params)]

    # -- buckets ----------------------------------------------------------------------------------------------
    def _build_buckets(self, bucket_indices):
        """The buckets for ``bucket_indices`` (the twin's ``initialize_buckets`` then locates each parameter)."""
        return build_buckets(bucket_indices, self.params, self.param_names, self.expect_sparse_gradients,
                             self.reduce_dtype, self.gradient_as_bucket_view, group=self.process_group)

    def get_grad_buckets(self):
        """The current buckets as :class:`GradBucket` objects (for tests and inspection)."""
        return [self._grad_bucket(b) for b in range(len(self.buckets))]

    def _grad_bucket(self, b):
        return GradBucket.of_bucket(b, len(self.buckets), self.buckets[b], self.params)

    # -- once per iteration -----------------------------------------------------------------------------------
    def prepare_for_forward(self):
        """Count the iteration (``prepare_for_forward``)."""
        self.num_iterations += 1
        self.stats.start_iteration(self.num_iterations)

    def search_unused_parameters(self, outputs):
        """Parameters that ``outputs`` do not reach get no gradient this step (``search_unused_parameters``).

        They are marked ready up front (their bucket slots hold zeros, or the gradient they accumulated under
        ``no_sync``). A parameter whose gradient accumulated under ``no_sync`` counts as *used*, so that
        gradient is reduced and written back: every micro-batch is synchronised, not only the last one (the
        anchor leaves such gradients unsynchronised, a known complaint).
        """
        reachable = graph_leaves(list(outputs))
        self.unused_parameters = [i for i, p in enumerate(self.params) if p not in reachable]
        self.local_used_map[:] = self.used_during_no_sync
        self.used_during_no_sync[:] = 0

    def _mark_unused_parameters_ready(self):
        """On the first hook of an iteration, unused parameters are marked ready, so their buckets complete."""
        self.has_marked_unused_parameters = True
        for unused in self.unused_parameters:
            self.mark_variable_ready(unused)

    def _queue_finalize_backward(self):
        """After the last bucket's launch: start the used-map sum and have ``finalize_backward`` run when backward
        ends (G1: the used map is the iteration's last collective)."""
        self._finalize_queued = True
        if self.find_unused_parameters and not self.static_graph:
            self.all_reduce_local_used_map()
        queue_callback(self.finalize_backward)

    def mark_variable_ready_sparse(self, index, bucket):
        """A sparse bucket holds the (scaled) sparse gradient itself (``mark_variable_ready_sparse``)."""
        param = self.params[index]
        grad = param.grad
        if grad is None:
            grad = empty_sparse_grad(param)  # every rank takes part in the gather, with or without rows
        elif not isinstance(grad, SparseGrad):
            raise TypeError(grad_mismatch(self.param_names, index, param.data.dtype, grad.data))
        bucket.gradients = grad if self.comm_hook is not None else grad * (1.0 / self.div_factor)

    def _reduction_divides(self, bucket) -> bool:
        """Whether ``bucket``'s allreduce averages (op "avg"), so that its gradients enter it undivided.

        With ``gradient_as_bucket_view`` backward computes the gradients in the bucket, and dividing them there is
        a pass of its own, where a shared-memory bucket's reduction divides for nothing: it scales each
        cache-sized piece it has just summed (no counterpart in the anchor, which divides on the way in). Without
        the view each gradient is copied in anyway, and the copy divides for nothing. The reduction must divide
        by the group size, which under Join with ``divide_by_initial_world_size=False`` it does not; and a comm
        hook divides by itself.
        """
        return (self.gradient_as_bucket_view and bucket.arena is not None and self.comm_hook is None
                and self.forward_work_static_world)

    def _allreduce_dense(self, bucket, gradients, name):
        """Start the allreduce of a dense bucket's ``gradients`` without a comm hook; returns its future."""
        op = "avg" if self._reduction_divides(bucket) else "sum"
        return self.process_group.allreduce(gradients, op=op, async_op=True, name=name).get_future()

    def all_reduce_local_used_map(self):
        """Sum the used-parameter flags over ranks (``all_reduce_local_used_map``), after the last bucket (G1, G3)."""
        self.local_used_work = self.process_group.allreduce(self.local_used_map.copy(), async_op=True,
                                                            name="local_used_map")

    def _read_reduced_used_map(self):
        """Wait for the used-map sum (only when a locally unused parameter needs the answer) and keep it."""
        if not self.local_used_map_reduced:
            self.local_used_map[:] = self.local_used_work.result()
            self.local_used_map_reduced = True

    def delay_all_reduce(self):
        """First static-graph iteration: reduce every bucket once backward ended (``delay_all_reduce``).

        The first iteration of a static graph only counts each parameter's hooks; what was never counted is
        unused for good. Every bucket is then filled and reduced in order, and finalized at once.
        """
        self.unused_parameters = [i for i, count in enumerate(self.hook_counts) if count == 0]
        self.require_finalize = True
        self._set_divide_factor()
        for b, bucket in enumerate(self.buckets):
            for position, index in enumerate(bucket.variable_indices):
                if bucket.expect_sparse_gradient:
                    self.mark_variable_ready_sparse(index, bucket)
                else:
                    self.mark_variable_ready_dense(index, bucket, position)
        self.all_reduce_local_used_map()
        for b in range(len(self.buckets)):
            self.all_reduce_bucket(b)
        self.next_bucket = len(self.buckets)
        self.finalize_backward()

    def finalize_backward(self):
        """Wait for every bucket and write the results into ``.grad`` (``finalize_backward``).

        Waiting happens here, once backward has ended, not in the hooks: by then most buckets have finished
        while backward computed. The copy back, per parameter, is the twin's ``finalize_bucket_dense``.
        """
        self.expect_autograd_hooks = False
        self.require_finalize = False
        self._finalize_queued = False
        for bucket in self.buckets:
            result = bucket.future.wait()
            if bucket.expect_sparse_gradient:
                self.params[bucket.variable_indices[0]].grad = result
                continue
            if result is not bucket.gradients:  # a hook handed back another array: copy back from it
                check_hook_value(self.comm_hook, bucket, result)
                bucket.views_out = [result[o:o + n].reshape(s)
                                    for o, n, s in zip(bucket.offsets, bucket.lengths, bucket.sizes)]
            self.finalize_bucket_dense(bucket)
            bucket.views_out = bucket.views_in
        self.div_factor = None  # Join may change it next iteration
        self.stats.end_iteration()

    def _set_divide_factor(self):
        """World size, or under Join the number of ranks not yet joined (``set_divide_factor``)."""
        if self.div_factor is not None:
            return
        self.div_factor = self.process_group.size
        if self.forward_work is not None and not self.forward_work_static_world:
            self.div_factor = int(self.forward_work.result()[0])
        self.forward_work = None

    # -- the one-time rebuild ---------------------------------------------------------------------------------
    def rebuild_buckets(self):
        """Once, re-bucket in gradient arrival order, as rank 0 saw it (``rebuild_buckets``). True if rebuilt.

        Called at every forward; it does something only after the first iteration (G1: rank 0's layout is
        broadcast, so every rank reduces the same buckets).
        """
        self.ensure_prior_reduction_finished()
        if not self._should_rebuild_buckets() or not self.rebuilt_param_indices:
            return False
        order = list(self.rebuilt_param_indices)
        if self.static_graph or self.auto_bucket_cap:
            arrived = set(order)
            order += [i for i in range(len(self.params)) if i not in arrived]  # never used: last
        if sorted(order) != list(range(len(self.params))):
            return False  # not every gradient arrived (unused parameters): keep the buckets
        if self.auto_bucket_cap:
            self._choose_bucket_caps(order)
        tensors = [self.params[i] for i in order]
        indices, _limits = compute_bucket_assignment_by_size(
            tensors, [self.first_bucket_bytes_cap, self.bucket_bytes_cap], self.expect_sparse_gradients, order)
        if self.auto_bucket_cap:  # rank 0's caps go with its layout, so every rank reports the same choice
            indices, self.auto_choice = self.process_group.broadcast_object((indices, self.auto_choice), src=0,
                                                                            name="rebuild_buckets")
            self.first_bucket_bytes_cap = self.auto_choice["first_cap_bytes"]
            self.bucket_bytes_cap = self.auto_choice["cap_bytes"]
            if self.process_group.rank == 0:
                log.info("%s", describe_auto_choice(self.auto_choice, len(indices)))
        else:
            indices = self.process_group.broadcast_object(indices, src=0, name="rebuild_buckets")
        self.has_rebuilt_bucket = True
        self.rebuilt_param_indices = []
        self.initialize_buckets(indices)
        return True

    def _choose_bucket_caps(self, order):
        """``bucket_cap_mb="auto"``: probe the group's allreduce and choose the caps (see reducer_autocap)."""
        n = len(self.params)
        arrivals = self.stats.arrivals if self.stats.arrivals is not None else np.full(n, np.nan)
        finite = arrivals[np.isfinite(arrivals)]
        arrivals = np.where(np.isfinite(arrivals), arrivals, finite.max() if finite.size else 0.0)
        itemsizes = [(p.data.dtype if self.reduce_dtype is None else self.reduce_dtype).itemsize
                     for p in self.params]
        wire = [int(p.data.size) * size for p, size in zip(self.params, itemsizes)]
        dense = sum(w for w, sparse in zip(wire, self.expect_sparse_gradients) if not sparse)
        model, arrivals = measure_link(self.process_group, dense, arrivals)
        choice = choose_bucket_caps(order, self.params, arrivals, model, self.expect_sparse_gradients, wire)
        self.first_bucket_bytes_cap, self.bucket_bytes_cap = choice.first_cap, choice.cap
        self.auto_choice = choice.as_dict()

    def ensure_prior_reduction_finished(self):
        """Refuse to start an iteration while the last one's reduction never ran (G4: names the parameters)."""
        if self.require_finalize:
            raise RuntimeError(prior_reduction_unfinished(
                self.process_group.rank, self.param_names, self._unmarked_parameters(), self.static_graph,
                self.find_unused_parameters))

    # -- configuration ----------------------------------------------------------------------------------------
    def set_static_graph(self):
        """Declare that the set of used parameters never changes (must precede the first iteration)."""
        if self.num_iterations != 0:
            raise RuntimeError("set_static_graph() must be called before the first iteration (before the first "
                               "forward pass), right after DistributedDataParallel is constructed")
        self.static_graph = True

    def register_comm_hook(self, state, hook):
        """Reduce buckets with ``hook(state, GradBucket) -> Future`` instead of the built-in allreduce (once)."""
        if not callable(hook):
            raise TypeError(f"the communication hook must be callable, got {type(hook).__name__}")
        check_hook_annotations(hook)
        if self.comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once: a communication hook is already "
                               f"registered ({hook_name(self.comm_hook)!r})")
        self.comm_hook, self.comm_hook_state = hook, state

    def set_forward_pass_work_handle(self, work, use_static_world_size):
        """Join: the forward pass's allreduce of ranks not joined sets the divide factor (unless static)."""
        self.forward_work, self.forward_work_static_world = work, bool(use_static_world_size)

    def get_logging_data(self):
        """What DDP's logger reports: configuration, buckets and sampled runtime stats."""
        return self.stats.logging_data({
            "world_size": self.process_group.size, "num_parameters": len(self.params),
            "bucket_sizes": [bucket.nbytes() for bucket in self.buckets],
            "bucket_indices": [list(bucket.variable_indices) for bucket in self.buckets],
            "has_rebuilt_buckets": self.has_rebuilt_bucket, "num_iterations": self.num_iterations,
            "find_unused_parameters": self.find_unused_parameters, "static_graph": self.static_graph,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            "bucket_cap_bytes": self.bucket_bytes_cap, "first_bucket_cap_bytes": self.first_bucket_bytes_cap,
            "bucket_cap_auto": self.auto_bucket_cap, "auto_bucket_cap": self.auto_choice,
            "comm_hook": None if self.comm_hook is None else hook_name(self.comm_hook),
            "impl": self.IMPL})

    def remove_hooks(self):
        """Detach from the parameters (when the DDP module is discarded)."""
        for handle in self.hook_handles:
            handle.remove()
        self.hook_handles = []
        for param in self.params:
            set_grad_buffer(param, None)  # backward no longer writes into this reducer's buckets

    # -- Join: what a rank that ran out of inputs needs to shadow an iteration --------------------------------
    # DDP's join hook (distlab.ddp) calls these; they mirror the Reducer methods that distributed.py's
    # _DDPJoinHook uses (_get_zeros_like_grad_buckets, _run_comm_hook, _get_local_used_map,
    # _push_all_rebuilt_params). The point of each: issue the very collective the training ranks issue in their
    # backward pass, bucket by bucket and with the same names, contributing zeros.
    def _get_zeros_like_grad_buckets(self):
        """The buckets in reduction order, holding zeros: a joined rank's contribution."""
        buckets = []
        for b, bucket in enumerate(self.buckets):
            if bucket.expect_sparse_gradient:
                zeros = empty_sparse_grad(self.params[bucket.variable_indices[0]])
            else:  # the bucket itself, zeroed: shared-memory buckets are reduced in place, so every rank must
                # pass its own (the anchor allocates zeros; the joined rank's gradients are replaced anyway)
                zeros = bucket.gradients
                zeros[...] = 0
            buckets.append(GradBucket.of_bucket(b, len(self.buckets), bucket, self.params, zeros, shadow=True))
        return buckets

    def _run_comm_hook(self, grad_bucket):
        """Reduce one bucket as ``all_reduce_bucket`` would (same collective, same name)."""
        b = grad_bucket.index()
        if self.comm_hook is not None:
            return check_hook_result(self.comm_hook, self.comm_hook(self.comm_hook_state, grad_bucket))
        if self.buckets[b].expect_sparse_gradient:
            return sparse_allreduce(self.process_group, grad_bucket.buffer(), name=f"bucket{b}")
        return self._allreduce_dense(self.buckets[b], grad_bucket.buffer(), f"bucket{b}")

    def _get_local_used_map(self):
        """A joined rank used no parameter: zeros (the anchor sends its stale map from its last iteration)."""
        return np.zeros(len(self.params), dtype=np.int32)

    def _push_all_rebuilt_params(self):
        """A joined rank records every parameter, so its next shadowed rebuild broadcasts like the others'."""
        if self._should_rebuild_buckets():
            self.rebuilt_param_indices = list(range(len(self.params)))

    # -- the hot path each twin defines (declared here, where the shared steps above call them) ---------------
    def _init_per_parameter_state(self):
        """Allocate the per-parameter bookkeeping (locators, ready flags, hook counts): the twin's own layout."""
        raise NotImplementedError

    def _make_hook(self, index):
        """The post-accumulate-grad hook of parameter ``index`` (calls the twin's ``autograd_hook``)."""
        raise NotImplementedError

    def _should_rebuild_buckets(self) -> bool:
        """True when the buckets are rebuilt after this iteration (the twin reads its arrival order)."""
        raise NotImplementedError

    def _unmarked_parameters(self):
        """The indices of the parameters not yet marked ready in this backward pass."""
        raise NotImplementedError
