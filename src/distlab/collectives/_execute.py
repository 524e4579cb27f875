"""Running a negotiated response: the collectives themselves, over the engine's process group.

Every rank runs the same responses in the same order (the negotiation's guarantee G1), so the collectives below
match across ranks. A fused allreduce packs its tensors into the engine's fusion buffer, reduces once and unpacks.
"""
from __future__ import annotations

import numpy as np

from .._types import ReduceOp
from .._wire import DTYPE_NAMES, JOIN_TENSOR_NAME, REDUCE_OPS, RESPONSE_TYPE_NAMES, ResponseType
from ..errors import CollectiveError, DistlabError
from ..timeline import now_us

__all__ = ["execute", "identity"]


def execute(engine, response):
    """Run one response of the agreed list: complete its handles with results, or with the error on every rank."""
    kind = response.response_type
    t0 = now_us() if engine.timeline.enabled else 0.0
    if kind == ResponseType.ERROR:
        error = CollectiveError(f"{response.error_message} (raised on every rank)", names=response.tensor_names)
        for entry in engine._take(response.tensor_names):
            if entry is not None:
                entry.future.set_exception(error)
        return
    if kind == ResponseType.JOIN:
        for entry in engine._take([JOIN_TENSOR_NAME]):
            if entry is not None:
                entry.future.set_result(response.last_joined_rank)
        return
    entries = engine._take(response.tensor_names)
    try:
        if kind in (ResponseType.ALLREDUCE, ResponseType.ADASUM):
            results = _allreduce(engine, response, entries)
        elif entries[0] is None and kind in (ResponseType.ALLGATHER, ResponseType.BROADCAST):
            raise DistlabError(f"rank {engine.rank} has no {response.tensor_names[0]!r} to take part in a "
                               "negotiated allgather/broadcast (it has joined?)")
        elif kind == ResponseType.ALLGATHER:
            results = [_allgather(engine, response, entries[0])]
        elif kind == ResponseType.BROADCAST:
            entry = entries[0]
            engine.group.broadcast(entry.array, src=entry.root, name=entry.name)
            results = [entry.array]
        elif kind == ResponseType.BARRIER:
            results = [None]
        else:
            raise DistlabError(f"unsupported response type {kind}")
    except BaseException as exc:
        for entry in entries:
            if entry is not None and not entry.future.done():
                entry.future.set_exception(exc)
        raise
    if engine.timeline.enabled:
        label = response.tensor_names[0] + (f" +{len(response.tensor_names) - 1}"
                                            if len(response.tensor_names) > 1 else "")
        engine.timeline.complete(f"{RESPONSE_TYPE_NAMES[kind]} {label}", t0, lane="collectives",
                                 cat="collectives",
                                 args={"tensors": list(response.tensor_names), "fused": len(response.tensor_names)})
    for entry, result in zip(entries, results):
        if entry is not None:
            entry.future.set_result(result)


def _allreduce(engine, response, entries):
    """One (possibly fused) allreduce; a joined rank's missing entries contribute the op's identity."""
    dtype = np.dtype(DTYPE_NAMES[response.tensor_type])
    op = ReduceOp.parse(REDUCE_OPS[response.reduce_op] or "sum")
    mpi_op = "sum" if op is ReduceOp.AVG else op.value
    sizes = response.tensor_sizes
    total = int(sum(sizes))
    fused = len(entries) > 1
    t0 = now_us() if engine.timeline.enabled else 0.0
    if fused:
        nbytes = total * dtype.itemsize
        if engine.fusion_buffer.nbytes < nbytes:
            engine.fusion_buffer = np.empty(nbytes, dtype=np.uint8)
        buf = engine.fusion_buffer[:nbytes].view(dtype)
    offset = 0
    for entry, count in zip(entries, sizes):
        if entry is None:   # this rank joined: contribute the op's identity (zeros for sum and average)
            part = buf[offset:offset + count] if fused else np.empty(count, dtype)
            part[...] = identity(op, dtype)
            if not fused:
                buf = part
        else:
            flat = entry.array.reshape(-1)
            if response.prescale_factor != 1.0:
                np.multiply(flat, response.prescale_factor, out=flat, casting="unsafe")
            if fused:
                buf[offset:offset + count] = flat
            else:
                buf = flat
        offset += count
    if fused and engine.timeline.enabled:
        engine.timeline.complete("fuse", t0, lane="collectives", cat="collectives",
                               args={"tensors": len(entries), "bytes": total * dtype.itemsize})
    engine.group.allreduce(buf, op=mpi_op, name=response.tensor_names[0] if not fused else
                         f"fused x{len(entries)}")
    scale = response.postscale_factor / (engine.size if op is ReduceOp.AVG else 1)
    if scale != 1.0:
        np.multiply(buf, scale, out=buf, casting="unsafe")
    results = []
    offset = 0
    for entry, count in zip(entries, sizes):
        if entry is None:
            results.append(None)
        elif fused:
            results.append(buf[offset:offset + count].reshape(entry.array.shape).copy())
        else:
            results.append(entry.array)
        offset += count
    return results


def _allgather(engine, response, entry):
    """Allgather with different first dimensions: pad to the largest, gather, cut each rank's rows."""
    sizes = [int(s) for s in response.tensor_sizes]
    array = entry.array
    rest = array.shape[1:]
    padded = np.zeros((max(sizes),) + rest, dtype=array.dtype)
    padded[:array.shape[0]] = array
    gathered = engine.group.allgather(padded, name=entry.name)
    return np.concatenate([gathered[r][:sizes[r]] for r in range(engine.size)], axis=0)


def identity(op, dtype):
    """The reduce op's identity for ``dtype`` (what a joined rank contributes)."""
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        return 0
    if op is ReduceOp.PRODUCT:
        return 1
    info = np.finfo(dtype) if dtype.kind in "fc" else np.iinfo(dtype) if dtype.kind in "iu" else None
    if info is None:   # bool
        return op is ReduceOp.MIN
    return info.max if op is ReduceOp.MIN else info.min
