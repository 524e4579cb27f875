"""What the launcher costs: start-up of a trivial job, and the output it forwards, against plain ``mpiexec``.

Run: ``python -P benchmarks/bench_launch.py`` (or ``make bench``). Five ways to run the same script on 2 ranks,
interleaved round by round so that the machine's state drifts equally for all:

- ``mpiexec``: ``mpiexec -n 2 python script.py``, its output piped to this process and thrown away;
- ``bootstrap``: ``mpiexec -n 2 python -m distlab._bootstrap script.py`` (what the launcher starts per rank, without
  its supervision: no job directory, so no watcher process and no records);
- ``manager``: ``python -m distlab._process_manager -n 2 python script.py``: distlab's process manager for one
  host in place of ``mpiexec`` (PMI over socketpairs, nothing listens);
- ``launcher``: :func:`distlab.launch.launch_script`, capturing (the watcher per rank, the records, the tagged
  output split into whole lines), with distlab's process manager (its default on one host);
- ``launcher/hydra``: the same with ``DISTLAB_PROCESS_MANAGER=mpiexec`` (Hydra starts the ranks).

Two scripts: ``empty`` (MPI start-up and shut-down only) and ``chatty`` (each rank prints 20 000 lines of 60 bytes,
half of them in two writes). Prints the median wall time of each and writes ``benchmarks/results/bench_launch.json``.
On a 2-core machine shared with other work the medians move by tens of milliseconds: compare within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SCRIPTS = {
    "empty": "from mpi4py import MPI\n",
    "chatty": (
        "import sys\nfrom mpi4py import MPI\n"
        "for i in range(20000):\n"
        "    if i % 2:\n"
        "        sys.stdout.write(f'line {i:6d} ' + 'x' * 30); sys.stdout.write(' end of the line\\n')\n"
        "    else:\n"
        "        sys.stdout.write(f'line {i:6d} ' + 'x' * 30 + ' end of the line\\n')\n"
    ),
}


def _plain(command: list[str], env: dict) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          stdin=subprocess.DEVNULL, timeout=600)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{command} failed:\n{done.stderr.decode(errors='replace')}")
    return elapsed


def measure(rounds: int, np_: int) -> list[dict]:
    from distlab.launch import find_mpiexec, job_environment, launch_script

    env = job_environment(np=np_)
    mpiexec = find_mpiexec()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, source in SCRIPTS.items():
            script = Path(tmp) / f"{name}.py"
            script.write_text(source)
            ways = {
                "mpiexec": lambda: _plain([mpiexec, "-n", str(np_), sys.executable, str(script)], env),
                "bootstrap": lambda: _plain([mpiexec, "-n", str(np_), sys.executable, "-m", "distlab._bootstrap",
                                             str(script)], env),
                "manager": lambda: _plain([sys.executable, "-m", "distlab._process_manager", "-n", str(np_),
                                           sys.executable, str(script)], env),
                "launcher": lambda: _timed_launch(launch_script, script, np_),
                "launcher/hydra": lambda: _timed_launch(launch_script, script, np_,
                                                        {"DISTLAB_PROCESS_MANAGER": "mpiexec"}),
            }
            times = {way: [] for way in ways}
            for _ in range(rounds):
                for way, run in ways.items():
                    times[way].append(run())
            base = statistics.median(times["mpiexec"])
            for way, samples in times.items():
                median = statistics.median(samples)
                rows.append({"script": name, "way": way, "np": np_, "rounds": rounds, "median_s": median,
                             "min_s": min(samples), "vs_mpiexec_ms": (median - base) * 1e3})
    return rows


def _timed_launch(launch_script, script: Path, np_: int, env: dict | None = None) -> float:
    start = time.perf_counter()
    result = launch_script(str(script), np=np_, capture=True, timeout=600, env=env)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"launch_script failed:\n{result.stderr}")
    if script.stem == "chatty" and result.stdout.count("\n") != 20000 * np_:
        sys.exit("the launcher lost or split lines")
    return elapsed


def table(rows: list[dict]) -> str:
    lines = [f"{'script':<8} {'way':<14} {'median s':>9} {'min s':>8} {'vs mpiexec':>11}"]
    for row in rows:
        lines.append(f"{row['script']:<8} {row['way']:<14} {row['median_s']:>9.3f} {row['min_s']:>8.3f} "
                     f"{row['vs_mpiexec_ms']:>+9.0f}ms")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="launches per way and script (default 15)")
    parser.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    options = parser.parse_args()
    rows = measure(options.rounds, options.np)
    RESULTS.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "bench_launch", "command": " ".join(sys.argv), "host_cores": os.cpu_count(),
              "load_avg": os.getloadavg(), "rows": rows}
    (RESULTS / "bench_launch.json").write_text(json.dumps(report, indent=1))
    print(table(rows))
    print(f"\nload average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
          f"written to {RESULTS / 'bench_launch.json'}")


if __name__ == "__main__":
    main()
