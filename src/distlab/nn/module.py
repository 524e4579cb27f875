"""``Module``: the container of parameters, buffers and submodules (mirrors torch/nn/modules/module.py).

Parameters, buffers and submodules are kept in the ordered dicts ``_parameters``, ``_buffers`` and ``_modules``
(for enumeration and dotted names) *and* in the instance ``__dict__`` (so ``self.weight`` in ``forward`` is a
plain attribute read, not a ``__getattr__`` fallback as in torch: this matters for 500-layer models).
"""
from __future__ import annotations

from collections import namedtuple

from ..autograd._array import array_module, cuda_module, is_cupy, to_numpy
from ..autograd.node import add_hook
from ..autograd.tensor import Tensor, zero_grads
from .parameter import Parameter

__all__ = ["Module", "IncompatibleKeys"]

IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


class Module:
    """Base class of every layer and model: subclass it, assign parameters/submodules, write ``forward``."""

    def __init__(self):
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_buffers", {})
        object.__setattr__(self, "_non_persistent", set())
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "_forward_pre_hooks", None)
        object.__setattr__(self, "_forward_hooks", None)
        object.__setattr__(self, "training", True)

    # -- registration -----------------------------------------------------------------------------------------
    def __setattr__(self, name, value):
        params = self.__dict__.get("_parameters")
        if params is None:
            raise AttributeError("cannot assign attributes before Module.__init__() call")
        if isinstance(value, Parameter):
            if name not in params:  # replacing a parameter keeps its place (as torch's ordered dicts do)
                self._forget(name)
            params[name] = value
        elif isinstance(value, Module):
            if name not in self._modules:  # replacing a submodule keeps its place: Sequential's order
                self._forget(name)
            self._modules[name] = value
        elif name in self._buffers:
            self._buffers[name] = value
        elif name in params or name in self._modules:
            if value is not None:
                raise TypeError(f"cannot assign {type(value).__name__} as {name!r} (a Parameter or Module slot)")
            (params if name in params else self._modules)[name] = None
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        self._forget(name)
        object.__delattr__(self, name)

    def _forget(self, name):
        for table in (self._parameters, self._buffers, self._modules):
            table.pop(name, None)
        self._non_persistent.discard(name)

    def register_parameter(self, name: str, param) -> None:
        """Register ``param`` (a Parameter or None) under ``name``."""
        if param is None:
            self._forget(name)
            self._parameters[name] = None
            object.__setattr__(self, name, None)
        else:
            setattr(self, name, param)

    def register_buffer(self, name: str, tensor, persistent: bool = True) -> None:
        """Register non-trainable state (an array or Tensor) saved in ``state_dict`` unless ``persistent=False``."""
        self._forget(name)
        self._buffers[name] = tensor
        if not persistent:
            self._non_persistent.add(name)
        object.__setattr__(self, name, tensor)

    def add_module(self, name: str, module) -> None:
        """Register a submodule (or None) under ``name``; an existing ``name`` keeps its place in the order."""
        if name not in self._modules:
            self._forget(name)
        self._modules[name] = module
        object.__setattr__(self, name, module)

    # -- traversal --------------------------------------------------------------------------------------------
    def named_modules(self, prefix: str = "", memo=None):
        """Yield ``(dotted_name, module)`` for this module and every descendant, each once."""
        memo = set() if memo is None else memo
        if id(self) in memo:
            return
        memo.add(id(self))
        yield prefix, self
        for name, child in self._modules.items():
            if child is not None:
                yield from child.named_modules(f"{prefix}.{name}" if prefix else name, memo)

    def modules(self):
        for _, m in self.named_modules():
            yield m

    def named_children(self):
        for name, child in self._modules.items():
            if child is not None:
                yield name, child

    def children(self):
        for _, child in self.named_children():
            yield child

    def _named_members(self, table: str, prefix: str, recurse: bool, remove_duplicate: bool = True):
        seen = set()
        modules = self.named_modules(prefix) if recurse else [(prefix, self)]
        for mod_prefix, module in modules:
            for name, value in getattr(module, table).items():
                if value is None or (remove_duplicate and id(value) in seen):
                    continue
                seen.add(id(value))
                yield (f"{mod_prefix}.{name}" if mod_prefix else name), value

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """Yield ``(dotted_name, Parameter)``, e.g. ``("layers.0.weight", p)``; shared parameters once, or under
        each of their names with ``remove_duplicate=False`` (as torch)."""
        return self._named_members("_parameters", prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True):
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True):
        return self._named_members("_buffers", prefix, recurse)

    def buffers(self, recurse: bool = True):
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    # -- modes and grads --------------------------------------------------------------------------------------
    def train(self, mode: bool = True):
        """Set training mode (Dropout active) on this module and its descendants."""
        for m in self.modules():
            object.__setattr__(m, "training", bool(mode))
        return self

    def eval(self):
        return self.train(False)

    def requires_grad_(self, requires_grad: bool = True):
        for p in self.parameters():
            p.requires_grad = requires_grad
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients: to None (the default, as torch 2.x) or to zeros in place."""
        zero_grads(self.parameters(), set_to_none)

    def apply(self, fn):
        """Call ``fn(module)`` on every descendant (children first) and on self."""
        for child in self.children():
            child.apply(fn)
        fn(self)
        return self

    def to(self, device: str):
        """Move parameters and buffers to ``"cpu"`` (numpy) or ``"cuda"`` (cupy) in place; returns self."""
        if device not in ("cpu", "cuda"):
            raise ValueError(f"Module.to: device must be 'cpu' or 'cuda', got {device!r}")
        xp = cuda_module() if device == "cuda" else None

        def move(arr):
            if xp is None:
                return to_numpy(arr)
            return arr if is_cupy(arr) else xp.asarray(arr)

        for module in self.modules():
            for p in module._parameters.values():
                if p is not None:
                    p.data = move(p.data)
                    p.grad = None
            for name, b in list(module._buffers.items()):
                if b is not None:
                    value = Tensor(move(b.data)) if isinstance(b, Tensor) else move(b)
                    module._buffers[name] = value
                    object.__setattr__(module, name, value)
        return self

    # -- state ------------------------------------------------------------------------------------------------
    def state_dict(self, prefix: str = "") -> dict:
        """Return ``{dotted_name: array}`` of parameters and persistent buffers.

        The arrays are the live ones (as torch's state_dict shares storage): copy them to keep a snapshot.
        """
        state = {}
        for mod_prefix, module in self.named_modules(prefix):
            dot = f"{mod_prefix}." if mod_prefix else ""
            for name, p in module._parameters.items():
                if p is not None:
                    state[dot + name] = p.data
            for name, b in module._buffers.items():
                if b is not None and name not in module._non_persistent:
                    state[dot + name] = b.data if isinstance(b, Tensor) else b
        return state

    def load_state_dict(self, state_dict: dict, strict: bool = True) -> IncompatibleKeys:
        """Copy values from ``state_dict`` into the parameters and buffers in place (shapes must match)."""
        own = self.state_dict()
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}: "
                               f"missing keys {missing}, unexpected keys {unexpected}")
        for key, target in own.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            value = value.data if isinstance(value, Tensor) else value
            if tuple(value.shape) != tuple(target.shape):
                raise RuntimeError(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, "
                                   f"the shape in current model is {tuple(target.shape)}")
            xp = array_module(target)
            target[...] = value if xp is array_module(value) else xp.asarray(value)
        return IncompatibleKeys(missing, unexpected)

    # -- calling ----------------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} has no forward()")

    def __call__(self, *args, **kwargs):
        if self._forward_pre_hooks:
            for hook in tuple(self._forward_pre_hooks.values()):
                result = hook(self, args)
                if result is not None:
                    args = result if isinstance(result, tuple) else (result,)
        out = self.forward(*args, **kwargs)
        if self._forward_hooks:
            for hook in tuple(self._forward_hooks.values()):
                result = hook(self, args, out)
                if result is not None:
                    out = result
        return out

    def register_forward_pre_hook(self, hook, *, prepend: bool = False):
        """``hook(module, args) -> None or new args``, run before ``forward``; returns a removable handle.

        ``prepend=True`` runs it before the hooks already registered (torch's ``prepend``; FSDP's hooks use it)."""
        hooks, handle = add_hook(self._forward_pre_hooks, hook, prepend)
        object.__setattr__(self, "_forward_pre_hooks", hooks)
        return handle

    def register_forward_hook(self, hook, *, prepend: bool = False):
        """``hook(module, args, output) -> None or new output``, run after ``forward`` (first with ``prepend``)."""
        hooks, handle = add_hook(self._forward_hooks, hook, prepend)
        object.__setattr__(self, "_forward_hooks", hooks)
        return handle

    # -- printing ---------------------------------------------------------------------------------------------
    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"({name}): " + repr(child).replace("\n", "\n  ") for name, child in self.named_children()]
        head = f"{type(self).__name__}({self.extra_repr()}"
        if not lines:
            return head + ")"
        return head + "\n  " + "\n  ".join(lines) + "\n)"
