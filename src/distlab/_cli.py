"""The command line: ``python -m distlab run ...``, ``merge-timeline ...`` and ``cluster up|down|status``."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import textwrap

from ._restart import parse_hosts
from ._supervise import MONITOR_INTERVAL, Interrupted
from .cluster.cli import add_parser as add_cluster_parser, run_command as run_cluster_command
from .errors import DistlabError, MpiNotFoundError
from .launch import LAUNCHER_VARIABLES, RANK_VARIABLES, _launch

RUN_USAGE = "python -m distlab run [options] (script.py | -m module) [args ...]"

RUN_DESCRIPTION = """\
Run a Python script, or a module with -m, on N MPI ranks with the MPI of this environment
(MPICH or Open MPI: the first line says which), as `mpiexec -n N python script.py args` would, and:
  - each line a rank prints comes out whole, prefixed with its rank: [0] ..., [1] ...
  - an uncaught exception on any rank ends the whole job at once (no rank waits in a collective
    for a peer that died); the launcher then prints that rank's traceback and a short summary:
    which rank failed and how (its exception, the signal that killed it, or that it vanished
    before its program finished);
  - Ctrl-C (or SIGTERM) stops every rank quietly; the timeline, if asked for, is still written
    (marked partial);
  - with --max-restarts N, a failed job is stopped on every rank and started again, at most N
    times (never after a clean end); the summary gives every attempt's root cause. On a virtual
    cluster (--cluster MIN:MAX) a host that died is left out while at least MIN hosts remain."""

EXIT_STATUS = """\
exit status:
  0     every rank's program finished
  N     the first failing rank's: 1 after an exception, N after sys.exit(N),
        128+S if killed by signal S, 1 if it vanished (os._exit(0) before its program finished)
  124   --timeout ran out
  130   interrupted by Ctrl-C (SIGINT); 143 by SIGTERM
  with --max-restarts: the last attempt's"""


def _variables(title: str, rows) -> str:
    lines = [title]
    for name, meaning in rows:
        lines.append(f"  {name}")
        lines += textwrap.wrap(meaning, 96, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def _run_parser() -> argparse.ArgumentParser:
    epilog = "\n\n".join([
        _variables("environment variables set for every rank:", RANK_VARIABLES)
        + "\n  every other variable of the launcher's environment is passed on (DISTLAB_IMPL, DISTLAB_DEBUG...)",
        _variables("environment variables the launcher reads:", LAUNCHER_VARIABLES),
        EXIT_STATUS,
        "examples:\n  python -m distlab run -n 4 train.py --epochs 3\n"
        "  python -m distlab run -np 2 -m mypkg.train --epochs 3\n"
        "  python -m distlab run -n 2 --timeline trace.json --no-prefix train.py\n"
        "  python -m distlab run -n 4 --max-restarts 3 train.py   (resumes from its checkpoints)\n"
        "  sudo .venv/bin/python -m distlab run -n 4 --cluster 2 --rate 1gbit train.py   (a virtual cluster)",
    ])
    parser = argparse.ArgumentParser(prog="python -m distlab run", usage=RUN_USAGE, description=RUN_DESCRIPTION,
                                     epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "-np", "--np", dest="np", type=int, default=2, metavar="N",
                        help="number of ranks (default 2)")
    parser.add_argument("-m", dest="module", metavar="module",
                        help="run a module as `python -m module` does; what follows it is its arguments")
    parser.add_argument("--timeline", metavar="FILE",
                        help="write a Chrome trace of the run to FILE (open it in https://ui.perfetto.dev)")
    parser.add_argument("--timeout", type=float, metavar="SECONDS",
                        help="stop the job after this many seconds (exit status 124)")
    parser.add_argument("--prefix", action=argparse.BooleanOptionalAction, default=True,
                        help="prefix each line of output with its rank, [N] (default: on)")
    parser.add_argument("--cluster", type=_hosts, metavar="HOSTS",
                        help="run across a virtual cluster of HOSTS hosts (root; brought up if needed); MIN:MAX "
                             "runs on MAX hosts and restarts on those that remain while at least MIN do")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="after a failure, stop every rank and start the job again, at most N times "
                             "(default 0, as torchrun); the ranks find DISTLAB_RESTART_COUNT in their environment")
    parser.add_argument("--monitor-interval", type=float, default=MONITOR_INTERVAL, metavar="SECONDS",
                        help=f"how often the launcher looks at the ranks' state (default {MONITOR_INTERVAL:g} s, "
                             "as torchrun)")
    parser.add_argument("--rate", help="with --cluster: the links' rate, e.g. 10gbit, 1gbit")
    parser.add_argument("--fault-tolerance", action="store_true",
                        help="keep the other ranks running when one dies: their operations fail with "
                             "ProcessFailedError, and distlab.comm.recovery rebuilds the groups on the survivors "
                             "(MPI's ULFM: Open MPI's mpirun --with-ft ulfm; refused on MPICH, whose ch4 device "
                             "lacks it, or with --max-restarts the job fails over to restarts)")
    return parser


_TAKES_VALUE = {"-n", "-np", "--np", "--timeline", "--timeout", "--cluster", "--rate", "--max-restarts",
                "--monitor-interval"}


def _hosts(value: str):
    """``--cluster``: a number of hosts, or torchrun's ``MIN:MAX``."""
    if value.isdigit():
        return int(value)
    try:
        parse_hosts(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if ":" not in value:
        raise argparse.ArgumentTypeError(f"expected a number of hosts or MIN:MAX, got {value!r}")
    return value


def split_run_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split ``run``'s arguments into the launcher's options and the program (``script args`` or
    ``-m module args``): as with ``python``, everything after the script or the module is the program's."""
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "-m":
            return argv[:i + 2], argv[i + 2:]
        if token.startswith("-m") and not token.startswith("--") and len(token) > 2:  # -mpackage.module
            return argv[:i] + ["-m", token[2:]], argv[i + 1:]
        if token in _TAKES_VALUE:
            i += 2
        elif token.startswith("-") and token != "-":
            i += 1
        else:
            return argv[:i + 1], argv[i + 1:]
    return argv, []


def run_command(argv: list[str]) -> int:
    options_part, program_args = split_run_args(argv)
    parser = _run_parser()
    parser.add_argument("script", nargs="?", help=argparse.SUPPRESS)
    options = parser.parse_args(options_part)
    if not options.module and not options.script:
        parser.error("no program to run: give a script (script.py) or a module (-m module)")
    if options.np < 1:
        parser.error(f"-n must be at least 1, got {options.np}")
    if options.rate is not None and options.cluster is None:
        parser.error("--rate shapes a virtual cluster's links: give --cluster HOSTS too")
    if options.max_restarts < 0:
        parser.error(f"--max-restarts must be at least 0, got {options.max_restarts}")
    if not options.monitor_interval > 0:
        parser.error(f"--monitor-interval must be positive, got {options.monitor_interval}")
    if options.script and not os.path.isfile(options.script):
        parser.error(f"no such script: {options.script}")
    target = ["-m", options.module] if options.module else [options.script]
    # SIGTERM (e.g. from `timeout`) must reach the supervisor, which stops every rank: raise instead of dying.
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        result = _launch(["distlab._bootstrap", *target, *program_args], options.np, timeline=options.timeline,
                         timeout=options.timeout, prefix=options.prefix, cluster=options.cluster,
                         rate=options.rate, fault_tolerance=options.fault_tolerance, announce=True,
                         max_restarts=options.max_restarts, monitor_interval=options.monitor_interval)
    except (DistlabError, MpiNotFoundError) as exc:  # the job could not start (a cluster, the MPI): say why
        print(f"distlab: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Interrupted) as exc:  # a second Ctrl-C while stopping: everything is killed
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        print(f"distlab: interrupted by {signal.Signals(signum).name}: every rank was killed", file=sys.stderr)
        return 128 + signum
    finally:
        signal.signal(signal.SIGTERM, previous)
    if result.timeline:
        state = "timeline"
        if result.timeline_partial:
            ranks = ", ".join(map(str, result.timeline_ranks))
            state = f"partial timeline (the run did not finish; ranks {ranks} of {options.np} wrote theirs)"
        print(f"distlab: {state} written to {result.timeline} (open it in https://ui.perfetto.dev)",
              file=sys.stderr)
    elif options.timeline:
        print(f"distlab: no timeline written: no rank recorded one ({options.timeline})", file=sys.stderr)
    return result.returncode


def _raise_interrupted(signum, _frame):
    raise Interrupted(signum)


def main(argv=None) -> int:
    """Command line: ``python -m distlab run ...`` (see ``--help``), ``merge-timeline`` and ``cluster``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m distlab",
                                     description="distlab's launcher: run a program on several MPI ranks.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,merge-timeline,cluster}")
    sub.add_parser("run", help="run a script or module on N MPI ranks (see: python -m distlab run --help)",
                   add_help=False)
    merge_parser = sub.add_parser("merge-timeline", help="merge per-rank timeline parts into one trace")
    merge_parser.add_argument("path")
    add_cluster_parser(sub)
    if argv and argv[0] == "run":
        return run_command(argv[1:])
    options = parser.parse_args(argv)
    if options.command == "cluster":
        return run_cluster_command(options)
    from .timeline import merge

    written = merge(options.path)
    print(written or f"no parts found for {options.path}")
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
