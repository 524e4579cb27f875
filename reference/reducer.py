"""The DDP reducer: gradient buckets reduced across ranks while backward still runs.

Twinned with ``core/_reducer.pyx``. Mirrors torch/csrc/distributed/c10d/reducer.cpp, function by function; each
method names the function it mirrors. One iteration goes like this:

1. ``prepare_for_forward`` counts iterations (runtime stats are sampled on iterations 1-10, then every 100th).
2. ``prepare_for_backward(outputs)`` resets the per-iteration counts; with ``find_unused_parameters`` it walks
   the autograd graph back from ``outputs`` and notes the parameters it cannot reach.
3. Backward runs. Each parameter's post-accumulate-grad hook calls ``autograd_hook(index)``, which marks the
   parameter ready: its gradient is copied (divided by the world size) into its bucket's view. When a bucket's
   last gradient is in, the bucket is launched, strictly in bucket order, as one asynchronous allreduce that
   overlaps with the rest of backward. After the last bucket, ``finalize_backward`` is queued to run when
   backward ends.
4. ``finalize_backward`` waits for each bucket and writes the averaged gradients back into ``.grad``.

Guarantees kept (named as on the reducer's docs page): G1, every rank issues the same collectives in the same
order (buckets strictly in order, the used-parameter map last, rank 0's rebuilt layout broadcast); G2, when
backward returns every ``.grad`` holds the average over ranks; G3, a parameter unused on every rank keeps its
``.grad`` untouched; G4, misuse (a parameter marked ready twice, an unfinished reduction, a changed static
graph) is an error naming the parameters, never a silent divergence or a hang.
"""
from __future__ import annotations

import numpy as np

from distlab import comm as _comm
from distlab.autograd import SparseGrad, Tensor, graph_leaves, queue_callback
from distlab.ddp_comm_hooks import sparse_allreduce
from distlab.reference.bucketing import compute_bucket_assignment_by_size
from distlab.reference.grad_bucket import GradBucket, build_bucket, point_grads_at_views
from distlab.reference.reducer_join import ReducerJoinMixin
from distlab import _reducer_support as support

__all__ = ["Reducer", "GradBucket", "compute_bucket_assignment_by_size"]

MiB = 1024 * 1024


class Reducer(ReducerJoinMixin):
    """Buckets gradients and reduces them across the ranks of ``process_group`` during backward.

    Parameters
    ----------
    params : sequence of Tensor
        The parameters to reduce (each requires grad; DDP drops the others).
    bucket_indices : list of list of int
        The buckets, in reduction order (from :func:`compute_bucket_assignment_by_size`, reversed by DDP).
    process_group : distlab.comm.ProcessGroup
        The ranks to reduce over.
    expect_sparse_gradients : sequence of bool, optional
        Per parameter, whether its gradient is sparse (sparse embeddings).
    bucket_bytes_cap, first_bucket_bytes_cap : int
        Byte caps used when the buckets are rebuilt after the first iteration.
    find_unused_parameters : bool
        Walk the graph each iteration to find parameters that get no gradient.
    gradient_as_bucket_view : bool
        Make ``.grad`` a view into the bucket (saves a copy and memory).
    param_names : sequence of str, optional
        Names used in error messages (default ``"param<i>"``).
    reduce_dtype : numpy dtype, optional
        Reduce in this dtype (mixed precision); default the parameters' dtype.
    """

    def __init__(self, params, bucket_indices, process_group, expect_sparse_gradients=None,
                 bucket_bytes_cap=25 * MiB, find_unused_parameters=False, gradient_as_bucket_view=False,
                 param_names=None, first_bucket_bytes_cap=1 * MiB, reduce_dtype=None):
        self.params = list(params)
        if not self.params:
            raise ValueError("the reducer needs at least one parameter that requires grad")
        n = len(self.params)
        self.process_group = process_group
        self.expect_sparse_gradients = [bool(s) for s in (expect_sparse_gradients or [False] * n)]
        self.bucket_bytes_cap = int(bucket_bytes_cap)
        self.first_bucket_bytes_cap = int(first_bucket_bytes_cap)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.param_names = list(param_names) if param_names is not None else [f"param{i}" for i in range(n)]
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
        self.rebuilt_param_indices = []
        self.ready_this_iteration = set()  # perIterationReadyParams_
        self.unused_parameters = []
        self.has_marked_unused_parameters = False
        self.local_used_map = np.zeros(n, dtype=np.int32)
        self.used_during_no_sync = np.zeros(n, dtype=np.int32)
        self.local_used_work = None
        self.local_used_map_reduced = False
        self.hook_counts = [0] * n  # numGradHooksTriggeredMap_ (static graph, first iteration)
        self.hook_counts_left = [0] * n  # numGradHooksTriggeredMapPerIteration_
        self.div_factor = None
        self.forward_work = None  # Join: the allreduce counting ranks that have not joined
        self.forward_work_static_world = True
        self.stats = support.ReducerStats(process_group.rank)
        self._finalize_queued = False
        self.initialize_buckets(bucket_indices)
        self.hook_handles = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                             for i, p in enumerate(self.params)]

    def _make_hook(self, index):
        def hook(_param):
            self.autograd_hook(index)
        return hook

    # -- buckets ----------------------------------------------------------------------------------------------
    def initialize_buckets(self, bucket_indices):
        """Build the buckets and the parameter -> (bucket, position) locators (``initialize_buckets``)."""
        flat = sorted(i for bucket in bucket_indices for i in bucket)
        if flat != list(range(len(self.params))):
            raise ValueError(f"bucket_indices must hold every parameter index 0..{len(self.params) - 1} exactly "
                             f"once, got {bucket_indices}")
        self.buckets = [build_bucket(b, indices, self.params, self.param_names, self.expect_sparse_gradients,
                                     0, self.reduce_dtype) for b, indices in enumerate(bucket_indices)]
        self.locators = [None] * len(self.params)  # variable_locators_
        for b, bucket in enumerate(self.buckets):
            for position, i in enumerate(bucket.variable_indices):
                self.locators[i] = (b, position)
            if self.gradient_as_bucket_view and not bucket.expect_sparse_gradient:
                point_grads_at_views(bucket, self.params)
        self.next_bucket = 0

    def get_grad_buckets(self):
        """The current buckets as :class:`GradBucket` objects (for tests and inspection)."""
        return [self._grad_bucket(b) for b in range(len(self.buckets))]

    def _grad_bucket(self, b):
        bucket = self.buckets[b]
        params = [self.params[i] for i in bucket.variable_indices]
        buffer = bucket.gradients
        return GradBucket(b, len(self.buckets), buffer, bucket.offsets, bucket.lengths, bucket.sizes, params)

    # -- per iteration ----------------------------------------------------------------------------------------
    def prepare_for_forward(self):
        """Count the iteration (``prepare_for_forward``)."""
        self.num_iterations += 1
        self.stats.start_iteration(self.num_iterations)

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
            self.has_marked_unused_parameters = True
            for unused in self.unused_parameters:
                self.mark_variable_ready(unused)
        if self.static_graph:
            if self.hook_counts_left[index] <= 0:
                raise RuntimeError(support.static_graph_changed(self.param_names, index))
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
            raise RuntimeError(support.marked_twice(self.param_names, index, self.static_graph,
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
            self._finalize_queued = True
            if self._dynamic_graph_find_unused():
                self.all_reduce_local_used_map()
            queue_callback(self.finalize_backward)

    def mark_variable_ready_dense(self, index, bucket, position):
        """Copy ``grad / div_factor`` into the bucket view, or zeros for a missing grad (``..._dense``)."""
        view = bucket.views_in[position]
        grad = self.params[index].grad
        if grad is None:
            view[...] = 0  # an unused parameter contributes zeros, so every rank sends the same bucket
            return
        data = grad.data
        if isinstance(data, SparseGrad) or data.dtype != self.params[index].data.dtype:
            raise TypeError(support.grad_mismatch(self.param_names, index, self.params[index].data.dtype, data))
        if self.comm_hook is not None:
            if data is not view:
                view[...] = data  # a hook sees the plain sum of gradients and divides itself
        elif data is view:
            view *= 1.0 / self.div_factor  # gradient_as_bucket_view: the grad already lives in the bucket
        else:
            np.multiply(data, 1.0 / self.div_factor, out=view, casting="unsafe")  # one pass: copy and scale

    def mark_variable_ready_sparse(self, index, bucket):
        """A sparse bucket holds the (scaled) sparse gradient itself (``mark_variable_ready_sparse``)."""
        grad = self.params[index].grad
        if grad is None:
            shape = self.params[index].data.shape
            values = np.zeros((0,) + tuple(shape[1:]), dtype=self.params[index].data.dtype)
            grad = SparseGrad(np.zeros(0, dtype=np.int64), values, shape)
        elif not isinstance(grad, SparseGrad):
            raise TypeError(support.grad_mismatch(self.param_names, index, self.params[index].data.dtype,
                                                  grad.data))
        bucket.gradients = grad if self.comm_hook is not None else grad * (1.0 / self.div_factor)

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
        if bucket.expect_sparse_gradient and self.comm_hook is None:
            bucket.future = sparse_allreduce(self.process_group, bucket.gradients, name=f"bucket{b}")
        elif self.comm_hook is None:
            bucket.future = self.process_group.allreduce(bucket.gradients, async_op=True,
                                                         name=f"bucket{b}").get_future()
        else:
            bucket.future = self.comm_hook(self.comm_hook_state, self._grad_bucket(b))
        nbytes = bucket.gradients.nbytes if not bucket.expect_sparse_gradient else 0
        self.stats.bucket_launched(b, nbytes, len(bucket.variable_indices), bucket.future)

    def all_reduce_local_used_map(self):
        """Sum the used-parameter flags over ranks (``all_reduce_local_used_map``), after the last bucket (G1, G3)."""
        self.local_used_work = self.process_group.allreduce(self.local_used_map.copy(), async_op=True,
                                                            name="local_used_map")

    def delay_all_reduce(self):
        """First static-graph iteration: reduce every bucket once backward ended (``delay_all_reduce``)."""
        self.unused_parameters = [i for i, count in enumerate(self.hook_counts) if count == 0]
        self.require_finalize = True
        self._set_divide_factor()
        for index in range(len(self.params)):
            b, position = self.locators[index]
            if self.buckets[b].expect_sparse_gradient:
                self.mark_variable_ready_sparse(index, self.buckets[b])
            else:
                self.mark_variable_ready_dense(index, self.buckets[b], position)
        self.all_reduce_local_used_map()
        for b in range(len(self.buckets)):
            self.all_reduce_bucket(b)
        self.next_bucket = len(self.buckets)
        self.finalize_backward()

    def finalize_backward(self):
        """Wait for every bucket and write the results into ``.grad`` (``finalize_backward``)."""
        self.expect_autograd_hooks = False
        self.require_finalize = False
        self._finalize_queued = False
        for b, bucket in enumerate(self.buckets):
            result = bucket.future.wait()
            if bucket.expect_sparse_gradient:
                self.params[bucket.variable_indices[0]].grad = result
                continue
            if result is not bucket.gradients:
                bucket.views_out = [result[o:o + n].reshape(s)
                                    for o, n, s in zip(bucket.offsets, bucket.lengths, bucket.sizes)]
            self.finalize_bucket_dense(bucket)
            bucket.views_out = bucket.views_in
        self.div_factor = None  # Join may change it next iteration
        if self._static_graph_first_iteration():
            self.hook_counts_left = list(self.hook_counts)
        self.stats.end_iteration()

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
        if not self.local_used_map_reduced:
            self.local_used_map[:] = self.local_used_work.result()
            self.local_used_map_reduced = True
        return not self.local_used_map[index]

    # -- rebuild, static graph, hooks, join -------------------------------------------------------------------
    def _should_rebuild_buckets(self):
        return (self.static_graph or not self.find_unused_parameters) and not self.has_rebuilt_bucket

    def rebuild_buckets(self):
        """Once, re-bucket in gradient arrival order, as rank 0 saw it (``rebuild_buckets``). True if rebuilt."""
        self.ensure_prior_reduction_finished()
        if not self._should_rebuild_buckets() or not self.rebuilt_param_indices:
            return False
        order = self.rebuilt_param_indices
        if self.static_graph:
            order = order + [i for i in self.unused_parameters if i not in order]
        if sorted(order) != list(range(len(self.params))):
            return False  # not every gradient arrived (unused parameters): keep the buckets
        tensors = [self.params[i] for i in order]
        indices, _limits = compute_bucket_assignment_by_size(
            tensors, [self.first_bucket_bytes_cap, self.bucket_bytes_cap], self.expect_sparse_gradients, order)
        indices = self.process_group.broadcast_object(indices, src=0, name="rebuild_buckets")
        self.has_rebuilt_bucket = True
        self.rebuilt_param_indices = []
        self.initialize_buckets(indices)
        return True

    def ensure_prior_reduction_finished(self):
        """Refuse to start an iteration while the last one's reduction never ran (names the parameters)."""
        if self.require_finalize:
            unmarked = [i for i in range(len(self.params)) if i not in self.ready_this_iteration]
            raise RuntimeError(support.prior_reduction_unfinished(
                self.process_group.rank, self.param_names, unmarked, self.static_graph, self.find_unused_parameters))

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
        if self.comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once: a communication hook is already "
                               f"registered ({getattr(self.comm_hook, '__name__', self.comm_hook)!r})")
        self.comm_hook, self.comm_hook_state = hook, state

    def set_forward_pass_work_handle(self, work, use_static_world_size):
        """Join: the forward pass's allreduce of ranks not joined sets the divide factor (unless static)."""
        self.forward_work, self.forward_work_static_world = work, bool(use_static_world_size)

    def _set_divide_factor(self):
        if self.div_factor is not None:
            return
        self.div_factor = self.process_group.size
        if self.forward_work is not None and not self.forward_work_static_world:
            self.div_factor = int(self.forward_work.result()[0])
        self.forward_work = None

    def _dynamic_graph_find_unused(self):
        return not self.static_graph and self.find_unused_parameters

    def _static_graph_first_iteration(self):
        return self.static_graph and self.num_iterations == 1

    def get_logging_data(self):
        """What DDP's logger reports: configuration, buckets and sampled runtime stats."""
        return self.stats.logging_data({
            "world_size": self.process_group.size, "num_parameters": len(self.params),
            "bucket_sizes": [b.gradients.nbytes if b.gradients is not None else 0 for b in self.buckets],
            "bucket_indices": [list(b.variable_indices) for b in self.buckets],
            "has_rebuilt_buckets": self.has_rebuilt_bucket, "num_iterations": self.num_iterations,
            "find_unused_parameters": self.find_unused_parameters, "static_graph": self.static_graph,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            "bucket_cap_bytes": self.bucket_bytes_cap, "first_bucket_cap_bytes": self.first_bucket_bytes_cap,
            "comm_hook": None if self.comm_hook is None else getattr(self.comm_hook, "__name__", repr(self.comm_hook)),
            "impl": "reference"})

    def remove_hooks(self):
        """Detach from the parameters (when the DDP module is discarded)."""
        for handle in self.hook_handles:
            handle.remove()
        self.hook_handles = []
