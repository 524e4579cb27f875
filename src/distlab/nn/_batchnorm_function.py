"""The batch-normalisation kernel shared by BatchNorm1d and SyncBatchNorm: one autograd node per call.

Both layers run the same arithmetic; they differ only in *where the statistics come from*. A :class:`StatsPlan`
carries a ``reduce`` callable that turns this process's per-channel sums into the sums over the whole batch:
the identity for BatchNorm1d, an allreduce over the ranks for SyncBatchNorm. So SyncBatchNorm on R ranks computes
what BatchNorm1d computes on the R batches concatenated (up to the order of floating-point additions).

Numerics. The statistics travel as sums: forward ``(sum x, sum x*x, count)`` per channel, backward
``(sum dy, sum dy*xhat)``, accumulated in float64 whatever the input dtype. The variance is
``sum(x*x)/n - mean**2`` (biased, as torch normalises with; the running variance gets the unbiased ``n/(n-1)``
correction). One pass with a subtraction loses about ``eps64 * (mean/std)**2`` of relative precision
(``eps64`` ~ 1e-16): negligible unless a channel's mean is some 1e5 times its spread. torch's SyncBatchNorm
instead allgathers each rank's (mean, invstd, count) and combines them (Chan's parallel variance): exact for
any mean, at the cost of an allgather of world_size x (2C+1) values instead of an allreduce of 2C+1.
"""
from __future__ import annotations

import numpy as np

from ..autograd._array import array_module
from ..autograd.function import Function

__all__ = ["StatsPlan", "BatchNormFunction", "reduce_axes"]


def reduce_axes(ndim: int) -> tuple:
    """Every axis but the channel axis 1: (0,) for (N, C), (0, 2) for (N, C, L)."""
    return (0,) + tuple(range(2, ndim))


class StatsPlan:
    """How one call normalises, and what it found (read back by the module to update its running stats).

    Parameters
    ----------
    training : bool
        True: normalise with this batch's statistics (and run backward through them); False: with
        ``running_mean``/``running_var``.
    eps : float
    reduce : callable or None
        ``reduce(vector, phase)`` -> the vector summed over every process taking part (``phase`` is
        ``"forward"`` or ``"backward"``); None: this process alone.
    running_mean, running_var : ndarray, optional
        Used when not ``training``.
    """

    __slots__ = ("training", "eps", "reduce", "running_mean", "running_var", "mean", "var", "count")

    def __init__(self, training: bool, eps: float, reduce=None, running_mean=None, running_var=None):
        self.training, self.eps, self.reduce = training, eps, reduce
        self.running_mean, self.running_var = running_mean, running_var
        self.mean = self.var = None  # the batch's (float64), set by a training forward
        self.count = 0  # elements per channel over the whole batch

    def total(self, vector, phase: str):
        return vector if self.reduce is None else self.reduce(vector, phase)


class BatchNormFunction(Function):
    """``y = (x - mean) / sqrt(var + eps) * weight + bias`` per channel (axis 1); ``apply(x, weight, bias, plan)``.

    Backward (training), with ``xhat`` the normalised input and sums over the whole batch of ``n`` elements per
    channel (torch's ``batch_norm_backward_reduce`` + ``batch_norm_backward_elemt``)::

        dweight = sum(dy * xhat)      dbias = sum(dy)        (this process's share: DDP adds the shares)
        dx = weight / sqrt(var + eps) * (dy - sum(dy) / n - xhat * sum(dy * xhat) / n)
    """

    @staticmethod
    def forward(ctx, x, weight, bias, plan: StatsPlan):
        data = x.data
        xp = array_module(data)
        channels = data.shape[1]
        axes, shape = reduce_axes(data.ndim), (1, channels) + (1,) * (data.ndim - 2)
        x64 = data.astype(np.float64, copy=False)
        if plan.training:
            local = xp.concatenate([x64.sum(axis=axes), (x64 * x64).sum(axis=axes),
                                    xp.array([data.size // channels if channels else 0], dtype=np.float64)])
            totals = plan.total(local, "forward")
            count = float(totals[-1])
            if count <= 1:
                raise ValueError(f"Expected more than 1 value per channel when training, got input size "
                                 f"{tuple(data.shape)} ({int(count)} value(s) per channel over the whole batch)")
            mean = totals[:channels] / count
            var = xp.maximum(totals[channels:2 * channels] / count - mean * mean, 0.0)
            plan.mean, plan.var, plan.count = mean, var, int(count)
        else:
            mean = plan.running_mean.astype(np.float64)
            var = plan.running_var.astype(np.float64)
        invstd = 1.0 / xp.sqrt(var + plan.eps)
        xhat = (x64 - mean.reshape(shape)) * invstd.reshape(shape)
        w = None if weight is None else weight.data.astype(np.float64).reshape(shape)
        y = xhat if w is None else xhat * w
        if bias is not None:
            y = y + bias.data.astype(np.float64).reshape(shape)
        ctx.save_for_backward(xhat, invstd, w, plan, data.dtype, None if weight is None else weight.data.dtype)
        return y.astype(data.dtype)

    @staticmethod
    def backward(ctx, grad):
        xhat, invstd, w, plan, x_dtype, w_dtype = ctx.saved_tensors
        dy = grad.data.astype(np.float64, copy=False)
        axes, shape = reduce_axes(dy.ndim), (1, dy.shape[1]) + (1,) * (dy.ndim - 2)
        xp = array_module(dy)
        sum_dy, sum_dy_xhat = dy.sum(axis=axes), (dy * xhat).sum(axis=axes)
        scale = invstd.reshape(shape) if w is None else w * invstd.reshape(shape)
        if plan.training:
            totals = plan.total(xp.concatenate([sum_dy, sum_dy_xhat]), "backward")
            channels = sum_dy.shape[0]
            mean_dy = (totals[:channels] / plan.count).reshape(shape)
            mean_dy_xhat = (totals[channels:] / plan.count).reshape(shape)
            dx = scale * (dy - mean_dy - xhat * mean_dy_xhat)
        else:
            dx = scale * dy
        dweight = None if w is None else sum_dy_xhat.astype(w_dtype)
        dbias = None if w_dtype is None else sum_dy.astype(w_dtype)
        return dx.astype(x_dtype), dweight, dbias, None
