"""Large allreduces across nodes, in pieces all in flight together.

Across a network link one large allreduce loses to the same bytes cut into pieces that are all started at once
(docs/measurements.md, "Collectives: large allreduces in pieces", has the figures and the command). MPI runs a large allreduce in
phases (with 2 ranks, MPICH's reduce-scatter then allgather): each rank sends half its buffer, reduces what it
received, then sends the reduced half back, so the link idles while the ranks reduce, and each direction of the
link idles during one phase. Pieces in flight together overlap one piece's reduction with the next one's
transfer, and the two phases of different pieces with each other. On one node the bytes move through shared
memory by the cores that reduce them, and pieces only add work: there an allreduce stays whole.

**The piece size** is chosen from the link, the way DDP's automatic bucket cap is
(:mod:`distlab._common.reducer_autocap`): the first time a group that spans nodes reduces at least
:data:`SPLIT_FROM_BYTES`, every rank times an allreduce of :data:`PROBE_BYTES` in 1 MiB pieces and in
:data:`PROBE_PIECE` pieces (best of 2 each), and one ``allreduce(max)`` makes every rank decide on the same
numbers (the probe is collective: every rank reaches it at the same allreduce, since an allreduce has the same
size everywhere). The two runs differ only in their number of pieces: their difference is what a piece costs
(its messages and progress work; at least :data:`MIN_OVERHEAD`), and what remains is the time per byte of pieces
in flight. For ``N`` bytes in pieces of ``p`` the pieces cost ``N / p * overhead`` and the pipeline fills and
drains with one piece on the wire, ``p / bandwidth``: the sum is least at ``p = sqrt(N * overhead *
bandwidth)``, rounded to a power of two within :data:`PIECE_BYTES`. An allreduce of less than two pieces stays
whole.

Across nodes a large allreduce always goes in pieces: on the virtual cluster, whole was slower than pieces at 1
and 2.5 Gbit/s, while at 10 Gbit/s, where the machine's cores rather than the link bound it, whole was as fast or
faster; no probe of a few MiB could tell those cases apart (a whole allreduce slows down as it grows), so the
link's rate cannot be what decides. A tiny allreduce's latency, what the bucket cap's model charges per bucket, is
no measure of a piece's cost either: pieces in flight do not wait for each other's round trips (the figures are in
docs/measurements.md, "Collectives: large allreduces in pieces").

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

__all__ = ["PIECES_VAR", "SPLIT_FROM_BYTES", "PIECE_BYTES", "PROBE_BYTES", "PROBE_PIECE", "MIN_OVERHEAD",
           "PieceSize", "choose_piece", "start_pieces", "in_turn"]

PIECES_VAR = "DISTLAB_ALLREDUCE_PIECES"
MiB = 1 << 20
#: Allreduces from this size on, in a group across nodes, are considered for splitting (and the first one probes).
SPLIT_FROM_BYTES = 2 * MiB
#: The smallest and largest piece the link may choose.
PIECE_BYTES = (256 << 10, 16 * MiB)
#: The probe's size (a small allreduce runs at a fraction of the link's rate, whole or in pieces), its small
#: pieces, and the least cost per piece it may conclude (pieces that came out faster than whole).
PROBE_BYTES = 8 * MiB
PROBE_PIECE = 128 << 10
MIN_OVERHEAD = 1e-5
_PROBING = "probing"


class PieceSize:
    """What one group knows of its link, and so how its large allreduces are cut: its own state machine.

    ``link`` is None until the group's first large allreduce asks (:meth:`bytes_for`), then "probing" while the
    probe's own allreduces run (they stay whole), then False (never split: one node, or ``off``), a fixed piece in
    bytes (a setting in MiB), or the probed ``(seconds per piece, seconds per byte in pieces)``. A setting that is
    refused leaves it None, so it is refused again next time.
    """

    __slots__ = ("link",)

    def __init__(self):
        self.link = None

    def bytes_for(self, group, nbytes: int) -> int:
        """The piece size for an allreduce of ``nbytes`` in ``group``, or 0 to leave it whole.

        Collective the first time it is asked for a group spanning nodes (see the module docstring); the same
        answer on every rank.
        """
        link = self.link
        if link is None:
            self.link = _PROBING  # the probe's own allreduces stay whole
            try:
                link = self.link = self._link_for(group)
            except BaseException:
                self.link = None  # a bad setting is refused again next time
                raise
        if link is _PROBING or link is False:
            return 0
        if isinstance(link, int):
            return link if 2 * link <= nbytes else 0
        return choose_piece(nbytes, *link)

    def _link_for(self, group):
        """False (never split), a fixed piece in bytes, or the probed ``(overhead, streamed)``."""
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
        return self._probe(group)

    def _probe(self, group) -> tuple[float, float]:
        """``(seconds per piece, seconds per byte in pieces)``, from a :data:`PROBE_BYTES` allreduce in 1 MiB
        pieces and in :data:`PROBE_PIECE` pieces (best of 2 each, the worst over ranks)."""
        probe = np.zeros(PROBE_BYTES // 4, dtype=np.float32)

        def best(piece: int, what: str) -> float:
            self.link = piece
            times = []
            for _ in range(2):
                group.barrier(name=f"allreduce pieces: {what}")
                start = time.perf_counter()
                group.allreduce(probe, name=f"allreduce pieces: {what}")
                times.append(time.perf_counter() - start)
            return min(times)

        try:
            measured = np.array([best(MiB, "1 MiB pieces"), best(PROBE_PIECE, "small pieces")])
        finally:
            self.link = _PROBING
        group.allreduce(measured, op="max", name="allreduce pieces: measurements")
        large, small = (float(x) for x in measured)
        few, many = PROBE_BYTES // MiB, PROBE_BYTES // PROBE_PIECE
        overhead = max((small - large) / (many - few), MIN_OVERHEAD)
        return overhead, max(large - few * overhead, 0.5 * large) / PROBE_BYTES


def choose_piece(nbytes: int, overhead: float, streamed: float) -> int:
    """The piece for ``nbytes`` (0: whole): ``sqrt(nbytes * overhead / streamed)`` as a power of two within
    :data:`PIECE_BYTES`, if ``nbytes`` makes two pieces at least.

    ``overhead``: seconds each piece adds; ``streamed``: seconds per byte of pieces in flight.
    """
    best = math.sqrt(max(nbytes * overhead / streamed, 1.0))
    piece = int(np.clip(2 ** round(math.log2(best)), *PIECE_BYTES))
    return piece if 2 * piece <= nbytes else 0


def start_pieces(comm, buf, piece: int, mpi_op, bits=None) -> list:
    """Start one in-place ``Iallreduce`` per ``piece`` bytes of the flat ``buf`` (``bits``: the MPI type its
    elements travel as, for bfloat16 as uint16); returns their requests, in order."""
    flat = buf.reshape(-1)
    if bits is not None:
        flat = flat.view(np.uint16)
    step = max(piece // flat.itemsize, 1)
    return [comm.Iallreduce(MPI.IN_PLACE, flat[i:i + step] if bits is None else [flat[i:i + step], bits], mpi_op)
            for i in range(0, flat.size, step)]


def in_turn(requests, finish, result):
    """The stages of a :class:`~distlab.comm.Work` waiting for the pieces one after the other, then running
    ``finish`` and returning ``result``.

    One piece at a time, as a loop over each piece's own ``wait`` does: every wait starts with a spin of
    busy polls (:func:`~distlab.comm.work.spin`), which keep feeding the sockets; one wait on all the pieces
    together backs off to sleeps after its first spin, and a large allreduce across a link was slower that way
    than piece by piece (docs/measurements.md, "Collectives: large allreduces in pieces"). Any test drives all of MPI's traffic, so the later pieces move meanwhile.
    """
    for request in requests:
        yield request
    if finish is not None:
        finish()
    return result
