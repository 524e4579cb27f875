"""Supervising a running job (its process manager: distlab's on one host, else ``mpiexec``): forward each rank's
output line by line, stop the job cleanly. distlab's process manager (:mod:`distlab._process_manager`) tags
output and forwards signals as Hydra does, so what follows holds for both.

Output. Hydra (the mpich wheel's ``mpiexec``) can prepend a pattern holding the rank to what it forwards
(``-prepend-pattern``), but it does so per chunk it reads: a rank writing half a line gets tagged, and the next
rank's chunk lands in the middle of that line (measured: ``[0] r0-part1 [1] r1-part1 [0] r0-part2``). So the
launcher asks hydra for an unambiguous marker (``\\x1e<nonce><rank>\\x1f``, stripped again), keeps each rank's
partial line until its newline arrives, and only then emits it, prefixed ``[rank] `` or not: lines of two ranks
never mix. Text between markers that follows a newline is hydra's own (its banners), which :func:`is_banner`
recognises and the launcher keeps out of the user's way.

Stopping. Hydra forwards ``SIGTERM`` to every rank; each rank then writes its timeline and a ``stopped`` record
and waits to be killed, because the first rank to exit would make hydra kill the others before they had written
theirs. The launcher waits until every started rank has ended or recorded its stop (bounded by a grace period),
then kills every rank's session and ``mpiexec``'s.
"""
from __future__ import annotations

import os
import re
import secrets
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ._jobdir import is_running, read_records, request_stop

#: Seconds the ranks get to write their timelines once told to stop, before they are killed.
STOP_GRACE = 10.0
#: Seconds to keep reading output after mpiexec exited (a rank's child may hold the pipe open).
DRAIN_GRACE = 1.0
#: Seconds between the launcher's looks at the ranks' records (torchrun's ``--monitor-interval``, 0.1 s).
MONITOR_INTERVAL = 0.1
#: Seconds a job may go on after a rank failed before the launcher stops every rank itself: the process manager
#: ends the job at once when a rank dies, so this only bounds a job whose survivors are left waiting.
FAILURE_GRACE = 5.0

# (rank, "stdout"|"stderr", line): rank None for mpiexec's own lines, UNKNOWN under an MPI without tags.
Sink = Callable[[int | None, str, str], None]
UNKNOWN = -1


class Interrupted(BaseException):
    """Raised in the launcher by its SIGTERM handler (SIGINT arrives as KeyboardInterrupt)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def new_marker() -> tuple[str, bytes]:
    """A per-job ``-prepend-pattern`` for hydra and the bytes that start it in the output."""
    nonce = secrets.token_hex(4)
    return f"\x1e{nonce}%r\x1f", f"\x1e{nonce}".encode()


_BANNER = re.compile(r"^(|=+|=   .*|YOUR APPLICATION TERMINATED WITH THE EXIT STRING: .*"
                     r"|This typically refers to a problem with your application\."
                     r"|Please see the FAQ page for debugging suggestions"
                     r"|\[mpiexec@[^\]]*\] (Sending Ctrl-C to processes as requested|Press Ctrl-C again to force "
                     r"abort|Exit codes: .*))$")
_ABORT_LINE = re.compile(r"^Abort\(\d+\) on node \d+ \(rank \d+ in comm \d+\): application called MPI_Abort")


def is_banner(line: str) -> bool:
    """A line hydra prints about a job's end (``BAD TERMINATION``...), which the failure summary replaces."""
    return bool(_BANNER.match(line))


_DIAGNOSTIC = re.compile(r"^\[(mpiexec|proxy:[^\]@]*)@[^\]]*\] ")


def is_diagnostic(line: str) -> bool:
    """A line hydra's mpiexec or proxy prints about itself (``[mpiexec@host] HYD_...: ...``)."""
    return bool(_DIAGNOSTIC.match(line))


_OPEN_MPI_TAG = re.compile(r"^\[\d+,(\d+)\]<std(?:out|err)>: ?")


def open_mpi_tag(line: str) -> tuple[int, str]:
    """``(rank, text)`` of a line Open MPI's ``mpirun --output tag`` forwarded (``[1,3]<stdout>: text``);
    ``(UNKNOWN, line)`` for any other line."""
    match = _OPEN_MPI_TAG.match(line)
    return (int(match.group(1)), line[match.end():]) if match else (UNKNOWN, line)


_NBC_NOTICE = re.compile(r"^NBC_Progress: an error \d+ was found during schedule ")


def is_nbc_notice(line: str) -> bool:
    """Open MPI's ``NBC_Progress: an error 75 was found during schedule ...`` (a nonblocking collective met a dead
    or revoked peer), which it prints to a rank's output and the rank's own error reports better."""
    return bool(_NBC_NOTICE.match(line))


def is_abort_line(line: str) -> bool:
    """MPICH's ``Abort(1) on node 1 ...`` line, which a rank prints when it calls ``MPI_Abort``."""
    return bool(_ABORT_LINE.match(line))


class Demux:
    """Split one of hydra's tagged streams into whole lines per rank; ``sink`` gets each line once complete.

    A line is passed without its newline. A progress bar redraws its line with carriage returns: the latest
    complete redraw is passed at once, ending in ``"\\r"``, so that progress shows as it goes.
    """

    def __init__(self, stream: str, marker: bytes | None, sink: Sink):
        self.stream = stream
        self.marker = marker
        self.sink = sink
        self._held = b""  # a marker cut in two by a read
        self._rank: int | None = None  # whose text this is, until its newline
        self._partial: dict[int | None, bytes] = {}

    def feed(self, data: bytes) -> None:
        if self.marker is None:  # an MPI without tags: whole lines, owner unknown
            self._rank = UNKNOWN
            self._text(data)
            return
        pieces = (self._held + data).split(self.marker)
        self._held = b""
        self._hold_cut_marker(pieces)
        self._text(pieces[0])
        for piece in pieces[1:]:  # each starts with "<rank>\x1f"
            end = piece.find(b"\x1f")
            if end > 0 and piece[:end].isdigit():
                self._rank = int(piece[:end])
                self._text(piece[end + 1:])
            else:  # the marker's bytes in the text itself (the nonce makes this most unlikely)
                self._text(self.marker + piece)

    def _hold_cut_marker(self, pieces: list[bytes]) -> None:
        """Keep back the end of ``pieces`` if a read cut a marker in two; it is completed by the next read."""
        last = pieces[-1]
        if len(pieces) > 1 and b"\x1f" not in last and (last == b"" or last.isdigit()):
            self._held = self.marker + last  # the rank's digits may go on
            pieces[-1] = b""
            if len(pieces) > 1 and pieces[-1] == b"":
                pieces.pop()
            return
        cut = last.rfind(b"\x1e")
        if cut != -1 and self.marker.startswith(last[cut:]):
            self._held, pieces[-1] = last[cut:], last[:cut]

    def _text(self, text: bytes) -> None:
        owner = self._rank
        while text:
            newline = text.find(b"\n")
            if newline == -1:
                self._partial[owner] = self._redraws(owner, self._partial.pop(owner, b"") + text)
                return
            line = text[:newline]
            if self._partial and owner in self._partial:
                line = self._partial.pop(owner) + line
            if b"\r" in line:
                line = self._redraws(owner, line[:-1] if line.endswith(b"\r") else line)  # "\r\n" ends a line too
            self.sink(owner, self.stream, line.decode(errors="replace"))
            # After a newline, text without a marker is mpiexec's own: hydra tags every line it forwards.
            owner = self._rank = None if self.marker is not None else UNKNOWN
            text = text[newline + 1:]

    def _redraws(self, owner, pending: bytes) -> bytes:
        """Pass on the last complete redraw of a line (text ending in "\\r"); return what follows it."""
        carriage = pending.rfind(b"\r")
        if carriage == -1:
            return pending
        last = pending[pending.rfind(b"\r", 0, carriage) + 1:carriage]
        if last:
            self.sink(owner, self.stream, last.decode(errors="replace") + "\r")
        return pending[carriage + 1:]

    def close(self) -> None:
        """End of stream: emit what is left of every partial line."""
        if self._held:
            self._text(self._held)
            self._held = b""
        for owner, rest in sorted(self._partial.items(), key=lambda item: (item[0] is None, item[0] or 0)):
            rest = self._redraws(owner, rest)
            if rest:
                self.sink(owner, self.stream, rest.decode(errors="replace"))
        self._partial.clear()


@dataclass
class RunOutcome:
    """How the ``mpiexec`` process ended, as the supervisor saw it."""

    status: int
    interrupted: int | None = None
    timed_out: bool = False


def supervise(command: list[str], env: dict, cwd: str | None, job_dir: Path, np: int, sink: Sink,
              marker: bytes | None, timeout: float | None, monitor_interval: float = MONITOR_INTERVAL,
              failure_grace: float | None = FAILURE_GRACE) -> RunOutcome:
    """Run ``command`` (mpiexec) in its own session, forward its output to ``sink``, stop it on interrupt.

    A ``KeyboardInterrupt`` or :class:`Interrupted` while the job runs stops every rank (they write their
    timelines first) and is reported in the outcome rather than raised; so is the ``timeout``. Every
    ``monitor_interval`` seconds the launcher looks at the ranks' records: a rank stopped by a SIGTERM from
    elsewhere has it stop the others as well, and so does a rank that failed while the others go on past
    ``failure_grace`` (one failure ends every rank, as torchrun's agent does; None under fault tolerance, where
    the survivors go on without the dead and their own timeouts bound every wait).
    """
    proc = subprocess.Popen(command, env=env, cwd=cwd, start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    streams = {proc.stdout.fileno(): Demux("stdout", marker, sink), proc.stderr.fileno(): Demux("stderr", marker, sink)}
    selector = selectors.DefaultSelector()
    for fd in streams:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    outcome = RunOutcome(0)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        try:
            reason = _pump(proc, selector, streams, deadline, job_dir, monitor_interval, failure_grace)
            if reason != "ended":
                outcome.timed_out = reason == "deadline"
                stop_job(proc, job_dir, np, selector, streams)
        except KeyboardInterrupt:
            outcome.interrupted = signal.SIGINT
            stop_job(proc, job_dir, np, selector, streams)
        except Interrupted as exc:
            outcome.interrupted = exc.signum
            stop_job(proc, job_dir, np, selector, streams)
    except BaseException:  # a second interrupt while stopping, or a bug: never leave a rank behind
        kill_job(proc, job_dir, np)
        raise
    finally:
        _drain(selector, streams, 0.2)
        for reader in streams.values():
            reader.close()
        selector.close()
        proc.stdout.close()
        proc.stderr.close()
    outcome.status = proc.wait()
    kill_stragglers(job_dir, np)
    return outcome


def _pump(proc, selector, streams, deadline: float | None, job_dir: Path,
          monitor_interval: float = MONITOR_INTERVAL, failure_grace: float | None = FAILURE_GRACE) -> str:
    """Forward output until mpiexec has exited and its pipes are drained ("ended"), until ``deadline``
    ("deadline"), until a rank was told to stop by someone else ("rank stopped"), or until the job outlived a
    failed rank by ``failure_grace`` ("rank failed"; None: never)."""
    drain_until = None
    next_check = time.monotonic() + monitor_interval
    failed_at = None
    while selector.get_map():
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return "deadline"
        if drain_until is None and proc.poll() is not None:
            drain_until = now + DRAIN_GRACE
        if drain_until is not None and now >= drain_until:
            return "ended"
        if now >= next_check:  # a rank that got SIGTERM from outside waits for the others to be stopped too
            next_check = now + monitor_interval
            names = _record_names(job_dir) if drain_until is None else []
            if any(name.endswith(".stopped") for name in names):
                return "rank stopped"
            if failed_at is None and failure_grace is not None \
                    and any(name.endswith((".failed", ".exit")) for name in names):
                failed_at = now
            if failed_at is not None and now - failed_at >= failure_grace:
                return "rank failed"
        limit = min(t for t in (deadline, drain_until, next_check) if t is not None) - now
        _read_ready(selector, streams, max(limit, 0.0))
    if deadline is None:
        proc.wait()
        return "ended"
    _wait(proc, deadline)
    return "ended" if proc.poll() is not None else "deadline"


def _record_names(job_dir: Path) -> list[str]:
    try:
        return os.listdir(job_dir)
    except OSError:
        return []


def _wait(proc, deadline: float) -> None:
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        pass


def _read_ready(selector, streams, timeout: float) -> None:
    for key, _ in selector.select(timeout):
        try:
            data = os.read(key.fd, 65536)
        except BlockingIOError:
            continue
        if data:
            streams[key.fd].feed(data)
        else:
            selector.unregister(key.fd)


def _drain(selector, streams, seconds: float) -> None:
    end = time.monotonic() + seconds
    while selector.get_map() and time.monotonic() < end:
        _read_ready(selector, streams, max(end - time.monotonic(), 0.0))


def stop_job(proc, job_dir: Path, np: int, selector=None, streams=None, grace: float = STOP_GRACE) -> None:
    """Ask every rank to stop (SIGTERM), give them ``grace`` seconds to write their timelines, then kill all."""
    request_stop(job_dir)
    _signal(proc.pid, signal.SIGTERM)  # hydra forwards it to every rank's process group
    for record in read_records(job_dir, np).values():
        if record.start and not record.ended and is_running(record.start):
            _signal(record.pid, signal.SIGTERM)  # directly too: an MPI that does not forward it
    end = time.monotonic() + grace
    while time.monotonic() < end and proc.poll() is None:
        records = read_records(job_dir, np).values()
        if all(r.ended or not r.start for r in records):
            break
        if selector is not None and selector.get_map():
            _read_ready(selector, streams, 0.02)
        else:
            time.sleep(0.02)
    kill_job(proc, job_dir, np)


def kill_job(proc, job_dir: Path, np: int) -> None:
    """SIGKILL every rank (its watcher's process group, where hydra made one) and mpiexec's process group."""
    for record in read_records(job_dir, np).values():
        if record.start and is_running(record.start):
            watcher = record.start.get("watcher")
            if watcher and _group_of(watcher) == watcher:
                _signal(watcher, signal.SIGKILL, group=True)
            _signal(record.pid, signal.SIGKILL)
    _signal(proc.pid, signal.SIGKILL, group=True)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    _wait_gone(job_dir, np)


def _wait_gone(job_dir: Path, np: int, within: float = 2.0) -> None:
    """Return once no rank runs any more (a killed process takes a moment to disappear), or after ``within``."""
    end = time.monotonic() + within
    starts = [r.start for r in read_records(job_dir, np).values() if r.start]
    while any(is_running(start) for start in starts) and time.monotonic() < end:
        time.sleep(0.01)


def kill_stragglers(job_dir: Path, np: int) -> None:
    """After mpiexec exited, no rank may live on (its proxy died first, say): kill any that does."""
    for record in read_records(job_dir, np).values():
        if record.start and is_running(record.start):
            _signal(record.pid, signal.SIGKILL)
    _wait_gone(job_dir, np)


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _signal(pid: int, signum: int, group: bool = False) -> None:
    try:
        if group:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass
