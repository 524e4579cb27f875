"""distlab.optim: optimizers over distlab parameters (mirrors torch.optim), and ZeroRedundancyOptimizer."""
from __future__ import annotations

from .adadelta import Adadelta
from .adagrad import Adagrad
from .adam import Adam, AdamW
from .adamax import Adamax
from .optimizer import Optimizer, required
from .rmsprop import RMSprop
from .rprop import Rprop
from .sgd import SGD
from .zero_redundancy import ZeroRedundancyOptimizer

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "Adamax", "Rprop",
           "ZeroRedundancyOptimizer", "required"]
