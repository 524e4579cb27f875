"""distlab.optim: optimizers over distlab parameters (mirrors torch.optim)."""
from __future__ import annotations

from .adam import Adam, AdamW
from .optimizer import Optimizer, required
from .sgd import SGD

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "required"]
