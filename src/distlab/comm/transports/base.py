"""The interface every device transport implements, as every c10d backend implements ``Backend``.

A :class:`~distlab.comm.ProcessGroup` makes its transport once, from the ranks' placements
(:func:`~distlab.comm.transports.select`), handing it the group's :class:`~distlab.comm.steps.GroupSteps`, never the
group itself. For each of the four collectives device arrays meet most, the group asks :meth:`Transport.takes`
whether the transport moves the arrays, and if so calls the collective of the same name, which checks nothing the
group checked already (dtype and op, shapes), takes its sequence number with ``steps.enter`` and returns what
``steps.run`` returns (a :class:`~distlab.comm.Work`, or the result once it completed). So calls go one way: group
-> transport -> steps -> :mod:`~distlab.comm.work`; a transport never calls back into the group.

The optional capabilities are methods with a default here (:meth:`Transport.shared_arrays`,
:meth:`Transport.releaser`), so the group calls them on any transport instead of probing for them.
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from ..steps import GroupSteps

__all__ = ["Transport"]


def _nothing() -> None:
    return None


class Transport(abc.ABC):
    """How one group moves the bytes of device arrays (see the module docstring).

    Parameters
    ----------
    steps : distlab.comm.steps.GroupSteps
        The group's steps: the communicator, the numbering, the waits. The transport keeps it as ``steps``.
    """

    #: The word ``ProcessGroup.device_comm`` shows (``DISTLAB_DEVICE_COMM``'s value that selects it).
    name = ""

    def __init__(self, steps: "GroupSteps"):
        self.steps = steps

    @abc.abstractmethod
    def takes(self, what: str, name, *arrays) -> bool:
        """Whether this transport moves the ``arrays`` of collective ``what`` named ``name`` (each checked: a
        contiguous array of a movable dtype, else the error the plain path would raise). The group asks it once
        per call, with every array of the call (``allgather``: the input and ``out``); the answer must be the same
        on every rank, or the ranks would run different protocols."""

    @abc.abstractmethod
    def allreduce(self, array, reduce_op, mpi_op, async_op: bool, name):
        """Reduce ``array`` across ranks in place with ``reduce_op`` (a :class:`~distlab.ReduceOp`; ``mpi_op`` is
        the MPI op the plain path would use). Returns its Work when ``async_op``, else ``array``."""

    @abc.abstractmethod
    def broadcast(self, array, src: int, async_op: bool, name):
        """Overwrite ``array`` on every rank with rank ``src``'s. Returns its Work when ``async_op``, else
        ``array``."""

    @abc.abstractmethod
    def allgather(self, array, out, async_op: bool, name):
        """Gather every rank's ``array`` into ``out`` (shape ``(size,) + array.shape``). Returns its Work when
        ``async_op``, else ``out``."""

    @abc.abstractmethod
    def reduce_scatter(self, output, input, reduce_op, mpi_op, async_op: bool, name):  # noqa: A002
        """Reduce ``input`` (``size`` equal blocks) across ranks; rank ``r`` receives block ``r`` in ``output``.
        Returns its Work when ``async_op``, else ``output``."""

    def shared_arrays(self, specs):
        """Collective: device arrays every rank of the node maps, one per ``(count, dtype)`` of ``specs``, as
        ``(memory, arrays)``; None on every rank when the transport has none (the default)."""
        return None

    def releaser(self) -> Callable[[], None]:
        """What frees the transport's resources when its group goes (a finalizer of its own: it must hold neither
        the transport nor the group's steps). The default frees nothing."""
        return _nothing
