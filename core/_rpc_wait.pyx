# cython: language_level=3
"""Core twin of :mod:`distlab.reference.rpc_wait` (read that): same names, same order, same behaviour.

A waiter polls ``MPI_Improbe`` itself, through the library mpi4py loaded (found by
``distlab._common.rpc_wait.libmpi``, checked by a message to itself), with the GIL released: it polls giving up
the core at every poll (``sched_yield``), then sleeps on a condition variable that :meth:`Waiter.touch` and
:meth:`Waiter.wake` signal. The matched message and its status are written into the waiter's own mpi4py
``Message`` and ``Status`` objects (their C handles, ``MPI._addressof``), so mpi4py receives it as its own. When
the library cannot be called that way (``path`` says why), the waiter polls through mpi4py as the reference does.
"""
from cpython.pythread cimport PyThread_get_thread_ident
from libc.stdint cimport uintptr_t
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, nanosleep, timespec

from distlab._common.rpc_wait import (IDLE_AFTER, IDLE_SLEEP_MAX, SELF_TEST_TAG, SLEEP_FIRST, check_times,
                                     comm_handle, libmpi, self_test_failed)
from distlab.comm.ulfm import failed_probe

__all__ = ["Waiter", "Seat"]

cdef extern from "<sched.h>" nogil:
    int sched_yield()

cdef extern from "<sys/prctl.h>" nogil:
    int prctl(int option, unsigned long arg2, unsigned long arg3, unsigned long arg4, unsigned long arg5)
    enum:
        PR_SET_TIMERSLACK
        PR_GET_TIMERSLACK

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    ctypedef struct pthread_condattr_t:
        pass
    int pthread_mutex_init(pthread_mutex_t* mutex, void* attr)
    int pthread_mutex_destroy(pthread_mutex_t* mutex)
    int pthread_mutex_lock(pthread_mutex_t* mutex)
    int pthread_mutex_unlock(pthread_mutex_t* mutex)
    int pthread_condattr_init(pthread_condattr_t* attr)
    int pthread_condattr_setclock(pthread_condattr_t* attr, int clock)
    int pthread_condattr_destroy(pthread_condattr_t* attr)
    int pthread_cond_init(pthread_cond_t* cond, pthread_condattr_t* attr)
    int pthread_cond_destroy(pthread_cond_t* cond)
    int pthread_cond_signal(pthread_cond_t* cond)
    int pthread_cond_timedwait(pthread_cond_t* cond, pthread_mutex_t* mutex, const timespec* abstime)

ctypedef int (*improbe_int_t)(int source, int tag, int comm, int* flag, void* message, void* status) noexcept nogil
ctypedef int (*improbe_ptr_t)(int source, int tag, void* comm, int* flag, void* message, void* status) noexcept nogil


cdef class Waiter:
    """See :class:`distlab.reference.rpc_wait.Waiter`."""
    cdef readonly object comm, status, message
    cdef public double spin, sleep_max
    cdef readonly str path
    cdef void* _improbe
    cdef uintptr_t _comm
    cdef bint _comm_is_pointer
    cdef void* _status_at
    cdef void* _message_at
    cdef volatile double _last
    cdef volatile int _sleeping, _woken, _touched
    cdef pthread_mutex_t _mutex
    cdef pthread_cond_t _cond

    def __cinit__(self, *args, **kwargs):
        cdef pthread_condattr_t attr
        pthread_mutex_init(&self._mutex, NULL)
        pthread_condattr_init(&attr)
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC)
        pthread_cond_init(&self._cond, &attr)
        pthread_condattr_destroy(&attr)

    def __dealloc__(self):
        pthread_cond_destroy(&self._cond)
        pthread_mutex_destroy(&self._mutex)

    def __init__(self, comm, spin, sleep_max):
        from mpi4py import MPI

        check_times("Waiter", spin=spin, sleep_max=sleep_max)
        self.comm = comm
        self.status = MPI.Status()
        self.message = MPI.Message()
        self.spin = spin
        self.sleep_max = sleep_max
        self._last = _now()
        address, reason = libmpi()
        if address is None:
            self.path = f"mpi4py ({reason})"
            return
        handle, self._comm_is_pointer = comm_handle(comm)
        self._comm = handle
        self._improbe = <void*><uintptr_t>address
        self._status_at = <void*><uintptr_t>MPI._addressof(self.status)
        self._message_at = <void*><uintptr_t>MPI._addressof(self.message)
        self.path = "libmpi"
        failed = _self_test(self, MPI)
        if failed is not None:
            self._improbe = NULL
            self.path = f"mpi4py ({self_test_failed(failed)})"

    @property
    def idle(self):
        """See :attr:`distlab.reference.rpc_wait.Waiter.idle`."""
        return bool(self._sleeping)

    def probe(self, int source, int tag, double timeout):
        """See :meth:`distlab.reference.rpc_wait.Waiter.probe`."""
        cdef int found
        if self._improbe == NULL:
            return _probe_mpi4py(self, source, tag, timeout)
        with nogil:
            found = _probe_libmpi(self, source, tag, timeout)
        if found < 0:
            from mpi4py import MPI

            raise failed_probe(self.comm, MPI.Exception(-found))
        return found == 1

    def touch(self):
        """See :meth:`distlab.reference.rpc_wait.Waiter.touch`."""
        self._last = _now()
        if self._sleeping:
            with nogil:
                pthread_mutex_lock(&self._mutex)
                self._touched = 1
                pthread_cond_signal(&self._cond)
                pthread_mutex_unlock(&self._mutex)

    def wake(self):
        """See :meth:`distlab.reference.rpc_wait.Waiter.wake`."""
        with nogil:
            pthread_mutex_lock(&self._mutex)
            self._woken = 1
            pthread_cond_signal(&self._cond)
            pthread_mutex_unlock(&self._mutex)


cdef class Seat:
    """See :class:`distlab.reference.rpc_wait.Seat`."""
    cdef public double takeover, poll
    cdef unsigned long _holder
    cdef bint _held
    cdef volatile double _away_since   # < 0: the holder listens
    cdef volatile int _stop

    def __init__(self, takeover, poll):
        check_times("Seat", positive=True, takeover=takeover, poll=poll)
        self.takeover = takeover
        self.poll = poll
        self._held = False
        self._away_since = -1.0

    @property
    def holder(self):
        """See :attr:`distlab.reference.rpc_wait.Seat.holder`."""
        return self._holder if self._held else None

    @property
    def away_since(self):
        """See :attr:`distlab.reference.rpc_wait.Seat.away_since`."""
        return self._away_since if self._away_since >= 0 else None

    # Each method below runs holding the GIL from start to end: that is what makes it atomic.
    def take(self):
        """See :meth:`distlab.reference.rpc_wait.Seat.take`."""
        cdef unsigned long me = PyThread_get_thread_ident()
        if not self._held:
            self._held = True
            self._holder = me
            self._away_since = -1.0
        return self._holder == me

    def listening(self):
        """See :meth:`distlab.reference.rpc_wait.Seat.listening`."""
        return self._held and self._holder == PyThread_get_thread_ident() and self._away_since < 0

    def leave(self):
        """See :meth:`distlab.reference.rpc_wait.Seat.leave`."""
        self._away_since = _now()

    def come_back(self):
        """See :meth:`distlab.reference.rpc_wait.Seat.come_back`."""
        if self._held and self._holder == PyThread_get_thread_ident():
            self._away_since = -1.0
            return True
        return False

    def watch(self, double timeout):
        """See :meth:`distlab.reference.rpc_wait.Seat.watch`."""
        cdef double deadline = _now() + timeout, away
        cdef bint due = False
        while True:
            with nogil:
                while not self._stop:
                    _sleep(self.poll)
                    away = self._away_since
                    if away >= 0 and _now() - away >= self.takeover:
                        due = True
                        break
                    if _now() >= deadline:
                        break
            if not due:
                return False
            away = self._away_since
            if away >= 0 and _now() - away >= self.takeover:   # still away, now that this thread holds the GIL
                self._holder = PyThread_get_thread_ident()
                self._held = True
                self._away_since = -1.0
                return True
            due = False

    def release(self):
        """See :meth:`distlab.reference.rpc_wait.Seat.release`."""
        if self._held and self._holder == PyThread_get_thread_ident():
            self._held = False
            self._away_since = -1.0

    def stop(self):
        """See :meth:`distlab.reference.rpc_wait.Seat.stop`."""
        self._stop = 1


# --- core-only helpers ---

cdef inline double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef inline void _sleep(double seconds) noexcept nogil:
    cdef timespec ts
    ts.tv_sec = <long>seconds
    ts.tv_nsec = <long>((seconds - ts.tv_sec) * 1e9)
    nanosleep(&ts, NULL)


cdef inline timespec _at(double when) noexcept nogil:
    cdef timespec ts
    ts.tv_sec = <long>when
    ts.tv_nsec = <long>((when - ts.tv_sec) * 1e9)
    return ts


cdef double _sleep_on(Waiter w, double when, int sleeping, double delay) noexcept nogil:
    """Sleep until ``when`` unless touched or woken meanwhile; the next sleep's length (``SLEEP_FIRST`` after a
    touch, else twice ``delay`` up to ``sleep_max``). ``sleeping``: what ``idle`` says meanwhile."""
    cdef timespec until = _at(when)
    pthread_mutex_lock(&w._mutex)
    if not (w._touched or w._woken):
        w._sleeping = sleeping
        pthread_cond_timedwait(&w._cond, &w._mutex, &until)
        w._sleeping = 0
    if w._touched:
        w._touched = 0
        delay = SLEEP_FIRST_C
    elif _now() - w._last < IDLE_AFTER_C:
        delay = min(delay * 2, w.sleep_max)
    else:   # idle for good: sleep longer
        delay = min(delay * 2, max(w.sleep_max, IDLE_SLEEP_MAX_C))
    pthread_mutex_unlock(&w._mutex)
    return delay


cdef int _probe_libmpi(Waiter w, int source, int tag, double timeout) noexcept nogil:
    """Waiter.probe through libmpi, GIL released: 1 matched, 0 time up or woken, -code for an MPI error."""
    cdef int flag = 0, rc, found
    cdef double now, start = _now(), deadline = start + timeout, delay = SLEEP_FIRST_C
    cdef unsigned long slack = 0
    cdef bint slack_set = False
    while True:
        if w._comm_is_pointer:
            rc = (<improbe_ptr_t>w._improbe)(source, tag, <void*>w._comm, &flag, w._message_at, w._status_at)
        else:
            rc = (<improbe_int_t>w._improbe)(source, tag, <int>w._comm, &flag, w._message_at, w._status_at)
        if rc != 0:
            found = -rc
            break
        if flag:
            w._last = _now()
            found = 1
            break
        if w._woken:
            w._woken = 0
            found = 0
            break
        now = _now()
        if now >= deadline:
            found = 0
            break
        if now - w._last < w.spin:
            sched_yield()    # polling: the core goes to whoever else needs it
            delay = SLEEP_FIRST_C
            continue
        if not slack_set:    # precise short sleeps (the default timer slack adds 50 us to each)
            slack = <unsigned long>prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0)
            prctl(PR_SET_TIMERSLACK, 1000, 0, 0, 0)
            slack_set = True
        delay = _sleep_on(w, min(now + delay, deadline), 1, delay)
    if slack_set:
        prctl(PR_SET_TIMERSLACK, slack, 0, 0, 0)
    return found


cdef object _probe_mpi4py(Waiter w, int source, int tag, double timeout):
    """Waiter.probe through mpi4py (the reference's loop: it sleeps where the libmpi path yields)."""
    cdef double now, deadline = _now() + timeout, delay = SLEEP_FIRST_C
    comm, status = w.comm, w.status
    while True:
        try:
            message = comm.Improbe(source, tag, status)
        except Exception as exc:
            raise failed_probe(comm, exc) from None
        if message is not None:
            w.message = message
            w._last = _now()
            return True
        if w._woken:
            w._woken = 0
            return False
        now = _now()
        if now >= deadline:
            return False
        if now - w._last < w.spin:
            delay = SLEEP_FIRST_C
        with nogil:
            delay = _sleep_on(w, min(now + delay, deadline), now - w._last >= w.spin, delay)


cdef double SLEEP_FIRST_C = SLEEP_FIRST
cdef double IDLE_AFTER_C = IDLE_AFTER
cdef double IDLE_SLEEP_MAX_C = IDLE_SLEEP_MAX


cdef object _self_test(Waiter w, MPI):
    """None if probing through libmpi finds a message this process sent itself with mpi4py, else what went wrong.

    The message goes on ``MPI.COMM_SELF`` (not on the waiter's communicator: nothing of it reaches another rank,
    so both twins send the same messages), probed with the waiter's own code and objects."""
    handle, comm_is_pointer = w._comm, w._comm_is_pointer
    w._comm, w._comm_is_pointer = comm_handle(MPI.COMM_SELF)
    sent = bytearray(b"\x2a")
    request = MPI.COMM_SELF.Isend([sent, MPI.BYTE], 0, SELF_TEST_TAG)
    try:
        if not w.probe(0, SELF_TEST_TAG, 5.0):
            return "no message matched within 5 s"
        got = (w.status.Get_source(), w.status.Get_tag(), w.status.Get_count(MPI.BYTE))
        received = bytearray(max(got[2], 1) if got[2] < 1 << 20 else 1)
        w.message.Recv([received, MPI.BYTE])
        if got != (0, SELF_TEST_TAG, 1):
            return f"matched (source, tag, bytes) {got}, expected {(0, SELF_TEST_TAG, 1)}"
        if received != sent:
            return f"received {bytes(received)!r}, sent {bytes(sent)!r}"
        return None
    finally:
        w._comm, w._comm_is_pointer = handle, comm_is_pointer
        if not request.Test():
            request.Cancel()
            request.Wait()
