"""The DDP reducer: gradient buckets reduced across ranks while backward still runs.

Twinned with ``core/_reducer.pyx``. Mirrors torch/csrc/distributed/c10d/reducer.cpp, function by function; each
method names the function it mirrors. The class defines every method of the reducer (there is no base class):
what runs per gradient, per bucket and per iteration is written here; what runs at construction, at the one-time
bucket rebuild, at registration or to report, and the error messages, are functions of
:mod:`distlab._common.reducer` that the methods call (the checked arguments come from its ``prepare_reducer``, as
Join's from ``prepare_join``), bucket assignment and :class:`~distlab.ddp.GradBucket` in
:mod:`distlab._common.reducer_buckets`. One iteration:

1. ``prepare_for_forward`` counts iterations (runtime stats are sampled on iterations 1-10, then every
   100th); at the second forward, ``rebuild_buckets`` re-buckets once in gradient-arrival order.
2. ``prepare_for_backward(outputs)`` resets the per-iteration counts; with ``find_unused_parameters``,
   ``search_unused_parameters`` walks the autograd graph back from ``outputs`` and notes the parameters
   it cannot reach.
3. Backward runs. Each parameter's post-accumulate-grad hook calls ``autograd_hook(index)``, which marks the
   parameter ready: its gradient is copied (divided by the world size, unless the bucket's reduction divides)
   into its bucket's view, or is already there (``gradient_as_bucket_view``). When a bucket's last gradient is
   in, the bucket is launched, strictly in bucket order, as one asynchronous allreduce that overlaps with the
   rest of backward. After the last bucket, ``finalize_backward`` is queued to run when backward ends.
4. ``finalize_backward`` waits for each bucket, and ``finalize_bucket_dense`` writes the averaged
   gradients back into ``.grad``.

Guarantees kept (named as on the reducer's docs page): G1, every rank issues the same collectives in the same
order (buckets strictly in order, the used-parameter map last, rank 0's rebuilt layout broadcast); G2, when
backward returns every ``.grad`` holds the average over ranks; G3, a parameter unused on every rank keeps its
``.grad`` untouched; G4, misuse (a parameter marked ready twice, an unfinished reduction, a changed static
graph) is an error naming the parameters, never a silent divergence or a hang.

No lock is taken (reducer.cpp takes ``mutex_``): the local autograd engine runs every hook on the thread that
called backward, one backward pass at a time.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from distlab import comm as _comm
from distlab.comm import ProcessGroup, Work
from distlab._common.reducer import (DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES, Bucket, GradBucket,
                                     allreduce_bucket, check_hook_result, check_prior_reduction,
                                     declare_static_graph, divide_factor, finished_buckets, grad_bucket,
                                     grad_buckets, grad_mismatch, grad_shape_mismatch, logging_data, make_buckets,
                                     marked_twice, prepare_reducer, queue_finalize, rebuilt_layout, register_hooks,
                                     release_parameters, set_comm_hook, sparse_allreduce, sparse_bucket_gradient,
                                     static_graph_changed, unreachable_parameters, zeros_like_grad_buckets)
from distlab.autograd import SparseGrad, Tensor, queue_callback
from distlab.futures import Future

__all__ = ["Reducer"]


class Reducer:
    """Buckets gradients and reduces them across the ranks of ``process_group`` during backward.

    Parameters
    ----------
    params : sequence of Tensor
        The parameters to reduce (each requires grad; DDP drops the others).
    bucket_indices : list of list of int
        The buckets, in reduction order (from :func:`~distlab.ddp.compute_bucket_assignment_by_size`, reversed
        by DDP).
    process_group : distlab.comm.ProcessGroup
        The ranks to reduce over.
    expect_sparse_gradients : sequence of bool, optional
        Per parameter, whether its gradient is sparse (sparse embeddings).
    bucket_bytes_cap, first_bucket_bytes_cap : int, or "auto" for ``bucket_bytes_cap``
        Byte caps used when the buckets are rebuilt after the first iteration (default 25 MiB and 1 MiB here;
        DDP passes "auto" unless given a number). ``bucket_bytes_cap="auto"`` chooses both at the rebuild from
        measurements (:mod:`distlab._common.reducer_autocap`).
    find_unused_parameters : bool
        Walk the graph each iteration to find parameters that get no gradient.
    gradient_as_bucket_view : bool
        Make ``.grad`` a view into the bucket, which backward computes the gradient in (saves copies and memory).
    param_names : sequence of str, optional
        Names used in error messages (default ``"param<i>"``).
    reduce_dtype : numpy dtype, optional
        Reduce in this dtype (mixed precision); default the parameters' dtype.
    """

    IMPL = "reference"

    def __init__(self, params: Sequence[Tensor], bucket_indices: Sequence[Sequence[int]], process_group: ProcessGroup,
                 expect_sparse_gradients: Sequence[bool] | None = None, bucket_bytes_cap: int | str = DEFAULT_BUCKET_BYTES,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = False,
                 param_names: Sequence[str] | None = None, first_bucket_bytes_cap: int = DEFAULT_FIRST_BUCKET_BYTES,
                 reduce_dtype: npt.DTypeLike = None) -> None:
        # mirrors Reducer::Reducer: the checked arguments and the initial state (shared with the core), kept
        # under their own names
        setup = prepare_reducer(params, process_group, expect_sparse_gradients, bucket_bytes_cap,
                                find_unused_parameters, gradient_as_bucket_view, param_names,
                                first_bucket_bytes_cap, reduce_dtype)
        vars(self).update(setup._asdict())  # every field of the set-up, under its own name
        self._finalize_queued = False
        n = len(self.params)  # the bookkeeping kept per parameter, here as Python sets and lists
        self.ready_this_iteration = set()  # perIterationReadyParams_
        self.rebuilt_param_indices = []  # arrival order, recorded until the one rebuild
        self.hook_counts = [0] * n  # numGradHooksTriggeredMap_ (static graph, first iteration)
        self.hook_counts_left = [0] * n  # numGradHooksTriggeredMapPerIteration_
        self.initialize_buckets(bucket_indices)
        self.hook_handles = register_hooks(self.params, self._make_hook)

    def _make_hook(self, index):
        """Parameter ``index``'s post-accumulate-grad hook: calls :meth:`autograd_hook`."""
        def hook(_param):
            self.autograd_hook(index)
        return hook

    def initialize_buckets(self, bucket_indices: Sequence[Sequence[int]]) -> None:
        """Build the buckets and the parameter -> (bucket, position) locators (``initialize_buckets``)."""
        self.buckets = make_buckets(self, bucket_indices)
        self.locators = [None] * len(self.params)  # variable_locators_
        for b, bucket in enumerate(self.buckets):
            for position, i in enumerate(bucket.variable_indices):
                self.locators[i] = (b, position)
        self.next_bucket = 0

    def get_grad_buckets(self) -> list[GradBucket]:
        """The current buckets as :class:`~distlab.ddp.GradBucket` objects (for tests and inspection)."""
        return grad_buckets(self.buckets, self.params)

    # -- per iteration ----------------------------------------------------------------------------------------
    def prepare_for_forward(self) -> None:
        """Count the iteration (``prepare_for_forward``)."""
        self.num_iterations += 1
        self.stats.start_iteration(self.num_iterations)

    def prepare_for_backward(self, outputs: Sequence[Tensor] = ()) -> None:
        """Reset per-iteration state; find unused parameters from ``outputs`` (``prepare_for_backward``)."""
        self.stats.mark("backward_compute_start")
        self.expect_autograd_hooks = True
        self.rebuilt_param_indices = []  # arrival order of this iteration (rebuild_buckets consumed the last)
        for bucket in self.buckets:
            bucket.pending = len(bucket.variable_indices)
            bucket.future = None
        self.next_bucket = 0
        self.has_marked_unused_parameters = False
        self.ready_this_iteration.clear()
        self.used_parameters.reset()
        if self.static_graph and self.num_iterations > 1:
            self.hook_counts_left = list(self.hook_counts)
        if self._dynamic_graph_find_unused():
            self.search_unused_parameters(outputs)

    def search_unused_parameters(self, outputs: Sequence[Tensor]) -> None:
        """Parameters that ``outputs`` do not reach get no gradient this step (``search_unused_parameters``): they
        are marked ready up front. One whose gradient accumulated under ``no_sync`` counts as *used*, so every
        micro-batch is synchronised, not only the last (the anchor leaves them unsynchronised, a known complaint)."""
        self.unused_parameters = unreachable_parameters(self.params, outputs)
        self.used_parameters.take_no_sync()

    def autograd_hook(self, index: int) -> None:
        """A parameter's gradient has been accumulated (``autograd_hook``)."""
        if not self.expect_autograd_hooks:
            # Outside a synchronised iteration (no_sync): remember that a gradient accumulated locally.
            self.used_parameters.no_sync[index] = 1
            return
        self.stats.grad_arrived(index, self.param_names[index])
        if self._dynamic_graph_find_unused() or self._static_graph_first_iteration():
            if self.params[index].grad is not None:
                self.used_parameters.local[index] = 1
        if self._static_graph_first_iteration():
            self.hook_counts[index] += 1  # the first static iteration only counts hooks ...
            if not self._finalize_queued:
                self._finalize_queued = True
                queue_callback(self.delay_all_reduce)  # ... and reduces everything once backward ended
            return
        if not self.has_marked_unused_parameters:
            self._mark_unused_parameters_ready()
        if self.static_graph:
            if self.hook_counts_left[index] <= 0:
                raise RuntimeError(static_graph_changed(self.param_names, index))
            self.hook_counts_left[index] -= 1
            if self.hook_counts_left[index] > 0:
                return  # a shared parameter: wait for its last hook of this iteration
        if self._should_rebuild_buckets():
            self.rebuilt_param_indices.append(index)
        self.mark_variable_ready(index)
        if self.next_bucket > 0:
            _comm.progress()  # MPI moves in-flight buckets only while someone calls into it

    def _mark_unused_parameters_ready(self):
        """On the first hook of an iteration, unused parameters are marked ready, so their buckets complete."""
        self.has_marked_unused_parameters = True
        for unused in self.unused_parameters:
            self.mark_variable_ready(unused)

    def mark_variable_ready(self, index: int) -> None:
        """Copy the gradient into its bucket; launch buckets whose last gradient this was (``mark_variable_ready``)."""
        if index in self.ready_this_iteration:  # G4: a second gradient in one iteration is an error, not a double add
            raise RuntimeError(marked_twice(self.param_names, index, self.static_graph,
                                            self.find_unused_parameters))
        self.ready_this_iteration.add(index)
        self.require_finalize = True
        self._set_divide_factor()
        b, position = self.locators[index]
        bucket = self.buckets[b]
        if bucket.expect_sparse_gradient:
            self.mark_variable_ready_sparse(index, bucket)
        else:
            self.mark_variable_ready_dense(index, bucket, position)
        bucket.pending -= 1
        if bucket.pending == 0:
            self.mark_bucket_ready(b)
        if self.next_bucket == len(self.buckets) and not self._finalize_queued:
            self._queue_finalize_backward()

    def mark_variable_ready_dense(self, index: int, bucket: Bucket, position: int) -> None:
        """Copy ``grad / div_factor`` into the bucket view, or zeros for a missing grad (``..._dense``); a gradient
        computed in its view is only divided there, if its bucket's reduction does not divide."""
        view = bucket.views_in[position]
        grad = self.params[index].grad
        if grad is None:
            view[...] = 0  # an unused parameter contributes zeros, so every rank sends the same bucket
            return
        data = grad.data
        if isinstance(data, SparseGrad) or data.dtype != self.params[index].data.dtype:
            raise TypeError(grad_mismatch(self.param_names, index, self.params[index].data.dtype, data))
        if data.shape != view.shape:  # mirrors reducer.cpp's check that grad and bucket view hold as many elements
            raise ValueError(grad_shape_mismatch(self.param_names, index, view.shape, data.shape))
        scale = self._scale_into_bucket(bucket)
        if data is view:  # gradient_as_bucket_view: backward computed the gradient in the bucket
            if scale != 1.0:
                view *= scale
        elif scale == 1.0:
            view[...] = data
        else:
            np.multiply(data, scale, out=view, casting="unsafe")  # one pass: copy and scale

    def mark_variable_ready_sparse(self, index: int, bucket: Bucket) -> None:
        """A sparse bucket holds the (scaled) sparse gradient itself (``mark_variable_ready_sparse``)."""
        bucket.gradients = sparse_bucket_gradient(self, index)

    def _scale_into_bucket(self, bucket):
        """``1 / div_factor``, or 1 when a comm hook divides by itself (it sees the plain sum of gradients) or the
        bucket's reduction divides (see ``_reduction_divides``)."""
        if self.comm_hook is not None or self._reduction_divides(bucket):
            return 1.0
        return 1.0 / self.div_factor

    def _reduction_divides(self, bucket):
        """Whether ``bucket``'s allreduce averages (op "avg"), so that its gradients enter it undivided: a
        shared-memory bucket holding gradients computed in place, whose reduction scales each piece it just summed
        (no counterpart in the anchor; see the reducer's page). Not under Join with a shrinking divisor, nor with a
        comm hook (it divides by itself)."""
        return (self.gradient_as_bucket_view and bucket.arena is not None and self.comm_hook is None
                and self.forward_work_static_world)

    def mark_bucket_ready(self, bucket_index: int) -> None:
        """Launch ready buckets strictly in order (``mark_bucket_ready``): every rank reduces the same sequence (G1)."""
        if bucket_index > self.next_bucket:
            return
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            self.all_reduce_bucket(self.next_bucket)
            self.next_bucket += 1

    def all_reduce_bucket(self, b: int) -> None:
        """Start bucket ``b``'s reduction through the comm hook (``all_reduce_bucket`` + ``run_comm_hook``)."""
        bucket = self.buckets[b]
        if self.comm_hook is not None:
            bucket.future = check_hook_result(self.comm_hook, self.comm_hook(self.comm_hook_state,
                                                                             grad_bucket(self.buckets, b, self.params)))
        elif bucket.expect_sparse_gradient:
            bucket.future = sparse_allreduce(self.process_group, bucket.gradients, name=f"bucket{b}")
        else:
            bucket.future = self._allreduce_dense(bucket, bucket.gradients, f"bucket{b}")
        self.stats.bucket_launched(b, bucket.nbytes(), len(bucket.variable_indices), bucket.future)

    def _allreduce_dense(self, bucket, gradients, name):
        """Start the allreduce of a dense bucket's ``gradients`` without a comm hook; returns its future."""
        return allreduce_bucket(self.process_group, gradients, name, self._reduction_divides(bucket))

    def _queue_finalize_backward(self):
        """After the last bucket's launch: start the used-map sum and have ``finalize_backward`` run when backward
        ends (G1: the used map is the iteration's last collective)."""
        self._finalize_queued = True
        queue_finalize(self)

    def all_reduce_local_used_map(self) -> None:
        """Sum the used-parameter flags over ranks (``all_reduce_local_used_map``), after the last bucket (G1, G3)."""
        self.used_parameters.start_sum(self.process_group)

    def delay_all_reduce(self) -> None:
        """First static-graph iteration: reduce every bucket once backward ended (``delay_all_reduce``); it only
        counted each parameter's hooks, and what was never counted is unused for good."""
        self.unused_parameters = [i for i, count in enumerate(self.hook_counts) if count == 0]
        self.require_finalize = True
        self._set_divide_factor()
        for bucket in self.buckets:
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

    def finalize_backward(self) -> None:
        """Wait for every bucket and write the results into ``.grad`` (``finalize_backward``): once backward
        ended, not in the hooks, so most buckets finished while backward computed."""
        self._finalize_queued = False
        for bucket in finished_buckets(self):  # each dense bucket, once reduced
            self.finalize_bucket_dense(bucket)

    def finalize_bucket_dense(self, bucket: Bucket) -> None:
        """Copy reduced views back into ``.grad`` (G2); globally unused parameters stay untouched (G3)."""
        for position, index in enumerate(bucket.variable_indices):
            if (self.static_graph or self.find_unused_parameters) and self._globally_unused(index):
                continue
            view_in, view_out = bucket.views_in[position], bucket.views_out[position]
            param = self.params[index]
            if self.gradient_as_bucket_view:
                if view_out is not view_in:
                    view_in[...] = view_out
                if param.grad is None or param.grad.data is not view_in:
                    param.grad = Tensor(view_in)
            elif param.grad is None:
                param.grad = Tensor(view_out.astype(param.data.dtype, copy=True))
            else:
                param.grad.data[...] = view_out  # copy_bucket_to_grad

    def _globally_unused(self, index):
        """Lazily wait for the used-map sum, only when a locally unused parameter needs it."""
        return self.used_parameters.globally_unused(index)

    def _set_divide_factor(self):
        """World size, or under Join the number of ranks not yet joined (``set_divide_factor``)."""
        if self.div_factor is None:
            self.div_factor = divide_factor(self.process_group, self.forward_work, self.forward_work_static_world)
            self.forward_work = None

    # -- the one-time rebuild ---------------------------------------------------------------------------------
    def rebuild_buckets(self) -> bool:
        """Once, after the first iteration, re-bucket in gradient arrival order as rank 0 saw it (``rebuild_buckets``;
        G1: rank 0's layout is broadcast). True if rebuilt; called at every forward."""
        self.ensure_prior_reduction_finished()
        if not self._should_rebuild_buckets() or not self.rebuilt_param_indices:
            return False
        indices = rebuilt_layout(self, self.rebuilt_param_indices)  # sets the caps; marks the reducer rebuilt
        if indices is None:
            return False  # not every gradient arrived (unused parameters): keep the buckets
        self.rebuilt_param_indices = []
        self.initialize_buckets(indices)
        return True

    def ensure_prior_reduction_finished(self) -> None:
        """Refuse to start an iteration while the last one's reduction never ran (G4: names the parameters)."""
        check_prior_reduction(self, self._unmarked_parameters)

    # -- configuration ----------------------------------------------------------------------------------------
    def set_static_graph(self) -> None:
        """Declare that the set of used parameters never changes (must precede the first iteration)."""
        declare_static_graph(self)

    def register_comm_hook(self, state: Any, hook: Callable[[Any, GradBucket], Future]) -> None:
        """Reduce buckets with ``hook(state, GradBucket) -> Future`` instead of the built-in allreduce (once)."""
        set_comm_hook(self, state, hook)

    def set_forward_pass_work_handle(self, work: Work | None, use_static_world_size: bool) -> None:
        """Join: the forward pass's allreduce of ranks not joined sets the divide factor (unless static)."""
        self.forward_work, self.forward_work_static_world = work, bool(use_static_world_size)

    def get_logging_data(self) -> dict[str, Any]:
        """What DDP's logger reports: configuration, buckets and sampled runtime stats."""
        return logging_data(self, self.IMPL)

    def remove_hooks(self) -> None:
        """Detach from the parameters (when the DDP module is discarded)."""
        release_parameters(self)

    # -- Join: what a rank that ran out of inputs needs to shadow an iteration --------------------------------
    # DDP's join hook calls these, as distributed.py's _DDPJoinHook calls the Reducer's: each issues the very
    # collective the training ranks issue in their backward pass, with the same name, contributing zeros.
    def _get_zeros_like_grad_buckets(self):
        """The buckets in reduction order, holding zeros: a joined rank's contribution."""
        return zeros_like_grad_buckets(self.buckets, self.params)

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

    # -- predicates -------------------------------------------------------------------------------------------
    def _should_rebuild_buckets(self):
        """Record arrivals and rebuild once, unless the used set may change (``should_rebuild_buckets``); the
        automatic bucket size needs the rebuild, so it rebuilds also with ``find_unused_parameters``."""
        return ((self.static_graph or not self.find_unused_parameters or self.auto_bucket_cap)
                and not self.has_rebuilt_bucket)

    def _dynamic_graph_find_unused(self):
        return not self.static_graph and self.find_unused_parameters

    def _static_graph_first_iteration(self):
        return self.static_graph and self.num_iterations == 1

    def _unmarked_parameters(self):
        """The parameters not marked ready in this iteration (for the unfinished-reduction error)."""
        return [i for i in range(len(self.params)) if i not in self.ready_this_iteration]
