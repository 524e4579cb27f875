"""PowerSGD's matrices: which gradients a bucket compresses, strided batches of them, orthogonalisation.

Mirrors the helpers of torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py (``_orthogonalize``,
``_orthogonalize_gram_schmidt``, ``_should_compress``) and the part of ``powerSGD_hook`` that sorts a bucket's
tensors; used by :mod:`distlab.ddp_comm_hooks.powersgd`. Works on numpy and cupy arrays alike (the array module
of the bucket).
"""
from __future__ import annotations

import itertools
import logging

import numpy as np

from ..autograd._array import array_module as _xp

log = logging.getLogger("distlab.ddp_comm_hooks")


def _strided(xp, base, offset, stride, count, shape):
    """``count`` arrays of ``shape`` starting at element ``offset`` of the flat ``base``, ``stride`` apart."""
    item = base.itemsize
    inner = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) * item for i in range(len(shape)))
    start = base[offset:]
    return xp.lib.stride_tricks.as_strided(start, (count,) + tuple(shape), (stride * item,) + inner)


# -- orthogonalisation (mirrors _orthogonalize and _orthogonalize_gram_schmidt) ---------------------------------
def _orthogonalize(matrices, epsilon=0.0):
    """Orthonormalise the columns of each matrix of the batch ``matrices`` (k, n, r) in place.

    As the anchor: Gram-Schmidt for rank 1 and 2 and for half precision, else a QR factorisation (faster from
    rank 3 on; the epsilon applies only to Gram-Schmidt).
    """
    rank = matrices.shape[2]
    if rank <= 2 or matrices.dtype.itemsize < 4:
        _orthogonalize_gram_schmidt(matrices, epsilon)
    else:
        xp = _xp(matrices)
        q, _ = xp.linalg.qr(matrices)
        matrices[...] = q


_zero_column_logged = [False]


def _orthogonalize_gram_schmidt(matrices, epsilon=0.0):
    """Gram-Schmidt on the columns of each matrix of ``matrices`` (k, n, r), in place.

    Column i is normalised (``epsilon`` is added to its norm, against vanishing gradients), then removed from the
    columns after it.
    """
    xp = _xp(matrices)
    num_cols = matrices.shape[2]
    for i in range(num_cols):
        col = matrices[:, :, i:i + 1]
        norm = xp.linalg.norm(col, axis=1, keepdims=True)
        if epsilon == 0:
            # the anchor divides by zero here (NaN); its intent, and distlab's: keep 0s. On a device no column is
            # read back to say so (a host sync per column and step).
            zero = norm == 0
            if xp is np and not _zero_column_logged[0] and zero.any():
                _zero_column_logged[0] = True
                log.error("The matrices to be orthogonalized have at least a column of all 0s; they stay 0. "
                          "Set a small orthogonalization_epsilon such as 1e-8 in the PowerSGD state.")
            col /= xp.where(zero, 1, norm)
        else:
            col /= norm + epsilon
        if i + 1 < num_cols:
            rest = matrices[:, :, i + 1:]
            rest -= xp.sum(col * rest, axis=1, keepdims=True) * col


def _should_compress(num_rows, num_cols, matrix_approximation_rank, min_compression_rate):
    """(worth compressing, elements before, elements after) for a num_rows x num_cols matrix (as the anchor)."""
    uncompressed_size = num_rows * num_cols
    compressed_size = (num_rows + num_cols) * matrix_approximation_rank
    return compressed_size * min_compression_rate < uncompressed_size, uncompressed_size, compressed_size


# -- where things live in a bucket --------------------------------------------------------------------------------
class _Layout:
    """One bucket's plan: runs of same-shape matrices to compress and runs of tensors sent as they are.

    A compressed run is (offset, stride, count, rows, cols, rank, p_offset, q_offset): ``count`` matrices
    rows x cols at ``offset``, ``stride`` elements apart, whose Ps (Qs) lie one after another from
    ``p_offset`` (``q_offset``). The matrices are ordered as the anchor orders them (grouped by shape, in order
    of first appearance), so P and Q memory match its layout. An uncompressed run is (offset, stride, count,
    length, u_offset), in bucket order.
    """

    __slots__ = ("key", "runs", "plain", "p_total", "q_total", "u_total", "numel_before", "numel_after")

    def __init__(self, key, offsets, lengths, sizes, rank, min_rate):
        self.key = key
        by_shape = {}  # (rows, cols) -> [offset, ...] in first-seen order, as torch's shape_to_tensors
        plain = []
        self.numel_before = self.numel_after = 0
        for offset, length, size in zip(offsets, lengths, sizes):
            rows = int(size[0]) if len(size) else 1
            cols = length // rows if rows else 0
            r = min(rows, cols, rank)
            worth, before, after = _should_compress(rows, cols, r, min_rate)
            self.numel_before += before
            if worth:
                by_shape.setdefault((rows, cols), []).append(offset)
                self.numel_after += after
            else:
                plain.append((offset, length))
                self.numel_after += before
        self.runs, self.p_total, self.q_total = [], 0, 0
        for (rows, cols), starts in by_shape.items():
            r = min(rows, cols, rank)
            for offset, stride, count in _constant_stride_runs(starts):
                self.runs.append((offset, stride, count, rows, cols, r, self.p_total, self.q_total))
                self.p_total += count * rows * r
                self.q_total += count * cols * r
        self.plain, self.u_total = [], 0
        for length, same_length in itertools.groupby(plain, key=lambda entry: entry[1]):
            for offset, stride, count in _constant_stride_runs([o for o, _ in same_length]):
                self.plain.append((offset, stride if count > 1 else length, count, length, self.u_total))
                self.u_total += count * length


def _constant_stride_runs(starts):
    """Split ``starts`` into maximal runs of a constant difference: [(first, stride, count), ...]."""
    out, i = [], 0
    while i < len(starts):
        j, stride = i + 1, 0
        if j < len(starts):
            stride = starts[j] - starts[i]
            while j < len(starts) and starts[j] - starts[j - 1] == stride and stride > 0:
                j += 1
        count = j - i
        out.append((starts[i], stride if count > 1 else 0, count))
        i = j
    return out
