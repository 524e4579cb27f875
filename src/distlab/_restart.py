"""Restarting a failed job (``python -m distlab run --max-restarts N``), as torchrun's elastic agent does.

torchrun (torch/distributed/elastic/agent/server/api.py, ``SimpleElasticAgent._invoke_run``) polls its workers
every ``--monitor-interval`` seconds; when one fails it stops all of them and, while restarts are left, starts the
whole group again, fresh processes with possibly new ranks; a job that ended cleanly is never restarted. The state
is the program's business ("make sure to checkpoint"): :mod:`distlab.checkpoint` and
:mod:`distlab.collectives.elastic` are how a distlab program resumes.

The launcher keeps the same contract, in one place:

- :func:`decide` says whether a finished attempt is restarted: only a failure (not success, an interrupt or the
  time limit), only while restarts are left (counted job-wide: one launcher supervises every rank, so the count
  cannot run per node past the limit, pytorch#108158);
- on a virtual cluster a host that died (its network interface down: its link cut, or its namespace gone) is
  left out, and the job restarts on the hosts that remain, while at least ``min_hosts`` do (torchrun's
  ``--nnodes=MIN:MAX``); a host whose ranks were only killed rejoins, as a torchrun node whose agent lives;
- every attempt's root cause is kept (:class:`Attempt`) and :func:`summary` lists them all when the job ends, in
  the shape of torchrun's "Root Cause (first observed failure)", for every attempt rather than the last.

Each attempt's ranks find ``DISTLAB_RESTART_COUNT`` (0 for the first attempt), ``DISTLAB_MAX_RESTARTS`` and
``DISTLAB_RUN_DIR`` (a directory that lives as long as the job, across its attempts) in their environment.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

__all__ = ["RESTART_COUNT_VAR", "MAX_RESTARTS_VAR", "RUN_DIR_VAR", "Attempt", "attempt_of", "decide", "summary",
           "check_max_restarts", "parse_hosts", "keep_attempt_timeline", "run_attempts"]

RESTART_COUNT_VAR = "DISTLAB_RESTART_COUNT"
MAX_RESTARTS_VAR = "DISTLAB_MAX_RESTARTS"
RUN_DIR_VAR = "DISTLAB_RUN_DIR"


def check_max_restarts(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"max_restarts must be a whole number >= 0, got {value!r}")
    return value


def parse_hosts(cluster) -> tuple[object, int | None]:
    """``cluster`` as ``(hosts or name, min_hosts)``: ``"1:2"`` is torchrun's MIN:MAX (2 hosts, at least 1)."""
    if isinstance(cluster, str) and ":" in cluster:
        low, _, high = cluster.partition(":")
        if not (low.isdigit() and high.isdigit()) or not 1 <= int(low) <= int(high):
            raise ValueError(f"--cluster MIN:MAX needs 1 <= MIN <= MAX, got {cluster!r}")
        return int(high), int(low)
    return cluster, None


@dataclass
class Attempt:
    """How one attempt of the job ended: its number, exit status, and root cause (the first observed failure)."""

    number: int
    returncode: int
    np: int
    started: float
    cause: str = ""
    host: str | None = None
    lines: list = field(default_factory=list)
    hosts: list | None = None

    @property
    def failed(self) -> bool:
        return self.returncode != 0


def attempt_of(number: int, np: int, started: float, result, hosts=None) -> Attempt:
    """The :class:`Attempt` of a finished attempt's :class:`~distlab.launch.JobResult`."""
    culprits = [e for e in result.ranks if e.culprit]
    cause = culprits[0].text if culprits else (result.summary[0] if result.summary else "")
    if culprits and culprits[0].time != float("inf"):
        cause += f" at {time.strftime('%H:%M:%S', time.localtime(culprits[0].time))}"
    return Attempt(number, result.returncode, np, started, cause, None, list(result.summary), hosts)


def decide(result, attempts: list, max_restarts: int) -> tuple[bool, str]:
    """Whether to start the job again after ``attempts`` (the last one just ended), and the line saying why not."""
    last = attempts[-1]
    if not last.failed:
        return False, ""
    if result.interrupted is not None:
        return False, "interrupted: not restarted"
    if result.timed_out:
        return False, "the time limit ran out: not restarted"
    if len(attempts) > max_restarts:
        return False, (f"no restart left (--max-restarts {max_restarts})" if max_restarts else "")
    return True, ""


def surviving_hosts(cluster_job, min_hosts: int | None):
    """``(job on the hosts that remain, lost hosts, why not)`` after a failed attempt on a virtual cluster."""
    lost = cluster_job.lost_hosts()
    if not lost:
        return cluster_job, [], ""
    remaining = len(cluster_job.hosts) - len(lost)
    need = len(cluster_job.hosts) if min_hosts is None else min_hosts
    if remaining < need:
        return None, lost, (f"host{'s' if len(lost) > 1 else ''} {', '.join(lost)} lost: {remaining} "
                            f"remain{'s' if remaining == 1 else ''}, fewer than the minimum of {need}")
    return cluster_job.without(lost), lost, ""


def restart_line(attempt: Attempt, max_restarts: int, lost: list, np: int) -> str:
    where = (f" on {np} ranks without host{'s' if len(lost) > 1 else ''} {', '.join(lost)} (lost)" if lost else "")
    return (f"attempt {attempt.number} failed ({attempt.cause or f'exit status {attempt.returncode}'}); "
            f"restarting every rank{where} (restart {attempt.number + 1} of {max_restarts})")


def keep_attempt_timeline(timeline: str | None, number: int) -> None:
    """A restarted job's timeline is its last attempt's; an earlier attempt's is kept beside it, numbered."""
    if timeline:
        root, ext = os.path.splitext(timeline)
        with contextlib.suppress(OSError):
            os.replace(timeline, f"{root}.attempt{number}{ext}")


def summary(attempts: list, max_restarts: int, gave_up: str) -> list[str]:
    """The lines that end a job run with restarts: every attempt's root cause, first observed failure first."""
    if not max_restarts and len(attempts) == 1:
        return []
    last = attempts[-1]
    lines = []
    if last.failed:
        lines.append(f"the job failed in each of its {len(attempts)} attempt{'s' if len(attempts) > 1 else ''}"
                     + (f" ({gave_up})" if gave_up else "") + "; root cause (first observed failure) of each:")
    elif len(attempts) > 1:
        lines.append(f"the job finished in attempt {last.number}, after {len(attempts) - 1} "
                     f"restart{'s' if len(attempts) > 2 else ''}; root cause (first observed failure) of each "
                     "failed attempt:")
    for attempt in attempts:
        if attempt.failed:
            when = time.strftime("%H:%M:%S", time.localtime(attempt.started))
            lines.append(f"  attempt {attempt.number} (started {when}, {attempt.np} ranks): "
                         f"{attempt.cause or 'no cause recorded'} (exit status {attempt.returncode})")
    return lines


def run_attempts(run_one, np: int, cluster_job, env: dict | None, max_restarts: int, min_hosts: int | None,
                 timeout: float | None, say, report: bool = True, before_restart=None):
    """The restart loop: ``run_one(np, cluster_job, extra_env, (time left, timeout), first)`` runs one attempt
    and returns its :class:`~distlab.launch.JobResult`; after a failure, while :func:`decide` says so, the job
    runs again (on a cluster, without the hosts that died). ``say(line)`` prints each restart, and with
    ``report`` the :func:`summary` at the end. Returns the last attempt's result, its ``attempts`` set and the
    summary added to its ``summary``.
    """
    run_dir = tempfile.mkdtemp(prefix="distlab-run-")  # lives across the attempts
    deadline = None if timeout is None else time.monotonic() + timeout
    attempts: list = []
    try:
        while True:
            extra = dict(env or {})
            extra.update({RESTART_COUNT_VAR: len(attempts), MAX_RESTARTS_VAR: max_restarts, RUN_DIR_VAR: run_dir})
            left = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            started = time.time()
            result = run_one(np, cluster_job, extra, (left, timeout), not attempts)
            attempts.append(attempt_of(len(attempts), np, started, result,
                                       list(cluster_job.hosts) if cluster_job else None))
            again, gave_up = decide(result, attempts, max_restarts)
            lost = []
            if again and cluster_job is not None:
                cluster_job, lost, gave_up = surviving_hosts(cluster_job, min_hosts)
                again = cluster_job is not None
                np = cluster_job.np if again else np
            if not again:
                break
            say(restart_line(attempts[-1], max_restarts, lost, np))
            keep_attempt_timeline(result.timeline, len(attempts) - 1)
            if before_restart is not None:
                before_restart()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    result.attempts = attempts
    closing = summary(attempts, max_restarts, gave_up)
    for line in closing if report else ():
        say(line)
    result.summary = result.summary + closing
    return result
