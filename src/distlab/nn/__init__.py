"""distlab.nn: modules, layers and losses over distlab.autograd (mirrors torch.nn)."""
from __future__ import annotations

from . import functional, init
from .batchnorm import BatchNorm1d, SyncBatchNorm
from .containers import ModuleList, Sequential
from .init import manual_seed
from .layers import Dropout, Embedding, Identity, LayerNorm, Linear, ReLU, Sigmoid, Tanh
from .loss import CrossEntropyLoss, MSELoss, NLLLoss
from .module import IncompatibleKeys, Module
from .parameter import Parameter

__all__ = [
    "Module", "Parameter", "IncompatibleKeys", "Linear", "Embedding", "ReLU", "Tanh", "Sigmoid", "Identity",
    "Dropout", "LayerNorm", "BatchNorm1d", "SyncBatchNorm", "Sequential", "ModuleList", "CrossEntropyLoss",
    "MSELoss", "NLLLoss",
    "functional", "init", "manual_seed",
]
