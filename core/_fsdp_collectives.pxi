# Included by _fsdp_param_group.pyx: the core twin of reference/fsdp_collectives.py (read it for the explanation).
# Copy-in, copy-out and the reduce-scatter's packing move host arrays of one dtype with memcpy over their
# memory (found through numpy's C API: no slicing, no temporary); device arrays and casts take the array
# module's own assignment, as the reference does, so both twins produce the same bytes.


@cython.final
cdef class ReduceScatterState:
    """See :class:`distlab.reference.fsdp_collectives.ReduceScatterState`."""
    cdef public list fsdp_params
    cdef public object reduce_input, reduce_output, work, post_divide, all_reduce_group, all_reduce_op
    cdef public object all_reduce_work, orig_dtype, name
    cdef public bint all_reduce_grads

    def __init__(self, list fsdp_params, reduce_input, reduce_output, work, post_divide, all_reduce_group,
                 all_reduce_op, bint all_reduce_grads, orig_dtype, str name):
        """See :class:`distlab.reference.fsdp_collectives.ReduceScatterState`."""
        self.fsdp_params, self.reduce_input, self.reduce_output = fsdp_params, reduce_input, reduce_output
        self.work, self.post_divide, self.orig_dtype, self.name = work, post_divide, orig_dtype, name
        self.all_reduce_group, self.all_reduce_op = all_reduce_group, all_reduce_op
        self.all_reduce_grads, self.all_reduce_work = all_reduce_grads, None


def foreach_all_gather(list fsdp_params, group, bint async_op, pool, xp, dtype, str name, flat_input=None):
    """See :func:`distlab.reference.fsdp_collectives.foreach_all_gather`."""
    cdef FSDPParam p
    cdef list numels = [p.all_gather_input_numel() for p in fsdp_params]
    cdef Py_ssize_t total = sum(numels), world_size = group.size
    cdef object flat_in = flat_input
    if flat_in is None:  # a cast or a post-forward piece: copied in; else the group's shards, sent as they are
        flat_in = pool.take(xp, dtype, total)
        all_gather_copy_in(fsdp_params, flat_in)
    cdef object flat_out = pool.take(xp, dtype, total * world_size)
    cdef object rows = flat_out.reshape(world_size, total)
    cdef object work = group.allgather(flat_in, out=rows, async_op=async_op, name=collective_name("all-gather", name))
    return AllGatherResult(rows, flat_out, flat_in, work if async_op else None, numels, world_size)


def all_gather_copy_in(list fsdp_params, flat_input):
    """See :func:`distlab.reference.fsdp_collectives.all_gather_copy_in`."""
    cdef double start = now_us()
    cdef FSDPParam p
    cdef Py_ssize_t offset = 0, n, itemsize = 0
    cdef char* dst = NULL
    if _is_host(flat_input):
        dst = cnp.PyArray_BYTES(<cnp.ndarray>flat_input)
        itemsize = cnp.PyArray_ITEMSIZE(<cnp.ndarray>flat_input)
    for p in fsdp_params:
        data = p.all_gather_input()
        n = p.all_gather_input_numel()
        if dst != NULL and _same_host_layout(data, flat_input):
            memcpy(dst + offset * itemsize, cnp.PyArray_BYTES(<cnp.ndarray>data), n * itemsize)
        else:
            flat_input[offset:offset + n] = data
        offset += n
    _span("copy-in", start, offset * itemsize if dst != NULL else flat_input.nbytes)


def foreach_all_gather_copy_out(result, list fsdp_params, pool):
    """See :func:`distlab.reference.fsdp_collectives.foreach_all_gather_copy_out`."""
    cdef object work = result.all_gather_work
    if work is not None:
        work.wait()
    cdef double start = now_us()
    cdef object gathered = result.all_gather_output
    cdef Py_ssize_t world_size = result.world_size, total = gathered.shape[1], offset = 0, numel, r, itemsize = 0
    cdef char* src = NULL
    cdef char* dst
    cdef FSDPParam p
    if _is_host(gathered):
        src = cnp.PyArray_BYTES(<cnp.ndarray>gathered)
        itemsize = cnp.PyArray_ITEMSIZE(<cnp.ndarray>gathered)
    for p, numel_obj in zip(fsdp_params, result.input_numels):
        numel = numel_obj
        target = p.all_gather_output
        if src != NULL and _same_host_layout(target, gathered):
            dst = cnp.PyArray_BYTES(<cnp.ndarray>target)
            for r in range(world_size):  # rank r's block of this parameter, a row of the output
                memcpy(dst + r * numel * itemsize, src + (r * total + offset) * itemsize, numel * itemsize)
        else:
            target.reshape(world_size, numel)[...] = gathered[:, offset:offset + numel]
        offset += numel
    _span("copy-out", start, gathered.nbytes)
    pool.give_back(result.all_gather_input)  # both flat buffers, for the next group
    pool.give_back(result.flat_output)


def foreach_reduce(list fsdp_params, list unsharded_grads, reduce_scatter_group, orig_dtype, reduce_dtype, xp,
                   gradient_divide_factor, all_reduce_group, bint all_reduce_grads, str name):
    """See :func:`distlab.reference.fsdp_collectives.foreach_reduce`."""
    cdef object grad_dtype = unsharded_grads[0].dtype
    if any(g.dtype != grad_dtype for g in unsharded_grads):
        raise AssertionError(f"FSDP reduce-scatter expects uniform gradient dtype but got "
                             f"{sorted({str(g.dtype) for g in unsharded_grads})}")
    cdef object dtype = grad_dtype if reduce_dtype is None else reduce_dtype
    cdef Py_ssize_t world_size = reduce_scatter_group.size, total = 0
    cdef FSDPParam p
    for p in fsdp_params:
        total += p.padded_sharded_numel
    factors = gradient_divide_factors(dtype, world_size, 1 if all_reduce_group is None else all_reduce_group.size,
                                      gradient_divide_factor)
    cdef object packed = xp.empty(total * world_size, dtype=dtype)
    foreach_reduce_scatter_copy_in(fsdp_params, unsharded_grads, packed.reshape(world_size, total))
    del unsharded_grads[:]  # the unsharded gradients are freed
    _div_if_needed(packed, factors[0])
    cdef object row = xp.empty(total, dtype=dtype)
    cdef object work = None
    if world_size == 1:
        row[...] = packed
    else:
        work = reduce_scatter_group.reduce_scatter(row, packed, op=factors[2], async_op=True,
                                                   name=collective_name("reduce-scatter", name))
    return ReduceScatterState(fsdp_params, packed, row, work, factors[1], all_reduce_group, factors[3],
                              all_reduce_grads, orig_dtype, name)


@cython.boundscheck(False)
@cython.wraparound(False)
def foreach_reduce_scatter_copy_in(list fsdp_params, list unsharded_grads, reduce_input):
    """See :func:`distlab.reference.fsdp_collectives.foreach_reduce_scatter_copy_in`."""
    cdef double start = now_us()
    cdef Py_ssize_t world_size = reduce_input.shape[0], total = reduce_input.shape[1], offset = 0
    cdef Py_ssize_t numel, filled, r, take, itemsize = 0
    cdef char* base = NULL
    cdef char* src
    cdef char* dst
    cdef FSDPParam p
    if _is_host(reduce_input):
        base = cnp.PyArray_BYTES(<cnp.ndarray>reduce_input)
        itemsize = cnp.PyArray_ITEMSIZE(<cnp.ndarray>reduce_input)
    for p, grad in zip(fsdp_params, unsharded_grads):
        numel = p.padded_sharded_numel
        if base != NULL and _same_host_layout(grad, reduce_input):
            src = cnp.PyArray_BYTES(<cnp.ndarray>grad)
            filled = cnp.PyArray_SIZE(<cnp.ndarray>grad)
            for r in range(world_size):  # chunk r of the gradient (padded with zero rows) into row r
                take = min(max(filled - r * numel, 0), numel)
                dst = base + (r * total + offset) * itemsize
                if take:
                    memcpy(dst, src + r * numel * itemsize, take * itemsize)
                if take < numel:
                    memset(dst + take * itemsize, 0, (numel - take) * itemsize)
        else:
            _copy_in_chunks(reduce_input[:, offset:offset + numel], grad.reshape(-1), numel, world_size)
        offset += numel
    _span("reduce-scatter copy-in", start, world_size * total * itemsize if base != NULL else reduce_input.nbytes)


def free_reduce_input(ReduceScatterState state):
    """See :func:`distlab.reference.fsdp_collectives.free_reduce_input`."""
    if state.work is not None:
        state.work.wait()
    state.work = state.reduce_input = None


def wait_reduce_scatter(ReduceScatterState state):
    """See :func:`distlab.reference.fsdp_collectives.wait_reduce_scatter`."""
    if state.work is not None:
        state.work.wait()
    state.work = state.reduce_input = None  # the packed gradients are freed
    cdef object replicas = state.all_reduce_group
    if replicas is None or not state.all_reduce_grads or state.all_reduce_work is not None:
        return
    state.all_reduce_work = replicas.allreduce(state.reduce_output, op=state.all_reduce_op, async_op=True,
                                               name=collective_name("all-reduce", state.name))


def finish_reduce(ReduceScatterState state):
    """See :func:`distlab.reference.fsdp_collectives.finish_reduce`."""
    wait_reduce_scatter(state)
    cdef object work = state.all_reduce_work
    if work is not None:
        work.wait()
        state.all_reduce_work = None
    cdef object row = state.reduce_output
    _div_if_needed(row, state.post_divide)
    if row.dtype != state.orig_dtype:
        row = row.astype(state.orig_dtype)
    cdef Py_ssize_t offset = 0
    cdef FSDPParam p
    for p in state.fsdp_params:  # each parameter's unpadded rows: its sharded gradient
        p.accumulate_sharded_grad(row[offset:offset + p.sharded_numel])
        offset += p.padded_sharded_numel
    state.reduce_output = None


cdef _div_if_needed(array, divide):
    """See ``distlab.reference.fsdp_collectives._div_if_needed``."""
    if divide is not None:
        if type(divide) is tuple:  # ("premul", 1 / factor): PREMUL_SUM's multiplication
            array *= (<tuple>divide)[1]
        elif divide != 1:
            array /= divide


cdef _span(str what, double start, nbytes):
    """See ``distlab.reference.fsdp_collectives._span``."""
    cdef object line = get_timeline()
    if line.enabled:
        line.complete(what, start, now_us(), lane=FSDP_LANE, args={"bytes": int(nbytes)})


# --- core-only helpers ---
cdef inline bint _is_host(object array):
    return type(array) is np.ndarray and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>array)


cdef inline bint _same_host_layout(object array, object like):
    """``array`` is a C-contiguous host array of ``like``'s dtype (so its bytes may be copied as they are)."""
    if type(array) is not np.ndarray or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>array):
        return False
    return <void*>cnp.PyArray_DESCR(<cnp.ndarray>array) == <void*>cnp.PyArray_DESCR(<cnp.ndarray>like) \
        or array.dtype == like.dtype


cdef _copy_in_chunks(block, flat, Py_ssize_t numel, Py_ssize_t world_size):
    """The reference's chunk copy (device arrays and casts): full chunks, the partial one, zero rows."""
    cdef Py_ssize_t full, rest
    if numel:
        full, rest = divmod(flat.size, numel)
    else:
        full, rest = world_size, 0
    if full:
        block[:full] = flat[:full * numel].reshape(full, numel)
    if rest:
        block[full, :rest] = flat[full * numel:]
        block[full, rest:] = 0
        full += 1
    if full < world_size:
        block[full:] = 0
