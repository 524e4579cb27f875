"""Containers: Sequential and ModuleList (mirrors torch.nn.modules.container)."""
from __future__ import annotations

from .module import Module

__all__ = ["Sequential", "ModuleList"]


class Sequential(Module):
    """Chain modules: ``Sequential(a, b, c)(x) == c(b(a(x)))``; children are named "0", "1", ..."""

    def __init__(self, *modules):
        super().__init__()
        for i, m in enumerate(modules):
            self.add_module(str(i), m)
        object.__setattr__(self, "_chain", tuple(modules))

    def add_module(self, name, module):
        super().add_module(name, module)
        object.__setattr__(self, "_chain", tuple(m for m in self._modules.values() if m is not None))

    def forward(self, x):
        for module in self._chain:
            x = module(x)
        return x

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Sequential(*self._chain[i])
        return self._chain[i]

    def __len__(self):
        return len(self._chain)

    def __iter__(self):
        return iter(self._chain)

    def append(self, module):
        self.add_module(str(len(self._modules)), module)
        return self


class ModuleList(Module):
    """A list of modules registered as children "0", "1", ... (no forward of its own)."""

    def __init__(self, modules=()):
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, module):
        self.add_module(str(len(self._modules)), module)
        return self

    def extend(self, modules):
        for m in modules:
            self.append(m)
        return self

    def __getitem__(self, i):
        items = list(self._modules.values())
        return ModuleList(items[i]) if isinstance(i, slice) else items[i]

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())
