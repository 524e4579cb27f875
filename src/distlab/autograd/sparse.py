"""Sparse row gradients: what ``nn.Embedding(..., sparse=True)`` produces.

A :class:`SparseGrad` is PyTorch's sparse COO gradient restricted to whole rows (``sparse_dim == 1``, which is
all an embedding table needs): ``indices`` (nnz,) row numbers, ``values`` (nnz, *row_shape), and the dense
``shape``. Like torch's, it may be *uncoalesced* (repeated rows); :meth:`coalesce` sums duplicates.
"""
from __future__ import annotations

from ._array import array_module, index_add

__all__ = ["SparseGrad", "add_grads"]


class SparseGrad:
    """A row-sparse gradient ``(indices, values, shape)``.

    Parameters
    ----------
    indices : ndarray of int, shape (nnz,)
        Row numbers (may repeat unless coalesced).
    values : ndarray, shape (nnz, *shape[1:])
        The rows.
    shape : tuple of int
        Shape of the dense gradient this stands for.
    coalesced : bool
        True when ``indices`` is sorted and unique.
    """

    __slots__ = ("indices", "values", "shape", "coalesced")
    is_sparse = True

    def __init__(self, indices, values, shape, coalesced=False):
        self.indices = indices
        self.values = values
        self.shape = tuple(shape)
        self.coalesced = coalesced

    @property
    def dtype(self):
        """The dtype of the values."""
        return self.values.dtype

    @property
    def data(self):
        """Self, so that ``param.grad.data`` works for sparse as for dense gradients."""
        return self

    def nnz(self) -> int:
        """Number of stored rows (counting duplicates)."""
        return int(self.indices.shape[0])

    def coalesce(self) -> "SparseGrad":
        """Return an equivalent gradient with sorted, unique indices (duplicate rows summed)."""
        if self.coalesced:
            return self
        xp = array_module(self.values)
        uniq, inverse = xp.unique(self.indices, return_inverse=True)
        values = xp.zeros((uniq.shape[0],) + self.values.shape[1:], dtype=self.values.dtype)
        index_add(values, inverse.reshape(-1), self.values)
        return SparseGrad(uniq, values, self.shape, coalesced=True)

    def to_dense(self):
        """Return the dense ndarray of shape ``shape``."""
        xp = array_module(self.values)
        dense = xp.zeros(self.shape, dtype=self.values.dtype)
        index_add(dense, self.indices, self.values)
        return dense

    def clone(self) -> "SparseGrad":
        """Return a copy that shares no memory with this one."""
        return SparseGrad(self.indices.copy(), self.values.copy(), self.shape, self.coalesced)

    def __add__(self, other):
        return add_grads(self, other)

    __radd__ = __add__

    def __mul__(self, scalar):
        return SparseGrad(self.indices, self.values * scalar, self.shape, self.coalesced)

    __rmul__ = __mul__

    def __repr__(self):
        return f"SparseGrad(nnz={self.nnz()}, shape={self.shape}, dtype={self.dtype})"


def add_grads(a, b):
    """Return ``a + b`` for dense arrays and/or :class:`SparseGrad` (never modifies either operand).

    sparse + sparse concatenates (uncoalesced, as torch does); sparse + dense scatters into a dense copy.
    """
    a_sparse = isinstance(a, SparseGrad)
    b_sparse = isinstance(b, SparseGrad)
    if not (a_sparse or b_sparse):
        return a + b
    if a_sparse and b_sparse:
        xp = array_module(a.values)
        return SparseGrad(xp.concatenate([a.indices, b.indices]),
                          xp.concatenate([a.values, b.values]), a.shape)
    sparse, dense = (a, b) if a_sparse else (b, a)
    out = dense.copy()
    index_add(out, sparse.indices, sparse.values)
    return out
