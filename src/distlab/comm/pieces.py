"""Large allreduces across nodes, in pieces all in flight together.

Across a network link one large allreduce loses to the same bytes cut into pieces that are all started at once
(measured at 2.5 Gbit/s, 26 MB: 95.6 ms whole against 88.5 ms in 1 MiB pieces). MPI runs a large allreduce in
phases (with 2 ranks, MPICH's reduce-scatter then allgather): each rank sends half its buffer, reduces what it
received, then sends the reduced half back, so the link idles while the ranks reduce, and each direction of the
link idles during one phase. Pieces in flight together overlap one piece's reduction with the next one's
transfer, and the two phases of different pieces with each other. On one node the bytes move through shared
memory by the cores that reduce them, and pieces only add work: there an allreduce stays whole.

**The piece size** is chosen from the link, the way DDP's automatic bucket cap is
(:mod:`distlab._common.reducer_autocap`): the first time a group that spans nodes reduces at least
:data:`SPLIT_FROM_BYTES`, every rank times an allreduce of that size whole and in :data:`PROBE_PIECE` pieces
(best of 3 each), and one ``allreduce(max)`` makes every rank decide on the same numbers (the probe is
collective: every rank reaches it at the same allreduce, since an allreduce has the same size everywhere). The
whole one gives the bandwidth, the difference what each piece costs beyond it (its message and progress work;
at least :data:`MIN_OVERHEAD`, as pieces may come out faster). For ``N`` bytes in pieces of ``p``, the pieces
cost ``N / p * overhead`` and the pipeline fills and drains with one piece on the wire, ``p / bandwidth``; the
sum is least at ``p = sqrt(N * overhead * bandwidth)``, rounded to a power of two within :data:`PIECE_BYTES`. An
allreduce less than twice its piece stays whole. (A tiny allreduce's latency, what the bucket cap's model
charges per bucket, is no measure of a piece's cost: pieces in flight together do not wait for each other's
round trips. Measured on the virtual cluster it read 0.01 ms at 2.5 Gbit/s and 1.5 ms at 1 Gbit/s, while a piece
cost about 0.4 ms and nothing.)

``DISTLAB_ALLREDUCE_PIECES`` = ``auto`` (default), ``off`` (never split), or a piece size in MiB (no probe). Each
piece is its own nonblocking allreduce of a slice of the array, reduced element by element exactly as the whole
one is: the result is the same bits.
"""
from __future__ import annotations

import math
import os
import time

import numpy as np
from mpi4py import MPI

__all__ = ["PIECES_VAR", "SPLIT_FROM_BYTES", "PIECE_BYTES", "PROBE_PIECE", "MIN_OVERHEAD", "piece_bytes", "choose_piece", "PieceRequest",
           "start_pieces"]

PIECES_VAR = "DISTLAB_ALLREDUCE_PIECES"
MiB = 1 << 20
#: Allreduces from this size on, in a group across nodes, are considered for splitting (and the first one probes).
SPLIT_FROM_BYTES = 2 * MiB
#: The smallest and largest piece the link may choose.
PIECE_BYTES = (256 << 10, 16 * MiB)
#: The probe's pieces, and the least cost per piece it may conclude (pieces that came out faster than whole).
PROBE_PIECE = 128 << 10
MIN_OVERHEAD = 1e-5
_PROBING = "probing"


def piece_bytes(group, nbytes: int) -> int:
    """The piece size for an allreduce of ``nbytes`` in ``group``, or 0 to leave it whole.

    Collective the first time it is asked for a group spanning nodes (see the module docstring); the same answer
    on every rank.
    """
    link = group.__dict__.get("_link")
    if link is None:
        group._link = _PROBING  # the probe's own allreduces stay whole
        try:
            link = group._link = _link_for(group)
        except BaseException:
            group._link = None  # a bad setting is refused again next time
            raise
    if link is _PROBING or link is False:
        return 0
    if isinstance(link, int):
        piece = link
    else:
        piece = choose_piece(nbytes, *link)
    return piece if 2 * piece <= nbytes else 0


def choose_piece(nbytes: int, overhead: float, bandwidth: float) -> int:
    """``sqrt(nbytes * overhead * bandwidth)`` as a power of two within :data:`PIECE_BYTES`."""
    best = math.sqrt(max(nbytes * overhead * bandwidth, 1.0))
    return int(np.clip(2 ** round(math.log2(best)), *PIECE_BYTES))


def _link_for(group):
    """False (never split), a fixed piece in bytes, or the probed ``(overhead per piece, bandwidth)``."""
    setting = os.environ.get(PIECES_VAR, "auto").strip().lower() or "auto"
    if setting in ("off", "0"):
        return False
    if setting != "auto":
        try:
            mib = float(setting)
        except ValueError:
            mib = -1.0
        if not mib > 0:
            raise ValueError(f"{PIECES_VAR}={setting!r}: expected auto, off, or a piece size in MiB")
        return int(mib * MiB)
    if group.size < 2 or len(set(group.node_keys.tolist())) < 2:
        return False  # one node: shared memory is faster whole
    return _probe(group)


def _probe(group) -> tuple[float, float]:
    """Seconds each piece adds, and the bandwidth (bytes/s): a :data:`SPLIT_FROM_BYTES` allreduce whole and in
    :data:`PROBE_PIECE` pieces, best of 3 each, the worst over ranks."""
    probe = np.zeros(SPLIT_FROM_BYTES // 4, dtype=np.float32)

    def timed(what: str) -> float:
        group.barrier(name=f"allreduce pieces: {what}")
        start = time.perf_counter()
        group.allreduce(probe, name=f"allreduce pieces: {what}")
        return time.perf_counter() - start

    whole = min(timed("whole") for _ in range(3))  # _link is _PROBING here: whole
    group._link = PROBE_PIECE
    try:
        split = min(timed("in pieces") for _ in range(3))
    finally:
        group._link = _PROBING
    measured = np.array([whole, split])
    group.allreduce(measured, op="max", name="allreduce pieces: measurements")
    whole, split = (float(x) for x in measured)
    count = probe.nbytes // PROBE_PIECE
    return max((split - whole) / (count - 1), MIN_OVERHEAD), probe.nbytes / whole


class PieceRequest:
    """The requests of an allreduce's pieces, tested together (a request to :class:`~distlab.comm.Work`)."""

    __slots__ = ("requests",)

    def __init__(self, requests):
        self.requests = requests

    def Test(self) -> bool:  # noqa: N802 - mirrors mpi4py's Request.Test
        return MPI.Request.Testall(self.requests)


def start_pieces(comm, buf, piece: int, mpi_op, bits=None) -> PieceRequest:
    """Start one in-place ``Iallreduce`` per ``piece`` bytes of the flat ``buf`` (``bits``: the MPI type its
    elements travel as, for bfloat16 as uint16); returns their :class:`PieceRequest`."""
    flat = buf.reshape(-1)
    if bits is not None:
        flat = flat.view(np.uint16)
    step = max(piece // flat.itemsize, 1)
    requests = []
    for start in range(0, flat.size, step):
        part = flat[start:start + step]
        requests.append(comm.Iallreduce(MPI.IN_PLACE, part if bits is None else [part, bits], mpi_op))
    return PieceRequest(requests)
