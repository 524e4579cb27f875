"""Per-rank entry point: ``mpiexec -n N python -m distlab._bootstrap (script.py | -m module) args...``.

Sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``, confines what the rank listens on
(:func:`confine_listeners`: loopback only when every rank is on one host), runs the script (or module) as
``__main__`` with the ``sys.argv`` it would have under ``python``, and turns an uncaught exception (or a
non-zero ``sys.exit``) on any rank into the end of the whole job, so the other ranks are not left waiting in a
collective. On ``SIGTERM`` a rank writes its timeline before it ends.

Under the launcher (``DISTLAB_JOB_DIR`` set, see :mod:`distlab._jobdir`) each rank also leaves records for the
launcher: a start record (``rank -> pid``), a completion record when its program really finished, a failure
record with the user's traceback. And the process ``mpiexec`` started forks before MPI starts: the child is the
rank, the parent its *watcher*, which waits for it and records how it ended (exit status, or the signal that
killed it). A rank that vanishes (``os._exit``, SIGKILL, a segfault) is then named with its pid and signal. If
the timeline is on, the watcher of a rank that ended badly first asks the other ranks to stop, so they write
their timelines before ``mpiexec`` kills them.
"""
from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time
import traceback

from . import _jobdir

#: Seconds a rank told to stop (under the launcher) waits to be killed before it exits by itself.
STOP_WAIT = 15.0
#: Seconds a watcher waits for the other ranks to write their timelines before it lets the job end.
PEER_STOP_WAIT = 5.0

_stopping = threading.Lock()
_rank_pid = -1  # the rank's own process: a process it forks is not the rank


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


def confine_listeners() -> None:
    """Before MPI starts, keep this rank from listening beyond what its job needs (the watcher forks later).

    - A listening socket inherited from the process manager is closed: hydra's control port, which it binds to
      every interface (``HYDU_sock_listen``, no option binds it elsewhere), leaks into every rank without
      close-on-exec, and a rank never accepts on it (mpiexec and its proxy keep theirs).
    - When the process manager put every rank on this host (``MPI_LOCALNRANKS`` equals ``PMI_SIZE``, as hydra and
      distlab's own process manager set them;
      Open MPI's ``OMPI_COMM_WORLD_LOCAL_SIZE`` its ``OMPI_COMM_WORLD_SIZE``) and neither ``UCX_TLS`` nor
      ``UCX_NET_DEVICES`` is set, ``UCX_TLS=sm,self``: by default UCX opens a TCP listener on every network
      device (the host's external address included), though between ranks of one host MPICH moves the bytes
      through shared memory and UCX sends none over TCP. A job across hosts is left to its own settings.
    """
    _close_inherited_listeners()
    local = os.environ.get("MPI_LOCALNRANKS", os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE"))
    world = os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE"))
    if local and local == world and "UCX_TLS" not in os.environ and "UCX_NET_DEVICES" not in os.environ:
        os.environ["UCX_TLS"] = "sm,self"


def _close_inherited_listeners() -> None:
    import socket

    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: nothing to find
        return
    for fd in fds:
        if fd <= 2:
            continue
        try:
            sock = socket.socket(fileno=fd)  # OSError if fd is not a socket (or was the listing's own fd)
        except OSError:
            continue
        try:
            listening = sock.family in (socket.AF_INET, socket.AF_INET6) and sock.getsockopt(
                socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        except OSError:
            listening = False
        finally:
            sock.detach()
        if listening:
            os.close(fd)


def start_rank() -> int:
    """Everything before the user's program: listeners confined, watcher, MPI, rank variables, start record,
    stop handler."""
    global _rank_pid
    confine_listeners()
    job_dir = _jobdir.job_dir_from_env()
    watcher = _fork_watcher(job_dir) if job_dir is not None and _can_watch() else None
    rank = set_rank_environment()
    _rank_pid = os.getpid()
    if job_dir is not None:
        _jobdir.write_start(job_dir, rank, watcher)
    install_stop_handler(rank, job_dir)
    return rank


def finish_rank(rank: int) -> None:
    """The completion record: the rank's program finished (checked by the launcher).

    A rank told to stop while its program ran on to the end did not finish it: it waits to be killed instead.
    """
    job_dir = _jobdir.job_dir_from_env()
    _wait_if_stopping()
    if job_dir is not None:
        _jobdir.write_done(job_dir, rank)


def _wait_if_stopping() -> None:
    """A rank being stopped (see :func:`_stop`) neither finishes nor fails: it waits to be killed."""
    if _stopping.locked():
        time.sleep(STOP_WAIT)
        os._exit(128 + signal.SIGTERM)


# --- the watcher: the process mpiexec started, waiting for the rank it forked ---------------------------------

def _can_watch() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def _fork_watcher(job_dir) -> int | None:
    """Fork before MPI starts; return the watcher's pid in the child (the rank). The parent never returns."""
    watcher = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child:
        _watch(child, job_dir)  # never returns
    _die_with(watcher)
    return watcher


def _die_with(watcher: int) -> None:
    """Have the kernel kill this rank if its watcher dies (mpiexec kills the watcher's process group anyway)."""
    from ._process_manager import die_with_parent

    if not die_with_parent():
        return
    if os.getppid() != watcher:  # the watcher died before prctl took effect
        os._exit(1)


def _watch(child: int, job_dir) -> None:
    # Signals for the rank reach it directly: hydra signals each rank's process group, which both share.
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_IGN)
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except ChildProcessError:
            os._exit(1)
    code = os.waitstatus_to_exitcode(status)
    if code != 0 or not _has_record(job_dir, child, "done"):
        _jobdir.write_exit(job_dir, child, status)
        # Under fault tolerance the others carry on without this rank: they are not stopped.
        if os.environ.get("DISTLAB_TIMELINE") and os.environ.get("DISTLAB_FAULT_TOLERANCE") != "1" \
                and not _has_record(job_dir, child, "stopped"):
            stop_peers(job_dir, child)
        _let_output_drain()
        # Die by a signal: hydra then ends the job on every host. (After a mere non-zero exit, measured on a
        # virtual cluster, it ended the ranks of that host only and the others waited.) The launcher takes
        # the status from the records.
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(code if code >= 0 else 128 - code)


def _let_output_drain(within: float = 2.0) -> None:
    """Wait until hydra's proxy has read what the rank wrote before it ended (bounded).

    The proxy learns of the end only when this watcher exits, and then ends the job: output still in the pipes
    could be lost (seen here: a rank's last lines missing). Output the proxy has read is forwarded before the
    news of the exit, on the same connection.
    """
    import array
    import fcntl
    import termios

    end = time.monotonic() + within
    while time.monotonic() < end:
        pending = 0
        for fd in (1, 2):
            count = array.array("i", [0])
            try:
                fcntl.ioctl(fd, termios.FIONREAD, count)  # bytes in the pipe, asked from its writing end
            except OSError:  # not a pipe: nothing to wait for
                continue
            pending += count[0]
        if not pending:
            return
        time.sleep(0.005)


def _has_record(job_dir, pid: int, kind: str) -> bool:
    for path in job_dir.glob("rank*.start"):
        start = _jobdir.read_record(path)
        if start and start["pid"] == pid:
            return (job_dir / f"rank{start['rank']}.{kind}").exists()
    return False


def stop_peers(job_dir, pid: int) -> None:
    """Ask every other running rank of this host to stop (they write their timelines) and wait for them."""
    _jobdir.request_stop(job_dir)
    asked = []
    for rank, record in _jobdir.read_records(job_dir, _world_size()).items():
        if record.start and record.pid != pid and not record.ended and _jobdir.is_running(record.start):
            try:
                os.kill(record.pid, signal.SIGTERM)
                asked.append(rank)
            except OSError:
                pass
    end = time.monotonic() + PEER_STOP_WAIT
    while asked and time.monotonic() < end:
        records = _jobdir.read_records(job_dir, _world_size())
        asked = [r for r in asked if not records[r].ended and _jobdir.is_running(records[r].start)]
        time.sleep(0.02)


def _world_size() -> int:
    for var in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if var in os.environ:
            return int(os.environ[var])
    return 1


# --- stopping on SIGTERM: write the timeline first -----------------------------------------------------------

def install_stop_handler(rank: int, job_dir) -> None:
    """On SIGTERM write this rank's timeline and a stop record, then end (see :func:`_stop`).

    The work happens on a thread woken through ``signal.set_wakeup_fd``: a Python signal handler runs only when
    the main thread is back in the interpreter, never while it is blocked inside an MPI call.
    """
    def on_signal(signum, _frame):
        threading.Thread(target=_stop, args=(signum, rank, job_dir), daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    # A process the rank forks (a multiprocessing worker) is not the rank: SIGTERM ends it as usual
    # (Pool.terminate() relies on that), and never writes the rank's stop record.
    os.register_at_fork(after_in_child=_forget_stop_handler)
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    try:
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    except ValueError:  # not the main thread: the Python handler alone will do
        return

    def wait_for_signal():
        while True:
            data = os.read(read_end, 64)
            if signal.SIGTERM in data and signal.getsignal(signal.SIGTERM) is on_signal:
                _stop(signal.SIGTERM, rank, job_dir)

    threading.Thread(target=wait_for_signal, name="distlab-stop", daemon=True).start()


def _forget_stop_handler() -> None:
    global _stopping
    _stopping = threading.Lock()
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except ValueError:  # forked from a thread other than the main one: the handler stays, _stop checks
        pass


def _stop(signum: int, rank: int, job_dir) -> None:
    if os.getpid() != _rank_pid:  # a forked process that kept the handler: end as SIGTERM would
        os._exit(128 + signum)
    if not _stopping.acquire(blocking=False):
        return
    try:
        from .timeline import flush_now

        flush_now()
    except Exception:  # noqa: BLE001 - stopping matters more than the trace
        pass
    if job_dir is not None:
        _jobdir.write_stopped(job_dir, rank, signum)
    _flush_stdio()
    if job_dir is not None:
        # The launcher kills every rank once all have written their timelines; exiting now would make mpiexec
        # kill the ranks still writing theirs.
        time.sleep(STOP_WAIT)
    os._exit(128 + signum)


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream must not stop the shutdown
            pass


# --- failing: record, then end the whole job -----------------------------------------------------------------

def fail(code: int, rank: int, summary: str, trace: str = "") -> None:
    """End the job because this rank failed: ``summary`` is one line, ``trace`` the user's traceback.

    Under the launcher the failure is recorded (the launcher prints it once, whatever mpiexec forwarded) and
    the rank exits, for its watcher to end the job; under a plain ``mpiexec`` it is printed tagged with the
    rank and the job is aborted (``MPI_Abort``).
    """
    job_dir = _jobdir.job_dir_from_env()
    _wait_if_stopping()  # an error after the stop (a peer gone, say) is not the cause of the job's end
    if job_dir is not None:
        _jobdir.write_failure(job_dir, rank, code, summary, trace)
    else:
        message = trace or f"{summary}\n"
        sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in message.rstrip("\n").split("\n")))
    _flush_stdio()
    try:
        from .timeline import flush_now

        flush_now()
    except Exception:  # noqa: BLE001 - ending the job matters more than the trace
        pass
    if job_dir is not None and _can_watch():
        os._exit(code)
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(code)


def describe_exit(code) -> tuple[int, str]:
    """Exit status and summary line for ``sys.exit(code)`` with a failure."""
    if isinstance(code, int):
        return code, f"called sys.exit({code})"
    return 1, f"exited: {code}"


def user_traceback(exc: BaseException) -> tuple[str, str]:
    """``(summary, traceback)`` of ``exc`` without the frames of this launcher (bootstrap, runpy)."""
    tb = start = exc.__traceback__
    while tb is not None:  # the user's frames are those after the last of ours (runpy calls the program)
        if _is_launcher_frame(tb.tb_frame.f_code.co_filename):
            start = tb.tb_next
        tb = tb.tb_next
    tb = start
    return f"raised {exception_line(exc)}", "".join(traceback.format_exception(type(exc), exc, tb))


def exception_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (module-qualified unless builtin), as a traceback ends."""
    kind = type(exc)
    name = kind.__qualname__
    if kind.__module__ not in ("builtins", "__main__"):
        name = f"{kind.__module__}.{name}"
    lines = str(exc).strip().splitlines()
    if not lines:
        return name
    return f"{name}: {lines[0]}" + (" [...]" if len(lines) > 1 else "")


def _is_launcher_frame(filename: str) -> bool:
    name = os.path.basename(filename)
    return filename in _LAUNCHER_FILES or name == "runpy.py" or filename == "<frozen runpy>"


_LAUNCHER_FILES = {os.path.abspath(__file__), os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                           "_runner.py")}


# --- the entry point -----------------------------------------------------------------------------------------

def _set_first_path(directory: str) -> None:
    """Put ``directory`` where ``python`` would: in place of the entry ``-m distlab._bootstrap`` added."""
    if sys.flags.safe_path:  # `python -P`: nothing was added
        sys.path.insert(0, directory)
    else:
        sys.path[0] = directory


USAGE = "usage: python -m distlab._bootstrap (script.py | -m module) [args...]"


def main(argv: list[str]) -> None:
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        sys.exit(USAGE)
    rank = start_rank()
    try:
        if argv[0] == "-m":
            # As `python -m module`: the current directory first on sys.path, argv[0] the module's file.
            sys.argv = [argv[1], *argv[2:]]
            _set_first_path(os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            # As `python script.py`: the script's directory first on sys.path (not the current directory).
            sys.argv = list(argv)
            _set_first_path(os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            code, summary = describe_exit(exc.code)
            fail(code, rank, summary)
    except BaseException as exc:  # noqa: BLE001 - every failure must end the job, not leave peers waiting
        summary, trace = user_traceback(exc)
        fail(1, rank, summary, trace)
    finish_rank(rank)
    _leave_after_a_failure()


def _leave_after_a_failure() -> None:
    """A survivor of a process failure (fault tolerance over ULFM) leaves without ``MPI_Finalize``: Open MPI
    5.0.11's may never return after a failure (both survivors done, the job still running minutes later)."""
    ulfm = sys.modules.get("distlab.comm.ulfm")
    if ulfm is None or not ulfm.failure_seen():
        return
    try:
        from .timeline import flush_now

        flush_now()
    except Exception:  # noqa: BLE001 - leaving matters more than the trace
        pass
    _flush_stdio()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
