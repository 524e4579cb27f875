"""Horovod's DistributedOptimizer: allreduce each gradient from its hook during backward (horovod/torch/optimizer.py).

A post-accumulate-grad hook on every parameter submits its gradient's allreduce the moment backward has
accumulated it, under the parameter's name, so the negotiation overlaps with the rest of backward and the ranks
may produce gradients in any order. ``step()`` waits for the reduced gradients (``synchronize()``), writes them
into ``.grad`` and steps the wrapped optimizer. With ``backward_passes_per_step=k`` the hook only submits on
every k-th backward pass: gradients accumulate locally in between. ``op=Average`` with a
``gradient_predivide_factor`` f splits the averaging into a prescale of 1/f before the sum and a postscale of
f/size after it (Horovod's way to keep float16 sums in range).
"""
from __future__ import annotations

import contextlib
import warnings

import numpy as np

from ..autograd.tensor import Tensor
from .ops import Average, allreduce_async, global_process_set, synchronize

__all__ = ["DistributedOptimizer", "Compression"]


class _NoneCompressor:
    """No compression: the gradient travels as it is."""

    @staticmethod
    def compress(array):
        return array, None

    @staticmethod
    def decompress(array, context):
        return array


class _FP16Compressor:
    """Floating-point gradients travel as float16 (half the bytes) and are cast back after the allreduce."""

    @staticmethod
    def compress(array):
        if array.dtype.kind == "f" and array.dtype != np.float16:
            return array.astype(np.float16), array.dtype
        return array, None

    @staticmethod
    def decompress(array, context):
        return array if context is None else array.astype(context)


class Compression:
    """Gradient compression for the allreduce (``horovod.torch.Compression``): ``none`` or ``fp16``."""

    none = _NoneCompressor
    fp16 = _FP16Compressor


class DistributedOptimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over every rank (``hvd.DistributedOptimizer``).

    Parameters
    ----------
    optimizer : distlab.optim.Optimizer
        The local optimizer; its ``param_groups`` and ``state`` are this object's.
    named_parameters : iterable, optional
        ``(name, parameter)`` pairs: they give each gradient its name (every rank must use the same names); default ``allreduce.noname.<i>`` in
        parameter order. Every optimized parameter must be named, each name once.
    compression : type
        ``Compression.none`` or ``Compression.fp16``.
    backward_passes_per_step : int
        Backward passes accumulated locally between two allreduces (and steps).
    op : ReduceOp
        ``Average`` or ``Sum``; Adasum is not implemented.
    gradient_predivide_factor : float
        With ``op=Average``, scale by ``1/f`` before the sum and ``f/size`` after it.
    process_set : distlab.collectives.ProcessSet
        The ranks the gradients are averaged over.
    """

    def __init__(self, optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                 op=Average, gradient_predivide_factor=1.0, process_set=global_process_set):
        self.optimizer = optimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if named_parameters is None:
            named_parameters = [(f"allreduce.noname.{i}", p) for i, p in enumerate(params)]
        named_parameters = list(named_parameters)
        if any(not isinstance(item, tuple) or len(item) != 2 for item in named_parameters):
            raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, usually "
                             "produced by model.named_parameters()")
        names = [name for name, _p in named_parameters]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"parameter names in named_parameters must be unique; found duplicates: "
                             f"{', '.join(duplicates)}")
        named_ids = {id(p) for _n, p in named_parameters}
        unnamed = [i for i, p in enumerate(params) if id(p) not in named_ids]
        if unnamed:
            raise ValueError(f"named_parameters was given, but the optimizer's parameters at positions {unnamed} "
                             "are not named in it")
        if isinstance(op, str) and op.lower() == "adasum":
            raise NotImplementedError("DistributedOptimizer(op=Adasum) is not implemented by distlab.collectives")
        if op is not Average and gradient_predivide_factor != 1.0:
            raise ValueError("gradient_predivide_factor is only supported with op=Average")
        if int(backward_passes_per_step) < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        self.compression = compression
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.op = op
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.process_set = process_set
        self._names = {id(p): name for name, p in named_parameters}
        self._params = [p for p in params if p.requires_grad]
        self._delay = {id(p): self.backward_passes_per_step for p in self._params}
        self._handles: dict[int, tuple] = {}        # id(param) -> (param, handle or None, compression context)
        self._synchronized = False
        self._should_synchronize = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook) for p in self._params]

    # -- the optimizer's face ----------------------------------------------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        """Load the wrapped optimizer's state and forget any pending gradient (as Horovod's)."""
        self._handles.clear()
        self._synchronized = False
        self._delay = {id(p): self.backward_passes_per_step for p in self._params}
        self.optimizer.load_state_dict(state_dict)

    # -- the hooks -----------------------------------------------------------------------------------------------
    def _scale_factors(self):
        if self.op is Average:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _allreduce_grad_async(self, p):
        grad = p.grad
        if grad is None:                        # a parameter without a gradient this step still takes part
            array = np.zeros_like(p.data)
        else:
            array = grad.to_dense().data if getattr(grad, "is_sparse", False) else grad.data
        compressed, context = self.compression.compress(array)
        pre, post = self._scale_factors()
        handle = allreduce_async(compressed, name=self._names[id(p)], op=self.op, prescale_factor=pre,
                                 postscale_factor=post, process_set=self.process_set)
        return handle, context

    def _hook(self, p) -> None:
        key = id(p)
        pending = self._handles.get(key)
        if pending is not None and pending[1] is not None and self._delay[key] <= 0:
            raise RuntimeError("Gradients were computed more than backward_passes_per_step times before call to "
                               "step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self._delay[key] -= 1
        handle, context = None, None
        if self._delay[key] == 0:
            handle, context = self._allreduce_grad_async(p)
        self._handles[key] = (p, handle, context)

    # -- synchronize and step ------------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every gradient's allreduce (submitting those not submitted yet) and write them into ``.grad``."""
        for p in self._params:
            key = id(p)
            _p, handle, _context = self._handles.get(key, (p, None, None))
            if handle is None:
                self._handles[key] = (p, *self._allreduce_grad_async(p))
        for key, (p, handle, context) in list(self._handles.items()):
            output = self.compression.decompress(synchronize(handle), context)
            self._delay[key] = self.backward_passes_per_step
            if p.grad is None or getattr(p.grad, "is_sparse", False):
                p.grad = Tensor(output.copy())  # on the gradient's device
            else:
                p.grad.data[...] = output.reshape(p.grad.data.shape)
        self._handles.clear()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside this context does not synchronize (call :meth:`synchronize` yourself before it)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Synchronize (unless inside :meth:`skip_synchronize`), then step the wrapped optimizer."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                              "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                              "your code.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients; refused between backward and step (an allreduce may still be writing them)."""
        if self._handles:
            raise RuntimeError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                               "or optimizer.synchronize(). This is prohibited as it can cause a race condition.")
        self.optimizer.zero_grad(set_to_none)

    def remove_hooks(self) -> None:
        """Unregister the gradient hooks (the parameters can then be used without this optimizer)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
