"""Launching jobs on several ranks: ``python -m distlab run`` and :func:`distlab.run`.

``python -m distlab run -n 4 [--timeline out.json] [--timeout S] script.py args...`` runs ``script.py`` on 4
ranks with the ``mpiexec`` of the environment distlab is installed in (the mpich wheel's, in a venv). Each rank
gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``; an uncaught exception on any rank prints
that rank's traceback and aborts the whole job (no rank is left waiting); the job's exit status is forwarded, and
each failing rank's error is repeated in a summary at the end.

``distlab.run(fn, np=4)`` runs a function (from a notebook too: it travels by cloudpickle) on 4 ranks and returns
the list of per-rank results; an exception on any rank is re-raised here as
:class:`~distlab.errors.RankFailedError` with the rank and its remote traceback.

Both start ``mpiexec`` in a session of its own and kill the whole process group on timeout, so a job can never
outlive its caller's patience.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import ClusterError, DistlabError, RankFailedError

__all__ = ["find_mpiexec", "mpiexec_command", "run_job", "launch_script", "run", "main", "JobResult"]


def find_mpiexec() -> str:
    """The ``mpiexec`` beside this Python (the venv's, from the mpich wheel), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found:
        return found
    raise DistlabError("no mpiexec found: install distlab's dependencies (`pip install mpich mpi4py`) in this "
                       "environment, or put a system MPI's mpiexec on PATH")


def mpiexec_command(np: int, module_args: list[str]) -> list[str]:
    """``mpiexec -n np python -m <module_args>`` with this interpreter."""
    if int(np) < 1:
        raise ValueError(f"np must be at least 1, got {np}")
    return [find_mpiexec(), "-n", str(int(np)), sys.executable, "-m", *module_args]


@dataclass
class JobResult:
    """What a finished job left: its exit status and, when captured, its output."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool


def _job_env(extra: dict | None, np: int = 1) -> dict:
    env = dict(os.environ)
    # As torchrun does: ranks sharing a machine must not each start one BLAS thread per core, or they fight
    # over the cores (seen here: a 30 us matmul taking 50 ms). An explicit setting wins.
    threads = str(max(1, (os.cpu_count() or 1) // max(1, int(np))))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, threads)
    # MPICH's progress engine busy-polls; throttled, an RPC listener blocked in MPI leaves the core to the
    # rank's other threads (measured here: rpc_sync 135 -> 47 us under load; collectives unchanged). Other
    # MPIs ignore the variable. It must be set before MPI starts, hence here.
    env.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "1")
    # The venv's bin first, so mpiexec finds the hydra proxy and ranks find the same Python.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["DISTLAB_LAUNCHER"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    return env


def run_job(command: list[str], timeout: float | None = None, env: dict | None = None,
            capture: bool = False, cwd: str | None = None, np: int = 1) -> JobResult:
    """Run ``command`` in its own session; on timeout kill the whole process group (every rank)."""
    proc = subprocess.Popen(command, env=_job_env(env, np), cwd=cwd, start_new_session=True,
                            stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE if capture else None,
                            stderr=subprocess.PIPE if capture else None, text=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
        out, err = proc.communicate()
    except BaseException:
        _kill_group(proc)
        proc.communicate()
        raise
    return JobResult(proc.returncode, out or "", err or "", timed_out)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=3)
            return
        except subprocess.TimeoutExpired:
            continue


def launch_script(script: str, np: int = 2, args=(), timeline: str | None = None, timeout: float | None = None,
                  env: dict | None = None, capture: bool = False, cwd: str | None = None,
                  cluster=None, rate=None) -> JobResult:
    """Run ``script`` on ``np`` ranks (see the module docstring); merges the timeline when asked for one.

    When the job fails, the message each failing rank printed before aborting is repeated at the end (in
    ``stderr`` when captured): ``mpiexec`` may tear the job down before it has forwarded a rank's last output.
    ``cluster`` (a number of hosts or a cluster's name) runs the ranks across a virtual cluster
    (:mod:`distlab.cluster`, needs root), its links shaped to ``rate`` when given.
    """
    extra = dict(env or {})
    if timeline:
        timeline = os.path.abspath(timeline)
        extra["DISTLAB_TIMELINE"] = timeline
    command = mpiexec_command(np, ["distlab._bootstrap", str(script), *map(str, args)])
    with tempfile.TemporaryDirectory(prefix="distlab-job-") as workdir:
        report = Path(workdir) / "failures.log"
        extra.setdefault(FAILURE_REPORT_VAR, str(report))
        result = _run_maybe_on_cluster(command, cluster, rate, np, timeout=timeout, env=extra, capture=capture,
                                       cwd=cwd)
        summary = _failure_summary(report, result.returncode) if not result.timed_out else ""
    if summary:
        if capture:
            result.stderr += summary
        else:
            sys.stderr.write(summary)
    if timeline:
        from .timeline import merge

        merge(timeline, expected_parts=np, wait=2.0)
    return result


def _run_maybe_on_cluster(command, cluster, rate, np, **kwargs) -> JobResult:
    """run_job, across the virtual cluster's hosts when ``cluster`` is given (then no rank may outlive it)."""
    if cluster is None:
        if rate is not None:
            raise ValueError("rate shapes a virtual cluster's links: give cluster= (a number of hosts) too")
        return run_job(command, np=np, **kwargs)
    from .cluster.jobs import cluster_job

    job = cluster_job(np, cluster, rate)
    kwargs["env"] = {**job.env, **(kwargs.get("env") or {})}
    watch = job.watch()
    try:
        result = run_job(job.wrap(command), np=np, **kwargs)  # one machine: BLAS threads per rank as on one host
    finally:
        watch.stop()
        job.end_survivors()
    lost = "" if not result.returncode else watch.explain(
        result.stdout + result.stderr if kwargs.get("capture") else None)
    if lost and kwargs.get("capture"):
        result.stderr += lost
    elif lost:
        sys.stderr.write(lost)
    return result


FAILURE_REPORT_VAR = "DISTLAB_FAILURE_REPORT"  # where _bootstrap.abort appends the message of a failing rank


def _failure_summary(report: Path, returncode: int) -> str:
    """The last line each failing rank reported (the error itself), in the order they failed; "" if none."""
    if returncode == 0 or not report.exists():
        return ""
    blocks = [b for b in report.read_text(errors="replace").split("\0") if b.strip()]
    if not blocks:
        return ""
    lines = [block.rstrip("\n").rsplit("\n", 1)[-1] for block in blocks]
    return (f"distlab: the job failed with exit status {returncode}; what the failing ranks reported, first "
            "failure first:\n" + "\n".join(lines) + "\n")


def run(fn, np: int = 2, args=(), kwargs=None, timeout: float | None = None, env: dict | None = None,
        cluster=None, rate=None):
    """Run ``fn(*args, **kwargs)`` on ``np`` ranks and return the list of per-rank return values.

    Parameters
    ----------
    fn : callable
        Any function cloudpickle can carry (a lambda or a function defined in a notebook works).
    np : int
        Number of ranks.
    args, kwargs
        Passed to ``fn`` on every rank.
    timeout : float, optional
        Kill the job after this many seconds (default: ``DISTLAB_TIMEOUT`` plus a minute).
    env : dict, optional
        Extra environment variables for the ranks.
    cluster : int or str, optional
        Run across a virtual cluster (:mod:`distlab.cluster`, needs root): a number of hosts (the cluster
        ``dl``, brought up if needed) or the name of a running cluster. Ranks are placed in blocks per host.
    rate : str, optional
        Shape the cluster's links to this rate (``"10gbit"``, ``"1gbit"``).

    Raises
    ------
    RankFailedError
        When ``fn`` raised on any rank (the message holds that rank's traceback).
    """
    import cloudpickle

    from .futures import default_timeout

    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    if module is not None and module.__name__ not in ("__main__",) and not module.__name__.startswith("distlab"):
        # Test modules and scripts are not importable on the ranks: send the function by value.
        cloudpickle.register_pickle_by_value(module)
    with tempfile.TemporaryDirectory(prefix="distlab-run-") as workdir:
        payload = Path(workdir) / "payload.pkl"
        payload.write_bytes(cloudpickle.dumps((fn, tuple(args), dict(kwargs or {}))))
        command = mpiexec_command(np, ["distlab._runner", str(payload), workdir])
        limit = default_timeout() + 60 if timeout is None else timeout
        job = _run_maybe_on_cluster(command, cluster, rate, np, timeout=limit, env=env, capture=True)
        if job.stdout:
            sys.stdout.write(job.stdout)
        if job.stderr:
            sys.stderr.write(job.stderr)
        return _collect_results(Path(workdir), np, job, limit)


def _collect_results(workdir: Path, np: int, job: JobResult, limit: float):
    import cloudpickle

    results, failures = [], {}
    for rank in range(np):
        path = workdir / f"rank{rank}.pkl"
        if not path.exists():
            results.append(None)
            continue
        ok, value = cloudpickle.loads(path.read_bytes())
        if ok:
            results.append(value)
        else:
            failures[rank] = value
            results.append(None)
    if failures:
        first = min(failures)
        raise RankFailedError(f"rank {first} of {np} raised:\n{failures[first]}", rank=first,
                              remote_traceback=failures[first], failures=failures)
    missing = [r for r in range(np) if not (workdir / f"rank{r}.pkl").exists()]
    if job.timed_out:
        raise RankFailedError(f"the job did not finish within {limit:g} s and was killed; ranks {missing} "
                              "returned nothing", rank=missing[0] if missing else None)
    if missing or job.returncode != 0:
        raise RankFailedError(f"ranks {missing} ended without a result (mpiexec exit status {job.returncode})"
                              + (f"\n{job.stderr[-2000:]}" if job.stderr else ""),
                              rank=missing[0] if missing else None)
    return results


def _terminate(signum, _frame):
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    """Command line: ``python -m distlab run -n N [--timeline out.json] [--timeout S] script.py args...``."""
    parser = argparse.ArgumentParser(prog="python -m distlab", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="run a script on N MPI ranks")
    run_parser.add_argument("-n", "--np", type=int, default=2, help="number of ranks (default 2)")
    run_parser.add_argument("--timeline", help="write a Chrome trace of the run to this file")
    run_parser.add_argument("--timeout", type=float, default=None, help="kill the job after this many seconds")
    run_parser.add_argument("--cluster", type=int, default=None, metavar="HOSTS",
                            help="run across a virtual cluster of HOSTS hosts (root; brought up if needed)")
    run_parser.add_argument("--rate", default=None, help="with --cluster: the links' rate, e.g. 10gbit, 1gbit")
    run_parser.add_argument("script")
    run_parser.add_argument("args", nargs=argparse.REMAINDER)
    merge_parser = sub.add_parser("merge-timeline", help="merge per-rank timeline parts into one trace")
    merge_parser.add_argument("path")
    from .cluster.cli import add_parser as add_cluster_parser, run_command as run_cluster_command

    add_cluster_parser(sub)
    options = parser.parse_args(argv)
    # A SIGTERM (e.g. from `timeout`) must reach run_job's cleanup, which kills every rank: raise instead of dying.
    signal.signal(signal.SIGTERM, _terminate)
    if options.command == "merge-timeline":
        from .timeline import merge

        written = merge(options.path)
        print(written or f"no parts found for {options.path}")
        return 0 if written else 1
    if options.command == "cluster":
        return run_cluster_command(options)
    if options.rate is not None and options.cluster is None:
        parser.error("--rate shapes a virtual cluster's links: give --cluster HOSTS too")
    try:
        result = launch_script(options.script, np=options.np, args=options.args, timeline=options.timeline,
                               timeout=options.timeout, cluster=options.cluster, rate=options.rate)
    except ClusterError as exc:
        print(f"distlab: {exc}", file=sys.stderr)
        return 1
    if result.timed_out:
        print(f"distlab: the job was killed after {options.timeout:g} s", file=sys.stderr)
        return 124
    if options.timeline:
        print(f"distlab: timeline written to {os.path.abspath(options.timeline)} "
              "(open it in https://ui.perfetto.dev)", file=sys.stderr)
    return result.returncode
