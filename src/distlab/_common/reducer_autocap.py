"""``bucket_cap_mb="auto"``: the reducer chooses its bucket size from what it measured (shared by both twins).

PyTorch has no such thing: its users tune ``bucket_cap_mb`` by hand. The trade-off it settles is the reducer's
central one. A bucket's allreduce can start only once its last gradient exists, so the last bucket's
communication always comes *after* backward and cannot be hidden: big buckets leave a long tail. Every bucket
pays a fixed cost (the collective's latency, the reducer's work per bucket), so many small buckets add up. Which
side wins depends on the link: across a 1 Gbit/s link the wire time of a 26 MB model is ten times its backward
pass and buckets of a few MB keep the wire busy from the first gradient on; on one host the allreduce is a
memory copy done by the same cores that compute backward, so overlapping it saves little and small buckets only
add latency.

**What is measured.** During the first synchronised iteration each gradient's arrival time (since the
iteration's first gradient) is recorded. At the one-time bucket rebuild that follows (``rebuild_buckets``),
three probes run on every rank (:func:`measure_link`): the latency of a tiny allreduce, the time of one allreduce
of a few MB alone (the bandwidth), and the same allreduce started while the rank computes as many matrix
products as fill that time alone, driving MPI between them as the reducer's hooks do (the *contention*: 0 when
the two overlap perfectly, as when a NIC or the kernel moves the bytes; 1 when they share one core and take
turns). On one node the probes use the shared-memory arena the buckets live in, whose reduction is the rank's
own work in its polls: the contention is 1 there by construction, and it is not probed. One ``allreduce(max)``
of everything makes every rank decide on the same numbers, so every rank picks the same caps.

**The cost model** (:func:`predict_end`). Backward delivers gradients at the recorded times; a bucket is ready
with its last gradient and its allreduce starts when it is ready and the previous bucket's is done (buckets go
strictly in order); an allreduce takes ``latency + bytes / bandwidth``. While backward and communication run
at the same time, each progresses at ``1 / (1 + contention)`` of its speed. The predicted cost of a bucket size
is the time from the first gradient until the last allreduce ends. :func:`choose_bucket_caps` evaluates the
candidate sizes; those within 3% of the best are ties, which the model cannot tell apart (it is only a model).
Where the wire takes longer than backward and can run beside it, the smallest tie of at least 1 MiB wins (an idle
wire lengthens the step for good, and a bucket more costs little); elsewhere the largest (fewer buckets). On one
host (contention 1) the largest tie is always the whole model, since every bucket more only adds its latency: the
choice there does not depend on what was measured, and the layout is the same in every run. The first bucket's
cap is ``min(1 MiB, cap)``, as the anchor's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .reducer_buckets import compute_bucket_assignment_by_size

__all__ = ["AUTO", "CANDIDATE_CAPS", "LinkModel", "AutoCapChoice", "predict_end", "choose_bucket_caps",
           "measure_link", "describe_auto_choice"]

MiB = 1024 * 1024
#: The value of ``bucket_cap_mb`` (and of the reducer's ``bucket_bytes_cap``) that asks for the choice.
AUTO = "auto"
#: Bucket sizes considered, in bytes.
CANDIDATE_CAPS = tuple(int(m * MiB) for m in (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1, 2, 4, 8, 16, 25, 32, 64))
FIRST_BUCKET_CAP = 1 * MiB
#: A cost within this fraction of the best counts as a tie (broken by ``_break_tie``).
TIE = 0.03
#: The bandwidth probe's size is the model's gradient bytes, clamped to this range.
PROBE_BYTES = (64 * 1024, 8 * MiB)
LATENCY_PROBE_ELEMENTS = 256


@dataclass(frozen=True)
class LinkModel:
    """What the cost model knows of the group's allreduce.

    Attributes
    ----------
    latency : float
        Seconds of fixed cost per allreduce.
    bandwidth : float
        Bytes per second of one allreduce running alone.
    contention : float
        In [0, 1]: how much backward and a concurrent allreduce slow each other (0: not at all).
    """

    latency: float
    bandwidth: float
    contention: float


@dataclass(frozen=True)
class AutoCapChoice:
    """The caps chosen, and why: the predicted cost of every candidate and the measurements behind them."""

    first_cap: int
    cap: int
    predicted: dict  # cap (bytes) -> predicted seconds from the first gradient to the last allreduce's end
    backward: float
    model: LinkModel

    def as_dict(self) -> dict:
        return {"first_cap_bytes": self.first_cap, "cap_bytes": self.cap, "backward_s": self.backward,
                "latency_s": self.model.latency, "bandwidth_Bps": self.model.bandwidth,
                "contention": self.model.contention,
                "predicted_s": {str(cap): seconds for cap, seconds in self.predicted.items()}}


def predict_end(bucket_bytes, bucket_ready, model: LinkModel) -> float:
    """Seconds from the first gradient until the last bucket's allreduce ends (the cost model above).

    Parameters
    ----------
    bucket_bytes : sequence of int
        Each bucket's bytes, in reduction order.
    bucket_ready : sequence of float
        When each bucket's last gradient arrives, in seconds of backward computation since the first gradient
        (nondecreasing: buckets are filled in arrival order). The last is the backward pass's length.
    model : LinkModel
    """
    backward = max(bucket_ready) if len(bucket_ready) else 0.0
    share = 1.0 / (1.0 + model.contention)
    now = computed = 0.0  # wall time; backward seconds done
    for nbytes, ready in zip(bucket_bytes, bucket_ready):
        work = model.latency + nbytes / model.bandwidth  # this allreduce's seconds, alone
        if computed < ready:  # wait for the bucket's last gradient; nothing is in flight meanwhile
            now += ready - computed
            computed = ready
        # The allreduce runs; backward (if not done) runs beside it at the shared speed until one of them ends.
        left = backward - computed
        if left > 0:
            together = min(work, left) / share  # wall time until the first of the two finishes
            now += together
            computed += together * share
            work -= together * share
        now += work  # the rest of the allreduce, alone
    return max(now, backward)


def _bucket_times(order, tensors, wire_bytes, arrivals, expect_sparse, first_cap, cap):
    """Each bucket's wire bytes and ready time, for the layout the rebuild would build with these caps."""
    buckets, _limits = compute_bucket_assignment_by_size([tensors[i] for i in order], [first_cap, cap],
                                                         expect_sparse, order)
    nbytes = [0 if expect_sparse is not None and expect_sparse[b[0]] else sum(int(wire_bytes[i]) for i in b)
              for b in buckets]
    ready = np.maximum.accumulate([max(float(arrivals[i]) for i in b) for b in buckets]).tolist()
    return nbytes, ready


def choose_bucket_caps(order, tensors, arrivals, model: LinkModel, expect_sparse=None,
                       wire_bytes=None) -> AutoCapChoice:
    """The caps of the candidate that the cost model predicts fastest (see the module docstring).

    Parameters
    ----------
    order : sequence of int
        Parameter indices in gradient arrival order (the order the rebuild buckets them in).
    tensors : sequence of Tensor or ndarray
        The parameters, by index (the layout is computed from them exactly as the rebuild does).
    arrivals : sequence of float
        Seconds from the iteration's first gradient to each parameter's, by parameter index.
    model : LinkModel
    expect_sparse : sequence of bool, optional
        Sparse parameters get buckets of their own, counted as latency only.
    wire_bytes : sequence of int, optional
        Bytes each parameter's gradient takes in its bucket (differs from the parameter's with a reduce dtype).
    """
    param_bytes = [int(getattr(t, "data", t).nbytes) for t in tensors]  # numpy or device arrays, never converted
    wire_bytes = param_bytes if wire_bytes is None else wire_bytes
    dense = [i for i in order if expect_sparse is None or not expect_sparse[i]]
    dense_total = max(sum(param_bytes[i] for i in dense), 1)  # caps count parameter bytes, as the rebuild's
    candidates = sorted({c for c in CANDIDATE_CAPS if c < dense_total} | {dense_total})
    predicted = {}
    for cap in candidates:
        nbytes, ready = _bucket_times(order, tensors, wire_bytes, arrivals, expect_sparse,
                                      min(FIRST_BUCKET_CAP, cap), cap)
        predicted[cap] = predict_end(nbytes, ready, model)
    best = min(predicted.values())
    ties = [c for c, seconds in predicted.items() if seconds <= best * (1 + TIE)]
    backward = float(max((float(arrivals[i]) for i in order), default=0.0))
    wire = sum(wire_bytes[i] for i in dense) / model.bandwidth
    # With full contention (one host) communication and backward take turns on the core: no wire stands idle.
    cap = _break_tie(ties, wire_bound=wire > backward and model.contention < 1.0)
    return AutoCapChoice(min(FIRST_BUCKET_CAP, cap), cap, predicted, backward, model)


def describe_auto_choice(choice: dict, buckets: int) -> str:
    """One line saying what "auto" chose and why (``choice`` is :meth:`AutoCapChoice.as_dict`); DDP logs it."""
    predicted = {int(cap): seconds for cap, seconds in choice["predicted_s"].items()}
    cap, whole = choice["cap_bytes"], max(predicted)
    against = "" if cap == whole else f" (the whole model in one bucket: {predicted[whole] * 1e3:.1f} ms)"
    return (f"bucket_cap_mb='auto' chose {cap / MiB:.3g} MiB, first bucket {choice['first_cap_bytes'] / MiB:.3g} "
            f"MiB, {buckets} buckets. Measured: backward {choice['backward_s'] * 1e3:.1f} ms, allreduce "
            f"{choice['bandwidth_Bps'] / 1e9:.3g} GB/s + {choice['latency_s'] * 1e6:.0f} us, contention "
            f"{choice['contention']:.2f}. Predicted: {predicted[cap] * 1e3:.1f} ms from the first gradient to the "
            f"last allreduce's end{against}. A number for bucket_cap_mb fixes the size.")


def _break_tie(ties, wire_bound: bool) -> int:
    """The cap to keep among candidates the model cannot tell apart.

    Where the wire takes longer than backward, every moment it stands idle lengthens the step for good, while a
    bucket more costs only its latency: keep the smallest tie of at least ``FIRST_BUCKET_CAP`` (smaller buckets
    add per-bucket work the latency probe does not see). Otherwise the cores backward needs do the reducer's
    per-bucket work too: keep the largest tie (fewer buckets).
    """
    if wire_bound:
        return min((c for c in ties if c >= FIRST_BUCKET_CAP), default=max(ties))
    return max(ties)


def measure_link(group, gradient_bytes: int, arrivals) -> tuple[LinkModel, np.ndarray]:
    """Probe the group's allreduce and agree on the measurements (every rank calls this at the same point).

    Returns the :class:`LinkModel` and ``arrivals`` with every value the maximum over ranks. The collectives
    issued (in order): a shared arena's set-up (one node only), 3 tiny allreduces, 2 allreduces of the probe
    size, one more started while computing (across nodes only: in an arena the contention is known), then one
    ``allreduce(max)`` of the measurements, all named ``auto bucket cap ...``.
    """
    specs = [(int(np.clip(gradient_bytes, *PROBE_BYTES)) // 4, np.float32), (LATENCY_PROBE_ELEMENTS, np.float32)]
    # Probe the path the buckets will take: in shared memory when the group's ranks share a node (the buckets are
    # placed there too, see distlab.comm.shared), else through MPI. ``placed`` keeps the arena alive.
    placed = group.shared_arrays(specs) if hasattr(group, "shared_arrays") else None
    probe, tiny = placed[1] if placed is not None else [np.zeros(count, dtype) for count, dtype in specs]
    latency = min(_timed(group, lambda: group.allreduce(tiny, name="auto bucket cap: latency")) for _ in range(3))
    alone = min(_timed(group, lambda: group.allreduce(probe, name="auto bucket cap: bandwidth")) for _ in range(2))
    compute_alone = together = 0.0
    if placed is None:
        compute_alone, together = _contention_probe(group, probe, alone)
    mine = np.concatenate([[latency, alone, compute_alone, together], np.nan_to_num(np.asarray(arrivals, float))])
    group.allreduce(mine, op="max", name="auto bucket cap: measurements")
    latency, alone, compute_alone, together = mine[:4]
    bandwidth = probe.nbytes / max(alone - latency, 1e-9)
    # In a shared-memory arena the reduction is this rank's own work, done on its thread in the polls between
    # backward's computations: it cannot run beside backward, so the contention is 1 by construction. Probed, it
    # read anything from 0.2 to 0.95 on one host (the ranks' memory-bound reductions run faster when they do not
    # coincide, which the probe takes for overlap), and auto then chose 4 MB where the whole model does best.
    contention = 1.0 if placed is not None else float(
        np.clip((together - max(alone, compute_alone)) / max(min(alone, compute_alone), 1e-9), 0.0, 1.0))
    return LinkModel(float(latency), float(bandwidth), contention), mine[4:]


def _contention_probe(group, probe, alone: float) -> tuple[float, float]:
    """Seconds of a fixed amount of layer-sized computation alone, and with an allreduce of ``probe`` beside it.

    A fixed amount of work, not a deadline: computing "for as long as the allreduce takes" would end on time
    however much of the core the allreduce took meanwhile, and the probe would see no contention where the
    allreduce is CPU work on the same core (one host: measured 0.12 that way).
    """
    products = _products_in(alone)
    compute_alone = _timed(group, lambda: _compute(products, None))

    def overlapped():
        work = group.allreduce(probe, async_op=True, name="auto bucket cap: contention")
        _compute(products, work)
        work.wait()

    return compute_alone, _timed(group, overlapped)


def _timed(group, fn) -> float:
    group.barrier(name="auto bucket cap: sync")
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


_A = np.full((32, 256), 0.5, dtype=np.float32)
_W = np.full((256, 256), 0.5, dtype=np.float32)


def _products_in(seconds: float) -> int:
    """How many of the layer-sized matrix products below fit in ``seconds`` on this rank (at least one)."""
    count, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end or count == 0:
        _A @ _W
        count += 1
    return count


def _compute(products: int, work) -> None:
    """``products`` matrix products like a layer's backward, testing ``work`` between them as the hooks do."""
    for _ in range(products):
        _A @ _W
        if work is not None:
            work.is_completed()
