"""``cupy.ElementwiseKernel`` for the stand-in: the kernel's own body run on the host, counted as one launch; and
distlab's multi-tensor kernels (raw kernels on cupy), one counted launch per chunk of tensors.

The body is the one cupy compiles (distlab's kernels are written in the subset of C that
:class:`distlab.autograd._kernels.HostElementwiseKernel` runs with numpy), so the stand-in checks the very code a
GPU runs, and that it is one launch where the unfused code was several.
"""
from __future__ import annotations

from distlab.autograd._kernels import HostElementwiseKernel
from distlab.autograd._kernels import MultiTensorKernel as _MultiTensorKernel

from . import _transfers
from ._ndarray import unwrap, wrap

__all__ = ["ElementwiseKernel", "MultiTensorKernel"]


class ElementwiseKernel(HostElementwiseKernel):
    """``cupy.ElementwiseKernel(in_params, out_params, operation, name)``: device arrays in and out, one launch a
    call; a host (numpy) array among the arguments is refused, as cupy refuses it."""

    def __call__(self, *args):
        host = HostElementwiseKernel.__call__(self, *unwrap(args, f"{self.name} argument"))
        _transfers.count_launch("elementwise")
        if len(args) > self.nin:  # the outputs were given: those very arrays, as cupy returns them
            return args[self.nin] if self.nout == 1 else tuple(args[self.nin:])
        return wrap(host)


class MultiTensorKernel(_MultiTensorKernel):
    """distlab's multi-tensor kernel (one ``RawKernel`` launch per chunk of tensors on cupy): the body run on the
    host tensor by tensor, each chunk counted as the one launch it is on a GPU; host arrays are refused."""

    def _launch(self, args: list) -> None:
        _MultiTensorKernel._launch(self, [unwrap(a, f"{self.name} argument") for a in args])
        _transfers.count_launch("elementwise")
