"""The DDP reducer: gradient buckets reduced across ranks while backward still runs.

Twinned with ``core/_reducer.pyx``. Mirrors torch/csrc/distributed/c10d/reducer.cpp, function by function; each
method names the function it mirrors. This module holds what runs per gradient, per bucket and per iteration;
construction, the one-time bucket rebuild, registration, Join support and the error messages live once in
:mod:`distlab._common.reducer` (:class:`~distlab._common.reducer.ReducerBase`, inherited here), bucket
assignment and :class:`~distlab.ddp.GradBucket` in :mod:`distlab._common.reducer_buckets`. One iteration:

1. ``prepare_for_forward`` (shared) counts iterations (runtime stats are sampled on iterations 1-10, then every
   100th); at the second forward, ``rebuild_buckets`` (shared) re-buckets once in gradient-arrival order.
2. ``prepare_for_backward(outputs)`` resets the per-iteration counts; with ``find_unused_parameters``,
   ``search_unused_parameters`` (shared) walks the autograd graph back from ``outputs`` and notes the parameters
   it cannot reach.
3. Backward runs. Each parameter's post-accumulate-grad hook calls ``autograd_hook(index)``, which marks the
   parameter ready: its gradient is copied (divided by the world size, unless the bucket's reduction divides)
   into its bucket's view, or is already there (``gradient_as_bucket_view``). When a bucket's last gradient is
   in, the bucket is launched, strictly in bucket order, as one asynchronous allreduce that overlaps with the
   rest of backward. After the last bucket, ``finalize_backward`` is queued to run when backward ends.
4. ``finalize_backward`` (shared) waits for each bucket, and ``finalize_bucket_dense`` writes the averaged
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

import numpy as np

from distlab import comm as _comm
from distlab._common.reducer import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_FIRST_BUCKET_BYTES,
    ReducerBase,
    check_hook_result,
    grad_mismatch,
    grad_shape_mismatch,
    marked_twice,
    sparse_allreduce,
    static_graph_changed,
)
from distlab.autograd import SparseGrad, Tensor, queue_callback

__all__ = ["Reducer"]


class Reducer(ReducerBase):
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

    def __init__(self, params, bucket_indices, process_group, expect_sparse_gradients=None,
                 bucket_bytes_cap=DEFAULT_BUCKET_BYTES, find_unused_parameters=False, gradient_as_bucket_view=False,
                 param_names=None, first_bucket_bytes_cap=DEFAULT_FIRST_BUCKET_BYTES, reduce_dtype=None):
        self._configure(params, bucket_indices, process_group, expect_sparse_gradients, bucket_bytes_cap,
                        find_unused_parameters, gradient_as_bucket_view, param_names, first_bucket_bytes_cap,
                        reduce_dtype)

    def _init_per_parameter_state(self):
        """The bookkeeping kept per parameter, here as Python sets and lists."""
        n = len(self.params)
        self.ready_this_iteration = set()  # perIterationReadyParams_
        self.rebuilt_param_indices = []  # arrival order, recorded until the one rebuild
        self.hook_counts = [0] * n  # numGradHooksTriggeredMap_ (static graph, first iteration)
        self.hook_counts_left = [0] * n  # numGradHooksTriggeredMapPerIteration_

    def _make_hook(self, index):
        """Parameter ``index``'s post-accumulate-grad hook: calls :meth:`autograd_hook`."""
        def hook(_param):
            self.autograd_hook(index)
        return hook

    def initialize_buckets(self, bucket_indices):
        """Build the buckets and the parameter -> (bucket, position) locators (``initialize_buckets``)."""
        self.buckets = self._build_buckets(bucket_indices)
        self.locators = [None] * len(self.params)  # variable_locators_
        for b, bucket in enumerate(self.buckets):
            for position, i in enumerate(bucket.variable_indices):
                self.locators[i] = (b, position)
        self.next_bucket = 0

    # -- per iteration ----------------------------------------------------------------------------------------
    def prepare_for_backward(self, outputs=()):
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
        self.local_used_map[:] = 0
        self.local_used_map_reduced = False
        if self.static_graph and self.num_iterations > 1:
            self.hook_counts_left = list(self.hook_counts)
        if self._dynamic_graph_find_unused():
            self.search_unused_parameters(outputs)

    def autograd_hook(self, index):
        """A parameter's gradient has been accumulated (``autograd_hook``)."""
        if not self.expect_autograd_hooks:
            # Outside a synchronised iteration (no_sync): remember that a gradient accumulated locally.
            self.used_during_no_sync[index] = 1
            return
        self.stats.grad_arrived(index, self.param_names[index])
        if self._dynamic_graph_find_unused() or self._static_graph_first_iteration():
            if self.params[index].grad is not None:
                self.local_used_map[index] = 1
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

    def mark_variable_ready(self, index):
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

    def mark_variable_ready_dense(self, index, bucket, position):
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

    def _scale_into_bucket(self, bucket):
        """``1 / div_factor``, or 1 when a comm hook divides by itself (it sees the plain sum of gradients) or the
        bucket's reduction divides (a shared-memory bucket holding gradients computed in place, see
        ``_reduction_divides``)."""
        if self.comm_hook is not None or self._reduction_divides(bucket):
            return 1.0
        return 1.0 / self.div_factor

    def mark_bucket_ready(self, bucket_index):
        """Launch ready buckets strictly in order (``mark_bucket_ready``): every rank reduces the same sequence (G1)."""
        if bucket_index > self.next_bucket:
            return
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            self.all_reduce_bucket(self.next_bucket)
            self.next_bucket += 1

    def all_reduce_bucket(self, b):
        """Start bucket ``b``'s reduction through the comm hook (``all_reduce_bucket`` + ``run_comm_hook``)."""
        bucket = self.buckets[b]
        if self.comm_hook is not None:
            bucket.future = check_hook_result(self.comm_hook, self.comm_hook(self.comm_hook_state,
                                                                             self._grad_bucket(b)))
        elif bucket.expect_sparse_gradient:
            bucket.future = sparse_allreduce(self.process_group, bucket.gradients, name=f"bucket{b}")
        else:
            bucket.future = self._allreduce_dense(bucket, bucket.gradients, f"bucket{b}")
        self.stats.bucket_launched(b, bucket.nbytes(), len(bucket.variable_indices), bucket.future)

    def finalize_bucket_dense(self, bucket):
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
                    param.grad = Tensor._wrap(view_in)
            elif param.grad is None:
                param.grad = Tensor._wrap(view_out.astype(param.data.dtype, copy=True))
            else:
                param.grad.data[...] = view_out  # copy_bucket_to_grad

    def _globally_unused(self, index):
        """Lazily wait for the used-map sum, only when a locally unused parameter needs it."""
        if self.local_used_map[index]:
            return False
        self._read_reduced_used_map()
        return not self.local_used_map[index]

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
