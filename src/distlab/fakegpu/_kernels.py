"""``cupy.ElementwiseKernel`` for the stand-in: the kernel's own body run on the host, counted as one launch.

The body is the one cupy compiles (distlab's kernels are written in the subset of C that
:class:`distlab.autograd._kernels.HostElementwiseKernel` runs with numpy), so the stand-in checks the very code a
GPU runs, and that it is one launch where the unfused code was several.
"""
from __future__ import annotations

from distlab.autograd._kernels import HostElementwiseKernel

from . import _transfers
from ._ndarray import unwrap, wrap

__all__ = ["ElementwiseKernel"]


class ElementwiseKernel(HostElementwiseKernel):
    """``cupy.ElementwiseKernel(in_params, out_params, operation, name)``: device arrays in and out, one launch a
    call; a host (numpy) array among the arguments is refused, as cupy refuses it."""

    def __call__(self, *args):
        host = HostElementwiseKernel.__call__(self, *unwrap(args, f"{self.name} argument"))
        _transfers.count_launch("elementwise")
        if len(args) > self.nin:  # the outputs were given: those very arrays, as cupy returns them
            return args[self.nin] if self.nout == 1 else tuple(args[self.nin:])
        return wrap(host)
