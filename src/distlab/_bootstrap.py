"""Per-rank entry point of the launcher: ``mpiexec -n N python -m distlab._bootstrap script.py args...``.

Sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``, runs the script as ``__main__``, and
turns an uncaught exception (or a non-zero ``sys.exit``) on any rank into ``MPI_Abort`` after printing the
rank's traceback, so the other ranks are not left waiting in a collective.
"""
from __future__ import annotations

import os
import runpy
import sys
import traceback


def set_rank_environment() -> int:
    """Export the torchrun-style rank variables from MPI; return the world rank."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    os.environ.update({
        "RANK": str(world.Get_rank()),
        "WORLD_SIZE": str(world.Get_size()),
        "LOCAL_RANK": str(local.Get_rank()),
        "LOCAL_WORLD_SIZE": str(local.Get_size()),
    })
    local.Free()
    return world.Get_rank()


def abort(code: int, rank: int, message: str) -> None:
    """Print ``message`` tagged with the rank, flush this rank's timeline, and abort the whole job."""
    from mpi4py import MPI

    tagged = "".join(f"[rank {rank}] {line}\n" for line in message.rstrip("\n").split("\n"))
    sys.stderr.write(tagged)
    sys.stderr.flush()
    _report_failure(tagged)
    sys.stdout.flush()
    try:
        from .timeline import get_timeline

        get_timeline().flush()
    except Exception:  # noqa: BLE001 - the abort matters more than the trace
        pass
    MPI.COMM_WORLD.Abort(code)


def _report_failure(tagged: str) -> None:
    """Append the message to the launcher's failure report, which the launcher prints after the job.

    mpiexec forwards a rank's output through its proxy and may kill the job on MPI_Abort before the last lines
    are through; the report file does not depend on that. One write per message (O_APPEND), NUL-separated.
    """
    from .launch import FAILURE_REPORT_VAR

    path = os.environ.get(FAILURE_REPORT_VAR)
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (tagged + "\0").encode(errors="replace"))
        finally:
            os.close(fd)
    except OSError:  # another node without the launcher's /tmp: the forwarded stderr is all there is
        pass


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m distlab._bootstrap script.py [args...]")
    script = argv[0]
    rank = set_rank_environment()
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code in (None, 0):
            return
        if not isinstance(code, int):
            abort(1, rank, f"exited: {code}")
        abort(code, rank, f"exited with status {code}")
    except BaseException:  # noqa: BLE001 - every failure must end the job, not leave peers waiting
        abort(1, rank, traceback.format_exc())


if __name__ == "__main__":
    main(sys.argv[1:])
