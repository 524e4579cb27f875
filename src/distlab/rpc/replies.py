"""The replies a blocking caller receives on its own thread: reply slots, and the wait for a reply.

Shared plumbing of :mod:`distlab.rpc` (not twinned). A request made by ``rpc_sync`` or ``to_here`` carries its
thread's *reply slot* (1 to ``RPC_REPLY_SLOTS``, a byte of the header): the callee sends the reply, header and
out-of-band buffers, on tag ``RPC_TAG_REPLY_BASE + slot``, and the caller's thread, which sent the request,
receives it there itself (:meth:`ReplySlots.await_reply`), waiting as the twinned ``rpc_wait`` waiter does (polls
for a while, then sleeps). No other thread wakes up for it and nothing is handed from one thread to another.

Each thread that makes blocking calls has a slot of its own for the agent's life (a thread that ends gives its
slot back); only that thread receives on its tag, so whatever arrives there answers one of its requests: a reply
that comes after its request timed out is recognised by its source and message id, and dropped. When every slot
is taken, the caller's reply comes through the listener instead (the agent's ``send``).
"""
from __future__ import annotations

import threading
import time
import weakref
from typing import Callable

from distlab import _backend
from distlab._common.rpc_wait import REPLY_SLEEP_MAX, REPLY_SPIN
from distlab._wire import RPC_FLAG_DEVICES, RPC_REPLY_SLOTS, RPC_TAG_REPLY_BASE
from distlab.errors import ProcessFailedError, RpcError, RpcMessageError

from . import framing
from .messenger import K_RESPONSE, SLICE, unpack_header

__all__ = ["ReplySlots"]


class _Slot:
    """A thread's reply slot: its number, its tag, and the waiter that receives its replies."""

    __slots__ = ("number", "tag", "waiter", "_free", "__weakref__")

    def __init__(self, number: int, waiter, free: Callable):
        self.number = number
        self.tag = RPC_TAG_REPLY_BASE + number
        self.waiter = waiter
        self._free = free

    def __del__(self):  # its thread ended: the number serves another thread
        self._free(self.number)


class ReplySlots:
    """The reply slots of an agent's threads, and their waits.

    Parameters
    ----------
    messenger : distlab.rpc.messenger.Messenger
        The agent's messenger (its communicator, its receiving helpers; its ``running`` ends every wait).
    record_error : callable
        ``record_error(text)``: log a late reply that was malformed.
    """

    def __init__(self, messenger, record_error: Callable):
        from mpi4py import MPI

        self._MPI = MPI
        self._wait = _backend.load("rpc_wait")
        self._messenger = messenger
        self._record_error = record_error
        self._max_bytes = framing.MAX_MESSAGE_BYTES
        self._free_slots = list(range(RPC_REPLY_SLOTS, 0, -1))
        self._lock = threading.Lock()
        self._thread_slot = threading.local()
        self._slots: weakref.WeakSet = weakref.WeakSet()

    def slot(self):
        """This thread's reply slot (made at its first blocking call); None when every slot is taken."""
        slot = getattr(self._thread_slot, "slot", None)
        if slot is None:
            with self._lock:
                if not self._free_slots:
                    return None
                number = self._free_slots.pop()
            slot = _Slot(number, self._wait.Waiter(self._messenger.comm, REPLY_SPIN, REPLY_SLEEP_MAX),
                         self._free_slot)
            self._thread_slot.slot = slot
            self._slots.add(slot)
        return slot

    def _free_slot(self, number: int) -> None:
        with self._lock:
            self._free_slots.append(number)

    def await_reply(self, slot, dst: int, mid: int, deadline: float):
        """Receive the reply to request ``mid`` sent to ``dst`` with ``slot``, on this thread, by ``deadline``
        (monotonic seconds). Returns ``(flags, meta, forks, body, buffers)``, or None when the time is up.

        A reply to an earlier request of this slot (one that timed out) is received and dropped. A malformed
        reply to this request raises its RpcMessageError; RpcError when the agent stops meanwhile; the
        ProcessFailedError that named ``dst`` when it died meanwhile (under fault tolerance).
        """
        messenger = self._messenger
        failed = messenger.failed
        ANY_SOURCE = self._MPI.ANY_SOURCE
        waiter, tag = slot.waiter, slot.tag
        status = waiter.status
        waiter.touch()  # the request just left: poll for the answer
        while True:
            if not messenger.running:
                raise RpcError("the RPC agent was shut down before the response arrived")
            if dst in failed:
                raise failed[dst]
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                if not waiter.probe(ANY_SOURCE, tag, min(left, SLICE)):
                    continue
            except ProcessFailedError as exc:  # this thread learnt of the death first
                messenger.peers_failed(exc)
                continue
            src = status.Get_source()
            data = messenger.receive(waiter)
            if data is None:
                continue
            try:
                kind, flags, rmid, sizes, forks, meta, body, _slot = unpack_header(data, self._max_bytes)
                buffers = messenger.receive_buffers(src, sizes, kind, flags, rmid, tag) if sizes else []
                if src != dst or rmid != mid or kind != K_RESPONSE:
                    continue  # the late answer to an earlier request of this slot
                if flags & RPC_FLAG_DEVICES:
                    buffers = framing.place_buffers(buffers, framing.device_records(
                        data, messenger.device_count, kind, flags, mid))
                return flags, framing.load_meta(meta, kind, flags, mid) if meta else None, forks, body, buffers
            except RpcMessageError as exc:
                if exc.sizes:
                    messenger.drain(src, exc, tag)
                if src == dst and exc.mid in (None, mid):
                    raise
                self._record_error(f"refused a late reply from worker {src}: {exc}")

    def stop(self) -> None:
        """End every wait (after the messenger stopped): each raises RpcError."""
        self.wake()

    def wake(self) -> None:
        """End every thread's current probe: each looks again at whether its agent runs and its callee lives."""
        for slot in list(self._slots):
            slot.waiter.wake()
