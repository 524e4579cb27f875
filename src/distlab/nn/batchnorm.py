"""BatchNorm1d and SyncBatchNorm (mirror torch/nn/modules/batchnorm.py and torch/nn/modules/_functions.py).

``BatchNorm1d`` normalises each channel of a (N, C) or (N, C, L) batch with the batch's mean and biased variance,
then scales and shifts it (``weight``, ``bias``), and keeps running estimates (``running_mean``,
``running_var`` with the unbiased variance, ``num_batches_tracked``) that eval mode normalises with.

``SyncBatchNorm`` does the same with the statistics of the *global* batch: in forward one allreduce of
``(sum x, sum x*x, count)`` per channel, in backward one of ``(sum dy, sum dy*xhat)``, so data-parallel training
behaves as if one process had seen every rank's batch. Each layer talks over a communicator of its own
(duplicated from ``process_group`` at construction), so its collectives never interleave with DDP's.

SyncBatchNorm is a Joinable, which PyTorch's is not (there, uneven inputs with SyncBatchNorm hang). A rank that ran
out of inputs contributes zero counts: its hook posts, without waiting, one forward and one backward allreduce of
zeros before each of Join's counts (a ``pre_hook``: they must already be in flight while DDP's join hook waits
for the buckets that the others' backward issues after this layer's). The ranks still training therefore
normalise with the statistics of the batches actually seen. Put every SyncBatchNorm layer in the Join, after
DDP: ``Join([ddp_model, *SyncBatchNorm.layers_in(ddp_model), zero])``.

Numerics: the statistics travel as float64 sums whatever the input dtype, and the variance is
``sum(x*x)/n - mean**2``, which loses about ``1e-16 * (mean/std)**2`` of relative precision (negligible unless
a channel's mean is some 1e5 times its spread); torch allgathers per-rank (mean, invstd, count) instead, exact for
any mean, at the cost of an allgather of world_size x (2C+1) values instead of an allreduce of 2C+1. The kernel
is in ``distlab.nn._batchnorm_function``.

Assumptions of the shadowing (as DDP's join hook assumes the same buckets every iteration): in training mode each
iteration runs one forward and one backward through every SyncBatchNorm layer.
"""
from __future__ import annotations

import numpy as np

from .. import _backend
from .._common.join import HostJoinable, Joinable, JoinHook
from ..autograd._array import array_module
from ..autograd.tensor import Tensor
from ._batchnorm_function import BatchNormFunction, StatsPlan
from .module import Module
from .parameter import Parameter

__all__ = ["BatchNorm1d", "SyncBatchNorm"]


class _BatchNorm(Module):
    """Parameters, buffers and the running-statistics update shared by BatchNorm1d and SyncBatchNorm."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum=0.1, affine: bool = True,
                 track_running_stats: bool = True, dtype=np.float32):
        super().__init__()
        if num_features <= 0:
            raise ValueError(f"num_features must be positive, got {num_features}")
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        if affine:
            self.weight = Parameter(np.ones(num_features, dtype=dtype))
            self.bias = Parameter(np.zeros(num_features, dtype=dtype))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if track_running_stats:  # Tensors, updated in place: DDP broadcasts the very arrays it listed
            self.register_buffer("running_mean", Tensor(np.zeros(num_features, dtype=dtype)))
            self.register_buffer("running_var", Tensor(np.ones(num_features, dtype=dtype)))
            self.register_buffer("num_batches_tracked", Tensor(np.zeros((), dtype=np.int64)))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            self.running_mean.data[...] = 0
            self.running_var.data[...] = 1
            self.num_batches_tracked.data[...] = 0

    def _check_input(self, x) -> None:
        if x.ndim < 2 or x.shape[1] != self.num_features:
            raise ValueError(f"{type(self).__name__}({self.num_features}) expects input of shape "
                             f"(N, {self.num_features}, ...), got {tuple(x.shape)}")

    def _normalise(self, x, reduce=None):
        """The batch_norm call of torch's ``_BatchNorm.forward``: which statistics, and the running update."""
        use_batch_stats = self.training or not self.track_running_stats
        plan = StatsPlan(use_batch_stats, self.eps, reduce,
                         None if use_batch_stats else self.running_mean.data,
                         None if use_batch_stats else self.running_var.data)
        out = BatchNormFunction.apply(x, self.weight, self.bias, plan)
        if self.training and self.track_running_stats:
            self._update_running_stats(plan)
        return out

    def _update_running_stats(self, plan: StatsPlan) -> None:
        """``running = (1 - f) * running + f * batch``, ``f`` = momentum, or 1/batches seen if momentum is None."""
        self.num_batches_tracked.data += 1
        factor = 1.0 / float(self.num_batches_tracked.data) if self.momentum is None else self.momentum
        unbiased = plan.var * plan.count / (plan.count - 1)
        for buffer, batch in ((self.running_mean, plan.mean), (self.running_var, unbiased)):
            buffer.data[...] = (1 - factor) * buffer.data + factor * batch

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"track_running_stats={self.track_running_stats}")


class BatchNorm1d(_BatchNorm):
    """Batch normalisation over (N, C) or (N, C, L) inputs (``torch.nn.BatchNorm1d``).

    Parameters
    ----------
    num_features : int
        C, the number of channels.
    eps : float
        Added to the variance before its square root.
    momentum : float or None
        Weight of the current batch in the running statistics; None: a cumulative average.
    affine : bool
        Learn ``weight`` (init 1) and ``bias`` (init 0).
    track_running_stats : bool
        Keep ``running_mean``/``running_var``/``num_batches_tracked`` and use them in eval mode (else batch
        statistics are used in both modes).
    dtype : numpy dtype
        Of the parameters and running statistics (float32).
    """

    def forward(self, x):
        if x.ndim not in (2, 3):
            raise ValueError(f"BatchNorm1d expected 2D or 3D input (got {x.ndim}D input)")
        self._check_input(x)
        return self._normalise(x)


class _SyncBatchNormJoinHook(JoinHook):
    """Shadows one iteration of a SyncBatchNorm layer with zero counts (nothing to wait for: see pre_hook)."""

    def __init__(self, layer: "SyncBatchNorm"):
        self.layer = layer
        self._posted: list = []

    def pre_hook(self) -> None:
        """Complete the previous shadow, then post this iteration's forward and backward allreduces of zeros."""
        self._complete()
        if self.layer.training:
            channels = self.layer.num_features
            self._posted = [self.layer._allreduce(np.zeros(2 * channels + 1), "forward", async_op=True),
                            self.layer._allreduce(np.zeros(2 * channels), "backward", async_op=True)]

    def post_hook(self, is_last_joiner: bool) -> None:
        """Complete the shadow every rank posted before the final count; adopt the last joiner's running stats."""
        self._complete()
        self.layer._sync_running_stats(is_last_joiner)

    def _complete(self) -> None:
        for work in self._posted:
            work.wait()
        self._posted = []


class SyncBatchNorm(_BatchNorm, HostJoinable):
    """Batch normalisation with statistics over every rank's batch (``torch.nn.SyncBatchNorm``); a Joinable.

    Parameters are those of :class:`BatchNorm1d`, plus
    ``process_group`` (:class:`distlab.comm.ProcessGroup`, default the world group): the ranks whose batches
    are normalised together. Construction is collective (every rank builds the same layers in the same order).
    Inputs are (N, C, ...) with any number of trailing axes.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum=0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group=None, dtype=np.float32):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, dtype)
        from .. import comm  # here, not at the top: importing distlab.nn starts no MPI

        Joinable.__init__(self)
        self.process_group = process_group if process_group is not None else comm.world()
        self._join = _backend.load("join").Join
        # A communicator of its own: the statistics allreduces of a training rank run in the middle of DDP's
        # backward, so on a shared communicator a joined rank could not reproduce their order.
        # DISTLAB_DEBUG=DETAIL checks each collective's fingerprint with a blocking allgather before posting it;
        # that would make a joined rank's pre_hook wait for the training ranks, which are waiting for DDP's
        # collectives that this rank issues after it. The per-layer group therefore stays unchecked.
        self._stats_group = comm.ProcessGroup(self.process_group.comm, timeout=self.process_group.timeout,
                                              name=f"{self.process_group.name}: SyncBatchNorm",
                                              fingerprint_checks=False)

    def forward(self, x):
        self._check_input(x)
        if not self.training:
            return self._normalise(x)
        self._join.notify_join_context(self)
        return self._normalise(x, self._allreduce)

    def _allreduce(self, vector, phase: str, async_op: bool = False):
        """Sum ``vector`` (float64) over the ranks in place; ``phase`` names it in traces and timeouts."""
        vector = array_module(vector).ascontiguousarray(vector, dtype=np.float64)  # on the statistics' device
        work = self._stats_group.allreduce(vector, async_op=async_op, name=f"SyncBatchNorm {phase} statistics")
        return work if async_op else vector

    def _sync_running_stats(self, is_last_joiner: bool) -> None:
        """Every rank takes the running statistics of the highest last joiner (joined ranks' are stale)."""
        if not self.track_running_stats:
            return
        group = self._stats_group
        chosen = np.array([group.rank if is_last_joiner else -1], dtype=np.int64)
        group.allreduce(chosen, op="max", name="SyncBatchNorm: last joiner")
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            group.broadcast(getattr(self, name).data, src=int(chosen[0]), name=f"SyncBatchNorm {name}")

    def join_hook(self, **kwargs) -> _SyncBatchNormJoinHook:
        """Zero-count shadows of this layer's forward and backward allreduces (see the module docstring)."""
        return _SyncBatchNormJoinHook(self)

    @classmethod
    def layers_in(cls, module) -> list:
        """Every SyncBatchNorm inside ``module`` (a DDP model too), in module order: list them in the Join."""
        inner = getattr(module, "module", module)
        return [m for m in inner.modules() if isinstance(m, cls)]

    @classmethod
    def convert_sync_batchnorm(cls, module, process_group=None):
        """Return ``module`` with every BatchNorm1d replaced by a SyncBatchNorm holding its parameters and buffers.

        A BatchNorm1d passed directly comes back converted; otherwise ``module`` is changed in place and
        returned (as torch). Collective: call it on every rank, on the same model.
        """
        if isinstance(module, BatchNorm1d):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group,
                            dtype=module.weight.dtype if module.affine else np.float32)
            if module.affine:
                converted.weight, converted.bias = module.weight, module.bias
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                if getattr(module, name) is not None:
                    getattr(converted, name).data = getattr(module, name).data
            converted.train(module.training)
            return converted
        for name, child in list(module.named_children()):
            replaced = cls.convert_sync_batchnorm(child, process_group)
            if replaced is not child:
                module.add_module(name, replaced)
        return module
