"""Helpers for testing twins against each other: a process group that records what crosses it.

The twin contract says both twins send the same messages, not only reach the same numbers. Wrapping the process
group in :class:`RecordingGroup` captures the sequence of collectives a component issues (operation, name, shape,
dtype, reduce op, root) so a test can compare the streams of the two twins, as PyYAML's tests compare event
streams.
"""
from __future__ import annotations

__all__ = ["RecordingGroup"]


def _describe(array) -> tuple:
    if array is None:
        return (None, None)
    return (tuple(int(d) for d in array.shape), str(array.dtype))


class RecordingGroup:
    """A :class:`~distlab.comm.ProcessGroup` stand-in that records each call, then forwards it.

    Attributes
    ----------
    trace : list of tuple
        ``(operation, name, shape, dtype, detail)`` per call, in call order.
    """

    def __init__(self, group):
        self._group = group
        self.trace: list[tuple] = []

    def __getattr__(self, name):
        return getattr(self._group, name)

    def _record(self, op, name, array=None, detail=None):
        shape, dtype = _describe(array)
        self.trace.append((op, name, shape, dtype, detail))

    def allreduce(self, array, op="sum", async_op=False, name=None):
        self._record("allreduce", name, array, str(op))
        return self._group.allreduce(array, op=op, async_op=async_op, name=name)

    def broadcast(self, array, src=0, async_op=False, name=None):
        self._record("broadcast", name, array, src)
        return self._group.broadcast(array, src=src, async_op=async_op, name=name)

    def allgather(self, array, out=None, async_op=False, name=None):
        self._record("allgather", name, array)
        return self._group.allgather(array, out=out, async_op=async_op, name=name)

    def reduce_scatter(self, output, input, op="sum", async_op=False, name=None):  # noqa: A002 - comm's signature
        self._record("reduce_scatter", name, input, str(op))
        return self._group.reduce_scatter(output, input, op=op, async_op=async_op, name=name)

    def allgather_object(self, obj, async_op=False, name=None):
        self._record("allgather_object", name)
        return self._group.allgather_object(obj, async_op=async_op, name=name)

    def broadcast_object(self, obj=None, src=0, async_op=False, name=None):
        self._record("broadcast_object", name, detail=src)
        return self._group.broadcast_object(obj, src=src, async_op=async_op, name=name)

    def barrier(self, async_op=False, name=None):
        self._record("barrier", name)
        return self._group.barrier(async_op=async_op, name=name)

    def new_group(self, ranks, name=None, timeout=None):
        """A sub-group that records into this group's trace (one stream for a mesh's rows and columns)."""
        group = self._group.new_group(ranks, name=name, timeout=timeout)
        if group is None:
            return None
        child = RecordingGroup(group)
        child.trace = self.trace
        return child
