# cython: language_level=3
"""Core twin of :mod:`distlab.reference.fingerprint` (read that module for the explanation)."""
import numpy as np

cimport cython

from distlab._common import fingerprint as _shared
from distlab._common.fingerprint import dtype_word, mismatch_message, unknown_op
from distlab import _wire

__all__ = ["make_fingerprint", "describe_fingerprint", "fingerprint_groups", "find_mismatch"]

# Word positions (asserted equal to the shared ones at import).
cdef enum:
    _VERSION = 0
    _SEQ = 1
    _OP = 2
    _REDUCE = 3
    _ROOT = 4
    _DTYPE = 5
    _NDIM = 6
    _DIMS = 7

assert (_shared.VERSION, _shared.SEQ, _shared.OP, _shared.REDUCE, _shared.ROOT, _shared.DTYPE, _shared.NDIM,
        _shared.DIMS) == (_VERSION, _SEQ, _OP, _REDUCE, _ROOT, _DTYPE, _NDIM, _DIMS), \
    "distlab.core._fingerprint is out of date with distlab._common.fingerprint"

cdef dict _OP_CODES = {name: code for code, name in enumerate(_wire.COLLECTIVE_OPS)}
cdef dict _REDUCE_OP_CODES = _wire.REDUCE_OP_CODES
cdef Py_ssize_t _WORDS = _wire.FINGERPRINT_WORDS
cdef Py_ssize_t _MAX_DIMS = _wire.FINGERPRINT_MAX_DIMS
cdef long long _FORMAT_VERSION = _wire.FINGERPRINT_VERSION
assert _WORDS == _DIMS + _MAX_DIMS
cdef dict _DTYPE_WORDS = {}     # dtype (as passed) -> its packed word


@cython.boundscheck(False)
@cython.wraparound(False)
def make_fingerprint(seq, op, shape=None, dtype=None, root=-1, reduce_op=""):
    """See :func:`distlab.reference.fingerprint.make_fingerprint`."""
    # w has _WORDS = _DIMS + maxd entries; every index below is < _DIMS + maxd
    cdef object words = np.zeros(_WORDS, dtype=np.int64)
    cdef long long[::1] w = words
    cdef Py_ssize_t i, n, maxd = _MAX_DIMS
    cdef long long tail
    w[_VERSION] = _FORMAT_VERSION
    w[_SEQ] = int(seq)
    code = _OP_CODES.get(op)
    if code is None:
        raise unknown_op(op)
    w[_OP] = code
    w[_REDUCE] = _REDUCE_OP_CODES[str(reduce_op)]
    w[_ROOT] = int(root)
    w[_DTYPE] = _dtype_word(dtype)
    if shape is None:
        w[_NDIM] = -1
        return words
    dims = tuple(shape)
    n = len(dims)
    w[_NDIM] = n
    if n > maxd:    # fold the tail into the last slot
        tail = 1
        for i in range(maxd - 1, n):
            tail *= <long long>int(dims[i])
        for i in range(maxd - 1):
            w[_DIMS + i] = int(dims[i])
        w[_DIMS + maxd - 1] = tail
    else:
        for i in range(n):
            w[_DIMS + i] = int(dims[i])
    return words


@cython.boundscheck(False)
@cython.wraparound(False)
def find_mismatch(table):
    """See :func:`distlab.reference.fingerprint.find_mismatch`."""
    # r < nranks and j < nwords: the table's own shape
    cdef long long[:, ::1] t = np.ascontiguousarray(table, dtype=np.int64)
    cdef Py_ssize_t r, j, nranks = t.shape[0], nwords = t.shape[1]
    for r in range(1, nranks):
        for j in range(nwords):
            if t[r, j] != t[0, j]:
                return mismatch_message(table)
    return None


# the shared (error-path) functions under the twin's own names
def describe_fingerprint(words):
    """See :func:`distlab.reference.fingerprint.describe_fingerprint`."""
    return _shared.describe_fingerprint(words)


def fingerprint_groups(table):
    """See :func:`distlab.reference.fingerprint.fingerprint_groups`."""
    return _shared.fingerprint_groups(table)


# --- core-only helpers ---------------------------------------------------------------------------------------
cdef long long _dtype_word(object dtype) except? -1:
    """dtype_word, remembered per dtype object (the same few dtypes come back on every collective)."""
    if dtype is None:
        return 0
    cached = _DTYPE_WORDS.get(dtype)
    if cached is None:
        cached = _DTYPE_WORDS[dtype] = dtype_word(dtype)
    return cached
