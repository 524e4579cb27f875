"""The job directory: the records each rank leaves for the launcher, and how the launcher reads them.

``python -m distlab run`` and :func:`distlab.run` make a fresh directory per job and name it in
``DISTLAB_JOB_DIR``. Every rank writes small JSON records there, each atomically (write, then rename):

``rank<N>.start``
    at start-up, once MPI has told the rank who it is: its pid, the pid of its watcher process, its host.
``rank<N>.done``
    when the rank's program really finished (returned, or ``sys.exit(0)``): the completion record. A rank that
    ends without one vanished mid-job (``os._exit``, a crash in a library, a kill).
``rank<N>.failed``
    when the program raised, or called ``sys.exit`` with a failure: exit status, exception type, message and the
    traceback of the user's own frames.
``rank<N>.stopped``
    when the rank was told to stop (``SIGTERM``): it wrote its timeline. ``stop.requested`` exists when the
    launcher (or a failing peer's watcher) asked for the stop; a rank stopped without it was stopped from outside.
``pid<P>.exit``
    written by the rank's watcher (the process that started it, see :mod:`distlab._bootstrap`) when the rank
    ended without a completion record: its exit status or the signal that killed it.

The launcher reads them once ``mpiexec`` has ended (:func:`read_records`) and :func:`classify` says how each
rank ended; it is the one source of the job's exit status and failure summary, whatever ``mpiexec`` printed.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

JOB_DIR_VAR = "DISTLAB_JOB_DIR"


def job_dir_from_env() -> Path | None:
    """The job directory the launcher named, or None when the rank runs under a plain ``mpiexec``."""
    path = os.environ.get(JOB_DIR_VAR)
    return Path(path) if path else None


def _write(path: Path, record: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError:  # a record is best effort: the launcher still names the rank, with less detail
        pass


def process_start_stamp(pid: int) -> str | None:
    """When process ``pid`` started (Linux: clock ticks since boot), None if it is gone or a zombie.

    With the pid it identifies a process for good: the launcher signals a pid only if this still matches,
    never a process that reused the pid of a rank that has ended.
    """
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def is_running(start: dict) -> bool:
    """The rank process named by a start record still runs here (alive, and its pid not reused since)."""
    if start.get("host") != socket.gethostname():
        return False
    stamp = process_start_stamp(start["pid"])
    return stamp is not None and stamp == start.get("stamp")


def write_start(job_dir: Path, rank: int, watcher: int | None) -> None:
    """The rank's start record: ``rank -> pid`` (and its watcher's pid, its host, its start stamp)."""
    pid = os.getpid()
    _write(job_dir / f"rank{rank}.start", {"rank": rank, "pid": pid, "watcher": watcher,
                                           "stamp": process_start_stamp(pid), "host": socket.gethostname(),
                                           "virtual_host": _virtual_host(), "time": time.time()})


def _virtual_host() -> str | None:
    """The virtual cluster's host this rank runs in (``dl-h2``), None outside a virtual cluster."""
    if not os.environ.get("DISTLAB_CLUSTER"):
        return None
    from .cluster.jobs import current_host

    return current_host()


def write_done(job_dir: Path, rank: int) -> None:
    """The completion record: the rank's program finished."""
    _write(job_dir / f"rank{rank}.done", {"rank": rank, "time": time.time()})


def write_failure(job_dir: Path, rank: int, code: int, summary: str, traceback: str = "") -> None:
    """The rank's program failed: ``summary`` is one line (``KeyError: 'x'``), ``traceback`` the user's frames."""
    _write(job_dir / f"rank{rank}.failed", {"rank": rank, "code": code, "summary": summary,
                                            "traceback": traceback, "time": time.time()})


STOP_REQUEST = "stop.requested"


def request_stop(job_dir: Path) -> None:
    """Say that the ranks about to get SIGTERM are being stopped on purpose (by the launcher, or a failing
    peer's watcher), so that a rank stopped by anyone else stands out."""
    _write(job_dir / STOP_REQUEST, {"pid": os.getpid(), "time": time.time()})


def write_stopped(job_dir: Path, rank: int, signum: int) -> None:
    """The rank was told to stop (by ``signum``) and has written what it recorded."""
    _write(job_dir / f"rank{rank}.stopped", {"rank": rank, "signal": signum, "time": time.time(),
                                             "requested": (job_dir / STOP_REQUEST).exists()})


def write_exit(job_dir: Path, pid: int, status: int) -> None:
    """The watcher's record of how its rank process ``pid`` ended (``status`` as ``os.waitpid`` gives it).

    It holds the rank as the MPI launcher numbered the process, when it says (Hydra's ``PMI_RANK``): a rank that
    died before it could write its start record is still named.
    """
    record = {"pid": pid, "code": os.waitstatus_to_exitcode(status), "time": time.time()}
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(var, "").isdigit():
            record["rank"] = int(os.environ[var])
            break
    _write(job_dir / f"pid{pid}.exit", record)


@dataclass
class RankRecord:
    """Everything one rank left in the job directory (None where it left nothing)."""

    rank: int
    start: dict | None = None
    done: dict | None = None
    failed: dict | None = None
    stopped: dict | None = None
    exit: dict | None = None

    @property
    def pid(self) -> int | None:
        if self.start:
            return self.start["pid"]
        return self.exit["pid"] if self.exit else None

    @property
    def ended(self) -> bool:
        """The rank left an end record (it finished, failed, stopped or its watcher saw it end)."""
        return any((self.done, self.failed, self.stopped, self.exit))


def read_record(path: Path) -> dict | None:
    """One record, or None if it is missing or half written."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_records(job_dir: Path, np: int) -> dict[int, RankRecord]:
    """Every rank's records, by rank (``np`` ranks; a rank that wrote nothing has an empty record)."""
    records = {rank: RankRecord(rank) for rank in range(np)}
    exits = {}
    for path in job_dir.iterdir() if job_dir.is_dir() else ():
        name, _, kind = path.name.partition(".")
        if name.startswith("pid") and kind == "exit":
            record = read_record(path)
            if record:
                exits[record["pid"]] = record
        elif name.startswith("rank") and name[4:].isdigit() and int(name[4:]) in records:
            if kind in ("start", "done", "failed", "stopped"):
                setattr(records[int(name[4:])], kind, read_record(path))
    for record in records.values():
        if record.pid in exits:
            record.exit = exits.pop(record.pid)
    for orphan in exits.values():  # a rank that died before its start record
        record = records.get(orphan.get("rank", -1))
        if record is not None and record.start is None:
            record.exit = orphan
    return records


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclass
class Ending:
    """How one rank ended, as the summary tells it. ``culprit`` means it ended the job (or would have)."""

    rank: int
    kind: str  # done | failed | stopped | stopped-outside | killed | vanished | lost | never-started
    text: str
    culprit: bool
    time: float = float("inf")
    code: int = 0
    traceback: str = ""
    summary: str = ""


def classify(records: dict[int, RankRecord]) -> list[Ending]:
    """How each rank ended, culprits first in the order they ended, then the others by rank."""
    endings = [_ending(record) for record in records.values()]
    culprits = sorted((e for e in endings if e.culprit), key=lambda e: (e.time, e.rank))
    # A rank stopped by a signal from outside the launcher, or that ended without any record (killed with the
    # job by mpiexec's clean-up or by the launcher), is a culprit only if nothing else explains the job's end.
    for kinds in (("stopped-outside",), ("lost", "never-started")):
        if not culprits:
            for ending in endings:
                if ending.kind in kinds:
                    ending.culprit = True
            culprits = sorted((e for e in endings if e.culprit), key=lambda e: (e.time, e.rank))
    others = [e for e in endings if not e.culprit]
    return culprits + others


def _ending(record: RankRecord) -> Ending:
    rank, pid = record.rank, record.pid
    host = record.start.get("virtual_host") if record.start else None
    who = f"rank {rank}" + (f" (pid {pid})" if pid else "") + (f" on host {host}" if host else "")
    exit_code = record.exit["code"] if record.exit else None
    if record.failed:
        failed = record.failed
        return Ending(rank, "failed", f"rank {rank} {failed['summary']}", True, failed["time"], failed["code"],
                      failed.get("traceback", ""), failed["summary"])
    if record.done and exit_code in (None, 0):
        return Ending(rank, "done", f"rank {rank} finished", False)
    if record.stopped:
        signum, kind = record.stopped["signal"], "stopped" if record.stopped.get("requested") else "stopped-outside"
        return Ending(rank, kind, f"{who} was stopped by {signal_name(signum)} from outside the launcher",
                      False, record.stopped["time"], 128 + signum, summary=f"stopped by {signal_name(signum)}")
    if exit_code is not None and exit_code < 0:
        signum = -exit_code
        return Ending(rank, "killed", f"{who} was killed by signal {signum} ({signal_name(signum)})", True,
                      record.exit["time"], 128 + signum)
    if exit_code is not None:
        when = "after its program finished" if record.done else "before its program finished"
        hint = "" if record.done else " (no completion record: os._exit(), or a library ending the process?)"
        return Ending(rank, "vanished", f"{who} exited with status {exit_code} {when}{hint}", True,
                      record.exit["time"], exit_code or 1)
    if record.start:
        return Ending(rank, "lost", f"{who} ended without a completion record", False, code=1,
                      summary="ended without a completion record")
    return Ending(rank, "never-started", f"rank {rank} never started (it wrote no start record)", False, code=1,
                  summary="never started")


@dataclass
class JobReport:
    """The launcher's verdict on a finished job: its exit status, how each rank ended, the lines to print."""

    returncode: int
    endings: list[Ending] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    tracebacks: list[tuple[int, str]] = field(default_factory=list)

    @property
    def culprits(self) -> list[Ending]:
        return [e for e in self.endings if e.culprit]


MAX_CULPRIT_LINES = 4


def verdict(records: dict[int, RankRecord], mpiexec_status: int, interrupted: int | None = None,
            timed_out: float | None = None) -> JobReport:
    """The job's exit status and summary from the ranks' records (``mpiexec_status`` only as a last resort).

    ``interrupted`` is the signal that stopped the launcher (exit status 128 + signal); ``timed_out`` the
    limit in seconds that the job overran (exit status 124).
    """
    endings = classify(records)
    report = JobReport(0, endings)
    unfinished = [e.rank for e in endings if e.kind != "done"]
    if interrupted is not None:
        report.returncode = 128 + interrupted
        report.lines.append(f"interrupted by {signal_name(interrupted)}"
                            f"{' (Ctrl-C)' if interrupted == signal.SIGINT else ''}: every rank was stopped")
        return report
    if timed_out is not None:
        report.returncode = 124
        report.lines.append(f"the job did not finish within {timed_out:g} s and was stopped "
                            f"({_ranks(unfinished)} had not finished)")
        return report
    culprits = report.culprits
    if not culprits:
        if mpiexec_status != 0:
            report.returncode = mpiexec_status
            report.lines.append(f"mpiexec exited with status {mpiexec_status} although every rank finished")
        return report
    report.returncode = culprits[0].code or 1
    groups: dict[str, list[Ending]] = {}
    for ending in culprits:  # the same error on several ranks is one line
        groups.setdefault(ending.summary or ending.text, []).append(ending)
    for members in list(groups.values())[:MAX_CULPRIT_LINES]:
        first = members[0]
        also = f" (also {_ranks([m.rank for m in members[1:]])})" if len(members) > 1 else ""
        report.lines.append(first.text + also)
        if first.traceback:
            report.tracebacks.append((first.rank, first.traceback))
    if len(groups) > MAX_CULPRIT_LINES:
        report.lines.append(f"... and {len(groups) - MAX_CULPRIT_LINES} more failures")
    others = [e.rank for e in endings if not e.culprit and e.kind != "done"]
    tail = f"the job failed with exit status {report.returncode}"
    if others:
        tail += f"; {_ranks(others)} {'was' if len(others) == 1 else 'were'} stopped"
    if report.tracebacks:
        tail += "; traceback above" if len(report.tracebacks) == 1 else "; tracebacks above"
    report.lines.append(tail)
    return report


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks))
