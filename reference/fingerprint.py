"""Collective fingerprints: what ``DISTLAB_DEBUG=DETAIL`` compares across ranks before every collective.

Twinned with ``core/_fingerprint.pyx``.

A fingerprint is a small, fixed-size int64 vector describing one collective call: its sequence number in the
process group, the operation, the reduce op, the root, and the array's dtype and shape (layout in
``distlab._wire``). Every rank builds its own, the ranks allgather them (a fixed-size exchange that cannot
itself mismatch), and each rank compares the table. Because every rank compares the same table, every rank
reaches the same verdict and raises the same error: that is what makes a mismatch an error "on every rank"
instead of a hang.

This mirrors the idea of PyTorch's ``ProcessGroupWrapper`` (c10d ``checkForMismatch`` with
``CollectiveFingerPrint``), which ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wraps around every collective; unlike it we
name every disagreeing rank and what each sent, in one message (the wording is shared by both twins, in
``distlab._common.fingerprint``, with :func:`describe_fingerprint` and :func:`fingerprint_groups`).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from distlab._common.fingerprint import (
    DIMS,
    DTYPE,
    NDIM,
    OP,
    REDUCE,
    ROOT,
    SEQ,
    VERSION,
    describe_fingerprint,
    dtype_word,
    unknown_op,
    fingerprint_groups,
    mismatch_message,
)
from distlab._wire import COLLECTIVE_OPS, FINGERPRINT_MAX_DIMS, FINGERPRINT_VERSION, FINGERPRINT_WORDS, REDUCE_OP_CODES

__all__ = ["make_fingerprint", "describe_fingerprint", "fingerprint_groups", "find_mismatch"]


def make_fingerprint(seq: int, op: str, shape: Sequence[int] | None = None, dtype: npt.DTypeLike = None, root: int = -1,
                     reduce_op: str = "") -> np.ndarray:
    """Describe one collective call as ``FINGERPRINT_WORDS`` int64 words.

    Parameters
    ----------
    seq : int
        The call's sequence number in its process group.
    op : str
        The collective's name, one of ``distlab._wire.COLLECTIVE_OPS``.
    shape : tuple of int, optional
        The array's shape (``None`` for calls without an array, such as barrier).
    dtype : numpy dtype or str, optional
        The array's dtype.
    root : int, optional
        The root rank for rooted collectives, -1 otherwise.
    reduce_op : str, optional
        The reduction's name (``"sum"``, ...) or ``""``.

    Returns
    -------
    numpy.ndarray
        An int64 vector of length ``FINGERPRINT_WORDS``.
    """
    words = np.zeros(FINGERPRINT_WORDS, dtype=np.int64)
    words[VERSION] = FINGERPRINT_VERSION
    words[SEQ] = seq
    if op not in COLLECTIVE_OPS:
        raise unknown_op(op)
    words[OP] = COLLECTIVE_OPS.index(op)
    words[REDUCE] = REDUCE_OP_CODES[str(reduce_op)]
    words[ROOT] = root
    words[DTYPE] = dtype_word(dtype)
    if shape is None:
        words[NDIM] = -1
        return words
    dims = [int(d) for d in shape]
    words[NDIM] = len(dims)
    # A shape longer than the slots folds its tail into the last slot, so it still differs when it should.
    if len(dims) > FINGERPRINT_MAX_DIMS:
        dims = dims[: FINGERPRINT_MAX_DIMS - 1] + [int(np.prod(dims[FINGERPRINT_MAX_DIMS - 1:]))]
    words[DIMS:DIMS + len(dims)] = dims
    return words


def find_mismatch(table: np.ndarray) -> str | None:
    """Return ``None`` if every rank sent the same fingerprint, else a message naming who sent what.

    Every rank calls this on the same gathered table, so every rank returns the same message.
    """
    table = np.asarray(table)
    if (table == table[0]).all():
        return None
    return mismatch_message(table)
