"""The RPC messenger: MPI point-to-point sends, the listener's loop, and the replies a caller receives itself.

Shared plumbing of :mod:`distlab.rpc` (not twinned); how a thread waits for a message is the twinned
``rpc_wait`` component (:mod:`distlab.reference.rpc_wait`: the waiter that polls then sleeps, and the listener's
seat).

Sends: a header message, then its out-of-band buffers, under a per-destination lock so the buffers of two messages
never interleave. A request goes on ``TAG_HEADER``, its buffers on ``TAG_BUFFER``. Its reply goes where the
request's *reply slot* says: slot 0 (``rpc_async``, ``remote``, RRef control messages) on ``TAG_HEADER`` to the
caller's listener; slot ``s`` (``rpc_sync``, ``to_here``) on tag ``TAG_REPLY_BASE + s``, header and buffers, to
the caller's own thread, which waits for it there (:meth:`Messenger.await_reply`): no other thread wakes up, and
nothing is handed from one thread to another. Each thread that makes blocking calls has a slot of its own, for the
agent's life (:meth:`Messenger.slot`); a reply that comes after its call timed out is recognised by its source and
message id and dropped. Small messages go out with a blocking ``MPI_Send`` (eager), large ones with ``MPI_Isend``
kept alive until complete; every send to one's own rank is an ``Isend`` (a blocking one completes only once
received). Small messages the listener sends while more are queued for it wait in a per-destination outbox and
leave as one ``batch`` message. A message the listener sends to its own rank is delivered locally.

Receives: the thread that holds the seat listens (:meth:`Messenger.listen`). Nothing a message claims is trusted
(see :mod:`distlab.rpc.framing`), and nothing is unpickled before every check passed: the codec checks the
header's version, kind, slot, flags, counts, sizes and pickles; the listener then refuses a kind no handler takes
(and stop or wake from another worker); buffers are matched by a probe and received within ``buffer_timeout``; only
then is the metadata unpickled, and the body later, by the thread that runs the handler. A refused message is
reported (its announced buffers received into nothing, so they are not taken for the next message's) and the
listener goes on.
"""
from __future__ import annotations

import collections
import threading
import time
import traceback
import weakref
from typing import Callable

from distlab import _backend
from distlab._common.rpc_framing import FRAME_LEN, with_sizes
from distlab._common.rpc_wait import LISTEN_SLEEP_MAX, LISTEN_SPIN, REPLY_SLEEP_MAX, REPLY_SPIN, STANDBY_POLL, TAKEOVER
from distlab._wire import (RPC_FLAG_DEVICES, RPC_KIND_CODES, RPC_KINDS, RPC_REPLY_SLOTS, RPC_TAG_BUFFER,
                           RPC_TAG_HEADER, RPC_TAG_REPLY_BASE)
from distlab.errors import RpcError, RpcMessageError

from . import framing
from .devices import DeviceBuffer

__all__ = ["Messenger", "TAG_HEADER", "TAG_BUFFER", "kind_name"]

TAG_HEADER = RPC_TAG_HEADER
TAG_BUFFER = RPC_TAG_BUFFER
EAGER_MAX = 16 * 1024  # bytes sent with a blocking MPI_Send (below MPICH's eager limits)
BATCH_MAX_FRAMES = 64
#: How long the listener polls for a message's buffers without pausing. The sender sends them right after the
#: header, so they are matched within microseconds; a pause (``time.sleep`` sleeps far longer) cost the 1 MiB
#: echo a third of its round trip (docs/measurements.md, "RPC: in-band buffers and the buffer spin").
BUFFER_SPIN = 0.002
#: The longest a waiting thread stays in one probe before it looks at its deadline and at its agent again.
SLICE = 0.25

K_RESPONSE = RPC_KIND_CODES["response"]
K_STOP = RPC_KIND_CODES["stop"]
K_WAKE = RPC_KIND_CODES["wake"]
K_BATCH = RPC_KIND_CODES["batch"]


def kind_name(kind: int) -> str:
    """The name of a message kind (for errors and the timeline)."""
    return RPC_KINDS[kind] if 0 <= kind < len(RPC_KINDS) else f"kind {kind}"


def _data(buf):
    """The memory MPI sends for an out-of-band buffer (a device array's is its host copy)."""
    return buf.data if type(buf) is DeviceBuffer else buf


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


class Messenger:
    """Sends and receives RPC messages on the agent's communicator.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The agent's own communicator.
    name : str
        This worker's name (in the errors it reports).
    deliver : callable
        ``deliver(src, kind, flags, mid, meta, forks, body, buffers, slot, here)``, called on the listening thread
        for every message received (batches already split); ``here``: a message of its own (not from a batch),
        whose request the listening thread may run itself.
    record_error : callable
        ``record_error(text)``: log a problem the listener survived.
    on_malformed : callable
        ``on_malformed(src, error, slot)``: a message from ``src`` was refused (an RpcMessageError); the agent logs
        it and, when the header could be read, answers the sender's request with the error (on reply slot ``slot``).
    handles : callable
        ``handles(kind) -> bool``: a message of ``kind`` (a response, or a request) has a handler on this worker;
        any other is refused before its metadata is unpickled.
    buffer_timeout : float
        How long a receiver waits for a message's out-of-band buffers after its header (seconds).
    """

    def __init__(self, comm, name: str, deliver: Callable, record_error: Callable, on_malformed: Callable,
                 handles: Callable, buffer_timeout: float):
        from mpi4py import MPI

        self._MPI = MPI
        self._wait = _backend.load("rpc_wait")
        self.comm = comm
        self.rank = comm.Get_rank()
        self.name = name
        self._deliver = deliver
        self._handles = handles
        self._record_error = record_error
        self._on_malformed = on_malformed
        self.buffer_timeout = buffer_timeout
        self._max_bytes = framing.MAX_MESSAGE_BYTES
        self.seat = self._wait.Seat(TAKEOVER, STANDBY_POLL)
        self.listener = self._wait.Waiter(comm, LISTEN_SPIN, LISTEN_SLEEP_MAX)
        #: how the waiters call MPI: "libmpi" (the core twin, GIL released) or "mpi4py ..." (and why)
        self.path = self.listener.path
        self._send_locks = [threading.Lock() for _ in range(comm.Get_size())]
        self._isends: list = []
        self._isend_lock = threading.Lock()
        # Small messages the listener sends (inline replies, control messages) wait in an outbox while more
        # messages are already queued for it, and go out together as one "batch" MPI message.
        self._outbox: dict[int, list] = {}
        self._outbox_bytes: dict[int, int] = {}
        self._local = collections.deque()  # messages the listener sent to its own worker: (header, buffers)
        self._free_slots = list(range(RPC_REPLY_SLOTS, 0, -1))
        self._slot_lock = threading.Lock()
        self._thread_slot = threading.local()
        self._slots: weakref.WeakSet = weakref.WeakSet()
        #: the devices this worker sees (set by the agent; None: no device arrays can be received)
        self.device_count = None
        self.running = True
        self._listening = 0  # threads inside listen() (one, or none; briefly two when the seat changes hands)

    # -- sending ----------------------------------------------------------------------------------------------
    def transmit(self, dst, kind, flags, mid, buffers, meta, forks, body, slot=0, tag=TAG_HEADER) -> None:
        """Send one message (header, then its out-of-band buffers); ``slot``: a request's reply slot; ``tag``: the
        header's tag (a reply to slot ``s`` goes on its tag, buffers included)."""
        header = framing.pack_header(kind, flags, mid, buffers, meta, forks, body, slot)
        MPI = self._MPI
        comm = self.comm
        listening = self.seat.listening()
        if dst == self.rank:
            if listening and tag == TAG_HEADER:
                # A send to one's own rank completes only when it is received, so from the listener it would
                # never complete: deliver it after the current message, as the same bytes (buffers copied).
                self._local.append((header, [bytearray(_data(b)) for b in buffers]))
                return
            requests = [comm.Isend([header, MPI.BYTE], dst, tag)]
            requests += [comm.Isend([_data(b), MPI.BYTE], dst, TAG_BUFFER if tag == TAG_HEADER else tag)
                         for b in buffers]
            self._keep(requests, header, buffers, True)
            return
        if not buffers and len(header) <= EAGER_MAX:
            if listening and tag == TAG_HEADER:
                self._queue_frame(dst, header)
                return
            comm.Send([header, MPI.BYTE], dst, tag)
            return
        requests = []
        with self._send_locks[dst]:
            if len(header) <= EAGER_MAX:
                comm.Send([header, MPI.BYTE], dst, tag)
            else:
                requests.append(comm.Isend([header, MPI.BYTE], dst, tag))
            buffer_tag = TAG_BUFFER if tag == TAG_HEADER else tag
            for buf in buffers:
                requests.append(comm.Isend([_data(buf), MPI.BYTE], dst, buffer_tag))
        self._keep(requests, header, buffers, False)

    def _keep(self, requests, header, buffers, to_self) -> None:
        """Keep the memory of sends in flight alive until they complete (pruned as more come)."""
        with self._isend_lock:
            self._isends.append((requests, header, buffers, to_self))
            if len(self._isends) > 8:
                self._isends = [entry for entry in self._isends if not self._MPI.Request.Testall(entry[0])]

    def after_send(self) -> None:
        """This worker sent a request whose answer comes to its listener: the listener polls for it."""
        self.listener.touch()

    def _queue_frame(self, dst, header) -> None:
        """Listening thread only: hold a small message for ``dst`` until the listener runs out of work."""
        box = self._outbox.get(dst)
        if box is None:
            box = self._outbox[dst] = []
            self._outbox_bytes[dst] = 0
        box.append(header)
        self._outbox_bytes[dst] += len(header) + FRAME_LEN.size
        if len(box) >= BATCH_MAX_FRAMES or self._outbox_bytes[dst] > EAGER_MAX - 64:
            self._flush_to(dst)

    def _flush_to(self, dst) -> None:
        box = self._outbox.pop(dst, None)
        self._outbox_bytes.pop(dst, None)
        if not box:
            return
        data = box[0] if len(box) == 1 else framing.pack_header(K_BATCH, 0, 0, [], None, (), framing.pack_batch(box))
        self.comm.Send([data, self._MPI.BYTE], dst, TAG_HEADER)

    def _flush_outbox(self) -> None:
        for dst in list(self._outbox):
            self._flush_to(dst)

    # -- the listener -----------------------------------------------------------------------------------------
    def listen(self) -> None:
        """Receive and handle messages while this thread holds the seat; return when it lost it, or at stop."""
        with self._slot_lock:
            self._listening += 1
        try:
            self._listen()
        finally:
            with self._slot_lock:
                self._listening -= 1

    def _listen(self) -> None:
        ANY_SOURCE, BYTE = self._MPI.ANY_SOURCE, self._MPI.BYTE
        waiter, seat = self.listener, self.seat
        status = waiter.status
        handled = 0
        while self.running:
            try:
                if self._local:
                    header, buffers = self._local.popleft()
                    self._handle(self.rank, header, buffers, True)
                else:
                    if self._outbox and handled >= BATCH_MAX_FRAMES // 4:
                        # Bound how long a held message waits while traffic from other workers keeps coming.
                        self._flush_outbox()
                        handled = 0
                    if self._outbox:
                        # More work already queued? Handle it first; else send what the outbox holds.
                        if not waiter.probe(ANY_SOURCE, TAG_HEADER, 0.0):
                            self._flush_outbox()
                            handled = 0
                            continue
                    elif not waiter.probe(ANY_SOURCE, TAG_HEADER, SLICE):
                        continue
                    data = self._receive(waiter, status, BYTE)
                    if data is not None:
                        self._handle(status.Get_source(), data, None, True)
                    handled += 1
            except Exception:  # noqa: BLE001 - keep listening; record what went wrong
                self._record_error(f"listener error: {traceback.format_exc()}")
            if not seat.listening():
                return
        self._flush_outbox()

    def _receive(self, waiter, status, BYTE):
        """The matched message's bytes (None: larger than the limit, dropped and reported)."""
        count = status.Get_count(BYTE)
        if count > self._max_bytes:
            self._drop(waiter.message)
            self._on_malformed(status.Get_source(), RpcMessageError(
                f"dropped a {count}-byte RPC message: larger than DISTLAB_RPC_MAX_MESSAGE_BYTES "
                f"({self._max_bytes})"), 0)
            return None
        data = bytearray(count)
        waiter.message.Recv([data, BYTE])
        return data

    def _handle(self, src, data, buffers, here) -> None:
        """Parse and dispatch one header message (its buffers come over MPI unless given).

        A malformed message (RpcMessageError: bad header, a kind nobody handles, sizes out of bounds, pickles that
        do not walk, buffers that do not come) is refused and reported, before anything in it is unpickled; the
        listener goes on with the next one.
        """
        try:
            kind, flags, mid, sizes, meta, forks, body, slot = framing.unpack_header(data)
            if kind == K_STOP or kind == K_WAKE:
                raise RpcMessageError(f"refused a {kind_name(kind)} message from worker {src}: only a worker's "
                                      "own listener sends those", kind=kind, flags=flags, mid=mid)
            self._check_kind(src, kind, flags, mid, sizes)
            records = self._device_records(data, kind, flags, mid, sizes) if flags & RPC_FLAG_DEVICES else ()
            if buffers is None:
                buffers = self._receive_buffers(src, sizes, kind, flags, mid, TAG_BUFFER) if sizes else []
            if records:  # device arrays: each buffer names the device it is rebuilt on
                buffers = framing.place_buffers(buffers, records)
            meta = framing.load_meta(meta, kind, flags, mid)
        except RpcMessageError as exc:
            if exc.sizes and buffers is None:
                self._drain(src, exc, TAG_BUFFER)
            self._on_malformed(src, exc, data[3] if exc.mid is not None else 0)
            return
        if kind == K_BATCH:
            self._on_batch(src, body)
        else:
            self._deliver(src, kind, flags, mid, meta, forks, body, buffers, slot, here)

    def _check_kind(self, src, kind, flags, mid, sizes) -> None:
        """RpcMessageError unless a message of ``kind`` has a handler here (a batch is split by the listener)."""
        if kind != K_BATCH and not self._handles(kind):
            raise with_sizes(RpcMessageError(
                f"refused message #{mid} ({kind_name(kind)}) from worker {src}: worker {self.name} has no handler "
                f"for message kind {kind}", kind=kind, flags=flags, mid=mid), sizes)

    def _device_records(self, data, kind, flags, mid, sizes) -> tuple:
        """The device record of each buffer, checked against this worker's devices (RpcMessageError otherwise)."""
        try:
            return framing.device_records(data, self.device_count, kind, flags, mid)
        except RpcMessageError as exc:
            raise with_sizes(exc, sizes) from None

    def _receive_buffers(self, src, sizes, kind, flags, mid, tag, keep=True) -> list:
        """Receive a message's out-of-band buffers from ``src`` on ``tag``: each one matched by a probe
        (``Improbe``), checked against the size its header announced, then received (``Mrecv``; into nothing
        unless ``keep``); all within ``buffer_timeout``. A buffer that does not come, or has another size, is an
        RpcMessageError."""
        MPI = self._MPI
        comm = self.comm
        status = MPI.Status()
        start = time.monotonic()
        deadline = start + self.buffer_timeout
        buffers = []
        for index, size in enumerate(sizes):
            message = comm.Improbe(src, tag, status)
            delay = 0.0
            while message is None:
                now = time.monotonic()
                if now > deadline:
                    raise RpcMessageError(
                        f"out-of-band buffer {index + 1} of {len(sizes)} ({size} bytes) of message #{mid} "
                        f"({kind_name(kind)}) from worker {src} did not arrive within {self.buffer_timeout:g} s",
                        kind=kind, flags=flags, mid=mid)
                if now - start > BUFFER_SPIN:
                    # Not there after BUFFER_SPIN: the sender is slow or stalled, so stop spinning.
                    time.sleep(delay)
                    delay = min(max(delay * 2, 1e-5), 1e-3)
                message = comm.Improbe(src, tag, status)
            count = status.Get_count(MPI.BYTE)
            if count != size:
                self._drop(message)
                raise RpcMessageError(
                    f"out-of-band buffer {index + 1} of {len(sizes)} of message #{mid} ({kind_name(kind)}) from "
                    f"worker {src} has {count} bytes, its header said {size}", kind=kind, flags=flags, mid=mid)
            if not keep:
                self._drop(message)
                continue
            buf = bytearray(size)
            message.Recv([buf, MPI.BYTE])
            buffers.append(buf)
        return buffers

    def _drain(self, src, exc, tag) -> None:
        """Receive into nothing the buffers a refused message announced (bounded like any buffer wait)."""
        try:
            self._receive_buffers(src, exc.sizes, exc.kind, exc.flags, exc.mid, tag, keep=False)
        except RpcMessageError as missing:
            self._record_error(f"refused message from worker {src}: {missing}")

    def _drop(self, message) -> None:
        """Receive a matched message into nothing: MPI truncates it and reports an error, and it is gone."""
        try:
            message.Recv([bytearray(0), self._MPI.BYTE])
        except self._MPI.Exception:
            pass

    def _on_batch(self, src, data) -> None:
        """Dispatch each small message of a batch, in order (their requests run on the pool, not here)."""
        try:
            frames = framing.split_batch(data)
        except RpcMessageError as exc:
            self._on_malformed(src, exc, 0)
            return
        for frame in frames:
            try:
                kind, flags, mid, sizes, meta, forks, body, slot = framing.unpack_header(frame)
                if sizes or kind in (K_BATCH, K_STOP, K_WAKE):
                    raise RpcMessageError(f"a message of kind {kind_name(kind)} with {len(sizes)} out-of-band "
                                          "buffers cannot travel in a batch", kind=kind, flags=flags, mid=mid)
                self._check_kind(src, kind, flags, mid, ())
                meta = framing.load_meta(meta, kind, flags, mid)
            except RpcMessageError as exc:
                self._on_malformed(src, exc, frame[3] if exc.mid is not None else 0)
            else:
                self._deliver(src, kind, flags, mid, meta, forks, body, [], slot, False)

    # -- replies the caller receives itself -------------------------------------------------------------------
    def slot(self):
        """This thread's reply slot (made at its first blocking call); None when every slot is taken (the reply
        then comes through the listener)."""
        slot = getattr(self._thread_slot, "slot", None)
        if slot is None:
            with self._slot_lock:
                if not self._free_slots:
                    return None
                number = self._free_slots.pop()
            slot = _Slot(number, self._wait.Waiter(self.comm, REPLY_SPIN, REPLY_SLEEP_MAX), self._free_slot)
            self._thread_slot.slot = slot
            self._slots.add(slot)
        return slot

    def _free_slot(self, number: int) -> None:
        with self._slot_lock:
            self._free_slots.append(number)

    def await_reply(self, slot, dst: int, mid: int, deadline: float):
        """Receive the reply to request ``mid`` sent to ``dst`` with ``slot``, on this thread, by ``deadline``
        (monotonic seconds). Returns ``(flags, meta, forks, body, buffers)``, or None when the time is up.

        A reply to an earlier request of this slot (one that timed out) is received and dropped. A malformed
        reply to this request raises its RpcMessageError; RpcError when the agent stops meanwhile.
        """
        ANY_SOURCE, BYTE = self._MPI.ANY_SOURCE, self._MPI.BYTE
        waiter, tag = slot.waiter, slot.tag
        status = waiter.status
        waiter.touch()  # the request just left: poll for the answer
        while True:
            if not self.running:
                raise RpcError("the RPC agent was shut down before the response arrived")
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if not waiter.probe(ANY_SOURCE, tag, min(left, SLICE)):
                continue
            src = status.Get_source()
            data = self._receive(waiter, status, BYTE)
            if data is None:
                continue
            try:
                kind, flags, rmid, sizes, meta, forks, body, _slot = framing.unpack_header(data)
                buffers = self._receive_buffers(src, sizes, kind, flags, rmid, tag) if sizes else []
                if src != dst or rmid != mid or kind != K_RESPONSE:
                    continue  # the late answer to an earlier request of this slot
                if flags & RPC_FLAG_DEVICES:
                    buffers = framing.place_buffers(buffers, framing.device_records(
                        data, self.device_count, kind, flags, mid))
                return flags, framing.load_meta(meta, kind, flags, mid), forks, body, buffers
            except RpcMessageError as exc:
                if exc.sizes:
                    self._drain(src, exc, tag)
                if src == dst and exc.mid in (None, mid):
                    raise
                self._record_error(f"refused a late reply from worker {src}: {exc}")

    # -- stopping ---------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop listening and waiting: the listener and every thread in :meth:`await_reply` return."""
        self.running = False
        self.seat.stop()
        self.listener.wake()
        for slot in list(self._slots):
            slot.waiter.wake()

    def wait_listeners(self, timeout: float) -> bool:
        """After :meth:`stop`: wait (bounded) until no thread listens any more (none is inside MPI's probe)."""
        deadline = time.monotonic() + timeout
        delay = 1e-4
        while self._listening:
            if time.monotonic() > deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
        return True

    def complete_sends(self, timeout: float) -> int:
        """Wait (bounded) for the ``Isend`` requests still in flight; return how many did not complete. Sends to
        this worker itself that nobody received (a reply to a call that timed out) are cancelled."""
        MPI = self._MPI
        deadline = time.monotonic() + timeout
        with self._isend_lock:
            entries, self._isends = self._isends, []
        for requests, _header, _buffers, to_self in entries:
            for request in requests if to_self else ():
                if not request.Test():  # nobody will receive it any more
                    request.Cancel()
                    request.Wait()
        pending = [r for entry in entries if not entry[3] for r in entry[0]]
        while pending and not MPI.Request.Testall(pending):
            if time.monotonic() > deadline:
                return len(pending)
            time.sleep(1e-3)
        return 0
