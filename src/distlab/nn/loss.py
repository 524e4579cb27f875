"""Loss modules (mirrors torch.nn.modules.loss)."""
from __future__ import annotations

from . import functional as F
from .module import Module

__all__ = ["CrossEntropyLoss", "MSELoss", "NLLLoss"]


class CrossEntropyLoss(Module):
    """``CrossEntropyLoss()(logits (N, C), target (N,) ints)``: log-softmax then negative log-likelihood."""

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, logits, target):
        return F.cross_entropy(logits, target, self.reduction)


class NLLLoss(Module):
    """Negative log-likelihood of integer targets under log-probabilities."""

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, log_probs, target):
        return F.nll_loss(log_probs, target, self.reduction)


class MSELoss(Module):
    """Mean squared error."""

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, input, target):
        return F.mse_loss(input, target, self.reduction)
