"""distlab.optim: optimizers over distlab parameters (mirrors torch.optim)."""
from __future__ import annotations

from .adadelta import Adadelta
from .adagrad import Adagrad
from .adam import Adam, AdamW
from .adamax import Adamax
from .optimizer import Optimizer, required
from .rmsprop import RMSprop
from .rprop import Rprop
from .sgd import SGD

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "Adamax", "Rprop", "required"]
