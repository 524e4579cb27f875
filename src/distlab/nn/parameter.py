"""``Parameter``: a leaf tensor that a Module registers as trainable (mirrors torch.nn.Parameter)."""
from __future__ import annotations

from ..autograd.tensor import Tensor

__all__ = ["Parameter"]


class Parameter(Tensor):
    """A leaf Tensor with ``requires_grad=True`` by default; assigning one to a Module attribute registers it."""

    def __init__(self, data, requires_grad: bool = True):
        super().__init__(data, requires_grad=requires_grad)

    def __repr__(self) -> str:
        return f"Parameter containing:\n{self.data!r}"
