"""A parameter group's two collectives: the all-gather of its parameters and the reduce-scatter of its gradients.

Twinned with ``core/_fsdp_collectives.pxi``. Mirrors torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:
``foreach_all_gather`` (copy-in and the all-gather), ``foreach_all_gather_copy_out``, ``foreach_reduce`` (the
reduce-scatter's packing, division and the view-out of the sharded gradients) and
``foreach_reduce_scatter_copy_in``.

The all-gather. Each rank's parameters' padded shards lie one after the other in a flat buffer of ``n`` elements:
the group's own (``pack_shards`` put them there when the group was made), or under mixed precision a buffer they
are copied into, cast to ``param_dtype`` on the way (the *copy-in*; also for the piece kept after a forward with
``reshard_after_forward=k``). The group all-gathers the ``W`` buffers into one ``(W, n)`` buffer, rank after rank:
row ``r`` holds rank ``r``'s shards. A parameter's unsharded rows are its
column block of every row, in row order, which the *copy-out* copies into the parameter's all-gather output::

    flat input (rank r):   [ p0 shard | p1 shard | p2 shard ]                    n elements
    all-gather output:     row 0: [ p0 rows 0..c0 | p1 rows 0..c1 | ... ]        (W, n)
                           row 1: [ p0 rows c0..  | p1 rows c1..  | ... ]
    copy-out, p0:          output[:, 0:n0] -> p0's (W * c0) padded rows

The output (and a copy-in's buffer) comes from a pool and is given back after the copy-out, so the next group
reuses it.

The reduce-scatter is the same picture backwards. Each gradient is padded on dimension 0 to ``W * c`` rows and
cut into ``W`` chunks, chunk ``r`` going into row ``r`` of a ``(W, n)`` buffer of ``reduce_dtype`` (torch's
``chunk_cat``); the reduce-scatter leaves rank ``r`` the reduced row ``r``: its own padded gradient shards, one
after the other, whose unpadded rows become (or are added to) the sharded parameters' gradients. Division follows
torch (:func:`~distlab._common.fsdp.gradient_divide_factors`): the collective's average for float32 and bfloat16,
a pre-division before and a post-division after a sum for float16. Hybrid sharding then all-reduces the row
among the ranks holding the same shard on other hosts.

One reduce-scatter is in flight at a time: the next group's waits for it before packing, and the gradients are
delivered when the group finishes its backward (:func:`finish_reduce`).
"""
from __future__ import annotations

from distlab._common.fsdp import FSDP_LANE, AllGatherResult, collective_name, gradient_divide_factors
from distlab.timeline import get_timeline, now_us

__all__ = ["AllGatherResult", "ReduceScatterState", "foreach_all_gather", "all_gather_copy_in",
           "foreach_all_gather_copy_out", "foreach_reduce", "foreach_reduce_scatter_copy_in",
           "free_reduce_input", "wait_reduce_scatter", "finish_reduce"]


class ReduceScatterState:
    """A group's gradient reduction in flight: the buffers and what is left to do once it completes."""

    def __init__(self, fsdp_params, reduce_input, reduce_output, work, post_divide, all_reduce_group,
                 all_reduce_op, all_reduce_grads, orig_dtype, name):
        self.fsdp_params = fsdp_params
        self.reduce_input = reduce_input  # freed once the reduce-scatter completes
        self.reduce_output = reduce_output
        self.work = work
        self.post_divide = post_divide
        self.all_reduce_group = all_reduce_group
        self.all_reduce_op = all_reduce_op
        self.all_reduce_grads = all_reduce_grads
        self.all_reduce_work = None
        self.orig_dtype = orig_dtype
        self.name = name


def foreach_all_gather(fsdp_params, group, async_op, pool, xp, dtype, name, flat_input=None):
    """Start the group's one all-gather of ``flat_input``, this rank's shards one after the other, or when it is
    None copy them into a buffer first (``foreach_all_gather``).

    Returns an :class:`AllGatherResult`; with ``async_op`` the all-gather may still be in flight.
    """
    numels = [fsdp_param.all_gather_input_numel() for fsdp_param in fsdp_params]
    total, world_size = sum(numels), group.size
    if flat_input is None:
        flat_input = pool.take(xp, dtype, total)
        all_gather_copy_in(fsdp_params, flat_input)
    flat_output = pool.take(xp, dtype, total * world_size)
    output = flat_output.reshape(world_size, total)
    work = group.allgather(flat_input, out=output, async_op=async_op, name=collective_name("all-gather", name))
    return AllGatherResult(output, flat_output, flat_input, work if async_op else None, numels, world_size)


def all_gather_copy_in(fsdp_params, flat_input) -> None:
    """Copy each parameter's all-gather input into its place in ``flat_input``, cast to the buffer's dtype
    (``all_gather_copy_in``, with ``_get_param_all_gather_inputs``'s cast folded into the copy)."""
    start = now_us()
    offset = 0
    for fsdp_param in fsdp_params:
        data = fsdp_param.all_gather_input()
        flat_input[offset:offset + data.size] = data
        offset += data.size
    _span("copy-in", start, flat_input.nbytes)


def foreach_all_gather_copy_out(result, fsdp_params, pool) -> None:
    """Wait for the all-gather, copy each parameter's column block into its all-gather output, and give the
    flat buffers back (``foreach_all_gather_copy_out``)."""
    if result.all_gather_work is not None:
        result.all_gather_work.wait()
    start = now_us()
    output, world_size = result.all_gather_output, result.world_size
    offset = 0
    for fsdp_param, numel in zip(fsdp_params, result.input_numels):
        fsdp_param.all_gather_output.reshape(world_size, numel)[...] = output[:, offset:offset + numel]
        offset += numel
    _span("copy-out", start, output.nbytes)
    pool.give_back(result.all_gather_input)  # (the group's own shards are not the pool's: nothing to give back)
    pool.give_back(result.flat_output)


def foreach_reduce(fsdp_params, unsharded_grads, reduce_scatter_group, orig_dtype, reduce_dtype, xp,
                   gradient_divide_factor, all_reduce_group, all_reduce_grads, name):
    """Pack the unsharded gradients, divide, and start the reduce-scatter (``foreach_reduce``).

    ``unsharded_grads`` (one per parameter of ``fsdp_params``, all of one dtype) is emptied once packed, so the
    gradients are freed. Returns the :class:`ReduceScatterState` to complete with :func:`wait_reduce_scatter` and
    :func:`finish_reduce`.
    """
    grad_dtypes = {grad.dtype for grad in unsharded_grads}
    if len(grad_dtypes) != 1:
        raise AssertionError(f"FSDP reduce-scatter expects uniform gradient dtype but got "
                             f"{sorted(map(str, grad_dtypes))}")
    reduce_dtype = reduce_dtype if reduce_dtype is not None else unsharded_grads[0].dtype
    world_size = reduce_scatter_group.size
    replicas = all_reduce_group.size if all_reduce_group is not None else 1
    pre, post, reduce_scatter_op, all_reduce_op = gradient_divide_factors(reduce_dtype, world_size, replicas,
                                                                         gradient_divide_factor)
    total = sum(fsdp_param.padded_sharded_numel for fsdp_param in fsdp_params)
    reduce_input = xp.empty(total * world_size, dtype=reduce_dtype)
    foreach_reduce_scatter_copy_in(fsdp_params, unsharded_grads, reduce_input.reshape(world_size, total))
    unsharded_grads.clear()
    _div_if_needed(reduce_input, pre)
    reduce_output = xp.empty(total, dtype=reduce_dtype)
    work = None
    if world_size > 1:
        work = reduce_scatter_group.reduce_scatter(reduce_output, reduce_input, op=reduce_scatter_op, async_op=True,
                                                   name=collective_name("reduce-scatter", name))
    else:
        reduce_output[...] = reduce_input
    return ReduceScatterState(fsdp_params, reduce_input, reduce_output, work, post, all_reduce_group,
                              all_reduce_op, all_reduce_grads, orig_dtype, name)


def foreach_reduce_scatter_copy_in(fsdp_params, unsharded_grads, reduce_input) -> None:
    """Chunk each gradient on dimension 0 into the rows of ``reduce_input`` (W, n), zero-padded
    (``foreach_reduce_scatter_copy_in`` / ``chunk_cat``)."""
    start = now_us()
    world_size = reduce_input.shape[0]
    offset = 0
    for fsdp_param, grad in zip(fsdp_params, unsharded_grads):
        numel = fsdp_param.padded_sharded_numel
        block = reduce_input[:, offset:offset + numel]
        flat = grad.reshape(-1)
        full, rest = divmod(flat.size, numel) if numel else (world_size, 0)
        if full:
            block[:full] = flat[:full * numel].reshape(full, numel)
        if rest:
            block[full, :rest] = flat[full * numel:]
            block[full, rest:] = 0
            full += 1
        if full < world_size:
            block[full:] = 0
        offset += numel
    _span("reduce-scatter copy-in", start, reduce_input.nbytes)


def free_reduce_input(state) -> None:
    """Complete the reduce-scatter's collective and free its input, ahead of :func:`wait_reduce_scatter`: the
    next group's copy-out and gradients never coexist with it, whatever the schedule (torch frees it later, at the
    next group's post-backward: its stream runs it behind the next backward; an MPI collective moves only inside
    MPI calls, so completing it here costs no overlap). What follows the reduce-scatter (the hybrid all-reduce,
    the gradients' delivery) keeps its place in the order of calls."""
    if state.work is not None:
        state.work.wait()
        state.work = None
    state.reduce_input = None


def wait_reduce_scatter(state) -> None:
    """Complete the reduce-scatter and free its input; hybrid sharding then starts the all-reduce among replicas."""
    if state.work is not None:
        state.work.wait()
        state.work = None
    state.reduce_input = None
    if state.all_reduce_group is not None and state.all_reduce_grads and state.all_reduce_work is None:
        state.all_reduce_work = state.all_reduce_group.allreduce(
            state.reduce_output, op=state.all_reduce_op, async_op=True, name=collective_name("all-reduce", state.name))


def finish_reduce(state) -> None:
    """Wait for everything, post-divide, cast to the parameters' dtype and deliver each sharded gradient: set, or
    added to the one the parameter holds (``foreach_reduce``'s view-out)."""
    wait_reduce_scatter(state)
    if state.all_reduce_work is not None:
        state.all_reduce_work.wait()
        state.all_reduce_work = None
    output = state.reduce_output
    _div_if_needed(output, state.post_divide)
    if output.dtype != state.orig_dtype:
        output = output.astype(state.orig_dtype)
    offset = 0
    for fsdp_param in state.fsdp_params:
        fsdp_param.accumulate_sharded_grad(output[offset:offset + fsdp_param.sharded_numel])
        offset += fsdp_param.padded_sharded_numel
    state.reduce_output = None


def _div_if_needed(array, divide) -> None:
    """Divide in place by ``divide`` (None or 1: nothing); ``("premul", f)`` multiplies by ``f`` (PREMUL_SUM)."""
    if divide is None:
        return
    if isinstance(divide, tuple):
        array *= divide[1]
    elif divide != 1:
        array /= divide


def _span(what: str, start: float, nbytes: int) -> None:
    timeline = get_timeline()
    if timeline.enabled:
        timeline.complete(what, start, now_us(), lane=FSDP_LANE, args={"bytes": int(nbytes)})
