"""What both DDP reducer twins share: the checked set-up, the one-time bucket rebuild's layout, registration,
logging, Join's zero buckets and the error messages, as functions.

There is no base class. As Join's twins take a :class:`~distlab._common.join.JoinSetup` from ``prepare_join``,
each reducer twin's ``__init__`` takes a :class:`ReducerSetup` from :func:`prepare_reducer` (the checked arguments
and the state a new reducer starts from) and keeps its fields under the names of :data:`REDUCER_STATE`; the twin
defines every method of the reducer, and its methods call the functions here for what runs at construction, at the
rebuild, at registration or to report. The functions take what they need as arguments, or read a reducer's state
by the names of :data:`REDUCER_STATE` (the one list of it); none calls a reducer's method, so calls go one way:
twin -> these functions. What runs per gradient, per bucket or per iteration is each twin's own.

The error messages are in :mod:`distlab._common.reducer_messages`, bucket assignment and :class:`GradBucket` in
:mod:`distlab._common.reducer_buckets`, the automatic bucket size in :mod:`distlab._common.reducer_autocap`,
runtime statistics in :mod:`distlab._common.reducer_stats`; this module re-exports what the twins import.
"""
from __future__ import annotations

import logging
from typing import Any, NamedTuple

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

__all__ = ["AUTO", "MiB", "DEFAULT_BUCKET_BYTES", "DEFAULT_FIRST_BUCKET_BYTES", "ReducerSetup", "REDUCER_STATE",
           "prepare_reducer", "make_buckets", "grad_bucket", "grad_buckets", "unreachable_parameters",
           "sparse_bucket_gradient", "divide_factor", "allreduce_bucket", "queue_finalize", "UsedParameters",
           "finished_buckets", "check_prior_reduction", "rebuilt_layout", "declare_static_graph", "set_comm_hook",
           "register_hooks", "logging_data",
           "release_parameters", "zeros_like_grad_buckets", "GradBucket", "Bucket", "build_buckets",
           "compute_bucket_assignment_by_size", "empty_sparse_grad", "sparse_allreduce", "NO_SIZE_LIMIT",
           "ReducerStats", "bucket_cap", "marked_twice", "prior_reduction_unfinished", "static_graph_changed",
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


# -- construction -------------------------------------------------------------------------------------------------
class UsedParameters:
    """Which parameters received a gradient (``local_used_map`` in the anchor): this iteration, on this rank
    (``local``, summed over ranks once the last bucket is launched, so that only a parameter unused on every rank is
    left untouched: G3), and under ``no_sync`` (``no_sync``: such a parameter counts as used at the next
    synchronised iteration). Both twins write ``local`` and ``no_sync`` per gradient (the core through typed views
    of the same arrays); the sum and its answer are this object's.
    """

    def __init__(self, count: int):
        self.local = np.zeros(count, dtype=np.int32)
        self.no_sync = np.zeros(count, dtype=np.int32)
        self._sum = None
        self._reduced = False

    def reset(self) -> None:
        """A new iteration: no parameter used yet (``prepare_for_backward``)."""
        self.local[:] = 0
        self._reduced = False

    def take_no_sync(self) -> None:
        """What accumulated under ``no_sync`` counts as used in this iteration (``search_unused_parameters``)."""
        self.local[:] = self.no_sync
        self.no_sync[:] = 0

    def start_sum(self, process_group) -> None:
        """Start the sum over ranks (``all_reduce_local_used_map``): after the last bucket, the iteration's last
        collective (G1)."""
        self._sum = process_group.allreduce(self.local.copy(), async_op=True, name="local_used_map")

    def globally_unused(self, index: int) -> bool:
        """Whether no rank used parameter ``index`` (waiting for the sum only when this rank did not use it)."""
        if self.local[index]:
            return False
        if not self._reduced:
            self.local[:] = self._sum.result()
            self._reduced = True
        return not self.local[index]


class ReducerSetup(NamedTuple):
    """What a new reducer starts from (:func:`prepare_reducer`): its checked arguments, then its initial state.

    A twin keeps every field under the same name (and the rest of :data:`REDUCER_STATE`, which it sets itself).
    """

    params: list
    process_group: Any
    expect_sparse_gradients: list
    auto_bucket_cap: bool
    bucket_bytes_cap: int
    first_bucket_bytes_cap: int
    find_unused_parameters: bool
    gradient_as_bucket_view: bool
    param_names: list
    reduce_dtype: Any
    #: runtime statistics (sampled iterations, the first iteration's gradient arrivals for the automatic cap)
    stats: ReducerStats
    #: which parameters received a gradient, here and on any rank
    used_parameters: UsedParameters
    auto_choice: Any = None  # with "auto": what was measured and chosen at the rebuild
    static_graph: bool = False
    comm_hook: Any = None
    comm_hook_state: Any = None
    num_iterations: int = 0
    expect_autograd_hooks: bool = False
    require_finalize: bool = False
    has_rebuilt_bucket: bool = False
    unused_parameters: list = ()  # (a new list each, from prepare_reducer)
    has_marked_unused_parameters: bool = False
    div_factor: Any = None
    forward_work: Any = None  # Join: the allreduce counting ranks that have not joined
    forward_work_static_world: bool = True


#: The state every twin keeps, by name: :class:`ReducerSetup`'s fields, then ``buckets`` (a list of
#: :class:`Bucket`), ``rebuilt_param_indices`` (the first iteration's gradient arrival order), ``hook_counts`` (a
#: static graph's hooks per parameter), ``next_bucket`` and ``hook_handles``. The one list of what the functions
#: here may read of a reducer (tests/test_reducer.py checks that both twins have it all).
REDUCER_STATE = ReducerSetup._fields + ("buckets", "rebuilt_param_indices", "hook_counts", "next_bucket",
                                        "hook_handles")


def prepare_reducer(params, process_group, expect_sparse_gradients, bucket_bytes_cap, find_unused_parameters,
                    gradient_as_bucket_view, param_names, first_bucket_bytes_cap, reduce_dtype) -> ReducerSetup:
    """Check the reducer's arguments (``Reducer::Reducer``), every error before anything is touched."""
    params = list(params)
    if not params:
        raise ValueError("the reducer needs at least one parameter that requires grad")
    n = len(params)
    expect_sparse = [bool(s) for s in (expect_sparse_gradients or [False] * n)]
    if len(expect_sparse) != n:
        raise ValueError(f"expect_sparse_gradients has {len(expect_sparse)} entries for {n} parameters")
    auto, cap = bucket_cap(bucket_bytes_cap, "bucket_bytes_cap")
    names = list(param_names) if param_names is not None else [f"param{i}" for i in range(n)]
    if len(names) != n:
        raise ValueError(f"param_names has {len(names)} names for {n} parameters")
    reduce_dtype = None if reduce_dtype is None else np.dtype(reduce_dtype)
    if gradient_as_bucket_view and reduce_dtype is not None:
        raise ValueError("gradient_as_bucket_view cannot be used with a reduce_dtype: a bucket in another "
                         "dtype cannot be the parameters' .grad")
    stats = ReducerStats(process_group.rank)
    if auto:
        stats.record_arrivals(n)
    return ReducerSetup(params, process_group, expect_sparse, auto, cap, int(first_bucket_bytes_cap),
                        bool(find_unused_parameters), bool(gradient_as_bucket_view), names, reduce_dtype, stats,
                        UsedParameters(n), unused_parameters=[])


def make_buckets(reducer, bucket_indices) -> list:
    """The buckets of ``reducer`` for ``bucket_indices`` (the twin's ``initialize_buckets`` then locates each
    parameter in them)."""
    return build_buckets(bucket_indices, reducer.params, reducer.param_names, reducer.expect_sparse_gradients,
                         reducer.reduce_dtype, reducer.gradient_as_bucket_view, group=reducer.process_group)


def grad_bucket(buckets, b: int, params) -> GradBucket:
    """Bucket ``b`` as the :class:`GradBucket` a comm hook receives."""
    return GradBucket.of_bucket(b, len(buckets), buckets[b], params)


def grad_buckets(buckets, params) -> list:
    """Every bucket as a :class:`GradBucket` (``get_grad_buckets``, for tests and inspection)."""
    return [grad_bucket(buckets, b, params) for b in range(len(buckets))]


# -- once per iteration ------------------------------------------------------------------------------------------
def unreachable_parameters(params, outputs) -> list:
    """The indices of the parameters that ``outputs`` do not reach: they get no gradient this step
    (``search_unused_parameters``)."""
    reachable = graph_leaves(list(outputs))
    return [i for i, p in enumerate(params) if p not in reachable]


def sparse_bucket_gradient(reducer, index: int):
    """What a sparse bucket holds once parameter ``index``'s gradient is ready (``mark_variable_ready_sparse``):
    the sparse gradient itself, scaled by ``1 / div_factor`` unless a comm hook divides (no gradient: an empty one,
    so that every rank takes part in the gather, with or without rows)."""
    param = reducer.params[index]
    grad = param.grad
    if grad is None:
        grad = empty_sparse_grad(param)
    elif not isinstance(grad, SparseGrad):
        raise TypeError(grad_mismatch(reducer.param_names, index, param.data.dtype, grad.data))
    return grad if reducer.comm_hook is not None else grad * (1.0 / reducer.div_factor)


def divide_factor(process_group, forward_work, static_world: bool) -> int:
    """The divisor of this iteration's gradients (``set_divide_factor``): the world size, or under Join the number
    of ranks not yet joined (the forward pass's count, unless DDP divides by the initial world size)."""
    if forward_work is not None and not static_world:
        return int(forward_work.result()[0])
    return process_group.size


def allreduce_bucket(process_group, gradients, name: str, divides: bool):
    """Start the allreduce of a dense bucket's ``gradients`` without a comm hook (``avg`` when the bucket's
    reduction ``divides``); returns its future."""
    return process_group.allreduce(gradients, op="avg" if divides else "sum", async_op=True, name=name).get_future()


def queue_finalize(reducer) -> None:
    """After the last bucket's launch (``mark_variable_ready``): start the used map's sum when the graph may leave
    parameters unused, and have the reducer's ``finalize_backward`` run when backward ends (G1: the used map is the
    iteration's last collective)."""
    if reducer.find_unused_parameters and not reducer.static_graph:
        reducer.used_parameters.start_sum(reducer.process_group)
    queue_callback(reducer.finalize_backward)


def finished_buckets(reducer):
    """The steps of ``finalize_backward`` around the copy back, which is the twin's: end the backward pass, wait
    for each bucket in order (a sparse bucket's result becomes its parameter's ``.grad``), and yield each dense one
    to be copied back into ``.grad`` (its ``views_out`` over the array a comm hook handed back, when that is
    another than the bucket's: checked); then end the iteration (Join may change the divide factor next time)."""
    reducer.expect_autograd_hooks = False
    reducer.require_finalize = False
    for bucket in reducer.buckets:
        result = bucket.future.wait()
        if bucket.expect_sparse_gradient:
            reducer.params[bucket.variable_indices[0]].grad = result
            continue
        if result is not bucket.gradients:
            check_hook_value(reducer.comm_hook, bucket, result)
            bucket.views_out = [result[o:o + n].reshape(s) for o, n, s in zip(bucket.offsets, bucket.lengths,
                                                                                 bucket.sizes)]
        yield bucket
        bucket.views_out = bucket.views_in
    reducer.div_factor = None
    reducer.stats.end_iteration()


def check_prior_reduction(reducer, unmarked) -> None:
    """Refuse to start an iteration while the last one's reduction never ran (G4: names the parameters that got no
    gradient, ``unmarked()``)."""
    if reducer.require_finalize:
        raise RuntimeError(prior_reduction_unfinished(reducer.process_group.rank, reducer.param_names, unmarked(),
                                                      reducer.static_graph, reducer.find_unused_parameters))


# -- the one-time rebuild ----------------------------------------------------------------------------------------
def rebuilt_layout(reducer, order) -> list | None:
    """The buckets (each a list of parameter indices) in gradient arrival order ``order`` as rank 0 saw it
    (``rebuild_buckets``), or None when not every gradient arrived (unused parameters: the buckets stay). Sets the
    reducer's caps (with the automatic cap, probing the link first: ``auto_choice`` says what it chose) and marks it
    rebuilt. Collective: rank 0's layout is broadcast, so every rank reduces the same buckets (G1)."""
    n = len(reducer.params)
    order = list(order)
    if reducer.static_graph or reducer.auto_bucket_cap:
        arrived = set(order)
        order += [i for i in range(n) if i not in arrived]  # never used: last
    if sorted(order) != list(range(n)):
        return None
    first_cap, cap, choice = reducer.first_bucket_bytes_cap, reducer.bucket_bytes_cap, reducer.auto_choice
    if reducer.auto_bucket_cap:
        chosen = _chosen_caps(reducer, order)
        first_cap, cap, choice = chosen.first_cap, chosen.cap, chosen.as_dict()
    group = reducer.process_group
    tensors = [reducer.params[i] for i in order]
    indices, _limits = compute_bucket_assignment_by_size(tensors, [first_cap, cap], reducer.expect_sparse_gradients,
                                                         order)
    if reducer.auto_bucket_cap:  # rank 0's caps go with its layout, so every rank reports the same choice
        indices, choice = group.broadcast_object((indices, choice), src=0, name="rebuild_buckets")
        first_cap, cap = choice["first_cap_bytes"], choice["cap_bytes"]
        if group.rank == 0:
            log.info("%s", describe_auto_choice(choice, len(indices)))
    else:
        indices = group.broadcast_object(indices, src=0, name="rebuild_buckets")
    reducer.first_bucket_bytes_cap, reducer.bucket_bytes_cap, reducer.auto_choice = first_cap, cap, choice
    reducer.has_rebuilt_bucket = True
    return indices


def _chosen_caps(reducer, order):
    """``bucket_cap_mb="auto"``: probe the group's allreduce and choose the caps (see reducer_autocap)."""
    params, stats = reducer.params, reducer.stats
    arrivals = stats.arrivals if stats.arrivals is not None else np.full(len(params), np.nan)
    finite = arrivals[np.isfinite(arrivals)]
    arrivals = np.where(np.isfinite(arrivals), arrivals, finite.max() if finite.size else 0.0)
    itemsizes = [(p.data.dtype if reducer.reduce_dtype is None else reducer.reduce_dtype).itemsize for p in params]
    wire = [int(p.data.size) * size for p, size in zip(params, itemsizes)]
    dense = sum(w for w, sparse in zip(wire, reducer.expect_sparse_gradients) if not sparse)
    model, arrivals = measure_link(reducer.process_group, dense, arrivals)
    return choose_bucket_caps(order, params, arrivals, model, reducer.expect_sparse_gradients, wire)


# -- configuration -----------------------------------------------------------------------------------------------
def declare_static_graph(reducer) -> None:
    """``set_static_graph()``: the reducer's graph is static from now on; refused after the first iteration."""
    if reducer.num_iterations != 0:
        raise RuntimeError("set_static_graph() must be called before the first iteration (before the first "
                           "forward pass), right after DistributedDataParallel is constructed")
    reducer.static_graph = True


def set_comm_hook(reducer, state, hook) -> None:
    """``register_comm_hook``: ``hook`` (checked: callable, annotated right, the first one) reduces the
    reducer's buckets from now on, with ``state``."""
    if not callable(hook):
        raise TypeError(f"the communication hook must be callable, got {type(hook).__name__}")
    check_hook_annotations(hook)
    if reducer.comm_hook is not None:
        raise RuntimeError("register_comm_hook can only be called once: a communication hook is already "
                           f"registered ({hook_name(reducer.comm_hook)!r})")
    reducer.comm_hook, reducer.comm_hook_state = hook, state


def register_hooks(params, make_hook) -> list:
    """Hook every parameter (``make_hook(index)``: its post-accumulate-grad hook); returns the handles."""
    return [param.register_post_accumulate_grad_hook(make_hook(i)) for i, param in enumerate(params)]


def logging_data(reducer, impl: str) -> dict:
    """What DDP's logger reports of ``reducer`` (the ``impl`` twin): configuration, buckets, sampled stats."""
    hook = reducer.comm_hook
    return reducer.stats.logging_data({
        "world_size": reducer.process_group.size, "num_parameters": len(reducer.params),
        "bucket_sizes": [bucket.nbytes() for bucket in reducer.buckets],
        "bucket_indices": [list(bucket.variable_indices) for bucket in reducer.buckets],
        "has_rebuilt_buckets": reducer.has_rebuilt_bucket, "num_iterations": reducer.num_iterations,
        "find_unused_parameters": reducer.find_unused_parameters, "static_graph": reducer.static_graph,
        "gradient_as_bucket_view": reducer.gradient_as_bucket_view,
        "bucket_cap_bytes": reducer.bucket_bytes_cap, "first_bucket_cap_bytes": reducer.first_bucket_bytes_cap,
        "bucket_cap_auto": reducer.auto_bucket_cap, "auto_bucket_cap": reducer.auto_choice,
        "comm_hook": None if hook is None else hook_name(hook), "impl": impl})


def release_parameters(reducer) -> None:
    """``remove_hooks``: remove the reducer's hooks from its parameters; backward no longer writes into its
    buckets."""
    for handle in reducer.hook_handles:
        handle.remove()
    reducer.hook_handles = []
    for param in reducer.params:
        set_grad_buffer(param, None)


# -- Join --------------------------------------------------------------------------------------------------------
def zeros_like_grad_buckets(buckets, params) -> list:
    """The buckets in reduction order, holding zeros: a joined rank's contribution (mirrors the Reducer's
    ``_get_zeros_like_grad_buckets``, which distributed.py's ``_DDPJoinHook`` calls).

    A dense bucket is zeroed where it is (shared-memory buckets are reduced in place, so every rank must pass its
    own; the anchor allocates zeros, and the joined rank's gradients are replaced anyway).
    """
    out = []
    for b, bucket in enumerate(buckets):
        if bucket.expect_sparse_gradient:
            zeros = empty_sparse_grad(params[bucket.variable_indices[0]])
        else:
            zeros = bucket.gradients
            zeros[...] = 0
        out.append(GradBucket.of_bucket(b, len(buckets), bucket, params, zeros, shadow=True))
    return out
