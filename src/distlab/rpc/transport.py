"""The RPC agent's transport: MPI point-to-point sends, and the listener thread that receives (not twinned).

How it waits (measured on this 2-core machine, MPICH wheel, 2 ranks; ``benchmarks/bench_rpc.py``): a listener
thread blocked in ``MPI_Mprobe`` (GIL released, MPICH's progress engine polls in C) gave a 36-50 us round trip
on an idle machine; ``MPI_Improbe`` polling from Python with ``sleep(0)``/back-off gave 190-240 us, and spinning
on ``Improbe`` from Python made the caller wait for the GIL (0.7-1.3 ms per round trip under load): the poller
re-takes the GIL before the woken caller can. But a blocking ``Mprobe`` busy-polls inside MPICH, so an idle
worker burnt a whole core. Hence the *adaptive* wait (default; ``DISTLAB_RPC_WAIT=block`` keeps the blocking
probe): the listener blocks in ``Mprobe`` while there is traffic; after ``IDLE_AFTER`` with no message and no
answer awaited, the timeout thread sends it a ``wake`` message, and it switches to polling ``Improbe`` with
pauses on an Event (no spinning, back-off up to ``IDLE_SLEEP_MAX``), which a send from this worker or any
arriving message ends. And while other threads stream sends (rpc_async, remote) and nobody blocks in
``call_sync``, the listener polls with 50 us pauses (*streaming* mode): a listener in ``Mprobe`` holds MPICH's
lock while it polls, and each ``MPI_Send`` of the streaming thread waited ~100 us for it. The caller always
waits on a condition variable: only one Python thread ever waits in MPI, and nobody spin-polls.

Sends: a header message (``TAG_HEADER``) then the out-of-band buffers (``TAG_BUFFER``), under a per-destination
lock so the buffers of two messages never interleave (MPI keeps order per source, tag and communicator). Small
messages use a blocking ``MPI_Send`` (eager: it never waits for the receiver); large ones ``MPI_Isend``, kept
alive until complete, so a listener replying inline never blocks on a peer that is itself blocked sending
(the progress engine completes them while the listener waits in ``Mprobe``).

Batching: small messages the listener itself sends (inline replies, RRef control messages) wait in a
per-destination outbox while more messages are already queued for the listener (``MPI_Improbe``), and leave as
one ``batch`` message (at most ``BATCH_MAX_FRAMES`` messages or ``EAGER_MAX`` bytes, flushed at least every
``BATCH_MAX_FRAMES // 4`` messages handled). A lone request is answered at once.
"""
from __future__ import annotations

import collections
import os
import threading
import time
import traceback
from typing import Callable

from distlab._common.rpc_framing import FRAME_LEN
from distlab._wire import RPC_KIND_CODES, RPC_KINDS, RPC_TAG_BUFFER, RPC_TAG_HEADER
from distlab.errors import RpcMessageError

from . import framing

__all__ = ["Transport", "TAG_HEADER", "TAG_BUFFER", "kind_name"]

IDLE_AFTER = 0.05        # adaptive wait: no message and nothing awaited for this long -> idle mode
IDLE_SLEEP_MAX = 0.002   # adaptive wait: longest pause between polls when idle (incoming wake-up latency bound)
STREAM_WINDOW = 0.001    # adaptive wait: another thread sent within this -> poll with pauses (streaming mode)
STREAM_PAUSE = 5e-5      # adaptive wait: pause between polls in streaming mode
TAG_HEADER = RPC_TAG_HEADER
TAG_BUFFER = RPC_TAG_BUFFER
EAGER_MAX = 16 * 1024  # bytes sent with a blocking MPI_Send (below MPICH's eager limits)
BATCH_MAX_FRAMES = 64

K_RESPONSE = RPC_KIND_CODES["response"]
K_STOP = RPC_KIND_CODES["stop"]
K_WAKE = RPC_KIND_CODES["wake"]
K_BATCH = RPC_KIND_CODES["batch"]


def kind_name(kind: int) -> str:
    """The name of a message kind (for errors and the timeline)."""
    return RPC_KINDS[kind] if 0 <= kind < len(RPC_KINDS) else f"kind {kind}"


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
    buffer_timeout : float
        How long the listener waits for a message's out-of-band buffers after its header (seconds).
    """

    def __init__(self, comm, name: str, deliver: Callable, busy: Callable, record_error: Callable,
                 on_malformed: Callable, buffer_timeout: float):
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self._deliver = deliver
        self._busy = busy
        self._record_error = record_error
        self._on_malformed = on_malformed
        self.buffer_timeout = buffer_timeout
        self._max_bytes = framing.MAX_MESSAGE_BYTES
        self.wait_mode = os.environ.get("DISTLAB_RPC_WAIT", "adaptive").strip().lower()
        if self.wait_mode not in ("adaptive", "block"):
            raise ValueError(f"DISTLAB_RPC_WAIT={self.wait_mode!r} is not one of adaptive, block")
        self._send_locks = [threading.Lock() for _ in range(comm.Get_size())]
        self._isends: list = []
        self._self_sends: list = []  # (request, header) of wake/stop messages to this worker's own listener
        self._isend_lock = threading.Lock()
        # Small messages the listener sends (inline replies, control messages) wait in an outbox while more
        # messages are already queued for it, and go out together as one "batch" MPI message.
        self._outbox: dict[int, list] = {}
        self._outbox_bytes: dict[int, int] = {}
        self._last_activity = time.monotonic()
        self.idle = False               # listener in idle mode (polling with pauses), adaptive wait only
        self._wake = threading.Event()  # set by a send to end an idle pause at once
        self._wake_sent = False         # a K_WAKE to self is in flight
        self._last_send = 0.0           # monotonic time of the last send by a thread other than the listener
        self._sync_threads = set()      # threads blocked in call_sync (they want the lowest latency)
        self._streaming = False         # listener polling with pauses while other threads stream sends
        self.on_leave_idle: Callable = lambda: None  # set by the agent: the timeout thread resumes idle checks
        self._local = collections.deque()  # messages the listener sent to its own worker: (header, buffers)
        self._listener_ident = None
        self.running = True
        self._listener = threading.Thread(target=self._listen, name=f"distlab-rpc-listener-{name}", daemon=True)

    def start(self) -> None:
        self._listener.start()

    def on_listener(self) -> bool:
        """True on the listener thread."""
        return threading.get_ident() == self._listener_ident

    # -- sending ----------------------------------------------------------------------------------------------
    def transmit(self, dst, kind, flags, mid, buffers, meta, forks, body) -> None:
        """Send one message (header, then its out-of-band buffers)."""
        header = framing.pack_header(kind, flags, mid, buffers, meta, forks, body)
        MPI = self._MPI
        comm = self.comm
        if dst == self.rank and threading.get_ident() == self._listener_ident:
            # A send to one's own rank completes only when the listener receives it, so from the listener it
            # would never complete (a 1-rank job then hung). Deliver it after the current message, as the same
            # bytes (buffers copied, as MPI would).
            self._local.append((header, [bytearray(b) for b in buffers]))
            return
        if not buffers and len(header) <= EAGER_MAX:
            if threading.get_ident() == self._listener_ident:
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
                requests.append(comm.Isend([buf, MPI.BYTE], dst, TAG_BUFFER))
        with self._isend_lock:
            self._isends.append((requests, header, buffers))
            if len(self._isends) > 8:
                self._isends = [entry for entry in self._isends if not MPI.Request.Testall(entry[0])]

    def after_send(self) -> None:
        """A thread sent a request: note it for the streaming mode, and end an idle pause at once."""
        if threading.get_ident() != self._listener_ident:
            self._last_send = time.monotonic()
        if self.idle:
            self._wake.set()

    def sync_begin(self) -> int:
        """This thread is about to block in ``call_sync``: the listener goes back to its blocking probe."""
        ident = threading.get_ident()
        self._sync_threads.add(ident)
        if self._streaming:
            self._wake.set()
        return ident

    def sync_end(self, ident: int) -> None:
        self._sync_threads.discard(ident)

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
        adaptive = self.wait_mode == "adaptive"
        self._listener_ident = threading.get_ident()
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
                elif adaptive and self.idle:
                    message = self._probe_idle(comm, status)
                elif (adaptive and not self._sync_threads
                      and time.monotonic() - self._last_send < STREAM_WINDOW):
                    message = self._probe_streaming(comm, status)
                else:
                    message = comm.Mprobe(MPI.ANY_SOURCE, TAG_HEADER, status)
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

        A malformed message (RpcMessageError: bad header, sizes out of bounds, buffers that do not come) is
        refused and reported; the listener goes on with the next one.
        """
        try:
            kind, flags, mid, sizes, meta, forks, body = framing.unpack_header(data)
            if buffers is None:
                buffers = self._receive_buffers(src, sizes, kind, flags, mid) if sizes else []
        except RpcMessageError as exc:
            self._on_malformed(src, exc)
            return False
        if src == self.rank and (kind == K_STOP or kind == K_WAKE):
            if kind == K_STOP:
                return True
            # the timeout thread saw no traffic for IDLE_AFTER: go idle unless something is awaited
            self._wake_sent = False
            if not self._busy() and time.monotonic() - self._last_activity >= IDLE_AFTER:
                self.idle = True
            return False
        self._last_activity = time.monotonic()
        if kind == K_BATCH:
            self._on_batch(src, body)
        else:
            self._deliver(src, kind, flags, mid, meta, forks, body, buffers)
        return False

    def _receive_buffers(self, src, sizes, kind, flags, mid) -> list:
        """Receive a message's out-of-band buffers from ``src``: each one matched by a probe (``Improbe``),
        checked against the size its header announced, then received (``Mrecv``); all within
        ``buffer_timeout``. A buffer that does not come, or has another size, is an RpcMessageError."""
        MPI = self._MPI
        comm = self.comm
        status = MPI.Status()
        deadline = time.monotonic() + self.buffer_timeout
        buffers = []
        for index, size in enumerate(sizes):
            message = comm.Improbe(src, TAG_BUFFER, status)
            delay = 1e-5
            while message is None:
                if time.monotonic() > deadline:
                    raise RpcMessageError(
                        f"out-of-band buffer {index + 1} of {len(sizes)} ({size} bytes) of message #{mid} "
                        f"({kind_name(kind)}) from worker {src} did not arrive within {self.buffer_timeout:g} s",
                        kind=kind, flags=flags, mid=mid)
                time.sleep(delay)
                delay = min(delay * 2, 1e-3)
                message = comm.Improbe(src, TAG_BUFFER, status)
            count = status.Get_count(MPI.BYTE)
            if count != size:
                self._drop(message)
                raise RpcMessageError(
                    f"out-of-band buffer {index + 1} of {len(sizes)} of message #{mid} ({kind_name(kind)}) from "
                    f"worker {src} has {count} bytes, its header said {size}", kind=kind, flags=flags, mid=mid)
            buf = bytearray(size)
            message.Recv([buf, MPI.BYTE])
            buffers.append(buf)
        return buffers

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
            except RpcMessageError as exc:
                self._on_malformed(src, exc)
            else:
                self._deliver(src, kind, flags, mid, meta, forks, body, [])

    def _probe_streaming(self, comm, status):
        """Streaming mode: another thread is sending a stream of requests (rpc_async, remote). A listener
        blocked in ``Mprobe`` holds MPICH's lock while it polls, and every send then waits for it (measured
        ~100 us per MPI_Send under load), so poll with ``Improbe`` and short pauses instead; go back to the
        blocking probe when the stream stops or a caller blocks in ``call_sync``."""
        MPI = self._MPI
        wake = self._wake
        self._streaming = True
        try:
            while True:
                message = comm.Improbe(MPI.ANY_SOURCE, TAG_HEADER, status)
                if message is not None:
                    return message
                if self._sync_threads or time.monotonic() - self._last_send >= STREAM_WINDOW or wake.is_set():
                    wake.clear()
                    return comm.Mprobe(MPI.ANY_SOURCE, TAG_HEADER, status)
                wake.wait(STREAM_PAUSE)
        finally:
            self._streaming = False

    def _probe_idle(self, comm, status):
        """Idle mode: poll with ``MPI_Improbe``, pausing on an Event (GIL released, no spinning) with
        exponential back-off up to ``IDLE_SLEEP_MAX``; a send from this worker ends the pause at once. Leaves
        idle mode (back to the blocking ``Mprobe``) on the first message or send."""
        MPI = self._MPI
        delay = 0.0
        wake = self._wake
        while True:
            message = comm.Improbe(MPI.ANY_SOURCE, TAG_HEADER, status)
            if message is not None or self._busy() or wake.is_set():
                wake.clear()
                self.idle = False
                self.on_leave_idle()
                if message is not None:
                    return message
                return comm.Mprobe(MPI.ANY_SOURCE, TAG_HEADER, status)
            delay = min(max(delay * 2.0, 5e-5), IDLE_SLEEP_MAX)
            wake.wait(delay)

    # -- idleness (asked by the timeout thread) ---------------------------------------------------------------
    def idle_interval(self):
        """How long the timeout thread may sleep before it checks idleness again (None: no check needed)."""
        return IDLE_AFTER if self.wait_mode == "adaptive" and not self.idle else None

    def maybe_go_idle(self) -> None:
        """After IDLE_AFTER without traffic, break the listener out of its busy-polling ``Mprobe`` (a K_WAKE
        message to self) so it can switch to idle polling."""
        if (self.wait_mode != "adaptive" or self.idle or self._wake_sent or self._busy() or not self.running
                or time.monotonic() - self._last_activity < IDLE_AFTER):
            return
        self._wake_sent = True
        try:
            self._send_to_self(K_WAKE)
        except Exception:  # noqa: BLE001 - the agent is stopping
            self._wake_sent = False

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
        self.running = False
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
