"""The launcher: distlab.run, `python -m distlab run` and the test harness; how they name what went wrong.

Each launch costs about 0.4 s on a quiet machine, so the command-line checks share launches where they can.
"""
import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

import distlab
from distlab import _jobdir
from distlab._bootstrap import user_traceback
from distlab._cli import split_run_args
from distlab._jobdir import process_start_stamp
from distlab._supervise import Demux, is_banner, supervise
from distlab.errors import RankFailedError

mpi = pytest.mark.mpi
LAUNCH_TIMEOUT = 120


# --- output: whole lines per rank, whatever the chunks -------------------------------------------------------

MARKER = b"\x1eabcd"


def tag(rank):
    return MARKER + str(rank).encode() + b"\x1f"


def hydra_stream(writes):
    """What hydra forwards for ``(rank, text)`` writes: a tag before each chunk and after each inner newline."""
    out = b""
    for rank, text in writes:
        body = text.encode()
        inner, last = body[:-1], body[-1:]
        out += tag(rank) + inner.replace(b"\n", b"\n" + tag(rank)) + last
    return out


def demux(stream, cuts):
    lines = []
    reader = Demux("stdout", MARKER, lambda rank, _, line: lines.append((rank, line)))
    start = 0
    for cut in sorted(cuts) + [len(stream)]:
        reader.feed(stream[start:cut])
        start = max(start, cut)
    reader.close()
    return lines


@given(st.lists(st.tuples(st.integers(0, 11), st.text(st.sampled_from("ab \n\u00e9"), min_size=1, max_size=12)),
                max_size=20), st.lists(st.integers(0, 400), max_size=8))
def test_demux_gives_each_rank_s_lines_whole_whatever_the_chunks(writes, cuts):
    stream = hydra_stream(writes)
    got = demux(stream, [c for c in cuts if c <= len(stream)])
    assert all(rank is not None for rank, _ in got)  # no rank's text taken for mpiexec's own
    for rank in range(12):
        text = "".join(t for r, t in writes if r == rank)
        expected = text.split("\n")
        if expected[-1] == "":
            expected.pop()
        assert [line for r, line in got if r == rank] == expected


def test_demux_keeps_mpiexec_s_own_lines_apart_and_recognises_its_banners():
    stream = hydra_stream([(0, "half "), (1, "one\n"), (0, "line\n")]) + b"\n=====\n=   BAD TERMINATION OF ONE\n"
    stream += b"YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)\n[proxy:0] HYDU_error\n"
    got = demux(stream, [])
    assert got[:2] == [(1, "one"), (0, "half line")]
    assert [line for rank, line in got if rank is None] == [
        "", "=====", "=   BAD TERMINATION OF ONE",
        "YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)", "[proxy:0] HYDU_error"]
    assert [is_banner(line) for rank, line in got if rank is None] == [True, True, True, True, False]


def test_demux_shows_a_progress_bar_s_latest_redraw_at_once_and_takes_crlf_as_newline():
    got = []
    reader = Demux("stderr", MARKER, lambda rank, _, line: got.append((rank, line)))
    reader.feed(tag(0) + b"\r 10%\r 20%\r 30")
    assert got == [(0, " 20%\r")]  # the latest complete redraw, not one per chunk
    reader.feed(tag(1) + b"windows\r\n" + tag(0) + b"%\r100%\n")
    assert got[1:] == [(1, "windows"), (0, " 30%\r"), (0, "100%")]


# --- the verdict: exit status and summary from the ranks' records --------------------------------------------

def records(np, **per_rank):
    out = {rank: _jobdir.RankRecord(rank, start={"pid": 100 + rank, "rank": rank}) for rank in range(np)}
    for key, fields in per_rank.items():
        rank = int(key[1:])
        for name, value in fields.items():
            setattr(out[rank], name, value)
    return out


def test_verdict_of_a_clean_run_is_zero_and_silent():
    done = {"done": {"time": 1.0}}
    report = _jobdir.verdict(records(2, r0=done, r1=done), 0)
    assert report.returncode == 0 and report.lines == []


def test_verdict_names_the_first_failure_groups_equal_errors_and_counts_the_stopped():
    failed = {"code": 1, "summary": "raised KeyError: 'x'", "traceback": "Traceback...\nKeyError: 'x'\n"}
    report = _jobdir.verdict(records(4, r2={"failed": dict(failed, time=2.0)}, r1={"failed": dict(failed, time=3.0)},
                                     r3={"stopped": {"signal": 15, "time": 4.0}}), 1)
    assert report.returncode == 1
    assert report.lines == ["rank 2 raised KeyError: 'x' (also rank 1)",
                            "the job failed with exit status 1; ranks 0, 3 were stopped; traceback above"]
    assert report.tracebacks == [(2, failed["traceback"])]


def test_verdict_of_killed_vanished_and_exited_ranks():
    killed = _jobdir.verdict(records(2, r1={"exit": {"code": -9, "time": 1.0}}), 9)
    assert (killed.returncode, killed.lines[0]) == (137, "rank 1 (pid 101) was killed by signal 9 (SIGKILL)")
    vanished = _jobdir.verdict(records(2, r0={"done": {"time": 1.0}}, r1={"exit": {"code": 0, "time": 1.0}}), 0)
    assert vanished.returncode == 1
    assert vanished.lines[0].startswith("rank 1 (pid 101) exited with status 0 before its program finished")
    assert vanished.lines[1] == "the job failed with exit status 1"
    exited = _jobdir.verdict(records(2, r1={"failed": {"code": 3, "summary": "called sys.exit(3)", "time": 1.0}}), 3)
    assert (exited.returncode, exited.lines) == (3, ["rank 1 called sys.exit(3)",
                                                     "the job failed with exit status 3; rank 0 was stopped"])


def test_verdict_without_any_record_of_the_end_still_names_the_ranks():
    lost = _jobdir.verdict(records(2, r0={"done": {"time": 1.0}}), 0)  # rank 1: a start record, then nothing
    assert lost.returncode == 1 and lost.lines[0] == "rank 1 (pid 101) ended without a completion record"
    never = _jobdir.verdict({0: _jobdir.RankRecord(0), 1: _jobdir.RankRecord(1)}, 1)
    assert never.returncode == 1
    assert never.lines == ["rank 0 never started (it wrote no start record) (also rank 1)",
                           "the job failed with exit status 1"]


def test_verdict_blames_a_rank_stopped_from_outside_not_those_the_launcher_stopped():
    report = _jobdir.verdict(records(3, r0={"stopped": {"signal": 15, "time": 2.0, "requested": True}},
                                     r1={"stopped": {"signal": 15, "time": 1.0}}, r2={"done": {"time": 1.0}}), 143)
    assert report.returncode == 143
    assert report.lines == ["rank 1 (pid 101) was stopped by SIGTERM from outside the launcher",
                            "the job failed with exit status 143; rank 0 was stopped"]


def test_verdict_of_interrupts_and_timeouts():
    interrupted = _jobdir.verdict(records(2), 0, interrupted=signal.SIGINT)
    assert (interrupted.returncode, interrupted.lines) == (130, ["interrupted by SIGINT (Ctrl-C): every rank was "
                                                                 "stopped"])
    late = _jobdir.verdict(records(2, r0={"done": {"time": 1.0}}), 0, timed_out=5.0)
    assert (late.returncode, late.lines) == (124, ["the job did not finish within 5 s and was stopped "
                                                   "(rank 1 had not finished)"])


def test_records_written_by_ranks_are_read_back_by_rank(tmp_path):
    _jobdir.write_start(tmp_path, 1, watcher=None)
    _jobdir.write_failure(tmp_path, 1, 2, "raised OSError: disk", "trace")
    _jobdir.write_exit(tmp_path, os.getpid(), 2 << 8)
    read = _jobdir.read_records(tmp_path, 2)
    assert read[1].pid == os.getpid() and read[1].failed["code"] == 2 and read[1].exit["code"] == 2
    assert read[0].start is None and not read[0].ended and read[1].ended
    assert _jobdir.is_running(read[1].start)


def test_a_rank_that_died_before_its_start_record_is_named_by_its_watcher(tmp_path, monkeypatch):
    monkeypatch.setenv("PMI_RANK", "0")
    _jobdir.write_exit(tmp_path, 4242, 1 << 8)
    read = _jobdir.read_records(tmp_path, 2)
    assert read[0].pid == 4242 and read[0].exit["code"] == 1
    report = _jobdir.verdict(read, 1)
    assert report.lines[0].startswith("rank 0 (pid 4242) exited with status 1 before its program finished")


def test_flush_now_writes_the_part_of_a_recording_timeline_and_merge_marks_it_partial(tmp_path, monkeypatch):
    from distlab import timeline

    monkeypatch.setattr(timeline, "_timeline", None)
    assert timeline.flush_now() is None  # nothing recorded, nothing written
    path = str(tmp_path / "t.json")
    monkeypatch.setattr(timeline, "_timeline", timeline.Timeline(path, rank=3))
    timeline.get_timeline().instant("before the stop")
    assert timeline.flush_now() == path + ".rank3"
    assert timeline.merge(path, partial=True) == path
    trace = json.loads(open(path).read())
    assert trace["otherData"]["partial"] is True
    assert [e["name"] for e in trace["traceEvents"] if e["ph"] == "i"] == ["before the stop"]


# --- the command line and the bootstrap, without MPI ---------------------------------------------------------

def test_split_run_args_leaves_the_program_its_own_options():
    assert split_run_args(["-np", "2", "train.py", "-n", "5"]) == (["-np", "2", "train.py"], ["-n", "5"])
    assert split_run_args(["--no-prefix", "-m", "pkg.mod", "--epochs", "3"]) == (
        ["--no-prefix", "-m", "pkg.mod"], ["--epochs", "3"])
    assert split_run_args(["-mpkg.mod", "-x"]) == (["-m", "pkg.mod"], ["-x"])
    assert split_run_args(["--timeout=5", "--timeline", "t.json", "s.py"]) == (
        ["--timeout=5", "--timeline", "t.json", "s.py"], [])


def test_user_traceback_drops_the_launcher_s_frames(tmp_path):
    import runpy

    script = tmp_path / "boom.py"
    script.write_text("def f():\n    raise KeyError('x')\nf()\n")
    try:
        runpy.run_path(str(script), run_name="__main__")
    except KeyError as exc:
        summary, trace = user_traceback(exc)
    assert summary == "raised KeyError: 'x'"
    assert "runpy" not in trace and trace.count("File ") == 2 and trace.endswith("KeyError: 'x'\n")


# --- distlab.run (MPI) ---------------------------------------------------------------------------------------------

def allreduce_rank(scale):
    import numpy as np

    from distlab import comm

    pg = comm.world()
    a = np.array([pg.rank * scale], dtype=np.float64)
    pg.allreduce(a)
    return {"rank": pg.rank, "size": pg.size, "sum": float(a[0])}


def fail_on_rank_one():
    import os

    if os.environ["RANK"] == "1":
        raise KeyError("missing shard 7")
    return "fine"


@mpi
def test_run_returns_per_rank_results():
    results = distlab.run(allreduce_rank, np=2, args=(10.0,), timeout=LAUNCH_TIMEOUT)
    assert results == [{"rank": 0, "size": 2, "sum": 10.0}, {"rank": 1, "size": 2, "sum": 10.0}]


@mpi
def test_run_carries_lambdas_and_closures():
    offset = 7
    assert distlab.run(lambda: offset + 1, np=2, timeout=LAUNCH_TIMEOUT) == [8, 8]


@mpi
def test_the_caller_of_run_and_the_launcher_never_start_mpi():
    # Importing mpi4py.MPI starts MPI: the process becomes an MPI singleton with listening sockets. A notebook
    # calling distlab.run and the `python -m distlab run` process used to; only the ranks may.
    code = ("import sys, distlab, distlab.__main__\n"
            "assert distlab.run(lambda: 1, np=2, timeout=120) == [1, 1]\n"
            "print('MPI started:', 'mpi4py.MPI' in sys.modules)")
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "MPI started: False", done.stdout


@mpi
def test_run_reraises_with_rank_and_remote_traceback():
    with pytest.raises(RankFailedError) as info:
        distlab.run(fail_on_rank_one, np=2, timeout=LAUNCH_TIMEOUT)
    err = info.value
    assert err.rank == 1 and "KeyError: 'missing shard 7'" in err.remote_traceback
    assert "fail_on_rank_one" in err.remote_traceback and "rank 1 of 2 raised" in str(err)
    assert "_runner" not in err.remote_traceback  # the user's frames, not the launcher's


def print_then_wait_for_the_caller(flag):
    """Rank 0 prints, then waits for a file that the caller creates only once it has seen the line."""
    import os
    import time

    if os.environ["RANK"] == "0":
        print("waiting for the caller", flush=True)
        deadline = time.monotonic() + 60
        while not os.path.exists(flag):
            if time.monotonic() > deadline:
                raise TimeoutError("the caller never saw the line: output is not streamed")
            time.sleep(0.02)
    return os.environ["RANK"]


class _Watcher:
    """A stand-in for sys.stdout that creates ``flag`` when it sees rank 0's line."""

    def __init__(self, flag):
        self.flag, self.text = flag, ""

    def write(self, text):
        self.text += text
        if "[0] waiting for the caller" in self.text:
            open(self.flag, "w").close()
        return len(text)

    def flush(self):
        pass


@mpi
def test_run_streams_each_rank_s_output_as_it_comes(tmp_path, monkeypatch):
    flag = str(tmp_path / "seen")
    watcher = _Watcher(flag)
    monkeypatch.setattr(sys, "stdout", watcher)
    assert distlab.run(print_then_wait_for_the_caller, np=2, args=(flag,), timeout=LAUNCH_TIMEOUT) == ["0", "1"]
    assert "[0] waiting for the caller\n" in watcher.text


def vanish_on_rank_one():
    import os

    import numpy as np

    from distlab import comm

    pg = comm.world()
    pg.allreduce(np.ones(2))
    if pg.rank == 1:
        print(f"pid {os.getpid()}", flush=True)
        os._exit(0)
    pg.allreduce(np.ones(2))
    return "fine"


@mpi
def test_run_names_a_rank_that_vanished(capfd):
    with pytest.raises(RankFailedError) as info:
        distlab.run(vanish_on_rank_one, np=2, timeout=LAUNCH_TIMEOUT)
    pid = re.search(r"\[1\] pid (\d+)", capfd.readouterr().out).group(1)
    assert info.value.rank == 1
    assert f"rank 1 (pid {pid}) exited with status 0 before its program finished" in str(info.value)


def wait_forever():
    import os
    import time

    print(f"ready pid {os.getpid()}", flush=True)
    time.sleep(120)


class _Interrupter(_Watcher):
    """A stand-in for sys.stdout that sends this process SIGINT (Ctrl-C) once both ranks said they are ready."""

    def write(self, text):
        self.text += text
        if self.text.count("ready pid") == 2 and not self.flag:
            self.flag = True
            os.kill(os.getpid(), signal.SIGINT)
        return len(text)


@mpi
def test_run_interrupted_stops_every_rank_and_raises_keyboard_interrupt(monkeypatch):
    watcher = _Interrupter(False)
    monkeypatch.setattr(sys, "stdout", watcher)
    with pytest.raises(KeyboardInterrupt):
        distlab.run(wait_forever, np=2, timeout=LAUNCH_TIMEOUT)
    pids = re.findall(r"ready pid (\d+)", watcher.text)
    assert len(pids) == 2 and _gone(pids)


def _gone(pids):
    """Every process in ``pids`` has ended (the launcher returns only once its ranks are gone)."""
    return [pid for pid in pids if process_start_stamp(int(pid))] == []


# --- the command line (MPI) ----------------------------------------------------------------------------------------

ANNOUNCE = re.compile(r"^distlab: \d+ ranks? on .+, started by .+\n")


def without_announce(stderr: str) -> str:
    """``stderr`` of ``distlab run`` less its first line, which says which MPI runs the job (checked here)."""
    assert ANNOUNCE.match(stderr), stderr
    return ANNOUNCE.sub("", stderr, count=1)


def launch(*args, cwd=None, timeout=LAUNCH_TIMEOUT):
    """``python -m distlab run ARGS``; its stderr without the first line (the MPI it runs on) when the job started."""
    done = subprocess.run([sys.executable, "-P", "-m", "distlab", "run", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)
    if ANNOUNCE.match(done.stderr):
        done.stderr = without_announce(done.stderr)
    return done


def write(path, source):
    path.write_text(textwrap.dedent(source))
    return path


@mpi
def test_output_is_prefixed_line_by_line_and_argv_forwarded(tmp_path):
    # Half lines from both ranks at once: hydra alone would splice them ("[0] a [1] a [0] b"), never here.
    script = write(tmp_path / "hello.py", """\
        import os, sys
        rank = os.environ["RANK"]
        for i in range(50):
            sys.stdout.write(f"r{rank} a{i} "); sys.stdout.write(f"b{i} "); sys.stdout.write(f"c{i}\\n")
        sys.stdout.write(f"hello from {rank} {sys.argv[1:]}\\n")
        sys.stderr.write(f"no newline at the end from {rank}")
        """)
    done = launch("-np", 2, script, "x", "--y")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert {"[0] hello from 0 ['x', '--y']", "[1] hello from 1 ['x', '--y']"} <= set(lines)
    spliced = [line for line in lines if not re.fullmatch(r"\[(\d)\] (r\1 a(\d+) b\3 c\3|hello from \1 .*)", line)]
    assert spliced == [] and len(lines) == 102
    assert sorted(done.stderr.splitlines()) == ["[0] no newline at the end from 0",
                                                "[1] no newline at the end from 1"]


@mpi
def test_module_runs_with_its_own_argv_and_no_prefix(tmp_path):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    write(package / "train.py", """\
        import os, sys
        print(os.environ["RANK"], __name__, os.path.relpath(sys.argv[0]), sys.argv[1:])
        """)
    done = launch("-n", 2, "--no-prefix", "-m", "mypkg.train", "--epochs", 3, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    expected = "__main__ " + os.path.join("mypkg", "train.py") + " ['--epochs', '3']"
    assert sorted(done.stdout.splitlines()) == [f"0 {expected}", f"1 {expected}"]
    # mpiexec's spelling of -n, and the prefix on by default with -m too
    done = launch("-np", 2, "-m", "mypkg.train", "--epochs", 3, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [f"[0] 0 {expected}", f"[1] 1 {expected}"]


@mpi
def test_a_typo_gives_the_user_s_traceback_and_a_short_summary(tmp_path):
    script = write(tmp_path / "typo.py", """\
        from mpi4py import MPI
        if MPI.COMM_WORLD.rank == 1:
            prnt("hello")
        MPI.COMM_WORLD.Barrier()
        """)
    done = launch("-n", 2, script)
    assert done.returncode == 1
    assert done.stdout == ""
    # The user's traceback (the caret line depends on the Python version) and a two-line summary.
    lines = [line for line in done.stderr.splitlines() if not re.fullmatch(r"\[1\] +\^+", line)]
    assert lines[:3] == ["[1] Traceback (most recent call last):", f'[1]   File "{script}", line 3, in <module>',
                         '[1]     prnt("hello")']
    assert lines[3].startswith("[1] NameError: name 'prnt' is not defined")
    assert lines[4].startswith("distlab: rank 1 raised NameError: name 'prnt' is not defined")
    assert lines[5:] == ["distlab: the job failed with exit status 1; rank 0 was stopped; traceback above"]
    for noise in ("_bootstrap", "runpy", "BAD TERMINATION", "Abort(", "====="):
        assert noise not in done.stderr


@mpi
def test_a_rank_that_exits_zero_mid_job_fails_the_job_and_is_named(tmp_path):
    script = write(tmp_path / "vanish.py", """\
        import os
        import numpy as np
        from distlab import comm
        pg = comm.world()
        print("pid", os.getpid(), flush=True)
        pg.allreduce(np.ones(2))
        if pg.rank == 1:
            os._exit(0)
        pg.allreduce(np.ones(2))
        """)
    done = launch("-n", 2, script)
    assert done.returncode == 1, done.stderr  # was 0: the job "succeeded"
    pid = re.search(r"\[1\] pid (\d+)", done.stdout).group(1)
    assert done.stderr.splitlines() == [
        f"distlab: rank 1 (pid {pid}) exited with status 0 before its program finished (no completion record: "
        "os._exit(), or a library ending the process?)",
        "distlab: the job failed with exit status 1; rank 0 was stopped"]


@mpi
def test_a_killed_rank_is_named_with_its_pid_and_signal_and_the_others_keep_their_timeline(tmp_path):
    script = write(tmp_path / "kill.py", """\
        import os, signal
        import numpy as np
        from distlab import comm
        pg = comm.world()
        print("pid", os.getpid(), flush=True)
        pg.allreduce(np.ones(2), name="before")
        shm = sorted({line.split()[-1] for line in open("/proc/self/maps") if "/dev/shm/mpich_shm_" in line})
        print("shm", *shm, flush=True)
        if pg.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        pg.allreduce(np.ones(2), name="after")
        """)
    trace = tmp_path / "kill.json"
    done = launch("-n", 2, "--timeline", trace, script)
    assert done.returncode == 128 + 9, done.stderr  # as a shell reports a process killed by SIGKILL
    # MPICH's shared-memory files, which only MPI_Finalize removes, are gone with the job all the same.
    shm = {path for line in re.findall(r"\] shm (.*)", done.stdout) for path in line.split()}
    assert shm and not any(os.path.exists(path) for path in shm), shm
    pid = re.search(r"\[1\] pid (\d+)", done.stdout).group(1)
    assert done.stderr.splitlines()[:2] == [f"distlab: rank 1 (pid {pid}) was killed by signal 9 (SIGKILL)",
                                            "distlab: the job failed with exit status 137; rank 0 was stopped"]
    assert "partial timeline (the run did not finish; ranks 0 of 2 wrote theirs)" in done.stderr
    data = json.loads(trace.read_text())
    assert data["otherData"]["partial"] is True
    assert {e["name"] for e in data["traceEvents"] if e["ph"] == "X" and e["pid"] == 0} >= {"allreduce before"}


@mpi
def test_a_failing_rank_ends_the_job_and_every_rank_keeps_its_timeline(tmp_path):
    script = write(tmp_path / "fail.py", """\
        import numpy as np
        from distlab import comm
        pg = comm.world()
        pg.allreduce(np.ones(2), name="first")
        if pg.rank == 1:
            raise ValueError("bad shard")
        pg.allreduce(np.ones(2), name="second")
        """)
    trace = tmp_path / "fail.json"
    done = launch("-n", 2, "--timeline", trace, script)
    assert done.returncode == 1
    assert "distlab: rank 1 raised ValueError: bad shard" in done.stderr
    data = json.loads(trace.read_text())
    assert data["otherData"]["partial"] is True
    spans = {(e["pid"], e["name"]) for e in data["traceEvents"] if e["ph"] == "X"}
    assert {(0, "allreduce first"), (1, "allreduce first")} <= spans


@mpi
def test_when_no_rank_started_mpiexec_s_own_errors_are_shown(tmp_path):
    script = write(tmp_path / "never.py", "print('never printed')\n")
    done = subprocess.run([sys.executable, "-P", "-m", "distlab", "run", "-n", "2", str(script)],
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT,
                          env={**os.environ, "HYDRA_LAUNCHER": "no-such-launcher", "DISTLAB_PROCESS_MANAGER": "mpiexec"})
    assert done.returncode == 1
    assert "unrecognized launcher: no-such-launcher" in done.stderr  # hydra's words, the only explanation
    assert done.stderr.splitlines()[-2:] == ["distlab: rank 0 never started (it wrote no start record) (also rank 1)",
                                             "distlab: the job failed with exit status 1"]


@mpi
@pytest.mark.parametrize("grace", [0.2, None])
def test_a_failed_rank_ends_the_job_after_the_grace_and_never_under_fault_tolerance(tmp_path, grace):
    # the job: a rank's end record (as its watcher writes it), then the others' work goes on past the grace;
    # under fault tolerance (grace None) the survivors finish it, else the launcher stops the job
    command = ["sh", "-c", f"echo '{{}}' > {tmp_path}/rank1.exit; sleep 1; echo survivors done"]
    lines = []
    outcome = supervise(command, dict(os.environ), None, tmp_path, 2, lambda *line: lines.append(line), None,
                        timeout=30, monitor_interval=0.05, failure_grace=grace)
    finished = any(line.endswith("survivors done") for *_, line in lines)
    assert finished == (grace is None) and (outcome.status == 0) == (grace is None), (outcome, lines)


def test_a_rank_stopped_from_outside_stops_the_job_and_is_named(tmp_path):
    script = write(tmp_path / "term.py", """\
        import os, signal, time
        from mpi4py import MPI
        print("pid", os.getpid(), flush=True)
        if MPI.COMM_WORLD.rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler or a user might
        time.sleep(60)
        """)
    done = launch("-n", 2, script)
    assert done.returncode == 143, done.stderr
    pid = re.search(r"\[1\] pid (\d+)", done.stdout).group(1)
    assert done.stderr.splitlines() == [f"distlab: rank 1 (pid {pid}) was stopped by SIGTERM from outside the launcher",
                                        "distlab: the job failed with exit status 143; rank 0 was stopped"]


@mpi
def test_a_worker_process_a_rank_forks_ends_on_sigterm_as_usual(tmp_path):
    # Pool.terminate() and Process.terminate() send SIGTERM: the worker must simply end, not stop the job.
    script = write(tmp_path / "workers.py", """\
        import multiprocessing, time
        from mpi4py import MPI
        def work():
            time.sleep(60)
        if __name__ == "__main__":
            worker = multiprocessing.get_context("fork").Process(target=work)
            worker.start()
            time.sleep(0.2)
            worker.terminate()
            worker.join(30)
            print("worker exit code", worker.exitcode, flush=True)
            MPI.COMM_WORLD.Barrier()
        """)
    done = launch("-n", 2, script)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["[0] worker exit code -15", "[1] worker exit code -15"]


HANGS = """\
    import os, sys, time
    from mpi4py import MPI
    from distlab.timeline import get_timeline, now_us
    start = now_us()
    get_timeline().complete("started", start)
    world = MPI.COMM_WORLD
    print("ready pid", os.getpid(), flush=True)
    if world.rank == 1:
        time.sleep(120)
    world.Barrier()  # rank 0 waits inside MPI, where no Python signal handler runs
    """


def _hanging_job(tmp_path, *options):
    """A launcher running HANGS on 2 ranks, once both ranks are ready: ``(its process, the ranks' pids)``."""
    script = write(tmp_path / "hang.py", HANGS)
    proc = subprocess.Popen([sys.executable, "-P", "-m", "distlab", "run", "-n", "2", *options, str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = []
    try:
        while len(pids) < 2:
            line = proc.stdout.readline()
            assert line, "the job ended before both ranks were ready"
            pids += re.findall(r"ready pid (\d+)", line)
    except BaseException:
        proc.kill()
        raise
    return proc, pids


def _interrupt(tmp_path, signum):
    trace = tmp_path / "hang.json"
    proc, pids = _hanging_job(tmp_path, "--timeline", str(trace))
    try:
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, without_announce(err), trace, pids


@mpi
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupt_stops_every_rank_quietly_and_writes_the_partial_timeline(tmp_path, signum):
    returncode, err, trace, pids = _interrupt(tmp_path, signum)
    assert returncode == 128 + signum
    assert "Traceback" not in err
    name = signal.Signals(signum).name
    assert err.splitlines()[0].startswith(f"distlab: interrupted by {name}") and len(err.splitlines()) == 2
    data = json.loads(trace.read_text())
    assert data["otherData"]["partial"] is True
    assert {e["pid"] for e in data["traceEvents"] if e["ph"] == "X" and e["name"] == "started"} == {0, 1}
    assert _gone(pids)


@mpi
def test_a_timeout_stops_the_job_with_status_124_and_keeps_the_timeline(tmp_path):
    script = write(tmp_path / "hang.py", HANGS)
    trace = tmp_path / "hang.json"
    done = launch("-n", 2, "--timeout", 20, "--timeline", trace, script)
    assert done.returncode == 124
    assert "distlab: the job did not finish within 20 s and was stopped (ranks 0, 1 had not finished)" \
        in done.stderr
    assert {e["pid"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "started"} == {0, 1}


def test_help_is_plain_text_and_lists_the_environment():
    done = subprocess.run([sys.executable, "-P", "-m", "distlab", "run", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0
    for raw in ("``", ":func:", ":class:", ":mod:"):
        assert raw not in done.stdout
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS",
                 "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "MPIR_CVAR_CH4_PROGRESS_THROTTLE", "PYTHONUNBUFFERED",
                 "DISTLAB_LAUNCHER", "DISTLAB_JOB_DIR", "DISTLAB_TIMELINE", "DISTLAB_TIMEOUT", "-np", "-m module",
                 "--no-prefix", "--timeout", "--timeline"):
        assert name in done.stdout, name
    assert "130   interrupted by Ctrl-C" in done.stdout and "124   --timeout" in done.stdout


def test_every_variable_the_launcher_sets_is_listed_for_help(monkeypatch, tmp_path):
    from distlab.launch import RANK_VARIABLES, job_environment

    listed = {name for names, _ in RANK_VARIABLES for name in re.findall(r"[A-Z][A-Z0-9_]{2,}", names)}
    for name in list(os.environ):  # from an empty environment, everything the ranks get is the launcher's doing
        monkeypatch.delenv(name)
    env = job_environment({"DISTLAB_TIMELINE": str(tmp_path / "t.json")}, np=2, job_dir=tmp_path)
    assert len(env) >= 9 and set(env) <= listed, set(env) - listed
    # the bootstrap adds the torchrun-style rank variables on each rank
    assert {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"} <= listed


def test_bad_command_lines_get_a_clear_error():
    none = subprocess.run([sys.executable, "-P", "-m", "distlab", "run", "-n", "2"], capture_output=True,
                          text=True, timeout=60)
    assert none.returncode == 2 and "no program to run" in none.stderr
    zero = subprocess.run([sys.executable, "-P", "-m", "distlab", "run", "-n", "0", "x.py"], capture_output=True,
                          text=True, timeout=60)
    assert zero.returncode == 2 and "-n must be at least 1" in zero.stderr
    missing = subprocess.run([sys.executable, "-P", "-m", "distlab", "run", "-n", "2", "absent.py"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no such script: absent.py" in missing.stderr


@mpi
def test_the_bootstrap_under_a_plain_mpiexec_tags_the_traceback_and_aborts(tmp_path):
    from distlab.launch import find_mpiexec, job_environment

    script = write(tmp_path / "fail.py", """\
        from mpi4py import MPI
        if MPI.COMM_WORLD.rank == 1:
            raise ValueError("bad shard")
        MPI.COMM_WORLD.Barrier()
        """)
    env = job_environment(np=2)
    del env["DISTLAB_LAUNCHER"]
    done = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, "-m", "distlab._bootstrap", str(script)],
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, env=env)
    assert done.returncode != 0
    assert "[rank 1] Traceback (most recent call last):" in done.stderr
    assert "[rank 1] ValueError: bad shard" in done.stderr and "runpy" not in done.stderr


# --- the test harness (the mpirun fixture) -------------------------------------------------------------------

@pytest.mark.parametrize("mode, ending", [("vanish", "exited with status 0 before its program finished"),
                                          ("kill", "was killed by signal 9 (SIGKILL)")])
@mpi
def test_harness_fails_a_scenario_whose_rank_vanished(mpirun, mode, ending):
    result = mpirun("comm_uncaught.py", np=2, args=[mode], expect_failure=True, timeout=60)
    pid = re.search(r"\[1\] rank 1 pid (\d+)", result.stdout).group(1)
    assert f"distlab: rank 1 (pid {pid}) {ending}" in result.stderr
    assert "rank 1 finished" not in result.stdout and "rank 0 finished" not in result.stdout


def test_leftover_mpi_shared_memory_is_removed_only_when_no_process_holds_it(tmp_path):
    import mmap
    import time

    from distlab import _leftovers

    since = time.time() - 1.0
    names = [f"{_leftovers.SHM_DIR}/{_leftovers.PREFIX}distlabtest_{os.getpid()}_{k}" for k in range(3)]
    other = f"{_leftovers.SHM_DIR}/distlabtest_not_mpi_{os.getpid()}"
    for path in names + [other]:
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
    mapped_fd = os.open(names[0], os.O_RDWR)
    mapping = mmap.mmap(mapped_fd, 4096)
    os.close(mapped_fd)  # held by its mapping only
    open_fd = os.open(names[1], os.O_RDONLY)  # held by a descriptor only
    try:  # (other jobs' leftovers of the last second may go too: hence "in", not "==")
        assert names[2] not in _leftovers.remove_leftovers(time.time() + 60)  # older than the job: not its own
        removed = _leftovers.remove_leftovers(since)
        assert names[2] in removed and names[0] not in removed and names[1] not in removed, removed
        assert os.path.exists(names[0]) and os.path.exists(names[1]) and os.path.exists(other)
        assert not os.path.exists(names[2])
    finally:
        mapping.close()
        os.close(open_fd)
    assert set(names[:2]) <= set(_leftovers.remove_leftovers(since))
    assert not any(os.path.exists(path) for path in names)
    os.unlink(other)


@mpi
def test_a_one_host_job_listens_on_loopback_only(mpirun):
    # Before: hydra's control port (bound to every interface) was held by mpiexec and its proxy and inherited by
    # every rank and its watcher, and UCX opened a TCP listener per rank on the host's external address and
    # another on loopback (10 listening sockets for 2 ranks, 6 on every interface). Now, under distlab's process
    # manager, no process of the job listens at all (the ranks reach it over socketpairs).
    result = mpirun("job_listeners.py", np=2, args=["local"])
    assert result.stdout.count("listeners OK") == 2 and result.stdout.count("UCX_TLS=sm,self") == 2, result.stdout
    assert result.stdout.count("process manager distlab, 0 listening sockets") == 2, result.stdout
    # Under hydra (asked for), the ranks listen on nothing beyond loopback; hydra keeps only its control port.
    result = mpirun("job_listeners.py", np=2, args=["local"], env={"DISTLAB_PROCESS_MANAGER": "mpiexec"})
    assert result.stdout.count("listeners OK") == 2 and result.stdout.count("process manager hydra") == 2, result.stdout
    # a UCX setting of the user's is left alone (and UCX's devices restricted to loopback keep to it)
    result = mpirun("job_listeners.py", np=2, args=["local"], env={"UCX_NET_DEVICES": "lo"})
    assert result.stdout.count("listeners OK") == 2 and result.stdout.count("UCX_TLS=None") == 2, result.stdout


@mpi
def test_a_launcher_killed_outright_takes_its_job_with_it(tmp_path):
    """What a test's time bound does to the test session (pytest-timeout's thread method ends it with os._exit), or
    SIGKILL to a launcher: its process manager is told by the kernel (PR_SET_PDEATHSIG) and stops every rank, so no
    job outlives its launcher."""
    import time

    proc, pids = _hanging_job(tmp_path)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while not _gone(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids if process_start_stamp(int(pid))]
    for pid in left:   # never leave them behind, even when the test fails
        os.kill(int(pid), signal.SIGKILL)
    assert not left, f"ranks {left} outlived their launcher"
