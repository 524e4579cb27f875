"""How the ranks of a save or a load agree on failure: every rank hears of every rank's error, and all raise."""
from __future__ import annotations

from ..errors import CheckpointException

__all__ = ["world", "reason", "failed", "agree"]


def world(group):
    """``group``, or the world group (imported here: importing distlab.checkpoint starts no MPI)."""
    if group is not None:
        return group
    from .. import comm

    return comm.world()


def reason(exc: BaseException) -> str:
    """One line for an exception: its message alone for a CheckpointException, else ``Type: message``."""
    return str(exc) if isinstance(exc, CheckpointException) else f"{type(exc).__name__}: {exc}"


def failed(what: str, failures: dict) -> CheckpointException:
    """The exception every rank raises: ``what`` failed, with each failed rank's reason."""
    lines = "; ".join(f"rank {rank}: {why}" for rank, why in sorted(failures.items()))
    return CheckpointException(f"{what} failed on {len(failures)} rank{'s' if len(failures) > 1 else ''}: {lines}",
                               failures)


def agree(group, error: str | None, what: str, step: str) -> None:
    """Gather every rank's ``error`` (None when it succeeded); raise :func:`failed` on every rank if any failed."""
    everyone = group.allgather_object(error, name=f"checkpoint {step} {what}")
    failures = {rank: e for rank, e in enumerate(everyone) if e}
    if failures:
        raise failed(what, failures)
