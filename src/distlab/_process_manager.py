"""The process manager of a job on one host: it starts the ranks and answers their PMI requests over socketpairs.

How MPI ranks find each other. An MPICH rank learns its rank, the job's size and its peers' addresses from a
process manager, through PMI: a line protocol of ``cmd=... key=value`` requests (``init``, ``get_maxes``,
``put``/``get`` in a key-value space shared by the job, ``barrier_in``, ``finalize``, ``abort``). The rank finds
its process manager through its environment: ``PMI_FD`` (a socket it inherited) or ``PMI_PORT`` (an address to
connect to), with ``PMI_RANK`` and ``PMI_SIZE``.

Why distlab has its own for one host. Hydra, the mpich wheel's ``mpiexec``, starts a proxy that connects back to a
control port, and binds that port to every interface (``HYDU_sock_listen`` takes ``INADDR_ANY``; no option of
hydra's binds it elsewhere): a job on a laptop listens on the network for its whole life. On one host nothing
needs a port: each rank gets its end of a socketpair as ``PMI_FD``, so the job listens on nothing at all. MPICH's
own one-host manager, ``mpiexec.gforker``, does that too, but labels output only as ``N>`` at line starts, which
cannot be told from a rank's own text when two ranks' partial lines interleave; this one tags output as hydra's
``-prepend-pattern`` does, so the launcher's demultiplexer (:mod:`distlab._supervise`) reads both alike.

What it keeps of hydra's behaviour (the launcher's supervision relies on it): each rank in its own process group,
signals (``SIGINT``, ``SIGTERM``, ``SIGHUP``) forwarded to every rank's group, stdin to rank 0 only, every chunk
of a rank's output and every line in it tagged with the pattern (``%r``: the rank), the job ended with
``SIGKILL`` to every rank as soon as one calls ``MPI_Abort`` or ends badly (a non-zero status or a signal), and
``PMI_process_mapping`` saying that every rank is on one node. It also ends with its launcher: a launcher killed
outright (a test session ended at a test's time bound) gets this manager a SIGTERM from the kernel, forwarded to
every rank, so no job outlives it. Its exit status is the first bad ending's
(``128 + signal`` for a signal), else 0. After a bad ending it removes the shared-memory files of the ranks that
never finalized (:mod:`distlab._leftovers`) when no launcher above it does.

Run by the launcher (:func:`distlab.launch.mpiexec_command`) as
``python -m distlab._process_manager [-prepend-pattern P] -n N program args...``; it never imports MPI.
"""
from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time

__all__ = ["main", "parse_request", "PmiServer"]

#: The PMI-1 limits this manager announces (``get_maxes``), as hydra announces them.
MAXES = "kvsname_max=256 keylen_max=64 vallen_max=1024"
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Seconds to keep forwarding output after the last rank ended (a rank's children may still hold the pipes).
DRAIN_GRACE = 0.5


def parse_request(line: str) -> dict:
    """``"cmd=get kvsname=k key=x"`` -> ``{"cmd": "get", "kvsname": "k", "key": "x"}`` (PMI-1's wire form)."""
    fields = {}
    for word in line.split():
        key, sep, value = word.partition("=")
        if not sep:
            raise ValueError(f"malformed PMI request {line!r}: {word!r} is not key=value")
        fields[key] = value
    if "cmd" not in fields:
        raise ValueError(f"malformed PMI request {line!r}: no cmd")
    return fields


class Rank:
    """One rank as the manager sees it: its process, its PMI socket, a request not yet whole, its output pipes."""

    def __init__(self, rank: int, process: subprocess.Popen, pmi: socket.socket):
        self.rank = rank
        self.process = process
        self.pmi = pmi
        self.pending = b""
        self.multiline: list[str] | None = None  # the lines of an ``mcmd=...`` request until its ``endcmd``
        self.outputs = {process.stdout.fileno(): 1, process.stderr.fileno(): 2}  # its pipe -> our stdout/stderr


class PmiServer:
    """The job's key-value space and barrier, answering each rank's PMI-1 requests (``reply(rank, line)``)."""

    def __init__(self, size: int, reply):
        self.size = size
        self.reply = reply
        # MPICH names the job's shared-memory segments after the key-value space: it must be the job's own.
        self.kvs_name = f"kvs_{os.getpid()}_{os.urandom(4).hex()}"
        self.kvs = {"PMI_process_mapping": f"(vector,(0,1,{size}))"}  # one node holding every rank
        self.waiting: list[int] = []  # ranks in the barrier
        self.aborted: int | None = None  # the exit code of an MPI_Abort

    def handle(self, rank: int, request: dict) -> None:
        """Answer one request; unknown commands are a ValueError (the job cannot go on without an answer)."""
        command = request["cmd"]
        answer = getattr(self, f"_{command}", None)
        if answer is None:
            raise ValueError(f"rank {rank} sent the PMI command {command!r}, which this process manager does not "
                             "serve (spawning processes and publishing names need hydra: "
                             "DISTLAB_PROCESS_MANAGER=mpiexec)")
        answer(rank, request)

    def _init(self, rank, request):
        self.reply(rank, "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0")

    def _get_maxes(self, rank, request):
        self.reply(rank, f"cmd=maxes {MAXES} rc=0")

    def _get_appnum(self, rank, request):
        self.reply(rank, "cmd=appnum appnum=0 rc=0")

    def _get_my_kvsname(self, rank, request):
        self.reply(rank, f"cmd=my_kvsname kvsname={self.kvs_name} rc=0")

    def _get_universe_size(self, rank, request):
        self.reply(rank, f"cmd=universe_size size={self.size} rc=0")

    def _put(self, rank, request):
        self.kvs[request["key"]] = request.get("value", "")
        self.reply(rank, "cmd=put_result rc=0")

    def _get(self, rank, request):
        value = self.kvs.get(request.get("key", ""))
        self.reply(rank, "cmd=get_result rc=-1 msg=key_not_found" if value is None
                   else f"cmd=get_result rc=0 value={value}")

    def _barrier_in(self, rank, request):
        self.waiting.append(rank)
        if len(self.waiting) == self.size:  # every rank arrived: release them all
            for waiting in self.waiting:
                self.reply(waiting, "cmd=barrier_out rc=0")
            self.waiting.clear()

    def _finalize(self, rank, request):
        self.reply(rank, "cmd=finalize_ack rc=0")

    def _abort(self, rank, request):
        code = request.get("exitcode", "1")
        self.aborted = int(code) if code.lstrip("-").isdigit() else 1


class ProcessManager:
    """Start ``size`` ranks of ``command``, serve their PMI, forward their output and signals, end the job."""

    def __init__(self, size: int, command: list[str], pattern: str | None):
        self.size = size
        self.command = command
        self.pattern = pattern
        self.selector = selectors.DefaultSelector()
        self.ranks: list[Rank] = []
        self.server = PmiServer(size, self._reply)
        self.status: int | None = None  # the first bad ending's status
        self.signalled: list[int] = []

    def run(self) -> int:
        self.started = time.time() - 1.0  # file times lag the clock by up to a tick
        for signum in FORWARDED:
            signal.signal(signum, self._forward)
        try:
            for rank in range(self.size):
                try:
                    self._start(rank)
                except OSError as exc:  # no such program, or out of processes or descriptors
                    _write(2, f"distlab process manager: could not start rank {rank} ({' '.join(self.command)}): "
                              f"{exc}\n".encode())
                    self.status = 1
                    return self.status
            self._serve()
        finally:
            self._kill_all()
            if self.status and not os.environ.get("DISTLAB_LAUNCHER"):  # the launcher removes them itself
                self._remove_leftovers()
        return self.status or 0

    def _remove_leftovers(self) -> None:
        """After a bad ending: the shared-memory files of ranks that never finalized (:mod:`distlab._leftovers`),
        once the killed ranks are gone (bounded), as the launcher removes them; here for a job started without it."""
        from . import _leftovers

        end = time.monotonic() + 2.0
        for entry in self.ranks:
            try:
                entry.process.wait(timeout=max(end - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                pass
        _leftovers.remove_leftovers(self.started)

    def _start(self, rank: int) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PMI_FD=str(theirs.fileno()), PMI_RANK=str(rank), PMI_SIZE=str(self.size),
                   MPI_LOCALNRANKS=str(self.size), MPI_LOCALRANKID=str(rank))
        process = subprocess.Popen(self.command, env=env, pass_fds=[theirs.fileno()], process_group=0,
                                   stdin=None if rank == 0 else subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=die_with_parent)
        theirs.close()
        entry = Rank(rank, process, ours)
        self.ranks.append(entry)
        self.selector.register(ours, selectors.EVENT_READ, ("pmi", entry))
        for fd in entry.outputs:
            self.selector.register(fd, selectors.EVENT_READ, ("output", entry))

    def _serve(self) -> None:
        """Until every rank has ended and its output is forwarded (or ``DRAIN_GRACE`` after its end)."""
        drain_until = None
        while drain_until is None or (self.selector.get_map() and time.monotonic() < drain_until):
            if self.signalled:  # forwarded here, not in the handler, which could race a rank's reaping
                self._signal_all(self.signalled.pop(0))
            for key, _ in self.selector.select(0.05 if self.selector.get_map() else 0.01):
                kind, entry = key.data
                if kind == "pmi":
                    self._read_requests(key.fileobj, entry)
                else:
                    self._forward_output(key.fd, entry)
            if self.server.aborted is not None and self.status is None:
                self.status = self.server.aborted
                self._kill_all()
            self._reap()
            if drain_until is None and all(r.process.returncode is not None for r in self.ranks):
                drain_until = time.monotonic() + DRAIN_GRACE

    def _read_requests(self, sock: socket.socket, entry: Rank) -> None:
        try:
            data = sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            self.selector.unregister(sock)
            sock.close()
            return
        entry.pending += data
        while b"\n" in entry.pending and self.status is None:
            line, entry.pending = entry.pending.split(b"\n", 1)
            request = self._whole_request(entry, line.decode(errors="replace").strip())
            if request:
                try:
                    self.server.handle(entry.rank, parse_request(request))
                except (ValueError, KeyError) as exc:
                    _write(2, f"distlab process manager: {exc}\n".encode())
                    self.status = 1
                    self._kill_all()

    @staticmethod
    def _whole_request(entry: Rank, line: str) -> str:
        """A request once whole: PMI-1 sends ``spawn`` as ``mcmd=spawn``, one ``key=value`` a line, to ``endcmd``."""
        if entry.multiline is not None:
            if line != "endcmd":
                entry.multiline.append(line)
                return ""
            request, entry.multiline = " ".join(entry.multiline), None
            return request
        if line.startswith("mcmd="):
            entry.multiline = ["cmd=" + line[len("mcmd="):]]
            return ""
        return line

    def _reply(self, rank: int, line: str) -> None:
        try:
            self.ranks[rank].pmi.sendall(line.encode() + b"\n")
        except OSError:  # the rank is gone; its ending is judged by its exit status
            pass

    def _forward_output(self, fd: int, entry: Rank) -> None:
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        if not data:
            self.selector.unregister(fd)
            return
        if self.pattern:  # as hydra: the tag before the chunk and before every line that starts in it
            tag = self.pattern.replace("%r", str(entry.rank)).encode()
            ends_line = data.endswith(b"\n")
            data = tag + (data[:-1] if ends_line else data).replace(b"\n", b"\n" + tag) + (b"\n" if ends_line else b"")
        _write(entry.outputs[fd], data)

    def _reap(self) -> None:
        for entry in self.ranks:
            if entry.process.returncode is None and entry.process.poll() is not None:
                code = entry.process.returncode
                if code != 0 and self.status is None:  # a bad ending ends the job, as hydra does
                    self.status = code if code > 0 else 128 - code
                    self._kill_all()

    def _forward(self, signum, frame) -> None:
        self.signalled.append(signum)

    def _signal_all(self, signum: int) -> None:
        for entry in self.ranks:
            if entry.process.returncode is None:
                try:
                    os.killpg(entry.process.pid, signum)
                except (ProcessLookupError, PermissionError):
                    pass

    def _kill_all(self) -> None:
        self._signal_all(signal.SIGKILL)


def _write(fd: int, data: bytes) -> None:
    while data:
        try:
            data = data[os.write(fd, data):]
        except BrokenPipeError:  # nobody reads our output any more: drop it, the job goes on
            return
        except BlockingIOError:
            time.sleep(0.01)


def die_with_parent(signum: int = signal.SIGKILL) -> bool:
    """Have the kernel send this process ``signum`` when its parent dies (``PR_SET_PDEATHSIG``); False where it
    cannot.

    Each rank calls it before it runs (its parent: this manager), and the bootstrap's rank (its parent: its
    watcher); this manager asks for SIGTERM when its launcher dies, which it forwards to every rank."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signum, 0, 0, 0)
    except (OSError, AttributeError):
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    """``[-prepend-pattern P] -n N program args...`` (the options of hydra's ``mpiexec`` the launcher uses)."""
    args = list(sys.argv[1:] if argv is None else argv)
    pattern, size = None, None
    while args and args[0] in ("-prepend-pattern", "-n", "-np"):
        option, value = args[0], args[1] if len(args) > 1 else None
        if value is None:
            raise SystemExit(f"distlab process manager: {option} needs a value")
        if option == "-prepend-pattern":
            pattern = value
        else:
            if not value.isdigit() or int(value) < 1:
                raise SystemExit(f"distlab process manager: -n takes a positive number of ranks, not {value!r}")
            size = int(value)
        args = args[2:]
    if size is None or not args:
        raise SystemExit("usage: python -m distlab._process_manager [-prepend-pattern P] -n N program args...")
    # A launcher killed outright (a test session ended at a test's time bound, a SIGKILL) takes its job with it:
    # the kernel sends this manager SIGTERM, which it forwards to every rank as on Ctrl-C.
    launcher = os.getppid()
    die_with_parent(signal.SIGTERM)
    if os.getppid() != launcher:
        raise SystemExit("distlab process manager: its launcher ended before the job started")
    return ProcessManager(size, args, pattern).run()


if __name__ == "__main__":
    sys.exit(main())
