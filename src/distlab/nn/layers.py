"""Layers: Linear, Embedding, activations, Dropout, LayerNorm, Identity (mirrors torch.nn.modules)."""
from __future__ import annotations

import math

import numpy as np

from . import functional as F
from . import init
from .module import Module
from .parameter import Parameter

__all__ = ["Linear", "Embedding", "ReLU", "Tanh", "Sigmoid", "Dropout", "LayerNorm", "Identity"]


class Linear(Module):
    """``y = x @ W.T + b`` with W (out, in) and b (out,).

    Initialised as torch's: ``kaiming_uniform_(W, a=sqrt(5))`` (bound ``1/sqrt(in)``) and b ~ U(-1/sqrt(in),
    1/sqrt(in)). ``seed`` is None (the default generator, see :func:`distlab.manual_seed`), an int or a Generator.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype=np.float32, seed=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        rng = init.resolve_rng(seed)
        self.weight = Parameter(np.empty((out_features, in_features), dtype=dtype))
        init.kaiming_uniform_(self.weight, a=math.sqrt(5), rng=rng)
        if bias:
            self.bias = Parameter(np.empty((out_features,), dtype=dtype))
            bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
            init.uniform_(self.bias, -bound, bound, rng=rng)
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Embedding(Module):
    """A lookup table (num_embeddings, embedding_dim) initialised N(0, 1); ``sparse=True`` gives SparseGrad."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx=None, sparse: bool = False,
                 dtype=np.float32, seed=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.sparse = padding_idx, sparse
        self.weight = Parameter(np.empty((num_embeddings, embedding_dim), dtype=dtype))
        init.normal_(self.weight, rng=init.resolve_rng(seed))
        if padding_idx is not None:
            self.weight.data[padding_idx] = 0

    def forward(self, indices):
        return F.embedding(indices, self.weight, self.padding_idx, self.sparse)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}" + (", sparse=True" if self.sparse else "")


class ReLU(Module):
    def forward(self, x):
        return F.relu(x)


class Tanh(Module):
    def forward(self, x):
        return F.tanh(x)


class Sigmoid(Module):
    def forward(self, x):
        return F.sigmoid(x)


class Identity(Module):
    def forward(self, x):
        return x


class Dropout(Module):
    """Inverted dropout, active in training mode only; its generator is drawn from ``seed`` at construction."""

    def __init__(self, p: float = 0.5, seed=None):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p = p
        self.rng = np.random.default_rng(init.resolve_rng(seed).integers(2**63))

    def forward(self, x):
        return F.dropout(x, self.p, self.training, self.rng)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class LayerNorm(Module):
    """Layer normalisation over the trailing ``normalized_shape`` with learnable ``weight`` (1) and ``bias`` (0)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, dtype=np.float32):
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape, self.eps = tuple(normalized_shape), eps
        if elementwise_affine:
            self.weight = Parameter(np.ones(self.normalized_shape, dtype=dtype))
            self.bias = Parameter(np.zeros(self.normalized_shape, dtype=dtype))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"
