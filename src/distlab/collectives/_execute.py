"""Running a negotiated response: the collectives themselves, over the process set's group.

Every member of a set runs the same responses in the same order (the negotiation's guarantee G1), so the
collectives below pair up. A fused allreduce packs its tensors into the set's fusion buffer, reduces once and
unpacks. Scaling follows Horovod's ``ScaleBuffer``: float16, bfloat16 and float32 are scaled in float32 with the
factor rounded to float32 once, float64 in float64, and integers in float64 then truncated toward zero (so
``op=Average`` of integers is the sum times ``1/size``, truncated: -7 over 2 ranks gives -3, not -4).
"""
from __future__ import annotations

import numpy as np

from .._types import ReduceOp
from .._wire import DTYPE_NAMES, JOIN_TENSOR_NAME, REDUCE_OPS, RESPONSE_TYPE_NAMES, ResponseType
from ..autograd._array import array_module
from ..errors import CollectiveError, DistlabError
from ..timeline import now_us
from ._failures import PeerFailed, stopped_by
from ._placement import ArenaRegions, lease, placeable

__all__ = ["execute", "check_reduction", "identity", "scale_in_place", "reducescatter_rows", "even_splits"]


def execute(engine, state, response):
    """Run one response of the agreed list: complete its handles with results, or with the error on every rank."""
    kind = response.response_type
    t0 = now_us() if state.timeline.enabled else 0.0
    if kind == ResponseType.ERROR:
        error = CollectiveError(f"{response.error_message} (raised on every rank)", names=response.tensor_names)
        entries = state.take(response.tensor_names)
        state.release(entries)
        for entry in entries:
            if entry is not None:
                entry.future.set_exception(error)
        return
    if kind == ResponseType.JOIN:
        for entry in state.take([JOIN_TENSOR_NAME]):
            if entry is not None:
                entry.future.set_result(state.world_rank(response.last_joined_rank))
        return
    entries = state.take(response.tensor_names)
    try:
        if kind in (ResponseType.ALLREDUCE, ResponseType.ADASUM):
            results = _allreduce(state, response, entries)
        elif entries[0] is None and kind != ResponseType.BARRIER:   # the coordinator refuses these under join
            raise DistlabError(f"rank {engine.rank} has no {response.tensor_names[0]!r} to take part in a "
                               f"negotiated {RESPONSE_TYPE_NAMES[kind]} (it has joined?)")
        elif kind == ResponseType.ALLGATHER:
            results = [_allgather(state, response, entries[0])]
        elif kind == ResponseType.BROADCAST:
            entry = entries[0]
            state.group.broadcast(entry.array, src=entry.root, name=entry.name)
            results = [entry.array]
        elif kind == ResponseType.ALLTOALL:
            results = [_alltoall(state, entries[0])]
        elif kind == ResponseType.REDUCESCATTER:
            results = [_reducescatter(state, response, entries[0])]
        elif kind == ResponseType.BARRIER:
            results = [None]
        else:
            raise DistlabError(f"unsupported response type {kind}")
    except BaseException as exc:
        error = stopped_by(exc) if isinstance(exc, PeerFailed) else exc   # a peer failed: say who and why
        for entry in entries:
            if entry is not None and not entry.future.done():
                entry.future.set_exception(error)
        raise
    finally:
        state.release(entries)   # the results are copied out of the set's arena by now
    if state.timeline.enabled:
        label = response.tensor_names[0] + (f" +{len(response.tensor_names) - 1}"
                                            if len(response.tensor_names) > 1 else "")
        state.timeline.complete(f"{RESPONSE_TYPE_NAMES[kind]} {label}", t0, lane="collectives", cat="collectives",
                                args={"tensors": list(response.tensor_names), "fused": len(response.tensor_names)})
    for entry, result in zip(entries, results):
        if entry is None:
            continue
        if entry.after is not None:                     # an internal operation finishing in the cycle thread
            try:
                result = entry.after(result)
            except Exception as exc:  # noqa: BLE001 - the error belongs to the caller's handle
                entry.future.set_exception(exc)
                continue
        entry.future.set_result(result)


def scale_in_place(buf, factor: float) -> None:
    """``buf *= factor`` as Horovod's ScaleBuffer does it (see the module docstring for the precisions)."""
    if factor == 1.0 or buf.size == 0:
        return
    dtype = buf.dtype
    if dtype.name == "bfloat16":
        buf[...] = (buf.astype(np.float32) * np.float32(factor)).astype(dtype)
    elif dtype.kind == "f":
        # A typed scalar makes the ufunc compute in its precision (float32 up to single, as ScaleBufferCPUImpl's
        # ``(float)scale_factor``, float64 above) and round once into ``buf``, converting in cache-sized chunks:
        # 4x faster than astype copies of the buffer
        compute = np.float32 if dtype.itemsize <= 4 else np.float64
        np.multiply(buf, compute(factor), out=buf, casting="unsafe")
    elif dtype.kind in "iu":
        buf[...] = np.trunc(buf.astype(np.float64) * factor)
    elif dtype.kind == "b":
        buf[...] = buf.astype(np.float64) * factor != 0
    else:
        np.multiply(buf, factor, out=buf, casting="unsafe")


def _reduce_op(response):
    op = ReduceOp.parse(REDUCE_OPS[response.reduce_op] or "sum")
    return op, ("sum" if op is ReduceOp.AVG else op.value)


def check_reduction(dtype, op: ReduceOp, kind: str, name: str) -> None:
    """Refuse at submission what the reduction below cannot take (complex with Min/Max, say), with comm's error.

    Found in the cycle thread instead, the refusal would stop the engine, and with it every rank's collectives.
    """
    from ..comm.reduce_ops import mpi_reduction  # the engine runs, so MPI is up

    mpi_reduction(np.dtype(dtype), ReduceOp.parse("sum" if op is ReduceOp.AVG else op.value), kind, name)


def _allreduce(state, response, entries):
    """One (possibly fused, possibly grouped) allreduce; a joined rank's missing entries contribute the identity."""
    dtype = _dtype(response.tensor_type)
    op, mpi_op = _reduce_op(response)
    sizes = response.tensor_sizes
    total = int(sum(sizes))
    fused = len(entries) > 1
    t0 = now_us() if state.timeline.enabled else 0.0
    # the tensors' device (a joined rank, with none of them, contributes from host memory: MPI moves the same bytes)
    xp = next((array_module(e.array) for e in entries if e is not None), np)
    placement = _placement(state, total * dtype.itemsize, dtype, mpi_op)
    buf, placed_at = None, None    # placed_at: where the reduced buffer lies in this rank's slot of the arena
    if fused and placement is not None and xp is np:  # a fusion buffer in the arena: reduced in shared memory
        buf, placed_at = placement.region(total, dtype)
        fusion_at = placed_at
    if fused and buf is None:  # the fusion buffer lives on the tensors' device, reallocated there when they move
        nbytes = total * dtype.itemsize
        if state.fusion_buffer.nbytes < nbytes or array_module(state.fusion_buffer) is not xp:
            state.fusion_buffer = xp.empty(nbytes, dtype=np.uint8)
        buf = state.fusion_buffer[:nbytes].view(dtype)
    offset = 0
    for entry, count in zip(entries, sizes):
        if entry is None:   # this rank joined: contribute the op's identity (zeros for sum and average)
            part = buf[offset:offset + count] if fused else xp.empty(count, dtype)
            part[...] = identity(op, dtype)
            if not fused:
                buf = part
        else:
            if entry.copied is not None and not entry.copied.wait(state.group.timeout):
                raise DistlabError(f"rank {state.rank}: the copy of {entry.name!r} into the shared-memory arena "
                                   f"did not finish within {state.group.timeout:g} s")
            flat = entry.array.reshape(-1)
            scale_in_place(flat, response.prescale_factor)
            if fused:
                buf[offset:offset + count] = flat
            else:
                buf, placed_at = flat, entry.offset
        offset += count
    if fused and state.timeline.enabled:
        state.timeline.complete("fuse", t0, lane="collectives", cat="collectives",
                                args={"tensors": len(entries), "bytes": total * dtype.itemsize})
    name = response.tensor_names[0] if not fused else f"fused x{len(entries)}"
    if placement is not None:   # every rank: the arrival step finds out whether all of them placed theirs
        state.group.allreduce_placed(buf, placement.arena, placed_at, op=mpi_op, name=name)
    else:
        state.group.allreduce(buf, op=mpi_op, name=name)
    # Average divides in the postscale factor (Horovod: postscale_factor /= size), in float64
    scale_in_place(buf, response.postscale_factor / (state.size if op is ReduceOp.AVG else 1))
    results = []
    offset = 0
    for entry, count in zip(entries, sizes):
        if entry is None:
            results.append(None)
        elif fused:
            results.append(buf[offset:offset + count].reshape(entry.array.shape).copy())
        elif entry.offset is not None:   # the arena region itself, leased to the caller until its views are gone
            results.append(lease(state.placement, entry.array, entry.offset))
            entry.offset = None
        else:
            results.append(entry.array)
        offset += count
    if fused and placed_at is not None:
        placement.release(fusion_at, total * dtype.itemsize)
    return results


def _placement(state, nbytes, dtype, mpi_op):
    """The set's arena when this allreduce is reduced in shared memory if placed there (made at the first)."""
    if not placeable(nbytes, dtype, mpi_op):
        return None
    if not state.placement_tried:   # every member runs this response here: the creation is collective
        state.placement_tried = True
        state.placement = ArenaRegions.create(state.group, nbytes)
    return state.placement


def _allgather(state, response, entry):
    """Allgather with different first dimensions: pad to the largest, gather, cut each rank's rows."""
    sizes = [int(s) for s in response.tensor_sizes]
    array = entry.array
    xp = array_module(array)  # the padding, the gathered rows and the result stay on the tensor's device
    padded = xp.zeros((max(sizes),) + array.shape[1:], dtype=array.dtype)
    padded[:array.shape[0]] = array
    gathered = state.group.allgather(padded, name=entry.name)
    return xp.concatenate([gathered[r][:sizes[r]] for r in range(state.size)], axis=0)


def _alltoall(state, entry):
    """Alltoall with splits (Horovod's alltoallv): rows ``splits[j]`` go to rank ``j``.

    The ranks first exchange their splits (an allgather), then every block is padded to the largest one so
    that one equal-block alltoall moves them; the result is this rank's received rows, in rank order, and how
    many came from each rank.
    """
    array = entry.array
    xp = array_module(array)  # the blocks stay on the tensor's device; the splits are host metadata
    splits = np.asarray(entry.splits, dtype=np.int64)
    table = state.group.allgather(splits, name=f"{entry.name} splits")       # table[i, j]: rows i sends to j
    received = table[:, state.rank].copy()
    block = int(table.max()) if table.size else 0
    rest = array.shape[1:]
    send = xp.zeros((state.size, block) + rest, dtype=array.dtype)
    offsets = np.concatenate([[0], np.cumsum(splits)])
    for j in range(state.size):
        send[j, :splits[j]] = array[offsets[j]:offsets[j + 1]]
    recv = xp.empty_like(send)
    if send.size:
        state.group.alltoall(recv.reshape(-1), send.reshape(-1), name=entry.name)
    output = xp.concatenate([recv[i, :received[i]] for i in range(state.size)], axis=0)
    return output, received.astype(np.int32)


def reducescatter_rows(rows: int, size: int) -> list:
    """Horovod's split of ``rows`` over ``size`` ranks: ``rows // size`` each, one more for the first ranks."""
    return [rows // size + (1 if r < rows % size else 0) for r in range(size)]


def even_splits(rows: int, size: int) -> list:
    """The default alltoall splits: as even as possible, the remainder to the first ranks."""
    return reducescatter_rows(rows, size)


def _reducescatter(state, response, entry):
    """Reduce every rank's tensor and give rank ``r`` its share of the first dimension (Horovod's split)."""
    array = entry.array
    op, mpi_op = _reduce_op(response)
    counts = reducescatter_rows(array.shape[0], state.size)
    block = max(counts)
    rest = array.shape[1:]
    xp = array_module(array)  # on the tensor's device
    send = xp.zeros((state.size, block) + rest, dtype=array.dtype)
    offset = 0
    for r, count in enumerate(counts):
        send[r, :count] = array[offset:offset + count]
        offset += count
    scale_in_place(send, response.prescale_factor)
    out = xp.empty((block,) + rest, dtype=array.dtype)
    if send.size:
        state.group.reduce_scatter(out, send, op=mpi_op, name=entry.name)
    out = out[:counts[state.rank]].copy()
    scale_in_place(out, response.postscale_factor / (state.size if op is ReduceOp.AVG else 1))
    return out


def _dtype(code: int):
    name = DTYPE_NAMES[code]
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def identity(op, dtype):
    """The reduce op's identity for ``dtype`` (what a joined rank contributes)."""
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        return 0
    if op is ReduceOp.PRODUCT:
        return 1
    if dtype.name == "bfloat16":
        return float("inf") if op is ReduceOp.MIN else float("-inf")
    info = np.finfo(dtype) if dtype.kind in "fc" else np.iinfo(dtype) if dtype.kind in "iu" else None
    if info is None:   # bool
        return op is ReduceOp.MIN
    return info.max if op is ReduceOp.MIN else info.min
