"""Functional forms of the layers and losses (mirrors torch.nn.functional).

``linear`` and ``embedding`` have their own backward nodes: a fused ``x @ W.T + b`` is one node instead of three
(the per-node engine cost matters for 500-layer models), and the embedding node is where sparse gradients are
born. The rest are compositions of autograd ops, so their gradients come from already-checked pieces.
"""
from __future__ import annotations


from ..autograd import ops, shape_ops
from ..autograd._array import array_module, index_add, is_cupy
from ..autograd.engine import leaf_grad_buffer
from ..autograd.node import Node
from ..autograd.ops import record
from ..autograd.sparse import SparseGrad
from ..autograd.tensor import Tensor

__all__ = ["linear", "embedding", "relu", "tanh", "sigmoid", "dropout", "layer_norm", "log_softmax", "softmax",
           "cross_entropy", "nll_loss", "mse_loss"]


class LinearBackward(Node):
    """Gradients of ``y = x @ W.T + b`` (torch's AddmmBackward): dx = g W, dW = g^T x, db = sum_rows g."""

    __slots__ = ()

    def apply(self, g):
        x, w = self.saved
        g2 = g if g.ndim == 2 else g.reshape(-1, g.shape[-1])
        gx = gw = gb = None
        if self.needs(0):
            gx = g @ w
        if self.needs(1):
            x2 = x if x.ndim == 2 else x.reshape(-1, x.shape[-1])
            gw = g2.T @ x2 if (out := leaf_grad_buffer(self, 1, w.shape, g2, x2)) is None \
                else array_module(out).matmul(g2.T, x2, out=out)  # DDP's bucket view, when it gave the weight one
        if len(self.next_nodes) > 2 and self.needs(2):
            gb = g2.sum(axis=0, out=leaf_grad_buffer(self, 2, g2.shape[1:], g2))
        return gx, gw, gb


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` for ``x`` of shape (..., in) and ``weight`` of shape (out, in)."""
    out = x.data @ weight.data.T
    if bias is not None:
        out += bias.data  # in place: `out` is a fresh array
        return record(out, LinearBackward, (x, weight, bias), (x.data, weight.data))
    return record(out, LinearBackward, (x, weight), (x.data, weight.data))


class EmbeddingBackward(Node):
    """Gradient of a row lookup: rows of ``g`` scattered to the looked-up indices, dense or :class:`SparseGrad`."""

    __slots__ = ()

    def apply(self, g):
        indices, shape, sparse, padding_idx = self.saved
        flat = indices.reshape(-1)
        rows = g.reshape(-1, shape[1])
        if padding_idx is not None:
            rows = rows * (flat != padding_idx)[:, None]  # the padding row never receives a gradient
        if sparse:
            return (None, SparseGrad(flat, rows, shape))
        dense = leaf_grad_buffer(self, 1, shape, g)
        if dense is None:
            dense = array_module(g).zeros(shape, dtype=g.dtype)
        else:
            dense[...] = 0
        index_add(dense, flat, rows)
        return (None, dense)


def embedding(indices, weight: Tensor, padding_idx=None, sparse: bool = False) -> Tensor:
    """Look up rows of ``weight`` (num, dim) at integer ``indices`` of any shape; output (*indices.shape, dim)."""
    idx = indices.data if isinstance(indices, Tensor) else indices
    xp = array_module(weight.data)
    idx = xp.asarray(idx)
    return record(weight.data[idx], EmbeddingBackward, (None, weight), (idx, weight.data.shape, sparse, padding_idx))


relu = ops.relu
tanh = ops.tanh
sigmoid = ops.sigmoid
log_softmax = shape_ops.log_softmax
softmax = shape_ops.softmax


def dropout(x: Tensor, p: float = 0.5, training: bool = True, rng=None) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by ``1/(1-p)`` (inverted dropout)."""
    if not training or p == 0.0:
        return x
    if p >= 1.0:
        return x * 0.0
    from .init import resolve_rng

    keep = resolve_rng(rng).random(x.shape) >= p
    mask = (keep / (1.0 - p)).astype(x.dtype)
    if is_cupy(x.data):
        mask = array_module(x.data).asarray(mask)
    return x * mask


def layer_norm(x: Tensor, normalized_shape, weight=None, bias=None, eps: float = 1e-5) -> Tensor:
    """Normalise over the trailing ``normalized_shape`` axes with the biased variance, then scale and shift."""
    n = len(normalized_shape) if isinstance(normalized_shape, (tuple, list)) else 1
    axes = tuple(range(x.ndim - n, x.ndim))
    centred = x - x.mean(axis=axes, keepdims=True)
    var = (centred * centred).mean(axis=axes, keepdims=True)
    y = centred / (var + eps).sqrt()
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def _reduce(loss: Tensor, reduction: str) -> Tensor:
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', not {reduction!r}")


def nll_loss(log_probs: Tensor, target, reduction: str = "mean") -> Tensor:
    """Negative log-likelihood of integer class ``target`` (N,) under ``log_probs`` (N, C)."""
    t = target.data if isinstance(target, Tensor) else target
    xp = array_module(log_probs.data)
    t = xp.asarray(t)
    picked = log_probs[xp.arange(t.shape[0]), t]
    return _reduce(-picked, reduction)


def cross_entropy(logits: Tensor, target, reduction: str = "mean") -> Tensor:
    """``nll_loss(log_softmax(logits), target)``: logits (N, C), integer targets (N,)."""
    return nll_loss(shape_ops.log_softmax(logits, axis=-1), target, reduction)


def mse_loss(input: Tensor, target, reduction: str = "mean") -> Tensor:
    """Mean squared error ``mean((input - target)^2)``."""
    diff = input - target
    return _reduce(diff * diff, reduction)
