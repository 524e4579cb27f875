"""PowerSGD gradient compression as a DDP communication hook (``ddp_comm_hooks.powerSGD_hook``).

Mirrors torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py (Vogels et al., "PowerSGD: Practical
Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019). Each gradient matrix M (a layer's
weight gradient, viewed as rows x the rest) is sent as two thin matrices: P = M Q (allreduced), orthogonalised,
then Q = M^T P (allreduced, averaged), and every rank rebuilds M ~ P Q^T. Vectors (biases) and matrices that
would not shrink by ``min_compression_rate`` are allreduced as they are. What compression loses is kept per
bucket (error feedback) and added to the next step's gradients; Q is kept too (warm start), so the one power
iteration per step refines last step's subspace. The public names are re-exported by
:mod:`distlab.ddp_comm_hooks`.

Where distlab differs from the anchor, and why:

- **Collective order (G1).** torch chains the P and Q allreduces with ``Future.then`` and blocks inside the
  callbacks; a callback runs when its allreduce completes, which is a different moment on every rank. distlab's
  collectives must be issued in the same order on every rank, so the Q stage runs at a fixed point: when the
  first bucket's future is waited for (the reducer's ``finalize_backward``, Join's shadow), the Qs of every
  bucket launched are computed and sent in launch order, then each bucket is finished as it is waited for.
  Sending each Q at the next bucket's launch instead (waiting there for the previous P) overlaps the Qs with
  backward but makes every launch wait for the slower rank: measured slower on a loaded machine
  (``bench_powersgd --variants``; the reducer's page has the figures).
  Per bucket the order is: [uncompressed | P] in one allreduce, then Q. torch sends the uncompressed tensors
  and P in two allreduces; one saves a round trip per bucket, with the same sums.
- **Join.** A rank that has joined shadows the others' buckets with zeros (:class:`~distlab.join.Join`); the hook
  then contributes exact zeros and leaves its error memory alone. torch adds the joined rank's stale error to the
  zeros and keeps feeding back minus the others' average.
- **A zero column** with ``orthogonalization_epsilon=0`` stays zero (the anchor's documented intent; its code
  divides by zero and fills the column, and then the gradients, with NaN). An error is logged once.
- **batched_powerSGD_hook** of torch 2.13 passes a 2-D matrix to its batched orthogonalisation and fails its
  first compressed step (an AssertionError); distlab orthogonalises it as a batch of one, as intended.
- Same-shape matrices lying at a constant stride in a bucket (the weights of layers of one size) are multiplied
  as one strided batch (one numpy call, as torch's ``batch_tensors_with_same_shape`` without the copy).
"""
from __future__ import annotations

import collections
import logging
import math

import numpy as np

from ..futures import Future
from ._powersgd_matrices import _Layout, _orthogonalize, _strided, _xp
from .default_hooks import _group, allreduce_hook

__all__ = ["PowerSGDState", "powerSGD_hook", "batched_powerSGD_hook"]

log = logging.getLogger("distlab.ddp_comm_hooks")

_TORCH_SLOTS = ("process_group", "matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate",
                "orthogonalization_epsilon", "use_error_feedback", "warm_start", "batch_tensors_with_same_shape",
                "rng", "error_dict", "p_memory_dict", "q_memory_dict", "iter", "total_numel_before_compression",
                "total_numel_after_compression", "compression_stats_logging_frequency", "next_stats_report")


def _report_compression_stats(bucket, state):
    """Log the compression stats every ``compression_stats_logging_frequency`` iterations (at the last bucket)."""
    if bucket.is_last() and state.iter >= state.next_stats_report:
        rate, before, after = state.compression_stats()
        log.info("Compression stats: iter %s, total before compression %s, total after compression %s, rate %s",
                 state.iter, before, after, rate)
        state.next_stats_report = state.iter + state.compression_stats_logging_frequency


class PowerSGDState:
    """PowerSGD's hyperparameters and its state for every bucket (mirrors torch's ``PowerSGDState``).

    Parameters
    ----------
    process_group : distlab.comm.ProcessGroup or None
        The group to reduce over (None: the world).
    matrix_approximation_rank : int
        The rank r of P (rows x r) and Q (columns x r): lower compresses more. Start at 1, double until the
        accuracy suffices; 1-4 is typical.
    start_powerSGD_iter : int
        Plain averaging allreduce for the first iterations, PowerSGD from this one on (the early steps are
        sensitive to inexact gradients, and DDP rebuilds its buckets after iteration 1). At least 2 with error
        feedback or warm start.
    min_compression_rate : float
        A matrix is compressed only if (rows + cols) * r * min_compression_rate < rows * cols; the rest (every
        vector) is allreduced as it is.
    use_error_feedback : bool
        Keep what compression lost, per bucket, and add it to the next step's gradients.
    warm_start : bool
        Keep Q from the last step (one power iteration per step refines it) instead of drawing it anew.
    orthogonalization_epsilon : float
        Added to each column's norm in Gram-Schmidt (against a zero column).
    random_seed : int
        Seeds the generator of Q's seeds: the same on every rank, a different Q at every draw.
    compression_stats_logging_frequency : int
        Log :meth:`compression_stats` every this many iterations.
    batch_tensors_with_same_shape : bool
        Accepted for torch's signature; distlab always multiplies same-shape matrices at a constant stride as
        one strided batch, without copying them.
    """

    __slots__ = _TORCH_SLOTS + ("_layouts", "_flights", "_sends", "_padded", "_q_at_launch")

    def __init__(self, process_group, matrix_approximation_rank=1, start_powerSGD_iter=1_000,
                 min_compression_rate=2, use_error_feedback=True, warm_start=True, orthogonalization_epsilon=0,
                 random_seed=0, compression_stats_logging_frequency=10_000, batch_tensors_with_same_shape=False):
        if isinstance(matrix_approximation_rank, bool) or not isinstance(matrix_approximation_rank, int) \
                or matrix_approximation_rank < 1:
            raise ValueError(f"matrix_approximation_rank must be an int >= 1, got {matrix_approximation_rank!r}")
        if isinstance(start_powerSGD_iter, bool) or not isinstance(start_powerSGD_iter, int):
            raise ValueError(f"start_powerSGD_iter must be an int, got {start_powerSGD_iter!r}")
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError("Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is enabled, "
                             "because PowerSGD can only be applied after the first two iterations in DDP.")
        if not min_compression_rate >= 0:
            raise ValueError(f"min_compression_rate must be >= 0, got {min_compression_rate!r}")
        if not orthogonalization_epsilon >= 0:
            raise ValueError(f"orthogonalization_epsilon must be >= 0, got {orthogonalization_epsilon!r}")
        log.info("PowerSGD config: matrix_approximation_rank = %s; start_powerSGD_iter = %s; "
                 "min_compression_rate = %s; orthogonalization_epsilon = %s; use_error_feedback = %s; "
                 "warm_start = %s; random_seed = %s; compression_stats_logging_frequency = %s",
                 matrix_approximation_rank, start_powerSGD_iter, min_compression_rate, orthogonalization_epsilon,
                 use_error_feedback, warm_start, random_seed, compression_stats_logging_frequency)
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.use_error_feedback = bool(use_error_feedback)
        self.warm_start = bool(warm_start)
        self.batch_tensors_with_same_shape = bool(batch_tensors_with_same_shape)
        # Draws the seed of each new Q, in the same order on every rank (as the anchor, a numpy RandomState).
        self.rng = np.random.RandomState(random_seed)
        self.error_dict: dict = {}  # bucket index -> the local error of the last step (flat, like the bucket)
        self.p_memory_dict: dict = {}  # bucket index -> every P of the bucket, flat
        self.q_memory_dict: dict = {}  # bucket index -> every Q of the bucket, flat
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.compression_stats_logging_frequency = max(1, compression_stats_logging_frequency)
        self.next_stats_report = 0
        self._reset_private()

    def _reset_private(self):
        self._layouts = {}  # bucket index -> _Layout (which tensors are compressed, where P and Q live)
        self._flights = collections.deque()  # buckets whose P is on the wire and whose Q is not yet sent
        self._sends = {}  # bucket index -> the flat [uncompressed | P] buffer allreduced together
        self._padded = {}  # batched hook: bucket index -> the bucket padded to a square
        # When a bucket's Q is sent: once backward is over, at the first wait (default), or at the next bucket's
        # launch, waiting there for its P (see the module docstring; bench_powersgd --variants measures both)
        self._q_at_launch = False

    def __getstate__(self):
        """The state without its process group (which cannot be pickled), as the anchor."""
        log.warning("NOTE: Process group is not serializable and excluded from a saved state.")
        return {slot: getattr(self, slot) for slot in _TORCH_SLOTS if slot != "process_group"}

    def __setstate__(self, state):
        """Restore a pickled state; the process group becomes the world's (None)."""
        self.process_group = None
        for slot, value in state.items():
            setattr(self, slot, value)
        self._reset_private()

    def maybe_increase_iter(self, bucket):
        """Count an iteration when its last bucket is processed."""
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_powerSGD_iter:
                log.info("Start to apply PowerSGD after %s iterations.", self.iter)

    def compression_stats(self):
        """(compression rate, elements before compression, elements after) accumulated so far."""
        rate = (self.total_numel_before_compression / self.total_numel_after_compression
                if self.total_numel_after_compression > 0 else 0)
        return rate, self.total_numel_before_compression, self.total_numel_after_compression


# -- one bucket in flight ---------------------------------------------------------------------------------------
class _Flight:
    """One bucket from its P allreduce to its decompression (the anchor's future chain, as an object).

    ``source`` holds the matrices M (the error memory with the error added, or the bucket itself), ``target``
    receives the result (the bucket, or its padded copy), ``error`` is the memory updated at the end (None
    without error feedback, or on a joined rank).
    """

    __slots__ = ("state", "group", "bucket", "layout", "source", "target", "error", "send", "p_mem", "q_mem",
                 "epsilon", "work_p", "work_q", "finish_copy")

    def __init__(self, state, group, bucket, layout, source, target, error, send, epsilon, finish_copy=None):
        self.state, self.group, self.bucket, self.layout = state, group, bucket, layout
        self.source, self.target, self.error, self.send, self.epsilon = source, target, error, send, epsilon
        b = bucket.index()
        self.p_mem, self.q_mem = state.p_memory_dict[b], state.q_memory_dict[b]
        self.work_p = self.work_q = None
        self.finish_copy = finish_copy

    def _matrices(self, xp, base, run):
        offset, stride, count, rows, cols, r, p_off, q_off = run
        return (_strided(xp, base, offset, stride, count, (rows, cols)),
                self.p_mem[p_off:p_off + count * rows * r].reshape(count, rows, r),
                self.q_mem[q_off:q_off + count * cols * r].reshape(count, cols, r))

    def launch(self):
        """P = M Q for every matrix; gather the uncompressed tensors; allreduce [uncompressed | P] (one call)."""
        xp = _xp(self.source)
        for run in self.layout.runs:
            m, p, q = self._matrices(xp, self.source, run)
            xp.matmul(m, q, out=p)
        for offset, stride, count, length, u_off in self.layout.plain:
            self.send[u_off:u_off + count * length].reshape(count, length)[...] = \
                _strided(xp, self.source, offset, stride, count, (length,))
        self.work_p = self.group.allreduce(self.send, async_op=True, name=f"bucket{self.bucket.index()} powerSGD P")

    def send_q(self, timeout=None):
        """P is summed: unpack the averaged uncompressed tensors, orthogonalise P, Q = M^T P, allreduce Q."""
        self.work_p.wait(timeout)
        xp = _xp(self.source)
        layout, size = self.layout, self.group.size
        if layout.u_total:
            plain = self.send[:layout.u_total]
            plain /= size
            for offset, stride, count, length, u_off in layout.plain:
                _strided(xp, self.target, offset, stride, count, (length,))[...] = \
                    plain[u_off:u_off + count * length].reshape(count, length)
        for run in layout.runs:
            m, p, q = self._matrices(xp, self.source, run)
            _orthogonalize(p, self.epsilon)  # P is a sum, not an average: orthogonalisation does not mind
            xp.matmul(m.transpose(0, 2, 1), p, out=q)
        if layout.q_total:
            self.work_q = self.group.allreduce(self.q_mem, async_op=True,
                                               name=f"bucket{self.bucket.index()} powerSGD Q")

    def finish(self, timeout=None):
        """Q is summed: average it, M ~ P Q^T into the target, keep the error; returns the reduced buffer."""
        state, xp = self.state, _xp(self.source)
        if self.work_q is not None:
            self.work_q.wait(timeout)
            self.q_mem /= self.group.size
        for run in self.layout.runs:
            _, p, q = self._matrices(xp, self.source, run)
            offset, stride, count, rows, cols, r = run[:6]
            out = _strided(xp, self.target, offset, stride, count, (rows, cols))
            if r == 1:  # an outer product: one multiply per element (numpy's matmul takes 10x longer for it)
                xp.multiply(p, q.transpose(0, 2, 1), out=out)
            else:  # Q^T contiguous: numpy's matmul then calls BLAS (docs/measurements.md, "PowerSGD")
                xp.matmul(p, xp.ascontiguousarray(q.transpose(0, 2, 1)), out=out)
        if self.error is not None:
            xp.subtract(self.error, self.target, out=self.error)  # what compression lost, added next step
        if not state.warm_start:
            state.p_memory_dict.clear()
            state.q_memory_dict.clear()
        state.maybe_increase_iter(self.bucket)
        return self.finish_copy() if self.finish_copy is not None else self.target


def _send_pending_qs(state, timeout=None):
    """Run the Q stage of every bucket whose P is in flight, in launch order (G1: the same order everywhere)."""
    while state._flights:
        state._flights[0].send_q(timeout)
        state._flights.popleft()


def _start(state, flight):
    """Launch ``flight``'s P (and, with ``_q_at_launch``, send the previous buckets' Qs now); returns the future
    that sends the pending Qs and finishes the bucket when waited for."""
    flight.launch()
    if state._q_at_launch:
        _send_pending_qs(state)
    state._flights.append(flight)

    def drive(timeout):
        try:
            _send_pending_qs(state, timeout)
            future.set_result(flight.finish(timeout))
        except BaseException as exc:  # noqa: BLE001 - a timeout names the bucket's allreduce and missing ranks
            if not future.done():
                future.set_exception(exc)
            raise

    future = Future(driver=drive, description=f"powerSGD of bucket{flight.bucket.index()}")
    return future


def _memory(state, b, xp, dtype, p_total, q_total, u_total):
    """Make sure the bucket has its [uncompressed | P] send buffer and its Q memory; True when Q must be drawn
    anew (the first compressed step, or every step without warm start)."""
    q_mem = state.q_memory_dict.get(b)
    keep_q = state.warm_start and q_mem is not None and q_mem.size == q_total
    send = state._sends.get(b)
    if send is None or send.size != u_total + p_total:
        send = state._sends[b] = xp.empty(u_total + p_total, dtype=dtype)
    state.p_memory_dict[b] = send[u_total:]
    if not keep_q:
        state.q_memory_dict[b] = xp.empty(q_total, dtype=dtype)
    return not keep_q


def _draw_qs(state, q_mem, shapes):
    """Fill each Q (given as (count, cols, rank)) from a standard normal, seeded from ``state.rng`` (the same
    draws on every rank); drawn on the host in float32 as the anchor draws on the CPU."""
    rng = np.random.RandomState(state.rng.randint(1_000_000_000))
    offset = 0
    for shape in shapes:
        n = int(np.prod(shape))
        values = rng.standard_normal(n).astype(np.float32).astype(q_mem.dtype)
        q_mem[offset:offset + n] = values if isinstance(q_mem, np.ndarray) else _xp(q_mem).asarray(values)
        offset += n


def _error_feedback(state, b, buffer, xp, joined):
    """Add the last step's error to the gradients (into the error memory, which then holds M); None without."""
    if not state.use_error_feedback or joined:
        return None
    error = state.error_dict.get(b)
    if error is None or error.size != buffer.size:
        log.info("A zero tensor of length %s that represents local error is created.", buffer.size)
        error = state.error_dict[b] = xp.zeros_like(buffer)
    xp.add(error, buffer, out=error)
    return error


def _forget(state, b):
    """Drop bucket ``b``'s error, P and Q: DDP rebuilt its buckets and the old ones no longer fit."""
    for memory in (state.error_dict, state.p_memory_dict, state.q_memory_dict, state._sends):
        memory.pop(b, None)


def _begin(state, bucket):
    """(group, the bucket's buffer, the plain averaging allreduce's future before ``start_powerSGD_iter`` or
    None); refuses a bucket PowerSGD cannot compress."""
    group = _group(state.process_group, bucket)
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return group, buffer, allreduce_hook(group, bucket)
    if buffer.dtype.kind != "f":
        raise TypeError(f"powerSGD: bucket {bucket.index()} holds {buffer.dtype} gradients; PowerSGD compresses "
                        "floating-point gradients only")
    return group, buffer, None


def powerSGD_hook(state: PowerSGDState, bucket) -> Future:
    """Compress each gradient matrix of the bucket to rank ``state.matrix_approximation_rank`` (PowerSGD).

    Mirrors torch's ``powerSGD_hook``: plain averaging allreduce before ``state.start_powerSGD_iter``; then

    1. add the bucket's error from the last step (error feedback);
    2. split the gradients: matrices worth compressing (``min_compression_rate``) and the rest (vectors);
    3. Q from the last step (warm start), or drawn from a seeded normal; orthogonalise each Q;
    4. P = M Q for every matrix; allreduce [the uncompressed tensors | every P] at once;
    5. average the uncompressed tensors; orthogonalise each summed P; Q = M^T P; allreduce every Q; average it;
    6. M ~ P Q^T into the bucket, and keep M's loss (what was put in minus what came out) for the next step.

    Steps 5-6 run at fixed points (see the module docstring), so every rank issues the same collectives in the
    same order. Returns a future whose value is the bucket's buffer, reduced in place.
    """
    group, buffer, plain = _begin(state, bucket)
    if plain is not None:
        return plain
    xp, b = _xp(buffer), bucket.index()
    lengths = bucket.lengths()
    key = (len(lengths), buffer.size, tuple(lengths))
    layout = state._layouts.get(b)
    if layout is None or layout.key != key:  # first compressed step, or DDP rebuilt its buckets
        if layout is not None:  # what was kept for the old layout does not fit the new one
            _forget(state, b)
        layout = state._layouts[b] = _Layout(key, bucket.offsets(), lengths, bucket.sizes(),
                                             state.matrix_approximation_rank, state.min_compression_rate)
    state.total_numel_before_compression += layout.numel_before
    state.total_numel_after_compression += layout.numel_after
    _report_compression_stats(bucket, state)
    joined = bucket.is_shadow()
    error = _error_feedback(state, b, buffer, xp, joined)
    source = buffer if error is None else error
    if _memory(state, b, xp, buffer.dtype, layout.p_total, layout.q_total, layout.u_total):
        _draw_qs(state, state.q_memory_dict[b], [(run[2], run[4], run[5]) for run in layout.runs])
    q_mem = state.q_memory_dict[b]
    for run in layout.runs:
        count, cols, r, q_off = run[2], run[4], run[5], run[7]
        _orthogonalize(q_mem[q_off:q_off + count * cols * r].reshape(count, cols, r),
                       state.orthogonalization_epsilon)
    flight = _Flight(state, group, bucket, layout, source, buffer, error, state._sends[b],
                     state.orthogonalization_epsilon)
    return _start(state, flight)


def batched_powerSGD_hook(state: PowerSGDState, bucket) -> Future:
    """Compress the whole bucket as one square matrix (mirrors torch's ``batched_powerSGD_hook``).

    Faster than :func:`powerSGD_hook` (one matrix per bucket) but usually much less accurate unless the rank is
    1: the gradients are laid end to end, padded with zeros to a square, and that square is compressed as
    :func:`powerSGD_hook` compresses one matrix (Gram-Schmidt or QR without epsilon, as the anchor).
    """
    group, buffer, plain = _begin(state, bucket)
    if plain is not None:
        return plain
    xp, b = _xp(buffer), bucket.index()
    total = int(buffer.size)
    side = math.ceil(math.sqrt(total))
    rank = state.matrix_approximation_rank
    state.total_numel_before_compression += total
    state.total_numel_after_compression += side * rank * 2
    _report_compression_stats(bucket, state)
    padded = state._padded.get(b)
    if padded is None or padded.size != side * side:
        if padded is not None:
            _forget(state, b)
        padded = state._padded[b] = xp.zeros(side * side, dtype=buffer.dtype)
        state._layouts[b] = _Layout(("batched", side), [0], [side * side], [(side, side)], rank, 0)
    layout = state._layouts[b]
    padded[:total] = buffer
    padded[total:] = 0  # the last step's decompression wrote there
    joined = bucket.is_shadow()
    error = _error_feedback(state, b, padded, xp, joined)
    source = padded if error is None else error
    if _memory(state, b, xp, buffer.dtype, layout.p_total, layout.q_total, 0):
        _draw_qs(state, state.q_memory_dict[b], [(1, side, min(side, rank))])
    _orthogonalize(state.q_memory_dict[b].reshape(1, side, -1))

    def copy_back():
        buffer[...] = padded[:total]
        return buffer

    flight = _Flight(state, group, bucket, layout, source, padded, error, state._sends[b], 0, copy_back)
    return _start(state, flight)
