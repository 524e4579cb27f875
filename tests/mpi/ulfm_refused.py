"""Fault tolerance refused where ULFM cannot work, naming the reason: under MPICH (the mpich wheel's ch4 device)
and under Open MPI started without ``--with-ft ulfm``. Run with ``DISTLAB_FAULT_TOLERANCE=1`` (as if the job had
asked for it) and, as its argument, words the reason must contain.
"""
from __future__ import annotations

import os
import sys

import numpy as np

from distlab import comm
from distlab.comm import ulfm
from distlab.errors import FaultToleranceUnsupportedError


def refused(call, words: str) -> str:
    try:
        call()
    except FaultToleranceUnsupportedError as exc:
        assert words in str(exc) and "--max-restarts" in str(exc), str(exc)
        return str(exc)
    raise AssertionError(f"{call} was not refused")


def main(words: str) -> None:
    found = ulfm.support()
    assert not found.available and words in found.reason, found
    assert ulfm.enabled(), "run it with DISTLAB_FAULT_TOLERANCE=1"
    refused(ulfm.require, words)
    refused(comm.world, words)  # a job that asked for fault tolerance gets no group that would not keep it
    os.environ.pop(ulfm.FT_VAR)
    group = comm.world()  # without the request, groups work as ever
    ones = np.ones(2)
    group.allreduce(ones)
    assert np.array_equal(ones, np.full(2, float(group.size)))
    print(f"refused OK: {found.reason}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
