"""Per-rank entry point of :func:`distlab.run`: ``python -m distlab._runner payload.pkl workdir``.

Loads ``(fn, args, kwargs)`` with cloudpickle, runs it, and writes ``workdir/rank<N>.pkl`` holding
``(True, result)`` or ``(False, traceback text)``. A failing rank aborts the job once its traceback is written,
so peers blocked in a collective do not wait out their timeout.
"""
from __future__ import annotations

import sys
import traceback
from pathlib import Path


def main(payload_path: str, workdir: str) -> None:
    import cloudpickle

    from ._bootstrap import abort, set_rank_environment

    rank = set_rank_environment()
    out = Path(workdir) / f"rank{rank}.pkl"
    try:
        fn, args, kwargs = cloudpickle.loads(Path(payload_path).read_bytes())
        outcome = (True, fn(*args, **kwargs))
        data = cloudpickle.dumps(outcome)
    except BaseException:  # noqa: BLE001 - report any failure to the caller
        text = traceback.format_exc()
        tmp = out.with_suffix(".tmp")
        tmp.write_bytes(cloudpickle.dumps((False, text)))
        tmp.replace(out)
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_size() > 1:
            abort(1, rank, text)
        return
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
