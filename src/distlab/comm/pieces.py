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
:data:`SPLIT_FROM_BYTES`, every rank times an allreduce of that size whole, in 2 pieces and in
:data:`PROBE_PIECE` pieces (best of 3 each), and one ``allreduce(max)`` makes every rank decide on the same
numbers (the probe is collective: every rank reaches it at the same allreduce, since an allreduce has the same
size everywhere). The two split runs differ only in their number of pieces: their difference is what a piece
costs (its messages and progress work; at least :data:`MIN_OVERHEAD`), and what remains is the time per byte of
pieces in flight; the whole run gives the time per byte whole. For ``N`` bytes in pieces of ``p`` the pieces
cost ``N / p * overhead`` and the pipeline fills and drains with one piece on the wire: the sum is least at
``p = sqrt(N * overhead * bandwidth in pieces)``, rounded to a power of two within :data:`PIECE_BYTES`. The
allreduce goes in pieces only when that prediction beats the whole one by more than :data:`TIE`, and when it
is at least twice the piece. (A tiny allreduce's latency, what the bucket cap's model charges per bucket, is no
measure of a piece's cost: pieces in flight do not wait for each other's round trips. On the virtual cluster it
read 0.01 ms at 2.5 Gbit/s and 1.5 ms at 1 Gbit/s, while a piece cost about 0.4 ms and nothing.)

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

__all__ = ["PIECES_VAR", "SPLIT_FROM_BYTES", "PIECE_BYTES", "PROBE_PIECE", "MIN_OVERHEAD", "TIE", "piece_bytes", "choose_piece", "PieceRequest",
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
#: Pieces predicted faster than whole by less than this fraction stay whole (the model cannot tell them apart).
TIE = 0.03
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
        return link if 2 * link <= nbytes else 0
    return choose_piece(nbytes, *link)


def choose_piece(nbytes: int, overhead: float, streamed: float, whole: float) -> int:
    """The piece for ``nbytes`` (0: whole): ``sqrt(nbytes * overhead / streamed)`` as a power of two within
    :data:`PIECE_BYTES`, if the pieces are predicted faster than whole by more than :data:`TIE`.

    ``overhead``: seconds each piece adds; ``streamed`` and ``whole``: seconds per byte in pieces and whole.
    """
    best = math.sqrt(max(nbytes * overhead / streamed, 1.0))
    piece = int(np.clip(2 ** round(math.log2(best)), *PIECE_BYTES))
    predicted = (nbytes + piece) * streamed + nbytes / piece * overhead
    return piece if 2 * piece <= nbytes and predicted < (1 - TIE) * nbytes * whole else 0


def _link_for(group):
    """False (never split), a fixed piece in bytes, or the probed ``(overhead, streamed, whole)``."""
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


def _probe(group) -> tuple[float, float, float]:
    """``(seconds per piece, seconds per byte in pieces, seconds per byte whole)``, from a
    :data:`SPLIT_FROM_BYTES` allreduce whole, in 2 pieces and in :data:`PROBE_PIECE` pieces (best of 3 each, the
    worst over ranks)."""
    probe = np.zeros(SPLIT_FROM_BYTES // 4, dtype=np.float32)

    def best(piece, what: str) -> float:
        group._link = piece
        times = []
        for _ in range(3):
            group.barrier(name=f"allreduce pieces: {what}")
            start = time.perf_counter()
            group.allreduce(probe, name=f"allreduce pieces: {what}")
            times.append(time.perf_counter() - start)
        return min(times)

    try:
        measured = np.array([best(_PROBING, "whole"), best(probe.nbytes // 2, "2 pieces"),
                             best(PROBE_PIECE, "small pieces")])
    finally:
        group._link = _PROBING
    group.allreduce(measured, op="max", name="allreduce pieces: measurements")
    whole, two, many = (float(x) for x in measured)
    count = probe.nbytes // PROBE_PIECE
    overhead = max((many - two) / (count - 2), MIN_OVERHEAD)
    return overhead, max(two - 2 * overhead, 0.5 * two) / probe.nbytes, whole / probe.nbytes


class PieceRequest:
    """The requests of an allreduce's pieces, as one request to :class:`~distlab.comm.Work`.

    A test looks at the first piece not yet seen complete, and moves on while pieces complete: any test drives
    all of MPI's traffic, so testing every piece on every poll (``Testall``) only adds work per poll (measured at
    10 Gbit/s, 26 MB in 1 MiB pieces: 115 ms with ``Testall``, 83 ms waiting on each piece's request in turn).
    """

    __slots__ = ("requests", "first")

    def __init__(self, requests):
        self.requests = requests
        self.first = 0

    def Test(self) -> bool:  # noqa: N802 - mirrors mpi4py's Request.Test
        requests, first = self.requests, self.first
        while first < len(requests) and requests[first].Test():
            first += 1
        self.first = first
        return first == len(requests)


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
