"""Reduce ops and dtypes: which MPI operation reduces which numpy dtype, decided before a collective starts.

Every check here runs before the collective takes its sequence number: a rank that passes a bad dtype or op
gets a clear ``TypeError`` and its group stays in step with the others (had it taken the number, its peers would
wait for a collective it never entered). Valid (dtype, op) pairs are remembered, so a check costs one dictionary
lookup on the hot path.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .._types import ReduceOp

__all__ = ["parse_op", "mpi_reduction", "check_movable", "averaging", "is_bfloat16", "as_bits", "reduction_buffer"]

_MPI_OPS = {
    ReduceOp.SUM: MPI.SUM, ReduceOp.AVG: MPI.SUM, ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX,
    ReduceOp.PRODUCT: MPI.PROD, ReduceOp.BAND: MPI.BAND, ReduceOp.BOR: MPI.BOR,
}
# MPI defines only logical ops on C bool: min is "and", max is "or", a sum saturates to "or".
_BOOL_OPS = {
    ReduceOp.SUM: MPI.LOR, ReduceOp.MIN: MPI.LAND, ReduceOp.MAX: MPI.LOR, ReduceOp.PRODUCT: MPI.LAND,
    ReduceOp.BAND: MPI.LAND, ReduceOp.BOR: MPI.LOR,
}
#: dtype kinds MPI moves natively: bool, signed and unsigned integers, floats (float16 included), complex.
_NUMERIC_KINDS = frozenset("biufc")
_OP_LOOKUP = {**{m: m for m in ReduceOp}, **{m.value: m for m in ReduceOp}}
_REDUCTIONS: dict = {}  # (dtype, ReduceOp) -> MPI op, for pairs already checked
_BF16_OPS: dict = {}


def parse_op(op) -> ReduceOp:
    """``ReduceOp.parse`` with a dictionary fast path (this runs on every collective)."""
    parsed = _OP_LOOKUP.get(op)
    return parsed if parsed is not None else ReduceOp.parse(op)


def as_bits(buf):
    """What MPI moves unreduced: ml_dtypes arrays (bfloat16...) as their bytes, others as they are."""
    return buf.view(np.uint8) if buf.dtype.kind == "V" else buf


def reduction_buffer(buf):
    """What MPI reduces: bfloat16 as its 16-bit words (which :func:`mpi_reduction`'s own op reduces), others as
    they are."""
    return [buf.view(np.uint16), MPI.UINT16_T] if is_bfloat16(buf.dtype) else buf


def is_bfloat16(dtype) -> bool:
    """True for ``ml_dtypes.bfloat16`` (a numpy extension dtype of kind ``V``, reduced by our own MPI op)."""
    return dtype.kind == "V" and dtype.name == "bfloat16"


def _of(what: str, name) -> str:
    return f"{what} of {name!r}" if name else what


def check_movable(dtype, what: str, name=None) -> None:
    """Refuse dtypes MPI cannot carry as typed buffers (object, strings, structured, datetime) with a TypeError."""
    if dtype.kind in _NUMERIC_KINDS or is_bfloat16(dtype):
        if not dtype.isnative:
            raise TypeError(f"{_of(what, name)}: dtype {dtype} has non-native byte order; convert it first: "
                            f"array.astype(array.dtype.newbyteorder('='))")
        return
    hint = ("use allgather_object/broadcast_object for Python objects" if dtype.kind == "O"
            else "send its raw bytes instead: array.view(np.uint8)")
    raise TypeError(f"{_of(what, name)}: arrays of dtype {dtype} cannot go through MPI (numeric and bool dtypes "
                    f"only); {hint}")


def mpi_reduction(dtype, op: ReduceOp, what: str, name=None):
    """The MPI op reducing ``dtype`` with ``op``; a TypeError naming the call, the tensor and the dtype if none does."""
    mpi_op = _REDUCTIONS.get((dtype, op))
    if mpi_op is None:
        mpi_op = _REDUCTIONS[(dtype, op)] = _choose_reduction(dtype, op, _of(what, name))
    return mpi_op


def _choose_reduction(dtype, op: ReduceOp, label: str):
    kind = dtype.kind
    bf16 = is_bfloat16(dtype)
    check_movable(dtype, label)
    if op in (ReduceOp.BAND, ReduceOp.BOR) and kind not in "biu":
        raise TypeError(f"{label}: op {op.value!r} needs an integer or bool array, got {dtype}")
    if op is ReduceOp.AVG and kind not in "fc" and not bf16:
        raise TypeError(f"{label}: op 'avg' needs a floating-point array, got {dtype} (use 'sum')")
    if op in (ReduceOp.MIN, ReduceOp.MAX) and kind == "c":
        raise TypeError(f"{label}: op {op.value!r} is undefined for complex numbers (they are not ordered), "
                        f"got {dtype}")
    if bf16:
        return _bfloat16_op(op, dtype)
    return _BOOL_OPS[op] if kind == "b" else _MPI_OPS[op]


def _bfloat16_op(op: ReduceOp, dtype):
    """An MPI op reducing ml_dtypes.bfloat16 values carried as uint16 (created once per reduce op)."""
    mpi_op = _BF16_OPS.get(op)
    if mpi_op is None:
        combine = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.MIN: np.minimum,
                   ReduceOp.MAX: np.maximum, ReduceOp.PRODUCT: np.multiply}[op]

        def reduce(inbuf, outbuf, _datatype):
            incoming = np.frombuffer(inbuf, dtype=dtype)
            into = np.frombuffer(outbuf, dtype=dtype)
            combine(into, incoming, out=into)

        mpi_op = _BF16_OPS[op] = MPI.Op.Create(reduce, commute=True)
    return mpi_op


def averaging(buf, size: int, copy_back):
    """The finish step of ``avg``: divide the sum by the group size, then copy a staged array back."""
    def finish():
        buf[...] /= size
        if copy_back is not None:
            copy_back()
    return finish
