"""The RPC agent's transport: MPI point-to-point sends, and the listener thread that receives (not twinned).

How the listener waits for a message (the adaptive wait) is :mod:`distlab.rpc.waiting`.

Sends: a header message (``TAG_HEADER``) then the out-of-band buffers (``TAG_BUFFER``), under a per-destination
lock so the buffers of two messages never interleave. Small messages use a blocking ``MPI_Send`` (eager), large
ones ``MPI_Isend`` kept alive until complete. Small messages the listener itself sends wait in a
per-destination outbox while more messages are queued for it, and leave as one ``batch`` message. A message
the listener sends to its own rank is delivered locally (such a send would wait for the listener forever).

Receives: nothing a message claims is trusted (see :mod:`distlab.rpc.framing`), and nothing is unpickled before
every check passed: the codec checks the header's version, kind, flags, counts, sizes and pickles; the listener
then refuses a kind no handler takes (and stop or wake from another worker); buffers are matched by a probe and
received within ``buffer_timeout``; only then is the metadata unpickled, and the body later, by the handler's
thread. A refused message is reported (its announced buffers received into nothing, so they are not taken for the
next message's) and the listener goes on.
"""
from __future__ import annotations

import collections
import threading
import time
import traceback
from typing import Callable

from distlab._common.rpc_framing import FRAME_LEN, with_sizes
from distlab._wire import RPC_FLAG_DEVICES, RPC_KIND_CODES, RPC_KINDS, RPC_TAG_BUFFER, RPC_TAG_HEADER
from distlab.errors import RpcMessageError

from . import framing
from .devices import DeviceBuffer
from .waiting import AdaptiveWait

__all__ = ["Transport", "TAG_HEADER", "TAG_BUFFER", "kind_name"]

TAG_HEADER = RPC_TAG_HEADER
TAG_BUFFER = RPC_TAG_BUFFER
EAGER_MAX = 16 * 1024  # bytes sent with a blocking MPI_Send (below MPICH's eager limits)
BATCH_MAX_FRAMES = 64
#: How long the listener polls for a message's buffers without pausing. The sender sends them right after the
#: header, so they are matched within microseconds; a pause (``time.sleep`` sleeps far longer) cost the 1 MiB
#: echo a third of its round trip (docs/measurements.md, "RPC: in-band buffers and the buffer spin").
BUFFER_SPIN = 0.002

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


class Transport:
    """Sends and receives RPC messages on the agent's communicator.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The agent's own communicator.
    name : str
        This worker's name (names the listener thread).
    deliver : callable
        ``deliver(src, kind, flags, mid, meta, forks, body, buffers)``, called on the listener thread for every
        message received (batches already split).
    busy : callable
        ``busy() -> bool``: this worker awaits answers (the listener then never goes idle).
    record_error : callable
        ``record_error(text)``: log a problem the listener survived.
    on_malformed : callable
        ``on_malformed(src, error)``: a message from ``src`` was refused (an RpcMessageError); the agent logs it
        and, when the header could be read, answers the sender's request with the error.
    handles : callable
        ``handles(kind) -> bool``: a message of ``kind`` (a response, or a request) has a handler on this worker;
        any other is refused before its metadata is unpickled.
    buffer_timeout : float
        How long the listener waits for a message's out-of-band buffers after its header (seconds).
    """

    def __init__(self, comm, name: str, deliver: Callable, busy: Callable, record_error: Callable,
                 on_malformed: Callable, handles: Callable, buffer_timeout: float):
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.name = name
        self._deliver = deliver
        self._handles = handles
        self._record_error = record_error
        self._on_malformed = on_malformed
        self.buffer_timeout = buffer_timeout
        self._max_bytes = framing.MAX_MESSAGE_BYTES
        self.waiting = AdaptiveWait(TAG_HEADER, busy, lambda: self._send_to_self(K_WAKE))
        self._send_locks = [threading.Lock() for _ in range(comm.Get_size())]
        self._isends: list = []
        self._self_sends: list = []  # (request, header) of wake/stop messages to this worker's own listener
        self._isend_lock = threading.Lock()
        # Small messages the listener sends (inline replies, control messages) wait in an outbox while more
        # messages are already queued for it, and go out together as one "batch" MPI message.
        self._outbox: dict[int, list] = {}
        self._outbox_bytes: dict[int, int] = {}
        self._local = collections.deque()  # messages the listener sent to its own worker: (header, buffers)
        self._listener_ident = None
        #: the devices this worker sees (set by the agent; None: no device arrays can be received)
        self.device_count = None
        self.running = True
        self._listener = threading.Thread(target=self._listen, name=f"distlab-rpc-listener-{name}", daemon=True)

    def start(self) -> None:
        self._listener.start()

    def on_listener(self) -> bool:
        """True on the listener thread."""
        return threading.get_ident() == self.waiting.listener_ident

    # -- sending ----------------------------------------------------------------------------------------------
    def transmit(self, dst, kind, flags, mid, buffers, meta, forks, body) -> None:
        """Send one message (header, then its out-of-band buffers)."""
        header = framing.pack_header(kind, flags, mid, buffers, meta, forks, body)
        MPI = self._MPI
        comm = self.comm
        if dst == self.rank and threading.get_ident() == self.waiting.listener_ident:
            # A send to one's own rank completes only when the listener receives it, so from the listener it
            # would never complete (a 1-rank job then hung). Deliver it after the current message, as the same
            # bytes (buffers copied, as MPI would).
            self._local.append((header, [bytearray(_data(b)) for b in buffers]))
            return
        if not buffers and len(header) <= EAGER_MAX:
            if threading.get_ident() == self.waiting.listener_ident:
                self._queue_frame(dst, header)
                return
            comm.Send([header, MPI.BYTE], dst, TAG_HEADER)
            return
        requests = []
        with self._send_locks[dst]:
            if len(header) <= EAGER_MAX:
                comm.Send([header, MPI.BYTE], dst, TAG_HEADER)
            else:
                requests.append(comm.Isend([header, MPI.BYTE], dst, TAG_HEADER))
            for buf in buffers:
                requests.append(comm.Isend([_data(buf), MPI.BYTE], dst, TAG_BUFFER))
        with self._isend_lock:
            self._isends.append((requests, header, buffers))
            if len(self._isends) > 8:
                self._isends = [entry for entry in self._isends if not MPI.Request.Testall(entry[0])]

    def _queue_frame(self, dst, header) -> None:
        """Listener thread only: hold a small message for ``dst`` until the listener runs out of work."""
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
        MPI = self._MPI
        if len(box) == 1:
            data = box[0]
        else:
            data = framing.pack_header(K_BATCH, 0, 0, [], None, (), framing.pack_batch(box))
        self.comm.Send([data, MPI.BYTE], dst, TAG_HEADER)

    def _flush_outbox(self) -> None:
        for dst in list(self._outbox):
            self._flush_to(dst)

    # -- receiving --------------------------------------------------------------------------------------------
    def _listen(self) -> None:
        MPI = self._MPI
        comm = self.comm
        status = MPI.Status()
        waiting = self.waiting
        waiting.listener_ident = threading.get_ident()
        handled = 0
        while True:
            try:
                if self._local:
                    header, buffers = self._local.popleft()
                    self._handle(self.rank, header, buffers)
                    continue
                if self._outbox and handled >= BATCH_MAX_FRAMES // 4:
                    # Bound how long a held message waits while traffic from other workers keeps coming.
                    self._flush_outbox()
                    handled = 0
                if self._outbox:
                    # More work already queued? Handle it first; else send what the outbox holds.
                    message = comm.Improbe(MPI.ANY_SOURCE, TAG_HEADER, status)
                    if message is None:
                        self._flush_outbox()
                        handled = 0
                        continue
                else:
                    message = waiting.probe(comm, status)
                src = status.Get_source()
                count = status.Get_count(MPI.BYTE)
                if count > self._max_bytes:
                    self._drop(message)
                    self._on_malformed(src, RpcMessageError(
                        f"dropped a {count}-byte RPC message: larger than DISTLAB_RPC_MAX_MESSAGE_BYTES "
                        f"({self._max_bytes})"))
                    continue
                data = bytearray(count)
                message.Recv([data, MPI.BYTE])
                if self._handle(src, data, None):
                    self._flush_outbox()
                    return
                handled += 1
            except Exception:  # noqa: BLE001 - keep listening; record what went wrong
                self._record_error(f"listener error: {traceback.format_exc()}")

    def _handle(self, src, data, buffers) -> bool:
        """Parse and dispatch one header message (its buffers come over MPI unless given); True for a stop.

        A malformed message (RpcMessageError: bad header, a kind nobody handles, sizes out of bounds, pickles that
        do not walk, buffers that do not come) is refused and reported, before anything in it is unpickled; the
        listener goes on with the next one.
        """
        try:
            kind, flags, mid, sizes, meta, forks, body = framing.unpack_header(data)
            if kind == K_STOP or kind == K_WAKE:
                if src != self.rank:
                    raise RpcMessageError(f"refused a {kind_name(kind)} message from worker {src}: only a worker's "
                                          "own listener sends those", kind=kind, flags=flags, mid=mid)
                if kind == K_WAKE:
                    self.waiting.woken()
                return kind == K_STOP
            self._check_kind(src, kind, flags, mid, sizes)
            records = self._device_records(data, kind, flags, mid, sizes) if flags & RPC_FLAG_DEVICES else ()
            if buffers is None:
                buffers = self._receive_buffers(src, sizes, kind, flags, mid) if sizes else []
            if records:  # device arrays: each buffer names the device it is rebuilt on
                buffers = framing.place_buffers(buffers, records)
            meta = framing.load_meta(meta, kind, flags, mid)
        except RpcMessageError as exc:
            if exc.sizes and buffers is None:
                self._drain(src, exc)
            self._on_malformed(src, exc)
            return False
        self.waiting.activity()
        if kind == K_BATCH:
            self._on_batch(src, body)
        else:
            self._deliver(src, kind, flags, mid, meta, forks, body, buffers)
        return False

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

    def _receive_buffers(self, src, sizes, kind, flags, mid, keep=True) -> list:
        """Receive a message's out-of-band buffers from ``src``: each one matched by a probe (``Improbe``),
        checked against the size its header announced, then received (``Mrecv``; into nothing unless ``keep``);
        all within ``buffer_timeout``. A buffer that does not come, or has another size, is an RpcMessageError."""
        MPI = self._MPI
        comm = self.comm
        status = MPI.Status()
        start = time.monotonic()
        deadline = start + self.buffer_timeout
        buffers = []
        for index, size in enumerate(sizes):
            message = comm.Improbe(src, TAG_BUFFER, status)
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
                message = comm.Improbe(src, TAG_BUFFER, status)
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

    def _drain(self, src, exc) -> None:
        """Receive into nothing the buffers a refused message announced (bounded like any buffer wait)."""
        try:
            self._receive_buffers(src, exc.sizes, exc.kind, exc.flags, exc.mid, keep=False)
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
            self._on_malformed(src, exc)
            return
        for frame in frames:
            try:
                kind, flags, mid, sizes, meta, forks, body = framing.unpack_header(frame)
                if sizes or kind in (K_BATCH, K_STOP, K_WAKE):
                    raise RpcMessageError(f"a message of kind {kind_name(kind)} with {len(sizes)} out-of-band "
                                          "buffers cannot travel in a batch", kind=kind, flags=flags, mid=mid)
                self._check_kind(src, kind, flags, mid, ())
                meta = framing.load_meta(meta, kind, flags, mid)
            except RpcMessageError as exc:
                self._on_malformed(src, exc)
            else:
                self._deliver(src, kind, flags, mid, meta, forks, body, [])

    def _send_to_self(self, kind):
        """A control message to this worker's own listener, sent without blocking: a send to one's own rank
        completes only when the listener receives it (MPICH matches it like any other send), so a blocking one
        would hang whenever the listener is busy or gone. The request is kept and cancelled at stop if unmatched."""
        header = framing.pack_header(kind, 0, 0, [], None, (), b"")
        request = self.comm.Isend([header, self._MPI.BYTE], self.rank, TAG_HEADER)
        with self._isend_lock:
            self._self_sends = [r for r in self._self_sends if not r[0].Test()] + [(request, header)]
        return request

    # -- stopping ---------------------------------------------------------------------------------------------
    def stop(self, timeout: float) -> bool:
        """Stop the listener (a K_STOP message to self); return whether it stopped within ``timeout``.

        ``running`` is already False (the agent clears it first, so the timeout thread sends no more wake-ups).
        """
        self.running = self.waiting.running = False
        if self._listener.is_alive():
            self._send_to_self(K_STOP)
            self._listener.join(timeout)
        with self._isend_lock:
            unmatched, self._self_sends = self._self_sends, []
        for request, _header in unmatched:  # e.g. a wake-up the stopped listener never received
            if not request.Test():
                request.Cancel()
                request.Wait()
        return not self._listener.is_alive()

    def complete_sends(self, timeout: float) -> int:
        """Wait (bounded) for the ``Isend`` requests still in flight; return how many did not complete."""
        MPI = self._MPI
        deadline = time.monotonic() + timeout
        with self._isend_lock:
            pending = [r for entry in self._isends for r in entry[0]]
            self._isends = []
        while pending and not MPI.Request.Testall(pending):
            if time.monotonic() > deadline:
                return len(pending)
            time.sleep(1e-3)
        return 0
