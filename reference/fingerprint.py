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
name every disagreeing rank and what each sent, in one message.
"""
from __future__ import annotations

import numpy as np

from distlab._wire import (
    COLLECTIVE_OPS,
    FINGERPRINT_MAX_DIMS,
    FINGERPRINT_VERSION,
    FINGERPRINT_WORDS,
    REDUCE_OP_CODES,
)

__all__ = ["make_fingerprint", "describe_fingerprint", "fingerprint_groups", "find_mismatch"]

_REDUCE_OP_NAMES = {code: name for name, code in REDUCE_OP_CODES.items()}

# Word positions inside a fingerprint (see distlab._wire).
_VERSION, _SEQ, _OP, _REDUCE, _ROOT, _DTYPE, _NDIM, _DIMS = range(8)


def _dtype_code(dtype) -> int:
    """Pack the dtype's string form (``'<f4'``) into one int64, so it can be unpacked for the message."""
    if dtype is None:
        return 0
    text = np.dtype(dtype).str.encode("ascii")[:8]
    return int.from_bytes(text.ljust(8, b"\0"), "little", signed=True)


def _dtype_name(code: int) -> str:
    if code == 0:
        return "-"
    text = int(code).to_bytes(8, "little", signed=True).rstrip(b"\0").decode("ascii", "replace")
    try:
        return np.dtype(text).name
    except TypeError:
        return text


def make_fingerprint(seq, op, shape=None, dtype=None, root=-1, reduce_op=""):
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
    words[_VERSION] = FINGERPRINT_VERSION
    words[_SEQ] = seq
    words[_OP] = COLLECTIVE_OPS.index(op)
    words[_REDUCE] = REDUCE_OP_CODES[str(reduce_op)]
    words[_ROOT] = root
    words[_DTYPE] = _dtype_code(dtype)
    if shape is None:
        words[_NDIM] = -1
        return words
    dims = [int(d) for d in shape]
    words[_NDIM] = len(dims)
    # A shape longer than the slots folds its tail into the last slot, so it still differs when it should.
    if len(dims) > FINGERPRINT_MAX_DIMS:
        dims = dims[: FINGERPRINT_MAX_DIMS - 1] + [int(np.prod(dims[FINGERPRINT_MAX_DIMS - 1:]))]
    words[_DIMS:_DIMS + len(dims)] = dims
    return words


def describe_fingerprint(words) -> str:
    """Return a human-readable form, e.g. ``"#3 allreduce(sum) float32[4, 2]"``."""
    op = COLLECTIVE_OPS[int(words[_OP])] if 0 <= int(words[_OP]) < len(COLLECTIVE_OPS) else f"op{int(words[_OP])}"
    reduce_name = _REDUCE_OP_NAMES.get(int(words[_REDUCE]), "?")
    text = f"#{int(words[_SEQ])} {op}"
    if reduce_name:
        text += f"({reduce_name})"
    ndim = int(words[_NDIM])
    if ndim >= 0:
        dims = [int(d) for d in words[_DIMS:_DIMS + min(ndim, FINGERPRINT_MAX_DIMS)]]
        text += f" {_dtype_name(int(words[_DTYPE]))}[{', '.join(map(str, dims))}]"
    if int(words[_ROOT]) >= 0:
        text += f" root={int(words[_ROOT])}"
    return text


def fingerprint_groups(table) -> dict:
    """Group ranks by fingerprint: ``{description: [ranks]}`` in order of first appearance.

    Parameters
    ----------
    table : array_like
        ``(world_size, FINGERPRINT_WORDS)`` int64: row ``r`` is rank ``r``'s fingerprint.
    """
    groups: dict[str, list[int]] = {}
    for rank, row in enumerate(np.asarray(table)):
        groups.setdefault(describe_fingerprint(row), []).append(rank)
    return groups


def find_mismatch(table):
    """Return ``None`` if every rank sent the same fingerprint, else a message naming who sent what.

    Every rank calls this on the same gathered table, so every rank returns the same message.
    """
    table = np.asarray(table)
    if (table == table[0]).all():
        return None
    groups = fingerprint_groups(table)
    parts = []
    for description, ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        parts.append(f"{who} called {description}")
    seqs = sorted({int(s) for s in table[:, _SEQ]})
    hint = ""
    if len(seqs) > 1:
        hint = " (the ranks are out of step: some skipped or added a collective earlier)"
    return f"collective mismatch across {len(table)} ranks: " + "; ".join(parts) + hint
