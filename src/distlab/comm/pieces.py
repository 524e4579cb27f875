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
:data:`SPLIT_FROM_BYTES`, every rank probes the latency of a tiny allreduce and the bandwidth of a 1 MiB one, and
one ``allreduce(max)`` makes every rank decide on the same numbers (the probe is collective: every rank reaches
it at the same allreduce, since an allreduce has the same size everywhere). A piece costs its share of fixed
work (about one latency), and the pipeline fills and drains with one piece on the wire (its size over the
bandwidth): for ``N`` bytes, ``N / p * latency + p / bandwidth`` is least at ``p = sqrt(N * latency *
bandwidth)``, rounded to a power of two between :data:`PIECE_BYTES` bounds. An allreduce less than twice its
piece stays whole.

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

__all__ = ["PIECES_VAR", "SPLIT_FROM_BYTES", "PIECE_BYTES", "piece_bytes", "choose_piece", "PieceRequest",
           "start_pieces"]

PIECES_VAR = "DISTLAB_ALLREDUCE_PIECES"
MiB = 1 << 20
#: Allreduces from this size on, in a group across nodes, are considered for splitting (and the first one probes).
SPLIT_FROM_BYTES = 2 * MiB
#: The smallest and largest piece the link may choose.
PIECE_BYTES = (256 << 10, 16 * MiB)
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


def choose_piece(nbytes: int, latency: float, bandwidth: float) -> int:
    """``sqrt(nbytes * latency * bandwidth)`` as a power of two within :data:`PIECE_BYTES`."""
    best = math.sqrt(max(nbytes * latency * bandwidth, 1.0))
    return int(np.clip(2 ** round(math.log2(best)), *PIECE_BYTES))


def _link_for(group):
    """False (never split), a fixed piece in bytes, or the probed ``(latency, bandwidth)``."""
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
    """Latency (s) of a tiny allreduce and bandwidth (bytes/s) of a 1 MiB one, the worst over ranks."""
    tiny, probe = np.zeros(256, dtype=np.float32), np.zeros(MiB // 4, dtype=np.float32)

    def timed(array, what: str) -> float:
        group.barrier(name=f"allreduce pieces: {what}")
        start = time.perf_counter()
        group.allreduce(array, name=f"allreduce pieces: {what}")
        return time.perf_counter() - start

    latency = min(timed(tiny, "latency") for _ in range(3))
    alone = min(timed(probe, "bandwidth") for _ in range(2))
    measured = np.array([latency, alone])
    group.allreduce(measured, op="max", name="allreduce pieces: measurements")
    latency, alone = (float(x) for x in measured)
    return latency, probe.nbytes / max(alone - latency, 1e-9)


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
