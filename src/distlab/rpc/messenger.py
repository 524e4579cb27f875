"""The RPC messenger: MPI point-to-point sends, the listener's loop, and the replies a caller receives itself.

Shared plumbing of :mod:`distlab.rpc` (not twinned); how a thread waits for a message is the twinned
``rpc_wait`` component (:mod:`distlab.reference.rpc_wait`: the waiter that polls then sleeps, and the listener's
seat).

Sends: a header message, then its out-of-band buffers, under a per-destination lock so the buffers of two messages
never interleave. A request goes on ``TAG_HEADER``, its buffers on ``TAG_BUFFER``. Its reply goes where the
request's *reply slot* says: slot 0 (``rpc_async``, ``remote``, RRef control messages) on ``TAG_HEADER`` to the
caller's listener; slot ``s`` (``rpc_sync``, ``to_here``) on tag ``TAG_REPLY_BASE + s``, header and buffers, to
the caller's own thread, which waits for it there (:mod:`distlab.rpc.replies`): no other thread wakes up, and
nothing is handed from one thread to another. Small messages go out with a blocking ``MPI_Send`` (eager), large ones with ``MPI_Isend``
kept alive until complete; every send to one's own rank is an ``Isend`` (a blocking one completes only once
received). Small messages the listener sends while more are queued for it wait in a per-destination outbox and
leave as one ``batch`` message; so do small requests other threads send while many are in flight (``CORK_AFTER``),
in a corked box the listener empties whenever it has nothing else to do. A message the listener sends to its own rank is delivered locally.

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
from typing import Callable

from distlab import _backend
from distlab._common.rpc_framing import FRAME_LEN, with_sizes
from distlab._common.rpc_wait import LISTEN_SLEEP_MAX, LISTEN_SPIN, STANDBY_POLL, TAKEOVER
from distlab._wire import RPC_FLAG_DEVICES, RPC_KIND_CODES, RPC_KINDS, RPC_TAG_BUFFER, RPC_TAG_HEADER
from distlab.errors import ProcessFailedError, RpcMessageError

from . import framing
from .devices import DeviceBuffer

__all__ = ["Messenger", "TAG_HEADER", "TAG_BUFFER", "K_RESPONSE", "CORK_AFTER", "kind_name", "unpack_header"]

TAG_HEADER = RPC_TAG_HEADER
TAG_BUFFER = RPC_TAG_BUFFER
EAGER_MAX = 16 * 1024  # bytes sent with a blocking MPI_Send (below MPICH's eager limits)
BATCH_MAX_FRAMES = 64
#: With at least this many requests in flight, a worker's small requests wait in corked boxes (``transmit(cork=)``):
#: their answers are not awaited one by one, so they may leave in batches (one MPI message, one probe, for many).
CORK_AFTER = 8
#: How long the listener polls for a message's buffers without pausing. The sender sends them right after the
#: header, so they are matched within microseconds; a pause (``time.sleep`` sleeps far longer) cost the 1 MiB
#: echo a third of its round trip (docs/measurements.md, "RPC: in-band buffers and the buffer spin").
BUFFER_SPIN = 0.002
#: The longest a waiting thread stays in one probe before it looks at its deadline and at its agent again.
SLICE = 0.25

_pack_header = framing.codec.pack_header      # the active codec twin's, called straight on the hot paths
unpack_header = framing.codec.unpack_header  # (kind, flags, mid, sizes, forks, meta, body, slot)

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


class Messenger:
    """Sends and receives RPC messages on the agent's communicator.

    What the listening thread does with a message it received is given by :meth:`attach`.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The agent's own communicator.
    name : str
        This worker's name (in the errors it reports).
    handlers : dict
        The request kinds this worker handles (keys); a message of another kind (not a response) is refused
        before its metadata is unpickled. The agent's registry, read here.
    record_error : callable
        ``record_error(text)``: log a problem the listener survived.
    on_malformed : callable
        ``on_malformed(src, error, slot)``: a message from ``src`` was refused (an RpcMessageError); the agent logs
        it and, when the header could be read, answers the sender's request with the error (on reply slot ``slot``).
    buffer_timeout : float
        How long a receiver waits for a message's out-of-band buffers after its header (seconds).
    """

    def __init__(self, comm, name: str, handlers: dict, record_error: Callable, on_malformed: Callable,
                 buffer_timeout: float):
        from mpi4py import MPI

        self._MPI = MPI
        self._wait = _backend.load("rpc_wait")
        self.comm = comm
        self.rank = comm.Get_rank()
        self.name = name
        self._handlers = handlers
        self._on_request = self._on_response = None
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
        self._local = collections.deque()  # what the listener handles before MPI's next: (src, header or frames, buffers)
        # Requests other threads send while many are in flight (rpc_async in a loop) wait in a corked box per
        # destination and leave as one batch: when the box is full, or when the listener has nothing else to do.
        self._corked: dict[int, list] = {}
        self._corked_bytes: dict[int, int] = {}
        self._cork_lock = threading.Lock()
        self._lock = threading.Lock()
        #: the devices this worker sees (set by the agent; None: no device arrays can be received)
        self.device_count = None
        self.running = True
        #: workers known dead (fault tolerance): id -> the ProcessFailedError that named them (see peers_failed)
        self.failed: dict[int, ProcessFailedError] = {}
        #: ``on_failure(error)``: set by the agent, told when workers died (it fails what waits for them)
        self.on_failure = None
        self._listening = 0  # threads inside listen() (one, or none; briefly two when the seat changes hands)

    def attach(self, on_request: Callable, on_response: Callable) -> None:
        """Where received messages go, called on the listening thread (batches already split):
        ``on_request(src, kind, flags, mid, meta, forks, body, buffers, slot, here)`` (``here``: the message came on
        its own, not in a batch, so the listening thread may run it itself) and
        ``on_response(src, flags, mid, forks, body, buffers, meta)``."""
        self._on_request = on_request
        self._on_response = on_response

    # -- sending ----------------------------------------------------------------------------------------------
    def transmit(self, dst, kind, flags, mid, buffers, meta, forks, body, slot=0, tag=TAG_HEADER,
                 cork=False) -> None:
        """Send one message (header, then its out-of-band buffers); ``slot``: a request's reply slot; ``tag``: the
        header's tag (a reply to slot ``s`` goes on its tag, buffers included); ``cork``: a small message may wait
        in ``dst``'s corked box and leave in a batch (the sender has many requests in flight)."""
        if buffers or meta is not None:
            header = framing.pack_header(kind, flags, mid, buffers, meta, forks, body, slot)
        else:
            header = _pack_header(kind, flags, mid, (), forks, b"", body, (), slot)
        MPI = self._MPI
        comm = self.comm
        listening = self.seat.listening()
        if dst == self.rank:
            if listening and tag == TAG_HEADER:
                # A send to one's own rank completes only when it is received, so from the listener it would
                # never complete: deliver it after the current message, as the same bytes (buffers copied).
                self._local.append((dst, header, [bytearray(_data(b)) for b in buffers]))
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
            if cork:
                self._cork(dst, header)
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
        if box:
            self._send_batch(dst, box)

    def _flush_outbox(self) -> None:
        for dst in list(self._outbox):
            self._flush_to(dst)
        if self._corked:
            self.flush_corked()

    def _cork(self, dst, header) -> None:
        """Any thread: hold a small request for ``dst`` in its corked box (sent at once when the box is full)."""
        full = None
        with self._cork_lock:
            box = self._corked.get(dst)
            if box is None:
                box = self._corked[dst] = []
                self._corked_bytes[dst] = 0
            box.append(header)
            self._corked_bytes[dst] += len(header) + FRAME_LEN.size
            if len(box) >= BATCH_MAX_FRAMES or self._corked_bytes[dst] > EAGER_MAX - 64:
                full = self._corked.pop(dst)
                del self._corked_bytes[dst]
        if full is not None:
            self._send_batch(dst, full)

    def flush_corked(self) -> None:
        """Send every corked box now (the listener, when it has nothing else to do)."""
        with self._cork_lock:
            boxes, self._corked, self._corked_bytes = self._corked, {}, {}
        for dst, box in boxes.items():
            self._send_batch(dst, box)

    def _send_batch(self, dst, frames) -> None:
        data = frames[0] if len(frames) == 1 else framing.pack_header(K_BATCH, 0, 0, [], None, (),
                                                                       framing.pack_batch(frames))
        self.comm.Send([data, self._MPI.BYTE], dst, TAG_HEADER)

    # -- the listener -----------------------------------------------------------------------------------------
    def listen(self) -> None:
        """Receive and handle messages while this thread holds the seat; return when it lost it, or at stop."""
        with self._lock:
            self._listening += 1
        try:
            self._listen()
        finally:
            with self._lock:
                self._listening -= 1

    def _listen(self) -> None:
        ANY_SOURCE = self._MPI.ANY_SOURCE
        waiter, seat = self.listener, self.seat
        status = waiter.status
        handled = 0
        while self.running:
            try:
                if self._local:
                    src, header, buffers = self._local.popleft()
                    if buffers is None:
                        self._on_frames(src, header)  # the rest of a batch another listener left
                    else:
                        self._handle(src, header, buffers, True)
                else:
                    if (self._outbox or self._corked) and handled >= BATCH_MAX_FRAMES // 4:
                        # Bound how long a held message waits while traffic from other workers keeps coming.
                        self._flush_outbox()
                        handled = 0
                    if self._outbox or self._corked:
                        # More work already queued? Handle it first; else send what the outbox holds.
                        if not waiter.probe(ANY_SOURCE, TAG_HEADER, 0.0):
                            self._flush_outbox()
                            handled = 0
                            continue
                    elif not waiter.probe(ANY_SOURCE, TAG_HEADER, SLICE):
                        continue
                    data = self.receive(waiter)
                    if data is not None:
                        self._handle(status.Get_source(), data, None, True)
                    handled += 1
            except ProcessFailedError as exc:  # workers died (fault tolerance): fail what waits for them
                self.peers_failed(exc)
            except Exception:  # noqa: BLE001 - keep listening; record what went wrong
                self._record_error(f"listener error: {traceback.format_exc()}")
            if not seat.listening():
                return
        self._flush_outbox()

    def receive(self, waiter):
        """The bytes of the message ``waiter`` matched (None: larger than the limit, dropped and reported)."""
        status = waiter.status
        count = status.Get_count(self._MPI.BYTE)
        if count > self._max_bytes:
            self._drop(waiter.message)
            self._on_malformed(status.Get_source(), RpcMessageError(
                f"dropped a {count}-byte RPC message: larger than DISTLAB_RPC_MAX_MESSAGE_BYTES "
                f"({self._max_bytes})"), 0)
            return None
        data = bytearray(count)
        waiter.message.Recv([data, self._MPI.BYTE])
        return data

    def _handle(self, src, data, buffers, here) -> None:
        """Parse and dispatch one header message (its buffers come over MPI unless given).

        A malformed message (RpcMessageError: bad header, a kind nobody handles, sizes out of bounds, pickles that
        do not walk, buffers that do not come) is refused and reported, before anything in it is unpickled; the
        listener goes on with the next one.
        """
        try:
            kind, flags, mid, sizes, forks, meta, body, slot = unpack_header(data, self._max_bytes)
            if kind == K_STOP or kind == K_WAKE:
                raise RpcMessageError(f"refused a {kind_name(kind)} message from worker {src}: only a worker's "
                                      "own listener sends those", kind=kind, flags=flags, mid=mid)
            if kind != K_RESPONSE and kind not in self._handlers:
                self._check_kind(src, kind, flags, mid, sizes)
            if flags & RPC_FLAG_DEVICES:
                records = self._device_records(data, kind, flags, mid, sizes)
                if buffers is None:
                    buffers = self.receive_buffers(src, sizes, kind, flags, mid, TAG_BUFFER)
                buffers = framing.place_buffers(buffers, records)  # each buffer names the device it lands on
            elif buffers is None:
                buffers = self.receive_buffers(src, sizes, kind, flags, mid, TAG_BUFFER) if sizes else []
            meta = framing.load_meta(meta, kind, flags, mid) if meta else None
        except RpcMessageError as exc:
            if exc.sizes and buffers is None:
                self.drain(src, exc, TAG_BUFFER)
            self._on_malformed(src, exc, data[3] if exc.mid is not None else 0)
            return
        if kind == K_RESPONSE:
            self._on_response(src, flags, mid, forks, body, buffers, meta)
        elif kind == K_BATCH:
            self._on_batch(src, body)
        else:
            self._on_request(src, kind, flags, mid, meta, forks, body, buffers, slot, here)

    def _check_kind(self, src, kind, flags, mid, sizes) -> None:
        """RpcMessageError unless a message of ``kind`` has a handler here (a batch is split by the listener)."""
        if kind != K_BATCH and kind != K_RESPONSE and kind not in self._handlers:
            raise with_sizes(RpcMessageError(
                f"refused message #{mid} ({kind_name(kind)}) from worker {src}: worker {self.name} has no handler "
                f"for message kind {kind}", kind=kind, flags=flags, mid=mid), sizes)

    def _device_records(self, data, kind, flags, mid, sizes) -> tuple:
        """The device record of each buffer, checked against this worker's devices (RpcMessageError otherwise)."""
        try:
            return framing.device_records(data, self.device_count, kind, flags, mid)
        except RpcMessageError as exc:
            raise with_sizes(exc, sizes) from None

    def receive_buffers(self, src, sizes, kind, flags, mid, tag, keep=True) -> list:
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

    def drain(self, src, exc, tag) -> None:
        """Receive into nothing the buffers a refused message announced (bounded like any buffer wait)."""
        try:
            self.receive_buffers(src, exc.sizes, exc.kind, exc.flags, exc.mid, tag, keep=False)
        except RpcMessageError as missing:
            self._record_error(f"refused message from worker {src}: {missing}")

    def _drop(self, message) -> None:
        """Receive a matched message into nothing: MPI truncates it and reports an error, and it is gone."""
        try:
            message.Recv([bytearray(0), self._MPI.BYTE])
        except self._MPI.Exception:
            pass

    def _on_batch(self, src, data) -> None:
        """Dispatch each small message of a batch, in order."""
        try:
            frames = framing.split_batch(data)
        except RpcMessageError as exc:
            self._on_malformed(src, exc, 0)
            return
        self._on_frames(src, frames)

    def _on_frames(self, src, frames) -> None:
        """The frames of a batch, in order. Should this thread lose the seat while it runs one's request, the
        listener that took it handles the rest."""
        seat = self.seat
        for index, frame in enumerate(frames):
            if not seat.listening():
                self._local.appendleft((src, frames[index:], None))
                self.listener.wake()
                return
            try:
                kind, flags, mid, sizes, forks, meta, body, slot = unpack_header(frame, self._max_bytes)
                if sizes or kind in (K_BATCH, K_STOP, K_WAKE):
                    raise RpcMessageError(f"a message of kind {kind_name(kind)} with {len(sizes)} out-of-band "
                                          "buffers cannot travel in a batch", kind=kind, flags=flags, mid=mid)
                if kind != K_RESPONSE and kind not in self._handlers:
                    self._check_kind(src, kind, flags, mid, ())
                meta = framing.load_meta(meta, kind, flags, mid) if meta else None
            except RpcMessageError as exc:
                self._on_malformed(src, exc, frame[3] if exc.mid is not None else 0)
            else:
                if kind == K_RESPONSE:
                    self._on_response(src, flags, mid, forks, body, [], meta)
                else:
                    self._on_request(src, kind, flags, mid, meta, forks, body, [], slot, True)

    def peers_failed(self, exc: ProcessFailedError) -> None:
        """Workers died: a waiter's probe said so (under fault tolerance; :func:`distlab.comm.ulfm.failed_probe`,
        which acknowledged it). Remember them, and tell the agent, which fails every request in
        flight to them and wakes the threads that wait for their replies."""
        for worker in exc.group_ranks:
            self.failed.setdefault(worker, exc)
        if self.on_failure is not None:
            self.on_failure(exc)

    # -- stopping ---------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop listening: the listener returns (and :class:`~distlab.rpc.replies.ReplySlots` waits no more)."""
        self.running = False
        self.seat.stop()
        self.listener.wake()

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
