# cython: language_level=3
"""Core twin of :mod:`distlab.reference.fingerprint` (read that module for the explanation)."""
import numpy as np

from distlab._wire import (
    COLLECTIVE_OPS,
    FINGERPRINT_MAX_DIMS,
    FINGERPRINT_VERSION,
    FINGERPRINT_WORDS,
    REDUCE_OP_CODES,
)

__all__ = ["make_fingerprint", "describe_fingerprint", "fingerprint_groups", "find_mismatch"]

cdef dict _REDUCE_OP_NAMES = {code: name for name, code in REDUCE_OP_CODES.items()}
cdef dict _OP_CODES = {name: i for i, name in enumerate(COLLECTIVE_OPS)}
cdef dict _DTYPE_CODES = {}

cdef enum:
    _VERSION = 0
    _SEQ = 1
    _OP = 2
    _REDUCE = 3
    _ROOT = 4
    _DTYPE = 5
    _NDIM = 6
    _DIMS = 7


cdef long long _dtype_code(object dtype) except? -1:
    if dtype is None:
        return 0
    cached = _DTYPE_CODES.get(dtype)
    if cached is not None:
        return cached
    text = np.dtype(dtype).str.encode("ascii")[:8]
    code = int.from_bytes(text.ljust(8, b"\0"), "little", signed=True)
    _DTYPE_CODES[dtype] = code
    return code


cdef str _dtype_name(long long code):
    if code == 0:
        return "-"
    text = int(code).to_bytes(8, "little", signed=True).rstrip(b"\0").decode("ascii", "replace")
    try:
        return np.dtype(text).name
    except TypeError:
        return text


def make_fingerprint(seq, op, shape=None, dtype=None, root=-1, reduce_op=""):
    """See :func:`distlab.reference.fingerprint.make_fingerprint`."""
    cdef object words = np.zeros(FINGERPRINT_WORDS, dtype=np.int64)
    cdef long long[::1] w = words
    cdef Py_ssize_t i, n, maxd = FINGERPRINT_MAX_DIMS
    cdef long long tail
    w[_VERSION] = FINGERPRINT_VERSION
    w[_SEQ] = seq
    code = _OP_CODES.get(op)
    if code is None:
        raise ValueError(f"{op!r} is not in tuple")
    w[_OP] = code
    w[_REDUCE] = REDUCE_OP_CODES[str(reduce_op)]
    w[_ROOT] = root
    w[_DTYPE] = _dtype_code(dtype)
    if shape is None:
        w[_NDIM] = -1
        return words
    dims = tuple(shape)
    n = len(dims)
    w[_NDIM] = n
    if n > maxd:
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


def describe_fingerprint(words):
    """See :func:`distlab.reference.fingerprint.describe_fingerprint`."""
    cdef long long opcode = int(words[_OP])
    cdef long long ndim = int(words[_NDIM])
    cdef Py_ssize_t i
    op = COLLECTIVE_OPS[opcode] if 0 <= opcode < len(COLLECTIVE_OPS) else f"op{opcode}"
    reduce_name = _REDUCE_OP_NAMES.get(int(words[_REDUCE]), "?")
    text = f"#{int(words[_SEQ])} {op}"
    if reduce_name:
        text += f"({reduce_name})"
    if ndim >= 0:
        dims = [int(words[_DIMS + i]) for i in range(min(ndim, FINGERPRINT_MAX_DIMS))]
        text += f" {_dtype_name(int(words[_DTYPE]))}[{', '.join(map(str, dims))}]"
    if int(words[_ROOT]) >= 0:
        text += f" root={int(words[_ROOT])}"
    return text


def fingerprint_groups(table):
    """See :func:`distlab.reference.fingerprint.fingerprint_groups`."""
    cdef dict groups = {}
    for rank, row in enumerate(np.asarray(table)):
        groups.setdefault(describe_fingerprint(row), []).append(rank)
    return groups


def find_mismatch(table):
    """See :func:`distlab.reference.fingerprint.find_mismatch`."""
    cdef long long[:, ::1] t = np.ascontiguousarray(table, dtype=np.int64)
    cdef Py_ssize_t r, j, nranks = t.shape[0], nwords = t.shape[1]
    cdef bint same = True
    cdef bint seq_differs = False
    for r in range(1, nranks):
        if t[r, _SEQ] != t[0, _SEQ]:
            seq_differs = True
        for j in range(nwords):
            if t[r, j] != t[0, j]:
                same = False
                break
    if same:
        return None
    parts = []
    for description, ranks in fingerprint_groups(table).items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        parts.append(f"{who} called {description}")
    hint = " (the ranks are out of step: some skipped or added a collective earlier)" if seq_differs else ""
    return f"collective mismatch across {nranks} ranks: " + "; ".join(parts) + hint
